"""The model as layers: validation, parameter/buffer indexing and per-worker shells.

A *layer* is one ``nn.Module`` of the user's ordered list. Parameters are identified by
object identity, so a weight shared between layers (tied embeddings) has one master and
one host copy; each stage uploads it once and its gradients from every use are summed.

Workers never run the user's modules directly: two workers may run the same layer at
once (one its forward stage, another its backward stage), so each worker gets a
*shell*: a deep copy of every layer whose parameters and buffers are meta tensors, into
which the device tensors of the stage being run are bound. A call that starts with none
in flight first copies into the shells what the user changed since (train/eval flags,
attributes, hooks: :meth:`Shell.follow`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError, InputError


def call_layer(layer: nn.Module, x, side):
    """How every layer is called: ``layer(x)``, or ``layer(x, **side)`` when the model
    has per-microbatch side inputs (attention masks, rotary tables)."""
    return layer(x) if side is None else layer(x, **side)


@dataclass(frozen=True)
class _Slot:
    module: nn.Module   # the submodule of a shell that holds the tensor
    name: str           # attribute name in its _parameters / _buffers
    index: int          # parameter id or buffer id


class LayerSet:
    """The user's layers with unique parameters (``params``) and buffers (``buffers``).

    ``keep_fp32``: parameters and buffers of the layers computed in fp32 whatever the
    pipeline's compute dtype (:attr:`fp32_params`, :attr:`fp32_buffers`)."""

    def __init__(self, layers: Sequence[nn.Module] | nn.Sequential,
                 keep_fp32: Iterable[torch.Tensor] = ()):
        if isinstance(layers, nn.Module) and not isinstance(layers, (nn.Sequential,
                                                                     nn.ModuleList)):
            raise ConfigError(f"got a single {type(layers).__name__}: pass an "
                              "nn.Sequential or a list of layer modules")
        self.layers: list[nn.Module] = list(layers)
        if not self.layers:
            raise ConfigError("the model has zero layers: pass at least one nn.Module")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, nn.Module):
                raise ConfigError(f"layer {i} is a {type(layer).__name__}, not an "
                                  "nn.Module: wrap functions in a module")
            for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
                if t.device.type != "cpu":
                    raise ConfigError(f"layer {i} holds {name} on {t.device}: keep the "
                                      "model on the CPU (call .cpu()); rotapipe moves "
                                      "weights to the workers itself")
        self.params: list[nn.Parameter] = []
        self.param_names: list[str] = []
        self.buffers: list[tuple[nn.Module, str]] = []   # one owner per unique buffer
        self.buffer_names: list[str] = []
        pid_of: dict[int, int] = {}
        bid_of: dict[int, int] = {}
        self.layer_params: list[list[int]] = []
        self.layer_buffers: list[list[int]] = []
        for i, layer in enumerate(self.layers):
            pids, bids = [], []
            for mod_name, mod in layer.named_modules(remove_duplicate=False):
                for name, p in mod._parameters.items():
                    if p is None:
                        continue
                    if id(p) not in pid_of:
                        pid_of[id(p)] = len(self.params)
                        self.params.append(p)
                        self.param_names.append(_join(i, mod_name, name))
                    pids.append(pid_of[id(p)])
                for name, b in mod._buffers.items():
                    if b is None:
                        continue
                    if id(b) not in bid_of:
                        bid_of[id(b)] = len(self.buffers)
                        self.buffers.append((mod, name))
                        self.buffer_names.append(_join(i, mod_name, name))
                    bids.append(bid_of[id(b)])
            self.layer_params.append(sorted(set(pids)))
            self.layer_buffers.append(sorted(set(bids)))
        self._pid_of, self._bid_of = pid_of, bid_of
        self._spare: list[Shell] | None = None   # shells check_copies built, unused yet
        self.fp32_params, self.fp32_buffers = self._kept(keep_fp32)
        """Indices of the parameters / buffers kept in fp32 on the host and the workers
        under any compute dtype (a router's weight and bias under bf16, as Hugging
        Face's ``_keep_in_fp32_modules_strict``)."""

    def _kept(self, tensors: Iterable[torch.Tensor]) -> tuple[frozenset[int], frozenset[int]]:
        if isinstance(tensors, (torch.Tensor, str)):
            tensors = [tensors]
        pids, bids = set(), set()
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"keep_fp32 holds {t!r} ({type(t).__name__}): pass the "
                                  "parameter and buffer tensors themselves, e.g. "
                                  "keep_fp32=[layer.router.weight, layer.router.bias]")
            pid, bid = self._pid_of.get(id(t)), self._bid_of.get(id(t))
            if pid is None and bid is None:
                raise ConfigError(f"keep_fp32 holds a {t.dtype} tensor of shape "
                                  f"{tuple(t.shape)} that is no parameter or buffer of the "
                                  "pipeline's layers: pass the layers' own tensors")
            if not t.is_floating_point():
                name = self.param_names[pid] if pid is not None else self.buffer_names[bid]
                raise ConfigError(f"keep_fp32 holds {name}, a {t.dtype} tensor: only "
                                  "floating-point tensors have a compute dtype to keep")
            (pids if pid is not None else bids).add(pid if pid is not None else bid)
        return frozenset(pids), frozenset(bids)

    def compute_dtype(self, pid: int, dtype: torch.dtype) -> torch.dtype:
        """dtype parameter ``pid`` computes in under compute dtype ``dtype``."""
        return torch.float32 if pid in self.fp32_params else dtype

    def buffer_dtype(self, bid: int, dtype: torch.dtype) -> torch.dtype:
        """dtype floating buffer ``bid`` computes in under compute dtype ``dtype``."""
        return torch.float32 if bid in self.fp32_buffers else dtype

    def __len__(self) -> int:
        return len(self.layers)

    def stage_params(self, layers: range) -> list[int]:
        return sorted({p for l in layers for p in self.layer_params[l]})

    def stage_buffers(self, layers: range) -> list[int]:
        return sorted({b for l in layers for b in self.layer_buffers[l]})

    def buffer_layers(self) -> frozenset[int]:
        return frozenset(l for l, bids in enumerate(self.layer_buffers) if bids)

    def buffer_value(self, bid: int) -> torch.Tensor:
        mod, name = self.buffers[bid]
        return mod._buffers[name]

    def set_buffer(self, bid: int, value: torch.Tensor) -> None:
        """Write a buffer's new value into the user's module (in place when it can)."""
        mod, name = self.buffers[bid]
        old = mod._buffers[name]
        if old.shape == value.shape:
            old.copy_(value)   # in place (casting): references to the buffer stay valid
        else:
            for m in self._owners(bid):
                m[0]._buffers[m[1]] = value.to(old.dtype) if old.is_floating_point() else value

    def _owners(self, bid):
        target = self.buffer_value(bid)
        return [(m, n) for layer in self.layers for m in layer.modules()
                for n, b in m._buffers.items() if b is target]

    def make_shells(self) -> list[Shell]:
        """One shell per layer for one worker (the first call takes the set
        :meth:`check_copies` built)."""
        if self._spare is not None:
            shells, self._spare = self._spare, None
            return shells
        return [Shell(layer, self._pid_of, self._bid_of) for layer in self.layers]

    def check_copies(self) -> None:
        """Build one worker's shells now, before the pipeline changes anything: a layer
        that ``copy.deepcopy`` cannot copy is refused with a :class:`ConfigError`
        naming it (not a bare ``RuntimeError`` after the weights were converted)."""
        shells = []
        for i, layer in enumerate(self.layers):
            try:
                shells.append(Shell(layer, self._pid_of, self._bid_of))
            except Exception as exc:
                old = any(type(h).__name__ == "WeightNorm" for m in layer.modules()
                          for h in m._forward_pre_hooks.values())
                fix = ("torch.nn.utils.weight_norm keeps its weight as a computed tensor, "
                       "which cannot be copied: use torch.nn.utils.parametrizations."
                       "weight_norm instead" if old else
                       "keep only parameters, buffers, submodules and plain values in "
                       "the layer's attributes (compute tensors derived from weights in "
                       "forward)")
                first = str(exc).splitlines()[0] if str(exc) else ""
                raise ConfigError(
                    f"layer {i} ({type(layer).__name__}) cannot be copied for the workers "
                    f"({type(exc).__name__}: {first}): each worker runs a copy of every "
                    f"layer, made with copy.deepcopy without its weights. {fix}") from exc
        self._spare = shells

    def set_training(self, shells: list[Shell]) -> None:
        """Copy each layer's train/eval flags onto its shell, and the attributes changed
        since the shell last took them (``dropout.p = 0.2``, a hook registered later)."""
        for shell in shells:
            shell.follow()


