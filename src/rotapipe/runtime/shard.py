"""Host optimizer state sharded across data-parallel ranks (ZeRO stages 1 and 2).

With ``DataParallelConfig(shard="optimizer" | "gradients")`` every trainable parameter
(flattened, ``n`` elements) is cut into ``W`` contiguous pieces, rank ``j`` owning
elements ``[j * n // W, (j + 1) * n // W)`` (:class:`ShardLayout`). A rank keeps the
fp32 master and the optimizer state of its pieces only: :meth:`RoundPipe.parameters`
returns the pieces (1-D ``nn.Parameter``), so ``torch.optim.AdamW(pipe.parameters())``
allocates 1/W of the state. Every rank still holds the full compute-dtype weights its
workers upload (the module's parameters alias them). Elementwise optimizers (SGD,
Adam, AdamW and their foreach/fused kernels) step a piece exactly as they would step
that part of the whole tensor; optimizers that look at whole tensors (Adafactor,
LAMB, Shampoo) are not exact.

Collectives, per bucket of parameters (the all-reduce's buckets, ``bucket_mb``):

- **reduce-scatter** of gradients: ``all_to_all_single`` sends piece ``j`` of each
  gradient to rank ``j`` (in ``grad_dtype``), and the owner sums the ``W``
  contributions in fp32, in rank order. gloo's own ``reduce_scatter`` is ``W``
  all-reduces of ``n / W`` elements (the bytes of an all-reduce, more latency); the
  all-to-all sends ``(W - 1) / W * n`` elements per rank, half a ring all-reduce.
- **all-gather** of the updated weights: each rank sends its pieces, cast to the
  compute dtype, to every rank (``all_to_all_single`` of its pieces repeated ``W``
  times: on gloo faster than ``all_gather_into_tensor``), and every rank copies the
  pieces into its compute copies.

When they run (issue order is the same on every rank, as the all-reduce's; see
:mod:`rotapipe.runtime.allreduce`):

- ``shard="gradients"``: every call reduce-scatters its gradients at the host lane's
  hand-offs (overlapped with the shallower stages' backward) and accumulates only its
  own pieces. ``shard="optimizer"``: calls that do not end a step accumulate the full
  local gradient (no traffic); the call that ends a step reduce-scatters the local
  sum; :meth:`ShardedOptimizer.sync_step` (``pipe.step()``) reduce-scatters what was
  accumulated, at once.
- ``optimizer_mode="overlap"`` without clipping or dynamic loss scaling steps each
  hand-off's pieces on the host lane as soon as their reduce-scatter is in, and starts
  their all-gather; otherwise the step is whole, after the call (the global norm and
  the overflow check are one all-reduce of the shards' summed squares, in float64).
- ``stale`` writes the step into the set of compute copies the calls two steps later
  read (:class:`~rotapipe.runtime.optimizer.HostOptimizer`), all-gathered there.

The per-call work is :class:`~rotapipe.runtime.shardcall.ShardCall`; the layout and the
collectives are ``shardcomm.py``'s (:class:`~rotapipe.runtime.shardcomm.ShardCollectives`,
a base class of :class:`ShardedOptimizer`). The user's own loop:
``optimizer.zero_grad()`` between calls is followed (:meth:`ShardedOptimizer.
follow_grads`), and editing the pieces' gradients otherwise (``clip_grad_norm_`` over
the pieces: a norm of pieces) is refused; ``optimizer.step()`` on the pieces outside the
pipeline would never reach the workers' weights and is refused (:func:`_refuse_own_step`).
"""

from __future__ import annotations

import functools
import math
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..config import NonFinite, OptimizerMode, ShardMode
from ..errors import InputError, NonFiniteError
from ..schedule import Schedule
from .callgrads import CallGrads
from .host import HostState, LossScaler, cleared_grads, in_own_step, own_step
from .inflight import InFlight
from .optimizer import HostOptimizer
from .shardcall import ShardCall
from .shardcomm import ShardCollectives, ShardLayout, Traffic, _Exchange
from .stepping import Cost

