"""Weights, optimizer and counters in and out of a RoundPipe: its parameters, the optimizer
it steps, state dicts and the pipeline state for exact resume (:class:`StateIO`)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from ..errors import CheckpointError, ConfigError
from ..model.quant import quantized
from ..runtime.dispatchers import on_worker_thread
from .checks import (OptimizerParams, check_optimizer_step, check_scheduler, check_state,
                     kind, check_pipeline_state)

__all__ = ["StateIO"]

PIECES = "rotapipe_pieces"
"""Key a sharded pipeline's optimizer adds to ``optimizer.state_dict()``: whose pieces
the state is of (``{"rank": r, "world": W}``), checked by ``load_state_dict``."""


def _check_pieces(shard, optimizer, state) -> None:
    """``optimizer.load_state_dict(state)`` of a sharded pipeline's optimizer: each rank's
    optimizer steps its own pieces, so the state must be this rank's (of this world
    size). Another rank's, with pieces of the same sizes, loaded without error and
    stepped each piece with another piece's moments (rank 0's file loaded on 2 ranks,
    as an unsharded checkpoint is: weights 0.016 off an uninterrupted run one step
    later). A state without the tag is checked by its sizes only."""
    lay = shard.layout
    saved = state.get(PIECES) if isinstance(state, dict) else None
    fix = ("Load each rank's own optimizer.state_dict() on that rank, or save with "
           "distributed.shard_state_dict(pipe, optimizer) on every rank and resume with "
           "distributed.load_shard_state_dicts (any world size). Nothing was loaded")
    mode = shard.shard.value
    if saved is not None and (saved.get("rank"), saved.get("world")) != (lay.rank, lay.world):
        raise CheckpointError(
            f"optimizer.load_state_dict: this state is the optimizer state of rank "
            f"{saved.get('rank')}'s pieces of {saved.get('world')} ranks, but this is rank "
            f"{lay.rank} of {lay.world}: with data_parallel.shard={mode!r} each rank's "
            "optimizer steps its own pieces of the parameters, so this rank would step "
            f"them with other elements' state, silently. {fix}")
    pieces = [q for group in optimizer.param_groups for q in group["params"]]
    for i, st in (state.get("state") or {}).items() if isinstance(state, dict) else ():
        if not isinstance(i, int) or not 0 <= i < len(pieces) or not isinstance(st, dict):
            continue
        n = pieces[i].numel()
        bad = [k for k, v in st.items()
               if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() != n]
        if bad:
            raise CheckpointError(
                f"optimizer.load_state_dict: the state {bad[0]!r} of parameter {i} has "
                f"{st[bad[0]].numel()} elements, but this rank's piece of it has {n} "
                f"(data_parallel.shard={mode!r}, rank {lay.rank} of {lay.world}): it is "
                f"not this rank's optimizer state. {fix}")


class StateIO:
    """What :class:`~rotapipe.pipe.RoundPipe` reads and replaces: every method completes
    the calls in flight first (``_flush`` under the pipeline's lock)."""

    def parameters(self) -> Iterator[nn.Parameter]:
        """The fp32 master weights (trainable parameters only), each once, after the
        calls in flight completed (:meth:`flush`)."""
        self._check_open()
        self.flush()
        if self._shard is not None:     # this rank's pieces of the fp32 masters
            return iter(self._shard.parameters())
        return iter([self.layerset.params[pid] for pid in self.host.trainable])

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, master)`` pairs; names are ``"<layer index>.<path>"`` (after
        :meth:`flush`)."""
        self._check_open()
        self.flush()
        if self._shard is not None:
            return iter(self._shard.named_parameters())
        return iter([(self.layerset.param_names[pid], self.layerset.params[pid])
                     for pid in self.host.trainable])

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, scheduler=None) -> None:
        """Use ``optimizer`` in :meth:`step`. It must hold only this model's trainable
        parameters (``fused=True`` AdamW is the fast choice on the CPU).

        ``scheduler``: a ``torch.optim.lr_scheduler`` over ``optimizer``, stepped by the
        pipeline right after every optimizer step it takes, on the thread that took
        it. With ``optimizer_mode="overlap"`` or ``"stale"`` a step is still under way when
        :meth:`train_step` returns, so a scheduler stepped by the caller would change
        the learning rate of that step: pass it here instead
        (:meth:`step_result` gives the learning rate each step used)."""
        self._check_open()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"attach_optimizer takes a torch.optim.Optimizer instance, got "
                              f"{kind(optimizer)}: build one over the pipeline's "
                              "parameters, e.g. torch.optim.AdamW(pipe.parameters())")
        if scheduler is not None and getattr(scheduler, "optimizer", None) is not optimizer:
            raise ConfigError("the scheduler does not drive this optimizer: build it over "
                              "the optimizer passed to attach_optimizer")
        if scheduler is not None:
            check_scheduler(scheduler)
        check_optimizer_step(optimizer)
        ls, trained = self.layerset, set(self.host.trainable)
        groups = OptimizerParams(self.parameters(), {
            id(p): (ls.param_names[pid], pid in trained) for pid, p in enumerate(ls.params)})
        groups.check(optimizer)
        with self._lock:
            self._flush()
            # PipeConfig.optimizer_state_dtype: checked here, state narrowed (now and
            # after every load_state_dict of the optimizer); checked again with the
            # groups before a step when they changed (OptimizerParams).
            if self._shard is None:
                self._host_opt.states.attach(optimizer)
                groups.states = self._host_opt.states
            self.optimizer, self.scheduler, self._groups = optimizer, scheduler, groups
            self._flush_optimizer_io(optimizer)

    def _flush_optimizer_io(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.state_dict()`` and ``optimizer.load_state_dict()`` flush this
        pipeline first, as its own state methods do: with ``overlap`` or ``stale`` the
        host optimizer is still stepping after ``train_step`` returns, so a state read
        then mixed stepped and unstepped parameters (step counts 2 and 3 in one saved
        state), and a state loaded then was stepped again by the step under way.
        The hooks hold the pipeline weakly and do nothing once it is closed, collected or
        drives another optimizer, or on the pipeline's own threads."""
        for handle in getattr(self, "_optimizer_hooks", ()):
            handle.remove()
        ref = weakref.ref(self)

        def flush(opt, *_):
            pipe = ref()
            if pipe is None or pipe._closed or pipe.optimizer is not opt \
                    or on_worker_thread(pipe._lock.owners):
                return None
            pipe.flush()
            return None

        def tag(opt, state):
            pipe = ref()
            if pipe is not None and pipe._shard is not None and pipe.optimizer is opt:
                lay = pipe._shard.layout
                state[PIECES] = {"rank": lay.rank, "world": lay.world}
            return state

        def check(opt, state):
            pipe = ref()
            if pipe is not None and not pipe._closed and pipe._shard is not None \
                    and pipe.optimizer is opt:
                _check_pieces(pipe._shard, opt, state)
            return None

        self._optimizer_hooks = (optimizer.register_state_dict_pre_hook(flush),
                                 optimizer.register_load_state_dict_pre_hook(flush),
                                 optimizer.register_state_dict_post_hook(tag),
                                 optimizer.register_load_state_dict_pre_hook(check))

    def train(self, mode: bool = True):
        """Set the layers' training flag (dropout, BatchNorm), as ``nn.Module.train``;
        returns the pipeline. The next call (training or evaluation) runs in the new
        mode: calls still in flight (``overlap``, ``stale``) complete in the mode they
        started in first (the workers' copies of the layers take the flags when a call
        begins with none in flight; a training call that finds them changed waits for
        those in flight, as after ``model.eval()`` on the user's own model)."""
        self._check_open()
        with self._lock:
            for layer in self.layerset.layers:
                layer.train(bool(mode))
        return self

    def eval(self):
        """``train(False)``."""
        return self.train(False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Trained weights (fp32 masters, frozen weights) and buffers, keyed like the
        ``state_dict`` of the container passed in (``nn.Sequential(*layers)`` for a
        list). The tensors are the live masters: copy them to keep a snapshot. Stale
        optimizer: applies the pending step first (:meth:`flush`). Frozen weights kept
        as NF4 (QLoRA) are left out: the module holds no values for them
        (:func:`rotapipe.model.quant.dequantize_frozen` gives them back)."""
        self._check_open()
        self.flush()
        state = self._container.state_dict()
        for k in self._nf4_keys():
            del state[k]
        return state

    def _nf4_keys(self) -> list[str]:
        """Keys of the container's state dict that name a frozen NF4 weight (QLoRA,
        :mod:`rotapipe.model.quant`): the module holds only a NaN placeholder for it,
        and the pipeline never changes it, so :meth:`state_dict` leaves it out and
        :meth:`load_state_dict` refuses it."""
        if not self.host.quantized:
            return []
        return [k for k, v in self._container.state_dict(keep_vars=True).items()
                if quantized(v) is not None]

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True):
        """Load weights and buffers (keys as :meth:`state_dict`) into the masters and
        refresh the compute-dtype copies the workers upload (every set of them).
        Returns ``(missing_keys, unexpected_keys)``, as ``nn.Module.load_state_dict``.

        All or nothing: keys (with ``strict``: none missing, none unexpected), shapes
        and dtype kinds (floating point or not) are checked before any tensor is
        written; a mismatch raises :class:`~rotapipe.errors.ConfigError` naming every
        offending key, and changes nothing. So does a state none of whose keys is the
        pipeline's, ``strict=False`` too (loading nothing, silently, is never meant:
        e.g. the wrapped model's own names). A frozen NF4 weight (QLoRA) is refused the
        same way: it is never loaded. Values are copied in place, cast to each
        tensor's dtype, as ``nn.Module.load_state_dict`` does."""
        self._check_open()
        with self._lock:
            self._flush()
            own = self._container.state_dict(keep_vars=True)
            nf4 = self._nf4_keys()
            for k in nf4:
                del own[k]
            given = [k for k in nf4 if isinstance(state, dict) and k in state]
            if given:
                more = f" (and {len(given) - 1} more)" if len(given) > 1 else ""
                raise ConfigError(
                    f"load_state_dict: {given[0]!r}{more} is a frozen weight kept as NF4 "
                    "(wrap_hf(quantize='nf4')): it is never loaded or changed, and "
                    "pipe.state_dict() leaves it out. Nothing was loaded: pass the state "
                    "without it, e.g. {k: v for k, v in state.items() if k in "
                    "pipe.state_dict()}")
            if isinstance(state, dict) and state and not any(k in own for k in state):
                raise ConfigError(
                    f"load_state_dict: none of the {len(state)} keys is one of the "
                    f"pipeline's (given {next(iter(state))!r}, the pipeline's are keyed "
                    f"like pipe.state_dict(): {next(iter(own))!r}, ...). Nothing was "
                    "loaded: a state dict of the model you wrapped (e.g. Hugging Face "
                    "names) loads into that model: pipe.flush(), then "
                    "model.load_state_dict(state) (the next call uploads the new weights)")
            check_state(own, state, strict)
            self._agree.loaded()        # data parallel: the next call compares weights
            keys = _IncompatibleKeys([k for k in own if k not in state],
                                     [k for k in state if k not in own])
            if self._shard is not None:
                self._load_sharded(state)
                return keys
            try:
                with torch.no_grad():
                    for k, v in state.items():
                        if k in own:
                            own[k].copy_(v)
            finally:
                self.host.write_back()
            return keys

    def _load_sharded(self, state: dict[str, torch.Tensor]) -> None:
        """Masters from the fp32 tensors themselves (the module's parameters hold only
        the compute dtype), then the rest of the container."""
        names = dict(self._container.named_parameters(remove_duplicate=False))
        by_id = {id(p): pid for pid, p in enumerate(self.layerset.params)}
        full = {}
        for key, value in state.items():
            p = names.get(key)
            if p is not None and id(p) in by_id and by_id[id(p)] in self.host.trainable:
                full[by_id[id(p)]] = value.float()
        # Keys were checked (check_state, with the caller's strict); NF4 weights are
        # left out of both.
        self._container.load_state_dict(state, strict=False)
        self._shard.load_full(full)

    def pipeline_state(self) -> dict:
        """The pipeline's own counters, for exact resume: training calls and evaluation
        calls (they define the random streams) and the loss scaler. Weights are in
        :meth:`state_dict`, optimizer state in the optimizer's (stale: flushes first)."""
        self._check_open()
        self.flush()
        return {"calls": self.calls, "evals": self._evals, "scaler": self.scaler.state_dict(),
                "optimizer_state_dtype": self.config.optimizer_state_dtype.value}

    def load_pipeline_state(self, state: dict) -> None:
        """Restore what :meth:`pipeline_state` returned. Everything is checked before
        anything changes (:class:`~rotapipe.errors.CheckpointError` naming the key).
        The loss scale resumes only from dynamic scaling into dynamic scaling: a fixed
        scale (or none: fp32, bf16) stays this pipeline's config, and a dynamic scaler
        given a fixed scale's state starts from its ``init_scale``."""
        self._check_open()
        calls, evals, scale, good, dynamic = check_pipeline_state(state)
        saved = state.get("optimizer_state_dtype", "fp32")
        ours = self.config.optimizer_state_dtype.value
        if saved != ours:
            raise CheckpointError(
                f"the checkpoint's optimizer state was kept as {saved!r}, this pipeline "
                f"keeps it as {ours!r}: build the pipeline with PipeConfig("
                f"optimizer_state_dtype={saved!r}) (rotapipe train: --optimizer-state "
                f"{saved}) to resume it")
        with self._lock:
            self._flush()
            self._agree.loaded()
            self._stream.committed, self._evals = calls, evals
            # A fixed loss scale stays the config's (LossScaler.load_state_dict).
            self.scaler.load_state_dict({"scale": scale, "good_steps": good,
                                         "dynamic": dynamic})