# A module's own state, bound (parameters, buffers), copied per shell (submodules) or
# followed as flags (training); every other attribute is followed by Shell.follow.
_STATE = frozenset({"_parameters", "_buffers", "_modules", "training"})


def _seen(k: str, v) -> tuple:
    """``(value, its keys when a hook dict)``: what :meth:`Shell.follow` compares (a
    hook registered later changes a hook dict's keys, not the dict)."""
    return v, tuple(v) if "hook" in k and isinstance(v, dict) else None


def _attributes(module: nn.Module) -> dict[str, tuple]:
    return {k: _seen(k, v) for k, v in vars(module).items() if k not in _STATE}


def _changed(module: nn.Module, seen: dict[str, tuple]):
    """``(name, value)`` of each attribute of ``module`` set or replaced since ``seen``
    (:func:`_attributes`) was taken."""
    for k, v in list(vars(module).items()):
        if k in _STATE:
            continue
        was = seen.get(k)
        if was is None or was[0] is not v or (was[1] is not None and was[1] != tuple(v)):
            yield k, v


class Shell:
    """A parameterless copy of one layer into which device tensors are bound."""

    def __init__(self, layer: nn.Module, pid_of: dict[int, int], bid_of: dict[int, int]):
        memo: dict[int, object] = {}
        for t in list(layer.parameters()):
            memo[id(t)] = nn.Parameter(torch.empty_like(t, device="meta"),
                                       requires_grad=t.requires_grad)
        for t in list(layer.buffers()):
            memo[id(t)] = torch.empty_like(t, device="meta")
        seen = [_attributes(m) for m in layer.modules()]
        self.module = copy.deepcopy(layer, memo)
        self._pairs = list(zip(layer.modules(), self.module.modules(), seen))
        """Per module of the layer: its copy here, and the attributes the copy was
        made from (submodules stay: a replaced one is refused, pipe.checks.ModelWatch)."""
        self.param_slots: list[_Slot] = []
        self.buffer_slots: list[_Slot] = []
        self._buffers: dict[int, torch.Tensor] | None = None   # the bound stage's
        self._bound: list[torch.Tensor] = []                   # per buffer slot
        self.draws: bool | None = None
        """Whether the layer's last call run with random ops watched drew random numbers
        (``None``: none since the copy last changed); the emulated backend runs a layer
        that drew nothing unwatched (``EmulatedDevice.seeded_layer``)."""
        pairs = zip(layer.modules(), self.module.modules())
        for om, sm in pairs:
            for name, p in om._parameters.items():
                if p is not None:
                    self.param_slots.append(_Slot(sm, name, pid_of[id(p)]))
            for name, b in om._buffers.items():
                if b is not None:
                    self.buffer_slots.append(_Slot(sm, name, bid_of[id(b)]))

    def follow(self) -> None:
        """Take the layer's train/eval flags, and a copy of every attribute the user
        set or replaced since this shell last took it (with no call in flight: the
        workers run the shells). Attributes changed in place (a list appended to)
        are not seen."""
        memo = None
        for om, sm, seen in self._pairs:
            if sm.training != om.training:
                sm.training, self.draws = om.training, None
            for k, v in _changed(om, seen):
                self.draws = None     # dropout.p = 0.1: its draws may change
                if memo is None:      # the layer's own tensors and modules map to ours
                    memo = self._memo()
                try:
                    sm.__dict__[k] = copy.deepcopy(v, memo)
                except Exception:     # a lock, a handle: the object itself, as plain
                    sm.__dict__[k] = v   # PyTorch would use it
                seen[k] = _seen(k, v)

    def stale(self) -> bool:
        """Whether :meth:`follow` would change anything: a train/eval flag or an
        attribute the user set or replaced since (read only: safe with calls in
        flight)."""
        return any(sm.training != om.training or next(_changed(om, seen), None)
                   for om, sm, seen in self._pairs)

    def _memo(self) -> dict[int, object]:
        """What a copy of a changed attribute maps to, as when the shell was made: the
        layer's modules to the shell's, its tensors to meta tensors."""
        memo: dict[int, object] = {}
        for om, sm, _ in self._pairs:
            memo[id(om)] = sm
            for t in list(om._parameters.values()) + list(om._buffers.values()):
                if t is not None:
                    memo[id(t)] = torch.empty_like(t, device="meta")
        return memo

    def bind(self, params: dict[int, torch.Tensor], buffers: dict[int, torch.Tensor]) -> None:
        for s in self.param_slots:
            s.module._parameters[s.name] = params[s.index]
        for s in self.buffer_slots:
            s.module._buffers[s.name] = buffers[s.index]
        self._buffers = buffers
        self._bound = [buffers[s.index] for s in self.buffer_slots]

    def bound_buffers(self) -> dict[int, torch.Tensor]:
        """Current buffer tensors (a forward may have updated or replaced them)."""
        return {s.index: s.module._buffers[s.name] for s in self.buffer_slots}

    def unbind(self) -> None:
        """Unbind, writing a buffer the forward *replaced* (``self.ema = 0.9 * self.ema
        + ...``, not in place) into the stage's buffers: the stage's next microbatch
        starts from it, as plain PyTorch's would (an in-place update needs nothing)."""
        for s in self.param_slots:
            s.module._parameters[s.name] = None
        for s, was in zip(self.buffer_slots, self._bound):
            now = s.module._buffers[s.name]
            if now is not was and now is not None:
                self._buffers[s.index] = now
            s.module._buffers[s.name] = None
        self._buffers, self._bound = None, []