# _Exchange: named here for shardcall.py's type hints.
__all__ = ["ShardLayout", "ShardedOptimizer", "Traffic", "_Exchange"]

PARTLY_STEPPED = (
    "rotapipe: the optimizer's step() raised part-way through a sharded whole step, "
    "which keeps no snapshot: the pieces it updated before raising keep their update "
    "(this rank's workers' copies follow them; .grad keeps the reduced gradients), and "
    "data parallelism is retired (the other ranks fail naming this one): restore a "
    "checkpoint on every rank (distributed.load_shard_state_dicts) and restart")


def _refuse_own_step(owner: weakref.ref, pieces: frozenset[int], optimizer, args,
                     kwargs) -> None:
    """Before any ``torch.optim`` step in the process: one the user takes on a sharded
    pipeline's pieces (not the pipeline's own, :func:`own_step`) would update this
    rank's fp32 pieces only (with ``shard="optimizer"``, on no gradient at all), never
    the weights the workers compute with: refuse it before it changes anything."""
    if in_own_step() or owner() is None:
        return
    if any(id(p) in pieces for group in optimizer.param_groups for p in group["params"]):
        shard = owner().shard.value
        raise InputError(
            f"optimizer.step() was called on the pieces of a sharded pipeline "
            f"(data_parallel.shard={shard!r}) outside the pipeline: it would update this "
            "rank's fp32 pieces only, never the weights the workers compute with (each "
            "rank's updated pieces are all-gathered by the pipeline's own step), so "
            "training would silently go wrong. Call pipe.step() instead of "
            "optimizer.step() on every rank (it reduce-scatters, clips to "
            "PipeConfig.clip_grad_norm, steps this optimizer and all-gathers the "
            "weights), or end the step with pipe.train_step(x, y); nothing was changed")

