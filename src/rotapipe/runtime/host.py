"""Model state in host memory: compute-dtype weights, fp32 masters, gradients.

The masters *are* the user's ``nn.Parameter`` objects, converted to fp32 in place, so
an optimizer built over ``model.parameters()`` (before or after wrapping) steps them
and ``model.state_dict()`` reads the trained weights. Frozen parameters get no master:
they are kept in the compute dtype only. The compute-dtype copies the workers upload
alias the masters in fp32 and are refreshed after each step otherwise. A tensor the
model keeps in fp32 (:attr:`~rotapipe.model.LayerSet.fp32_params`) computes in fp32
whatever the compute dtype: its compute copy is fp32 (the master itself, as in fp32).

Gradients of one call are staged (:class:`CallGrads`) and merged into ``param.grad``
only when the whole call succeeded, so a failed call changes nothing. Staged in the
compute dtype (bf16: 2 bytes per parameter) and widened to fp32 one parameter at a
time where they are merged or stepped, the host holds one fp32 gradient per parameter
(docs/memory.md).
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from ..config import PrecisionConfig
from ..errors import InputError
from ..model import LayerSet
from ..model.quant import NF4Weight, quantized
from .callgrads import CallGrads
from .pinning import HostPinning
from .pool import BlockPool


class _OwnSteps(threading.local):
    active = False


_OWN_STEPS = _OwnSteps()
"""Per thread: whether an optimizer step running on it is the pipeline's own (which
writes its compute copies back itself). Thread-local, not shared state: it only marks
a frame of the thread's own stack."""


@contextlib.contextmanager
def own_step():
    """Mark the optimizer steps taken inside as the pipeline's own: the process-wide
    watch on optimizer steps (:meth:`HostState.stepped_elsewhere`) skips them."""
    before, _OWN_STEPS.active = _OWN_STEPS.active, True
    try:
        yield
    finally:
        _OWN_STEPS.active = before


def in_own_step() -> bool:
    """Whether the optimizer step now running on this thread is a pipeline's own."""
    return _OWN_STEPS.active


def cleared_grads(params, left: dict) -> tuple[list[int], list[int]]:
    """Which of ``(pid, parameter)`` had the gradient the last commit left them (``left``:
    pid -> (weakref to that gradient, its version)) cleared since (``zero_grad()``:
    set to ``None``, or zeroed in place), and which kept one (a gradient the user set
    on a parameter given none counts as kept: theirs to weight)."""
    cleared, kept = [], []
    for pid, p in params:
        g, was = p.grad, left.get(pid)
        if was is None:
            if g is not None:
                kept.append(pid)
            continue
        if g is None or (g is was[0]() and g._version != was[1] and not g.any()):
            cleared.append(pid)
        else:
            kept.append(pid)
    return cleared, kept