def _join(layer: int, mod_name: str, name: str) -> str:
    return ".".join(x for x in (str(layer), mod_name, name) if x)


class Lookups:
    """Embedding tables whose weight a stage needs only at the rows a call looks up.

    ``modules`` maps an ``nn.Embedding`` of the model to ``fn(microbatch_inputs) ->
    integer tensor`` of the indices it will look up in that microbatch (for a language
    model: the token ids). A stage whose layers use the table's weight only through
    these modules uploads just the call's rows (the rest of its device copy is NaN, so
    a lookup outside them cannot pass silently) and downloads just their gradients,
    which are exactly the nonzero rows of the full gradient. A declared module looks up
    in the first layer that holds it; a stage with another layer using the weight (a
    tied LM head) moves it whole.
    """

    def __init__(self, layerset: LayerSet,
                 modules: Mapping[nn.Module, Callable[[object], torch.Tensor]] | None):
        self.ids: dict[int, Callable[[object], torch.Tensor]] = {}
        """Parameter id -> the function giving the indices a microbatch looks up."""
        self.rows: dict[int, int] = {}
        """Parameter id -> rows of its table."""
        # Per layer: the tables it uses through a declared lookup, and otherwise.
        self._lookup: list[frozenset[int]] = [frozenset()] * len(layerset)
        self._other: list[frozenset[int]] = [frozenset()] * len(layerset)
        if not modules:
            return
        declared: set[int] = set()
        for mod, fn in modules.items():
            where = type(mod).__name__
            if not isinstance(mod, nn.Embedding):
                raise ConfigError(f"lookups: {where} is not an nn.Embedding: only an "
                                  "embedding table's rows can be moved by index")
            if not callable(fn):
                raise ConfigError(f"lookups: the value for {where} must be fn(inputs) -> "
                                  f"index tensor, got {type(fn).__name__}")
            if mod.max_norm is not None or mod.sparse:
                raise ConfigError(f"lookups: {where} has max_norm or sparse set (it "
                                  "renormalises rows in place or returns sparse "
                                  "gradients): drop it from lookups")
            pid = layerset._pid_of.get(id(mod.weight))
            if pid is None:
                raise ConfigError(f"lookups: {where} is not a module of the pipeline's "
                                  "layers: pass the model's own embedding module")
            self.ids[pid] = fn
            self.rows[pid] = mod.weight.shape[0]
            declared.add(id(mod))
        # A declared module looks up in the first layer holding it; a later layer
        # holding it (a head reading a tied embedding's weight) uses the whole table.
        owner: dict[int, int] = {}
        for l, layer in enumerate(layerset.layers):
            for mod in layer.modules():
                if id(mod) in declared:
                    owner.setdefault(id(mod), l)
        for l, layer in enumerate(layerset.layers):
            ok, other = set(), set()
            for mod in layer.modules():
                for p in mod._parameters.values():
                    pid = layerset._pid_of.get(id(p)) if p is not None else None
                    if pid in self.ids:
                        lookup = id(mod) in declared and owner[id(mod)] == l
                        (ok if lookup else other).add(pid)
            self._lookup[l], self._other[l] = frozenset(ok), frozenset(other)

    def __bool__(self) -> bool:
        return bool(self.ids)

    def stage_pids(self, layers: range) -> frozenset[int]:
        """Tables a stage over ``layers`` moves by rows: those it uses through lookups
        and no layer of it uses otherwise (a tied LM head in the same stage makes the
        table move whole)."""
        return frozenset().union(*(self._lookup[l] for l in layers)) \
            - frozenset().union(*(self._other[l] for l in layers))

    def call_rows(self, microbatches: Sequence) -> dict[int, torch.Tensor]:
        """Table -> the sorted distinct rows the call's microbatches look up (int64, on
        the CPU). Raises :class:`InputError` for indices outside a table."""
        out = {}
        for pid, fn in self.ids.items():
            ids = [fn(x) for x in microbatches]
            for t in ids:
                if not isinstance(t, torch.Tensor) or t.is_floating_point() or \
                        t.is_complex() or t.dtype == torch.bool:
                    got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                    raise InputError(f"lookups gave {got} for a microbatch: it must "
                                     "return the integer indices the embedding looks up")
            flat = torch.cat([t.reshape(-1).to("cpu", torch.int64) for t in ids])
            rows = torch.unique(flat, sorted=True)
            n = self.rows[pid]
            if rows.numel() and (int(rows[0]) < 0 or int(rows[-1]) >= n):
                bad = int(rows[0]) if int(rows[0]) < 0 else int(rows[-1])
                raise InputError(f"index {bad} is outside the embedding table's {n} rows "
                                 "(are the inputs token ids of this model's vocabulary? "
                                 "check the tokenizer matches the model)")
            out[pid] = rows
        return out