class ShardedOptimizer(HostOptimizer, ShardCollectives):
    """The host optimizer of a sharded data-parallel pipeline: its masters, gradients
    and collectives (module docstring). Built after :class:`HostState`: it takes the
    fp32 values of this rank's pieces, then points each trainable parameter at its
    compute copy, dropping the full fp32 master."""

    def __init__(self, host: HostState, scaler: LossScaler, mode: OptimizerMode,
                 max_norm: float | None, reducer, shard: ShardMode,
                 grad_dtype: torch.dtype, bucket_mb: float,
                 nonfinite: NonFinite = NonFinite.RAISE):
        super().__init__(host, scaler, mode, max_norm, nonfinite)
        self.r, self.shard, self.grad_dtype = reducer, shard, grad_dtype
        params = host.layerset.params
        self.layout = ShardLayout({pid: params[pid].numel() for pid in host.trainable},
                                  reducer.world, reducer.rank)
        self.masters: dict[int, nn.Parameter] = {}
        """This rank's fp32 pieces (non-empty ones), by parameter index."""
        with torch.no_grad():
            for pid in host.trainable:
                p = params[pid]
                a, b = self.layout.range(pid)
                if b > a:
                    self.masters[pid] = nn.Parameter(p.detach().reshape(-1)[a:b].float()
                                                     .clone())
                for view in host.views:
                    assert view[pid].is_contiguous(), "compute copies are contiguous"
                if p.data is not host.compute[pid]:
                    p.data = host.compute[pid]      # the full fp32 master goes
        self._names = {id(q): host.layerset.param_names[pid] for pid, q in self.masters.items()}
        limit = max(1, int(bucket_mb * 2**20) // 4)
        self.buckets: list[list[int]] = []
        """Every trainable parameter, deepest first, in buckets of at most ``bucket_mb``
        (the whole-step collectives)."""
        size = limit
        for pid in reversed(host.trainable):
            n = params[pid].numel()
            if size + n > limit and (not self.buckets or self.buckets[-1]):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(pid)
            size += n
        self.samples = 0.0
        """Loss units accumulated since the last step (global, as HostState.samples)."""
        self.local: dict[int, torch.Tensor] = {}
        """``shard="optimizer"``: the full local gradient accumulated since the last step."""
        self.latest = 0        # the set of compute copies holding the newest weights
        self.traffic = Traffic()
        self.last_global_norm: float | None = None
        """The global gradient norm of the last whole step (clipping on or off)."""
        self.gathered = False
        """Inside :func:`rotapipe.distributed.full_weights`: the model's parameters hold
        the whole fp32 masters (a save there writes fp32)."""
        self.last_step_gate: InFlight | None = None
        """Backpressure counters of the last whole-step collectives (caller thread)."""
        self._left: dict[int, tuple[weakref.ref, int]] = {}
        """Per piece, the ``.grad`` the last call that ended no step left (weakly) and
        its version: :meth:`follow_grads` tells from them what the user cleared."""
        ids = frozenset(id(q) for q in self.masters.values())
        handle = register_optimizer_step_pre_hook(functools.partial(
            _refuse_own_step, weakref.ref(self), ids))
        weakref.finalize(self, handle.remove)

    # -- what the pipeline reads -----------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        """This rank's fp32 pieces, in parameter order (what the optimizer steps)."""
        return list(self.masters.values())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(name of the whole parameter, piece)`` pairs."""
        return [(self._names[id(q)], q) for q in self.masters.values()]

    def owner_of(self, piece: nn.Parameter) -> tuple[int, int, int]:
        """``(parameter index, start, end)`` of a piece."""
        for pid, q in self.masters.items():
            if q is piece:
                return (pid, *self.layout.range(pid))
        raise KeyError("not a piece of this pipeline")

    def reset_traffic(self) -> Traffic:
        out, self.traffic = self.traffic, Traffic()
        return out

    # -- HostOptimizer's interface -----------------------------------------------------------
    def call_hook(self, optimizer, schedule: Schedule, stage_pids, grads: CallGrads,
                  units: float, step: bool, cost: Cost, reduce=None, view: int = 0):
        self.follow_grads()
        return ShardCall(self, optimizer, schedule, grads, units, step, cost,
                         view if self.mode is OptimizerMode.STALE else None)

    def sync_step(self, optimizer: torch.optim.Optimizer, cost: Cost,
                  view: int | None = None) -> bool:
        """``pipe.step()``: reduce-scatter what ``shard="optimizer"`` accumulated, then
        one whole step (a collective: every rank calls it)."""
        self.follow_grads()
        if self.shard is ShardMode.OPTIMIZER and self.samples > 0:
            reduced: dict = {}
            sent = self._bounded(
                [(self._scatter_bytes(pids),
                  lambda pids=pids: self._scatter(pids, lambda pid: self.local.pop(pid, None)))
                 for pids in self.buckets],
                lambda x: self._collect([x], reduced))
            self._collect(sent, reduced)
            for pid, q in self.masters.items():
                q.grad = reduced.get(pid)
        try:
            return self._whole_step(optimizer, cost, view)
        except Exception as exc:
            if self.r.broken is not None and hasattr(exc, "add_note"):   # Python 3.11+
                exc.add_note(PARTLY_STEPPED)
            raise

    def flush(self) -> None:
        """Every set of compute copies follows the newest one (no collective)."""
        views = self.host.views
        if len(views) > 1:
            with torch.no_grad():
                for v, view in enumerate(views):
                    if v != self.latest:
                        for pid in self.host.trainable:
                            view[pid].copy_(views[self.latest][pid])
            self.latest = 0

    def zero_grad(self) -> None:
        for q in self.masters.values():
            q.grad = None
        self.local.clear()
        self.samples = 0.0
        self._left = {}

    def show_grads(self) -> None:
        """After a call that ended no step: each piece's ``.grad`` shows what was
        accumulated (``shard="gradients"``: its reduced gradient; ``"optimizer"``: a
        view of this rank's part of the local, not yet reduced, sum), so that the
        user's ``optimizer.zero_grad()`` is seen (:meth:`follow_grads`)."""
        if self.shard is ShardMode.OPTIMIZER:
            for pid, q in self.masters.items():
                g = self.local.get(pid)
                a, b = self.layout.range(pid)
                q.grad = None if g is None else g.view(-1)[a:b]
        self._left = {pid: (weakref.ref(q.grad), q.grad._version)
                      for pid, q in self.masters.items() if q.grad is not None}

    def follow_grads(self) -> None:
        """Before a call or a step: if the user cleared the pieces' gradients since
        the last call (``optimizer.zero_grad()``, either way), start a new
        accumulation, as :meth:`HostState.follow_grads` does without sharding.
        Clearing some but not all is ambiguous: an :class:`InputError`, and data
        parallelism is retired (the units of this call are already all-reduced)."""
        if self.samples == 0 or not self._left:
            return
        self._refuse_edited()
        cleared, kept = cleared_grads(self.masters.items(), self._left)
        if not cleared:
            return
        if kept:
            names = self.host.layerset.param_names
            self.r.fail("its pieces' gradients were cleared in part")
            raise InputError(
                f"the gradient piece of {names[cleared[0]]} was cleared since the last "
                f"call (optimizer.zero_grad() over part of pipe.parameters()?) but that of "
                f"{names[kept[0]]} was not: the next call could not tell which calls its "
                "gradients average over, and data parallelism is retired. Clear them all "
                "with pipe.zero_grad() (or optimizer.zero_grad() over all of "
                "pipe.parameters()), or none, and restart from the last checkpoint")
        self.zero_grad()

    def _refuse_edited(self) -> None:
        """A piece's ``.grad`` changed since the last call other than by clearing it
        (``torch.nn.utils.clip_grad_norm_(pipe.parameters())``, which scales in place,
        or a new tensor put there): it holds this rank's piece only (``"optimizer"``: of
        the local, unreduced sum), so a norm or an edit computed on it is not the whole
        gradient's, and the step would silently differ from plain PyTorch (measured: 2
        ranks, 3 steps, weights off by up to 0.038). An :class:`InputError`, and data
        parallelism is retired (a rank that raises alone would leave its peers waiting
        in the step's collectives)."""
        for pid, q in self.masters.items():
            g, was = q.grad, self._left.get(pid)
            if was is None or g is None:
                continue            # cleared (set to None), or cleared_grads' to judge
            if g is was[0]() and (g._version == was[1] or not g.any()):
                continue            # untouched, or zeroed in place (zero_grad)
            name = self.host.layerset.param_names[pid]
            self.r.fail("its pieces' gradients were edited")
            raise InputError(
                f"the gradient piece of {name} was changed since the last call "
                "(torch.nn.utils.clip_grad_norm_(pipe.parameters())?): with "
                f"data_parallel.shard={self.shard.value!r} each rank's .grad holds its "
                "piece of each gradient only, so a norm (or any edit) computed there is "
                "not the whole gradient's and the step would silently differ from one "
                "process. Clip with PipeConfig(clip_grad_norm=max_norm) (the global "
                "norm, on every rank alike) and change the pieces' gradients only by "
                "clearing them (zero_grad()). Data parallelism is retired: restart from "
                "the last checkpoint")

    def gather_masters(self) -> dict[int, torch.Tensor]:
        """Every trainable parameter's whole fp32 master, all-gathered from the ranks'
        pieces bucket by bucket (a collective: every rank calls it; the compute copies
        hold them only rounded to the compute dtype). Exact: each element is copied
        from its owner."""
        self.r.check()
        lay, W, params = self.layout, self.layout.world, self.host.layerset.params
        full: dict[int, torch.Tensor] = {}
        for pids in self.buckets:
            send = torch.cat([self.masters[pid].detach() if pid in self.masters
                              else torch.empty(0) for pid in pids])
            splits = [sum(lay.length(pid, i) for pid in pids) for i in range(W)]
            out = torch.empty(sum(splits))
            work, seq = self.r.exchange(out, send.repeat(W), splits, [send.numel()] * W)
            self.r._wait(work, seq, f"fp32 master all-gather of {len(pids)} parameters")
            off = 0
            for i in range(W):                # rank i's pieces, in bucket order
                for pid in pids:
                    t = full.setdefault(pid, torch.empty(params[pid].numel()))
                    a, b = lay.range(pid, i)
                    t[a:b] = out[off:off + b - a]
                    off += b - a
        return {pid: t.view(params[pid].shape) for pid, t in full.items()}

    def load_full(self, state: dict[int, torch.Tensor]) -> None:
        """Set the masters from whole fp32 tensors (by parameter index) and every
        compute copy from them (every rank loads the same tensors: no collective)."""
        params = self.host.layerset.params
        with torch.no_grad():
            for pid, t in state.items():
                if pid in self.masters:
                    a, b = self.layout.range(pid)
                    self.masters[pid].copy_(t.reshape(-1)[a:b])
                for view in self.host.views:
                    view[pid].copy_(t.reshape(params[pid].shape))
        self.latest = 0
    # -- the whole step -----------------------------------------------------------------------
    def _whole_step(self, optimizer, cost: Cost, view: int | None) -> bool:
        """Clip to the global norm (one all-reduce of the shards' summed squares), skip
        on overflow, step this rank's pieces, all-gather the weights into ``view``
        (``None``: every set); the masters' ``.grad`` hold the step's gradients."""
        qs = [q for q in self.masters.values() if q.grad is not None]
        overflow, norm = False, None
        # One all-reduce of the shards' squared norms: the global norm for clipping and
        # the non-finite check (the same sum on every rank, so every rank decides alike).
        sq = sum((float(q.grad.double().square().sum()) for q in qs), 0.0)
        total = self.r.global_sum(sq, "sum of the shards' squared gradient norms")
        self.last_global_norm = math.sqrt(total) if math.isfinite(total) else float("nan")
        if not math.isfinite(total):
            if not self.scaler.dynamic and self.nonfinite is NonFinite.RAISE:
                raise NonFiniteError(
                    "the global gradient norm is not finite; no weight or optimizer "
                    "state changed. Lower the learning rate, check the data, clip "
                    "gradients (clip_grad_norm), or set PipeConfig(nonfinite='skip')")
            overflow = True
        if self.max_norm is not None and not overflow:
            norm = math.sqrt(total)
            coef = self.max_norm / (norm + 1e-6)   # clip_grad_norm_'s formula
            if coef < 1.0:
                for q in qs:
                    q.grad.mul_(coef)
        if not overflow:
            try:
                with own_step():
                    optimizer.step()
            except Exception:
                self._keep_partial_step()
                raise
            if cost is not None:
                cost([pid for pid, q in self.masters.items() if q.grad is not None])
            views = list(range(len(self.host.views))) if view is None else [view]
            self._publish(views)
            self.latest = views[0] if view is not None else 0
        self.skipped(overflow)
        self.last_norm = norm
        self.zero_grad()
        return not overflow

    def _keep_partial_step(self) -> None:
        """The optimizer's whole step raised part-way: a whole step keeps no snapshot,
        so the pieces it updated before raising keep their update. This rank's compute
        copies follow its pieces (no collective: the other ranks' pieces in them stay
        as they were) and data parallelism is retired, so that no rank waits for the
        weight all-gather this rank will never issue (its peers fail naming it)."""
        with torch.no_grad():
            for pid, q in self.masters.items():
                a, b = self.layout.range(pid)
                for view in self.host.views:
                    view[pid].view(-1)[a:b].copy_(q.detach())
        self.r.fail("its optimizer's step raised part-way")