class HostState:
    """``pinning`` keeps every tensor the workers upload in its host memory mode
    (:class:`~rotapipe.runtime.pinning.HostPinning`; ``None``: pageable, as allocated).
    ``views=2`` keeps two sets of compute copies of the trainable weights (the stale
    optimizer writes one step's weights into one set while workers still upload the
    previous step's from the other: :attr:`views`); every master then has compute
    copies of its own, even in fp32."""

    def __init__(self, layerset: LayerSet, precision: PrecisionConfig,
                 pinning: HostPinning | None = None, views: int = 1):
        separate = views > 1
        self.layerset = layerset
        self.dtype = precision.compute_dtype
        self.pinning = pinning
        self.compute: list[torch.Tensor] = []
        self._separate: list[int] = []     # params whose compute copy is not the master
        self.quantized: dict[int, NF4Weight] = {}
        """Frozen weights kept as NF4 (:mod:`rotapipe.model.quant`): their compute copy
        is the packed uint8 bytes, which workers upload and dequantize."""
        keep = pinning.keep if pinning is not None else (lambda t: t)
        for pid, p in enumerate(layerset.params):
            dtype = self.dtype_of(pid)      # fp32 for a tensor the model keeps in fp32
            if p.requires_grad:
                if p.dtype != torch.float32:
                    p.data = p.data.float()
                if dtype == torch.float32 and not separate:
                    p.data = keep(p.data)          # the master is its own compute copy
                    self.compute.append(p.data)
                else:
                    # Allocated in its mode (page-locked from the start), then filled:
                    # pinning a finished copy would copy it a second time.
                    c = pinning.new(p.shape, dtype) if pinning is not None else \
                        torch.empty(p.shape, dtype=dtype)
                    with torch.no_grad():
                        c.copy_(p.data)
                    self.compute.append(c)
                    self._separate.append(pid)
            elif quantized(p) is not None:
                q = quantized(p)
                q.packed = keep(q.packed)       # page-locked in its mode, like any weight
                self.quantized[pid] = q
                self.compute.append(q.packed)
            else:
                if p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)
                p.data = keep(p.data)
                self.compute.append(p.data)
        self._is_separate = frozenset(self._separate)
        self._versions = {pid: layerset.params[pid]._version for pid in self._separate}
        """Per master with a copy of its own: its version counter when last copied (an
        in-place edit since bumps it: :meth:`follow_edits`)."""
        self._stepped: set[int] = set()
        """Masters an optimizer step outside the pipeline updated since they were last
        copied (fused kernels do not bump the version counter): :meth:`stepped_elsewhere`."""
        self._pid_of = {id(p): pid for pid, p in enumerate(layerset.params)}
        self._left: dict[int, tuple[weakref.ref, int]] = {}
        """Per parameter, the ``.grad`` the last :meth:`commit` left (weakly: a step
        drops it) and its version: :meth:`follow_grads` tells from them what the user
        cleared since."""
        self.views: list[list[torch.Tensor]] = [self.compute]
        """Sets of compute copies the workers may upload (one, or two for ``stale``):
        frozen weights are shared by every set."""
        for _ in range(views - 1):
            view = list(self.compute)
            for pid in self._separate:
                c = self.compute[pid]
                view[pid] = pinning.new(c.shape, c.dtype) if pinning is not None else \
                    torch.empty_like(c)
                with torch.no_grad():
                    view[pid].copy_(c)
            self.views.append(view)
        self.trainable = [pid for pid, p in enumerate(layerset.params) if p.requires_grad]
        self.grad_pool = BlockPool()
        """Storages of the fp32 gradients a call widens on arrival (:class:`CallGrads`):
        once a step dropped them (``zero_grad``) and nothing else holds them, the next
        call's reuse them instead of page-faulting fresh memory in."""
        self.samples = 0.0
        """Loss items (samples, or ``loss_weight`` units) whose gradients ``param.grad``
        holds since the last step/zero_grad."""

    def dtype_of(self, pid: int) -> torch.dtype:
        """dtype parameter ``pid`` computes in on the workers: the compute dtype, or
        fp32 for one the model keeps in fp32 (``RoundPipe(keep_fp32=...)``)."""
        return self.layerset.compute_dtype(pid, self.dtype)

    def device_bytes(self, pid: int) -> int:
        """Bytes parameter ``pid`` takes on a worker: its compute copy, or for an NF4
        weight the dequantized weight in its compute dtype."""
        q = self.quantized.get(pid)
        if q is not None:
            return q.shape.numel() * self.dtype_of(pid).itemsize
        c = self.compute[pid]
        return c.numel() * c.element_size()

    def is_pinned(self, pid: int) -> bool:
        """Whether the compute copy of parameter ``pid`` (what workers upload) is page-
        locked (recorded so on emulated workers); ``False`` without a pinning."""
        return self.pinning is not None and self.pinning.is_pinned(self.compute[pid])

    def write_back(self, pids: list[int] | None = None, view: int | None = None) -> None:
        """Refresh compute-dtype copies from the masters after an optimizer step (of the
        parameters ``pids``; default all; into the set ``view`` of :attr:`views`,
        default every set): one pass that reads fp32 and writes the compute dtype.
        Copies that alias their master need nothing."""
        params = self.layerset.params
        todo = self._separate if pids is None else [p for p in pids if p in self._is_separate]
        views = self.views if view is None else [self.views[view]]
        with torch.no_grad():
            for compute in views:
                for pid in todo:
                    compute[pid].copy_(params[pid].data)
        for pid in todo:
            self._versions[pid] = params[pid]._version
            self._stepped.discard(pid)

    def settle(self, pids) -> None:
        """Record masters ``pids`` as matching their compute copies (restored together
        from a snapshot, not copied from one another)."""
        params = self.layerset.params
        for pid in pids:
            if pid in self._is_separate:
                self._versions[pid] = params[pid]._version

    def follow_edits(self) -> list[int]:
        """Refresh the compute copies of the masters changed in place since they were
        last copied (a user's edit under ``torch.no_grad()``, between calls); returns
        their indices. Call it only with no call in flight (the host lane may be
        stepping masters then)."""
        params, compute = self.layerset.params, self.compute
        # A parameter that holds its compute copy itself (sharded optimizer state: the
        # fp32 master is this rank's piece) is edited where the workers read it.
        edited = [pid for pid in self._separate
                  if (params[pid]._version != self._versions[pid] or pid in self._stepped)
                  and params[pid].data_ptr() != compute[pid].data_ptr()]
        self._stepped.clear()
        if edited:
            self.write_back(edited)
        return edited

    def stepped_elsewhere(self, param: torch.Tensor) -> None:
        """An optimizer step outside the pipeline (the user's own ``opt.step()``) just
        updated ``param``: :meth:`follow_edits` refreshes its compute copies. Fused
        ``torch.optim`` kernels write the masters without bumping their version
        counters, so the versions alone would miss it."""
        pid = self._pid_of.get(id(param))
        if pid is not None and self.layerset.params[pid] is param:
            self._stepped.add(pid)

    def follow_grads(self) -> None:
        """Before a call, with none in flight: if the user cleared the accumulated
        gradients (``optimizer.zero_grad()``, either way) since the last commit, the
        next call starts a new accumulation, as after :meth:`zero_grad` (otherwise
        its gradient would be weighted as one part of the earlier calls' mean).
        Clearing some but not all is ambiguous: an :class:`InputError`."""
        if self.samples == 0 or not self._left:
            return
        params, names = self.layerset.params, self.layerset.param_names
        cleared, kept = cleared_grads(((pid, params[pid]) for pid in self.trainable),
                                      self._left)
        if not cleared:
            return
        if kept:
            raise InputError(
                f"the gradient of {names[cleared[0]]} was cleared since the last call "
                f"(optimizer.zero_grad() over part of the parameters?) but that of "
                f"{names[kept[0]]} was not: the next call could not tell which calls "
                "its gradients average over. Clear them all with pipe.zero_grad() (or "
                "optimizer.zero_grad() over all of pipe.parameters()), or none")
        for pid in cleared:
            params[pid].grad = None
        self.samples = 0.0
        self._left = {}

    def commit(self, grads: CallGrads, samples: float) -> None:
        """Merge one successful call's gradients so that ``param.grad`` is the gradient
        of the mean loss over every sample since the last step."""
        total = self.samples + samples
        keep, new = self.samples / total, samples / total
        params = self.layerset.params
        with torch.no_grad():
            for pid in self.trainable:
                p = params[pid]
                # fp32; a staged bf16 one is widened here, into CallGrads' reused
                # buffer where it is only added to an existing .grad
                g = grads.pop(pid, reuse=p.grad is not None)
                if p.grad is None:
                    if g is not None:
                        p.grad = g.mul_(new) if new != 1.0 else g
                elif g is None:
                    p.grad.mul_(keep)
                else:
                    p.grad.mul_(keep).add_(g, alpha=new)
        grads.clear()      # merged: one fp32 gradient per parameter remains
        self.samples = total
        self._left = {pid: (weakref.ref(params[pid].grad), params[pid].grad._version)
                      for pid in self.trainable if params[pid].grad is not None}

    def zero_grad(self) -> None:
        for pid in self.trainable:
            self.layerset.params[pid].grad = None
        self.samples = 0.0
        self._left = {}


class LossScaler:
    """Dynamic loss scaling as ``torch.amp.GradScaler`` does it: halve the scale and
    skip the step when gradients overflow, double it after ``growth_interval`` clean
    steps. A fixed scale never changes."""

    def __init__(self, precision: PrecisionConfig):
        ls = precision.loss_scale
        self.dynamic = ls == "dynamic"
        self.scale = float(precision.init_scale if self.dynamic else (ls or 1.0))
        self.growth_interval = precision.growth_interval
        self._good_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.scale *= 0.5
            self._good_steps = 0
        else:
            self._good_steps += 1
            if self._good_steps >= self.growth_interval:
                self.scale *= 2.0
                self._good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "dynamic": self.dynamic}

    def load_state_dict(self, state: dict) -> None:
        """Resume dynamic scaling where ``state`` left it. A fixed scale (or none) is the
        config's and is kept, as a disabled ``torch.amp.GradScaler`` ignores a loaded
        state; a state of a fixed scale (``"dynamic": False``) holds nothing for a
        dynamic scaler, which keeps its ``init_scale``. (A state without the key, from
        before it existed, is loaded into a dynamic scaler as it is.)"""
        if not self.dynamic or state.get("dynamic", True) is False:
            return
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
