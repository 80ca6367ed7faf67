"""The optimizer work of one training call: the hook every call gets (:class:`CallHook`),
the whole step of ``sync`` and ``stale`` (:class:`WholeStep`), and what the per-stage
steps share (:func:`clip`, :func:`step_params`, undo :class:`Snapshot`, :func:`merged`
gradients). :class:`~rotapipe.runtime.optimizer.HostOptimizer` picks the hook of a call;
:class:`~rotapipe.runtime.overlapstep.OverlapStep` is the per-stage one."""

from __future__ import annotations

import copy
import typing
from collections import Counter
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..config import NonFinite
from ..schedule import ActionKind as K, Schedule
from .callgrads import CallGrads
from .host import HostState

if typing.TYPE_CHECKING:
    from .optimizer import HostOptimizer

__all__ = ["Cost", "CallHook", "WholeStep", "partly_stepped", "merged", "Room",
           "per_element", "clip", "step_params", "Snapshot"]

Cost = Callable[[list[int]], None] | None
"""Called after the optimizer stepped a set of parameters (indices into
``layerset.params``), on the thread that stepped them (timed emulation sleeps there)."""


class CallHook:
    """The optimizer work of one training call: :meth:`handoff` after each ``O`` action
    (host lane), :meth:`commit` once every gradient of the call is in (the call then
    changes the state), :meth:`abort` when it failed. This base only accumulates: the
    call's gradients are merged into ``param.grad`` (:meth:`HostState.commit`).

    A parameter is complete once every stage holding it has handed off (a tied
    weight: after its shallowest stage; ``schedule`` and ``stage_pids`` say which
    ``O`` hands off what). Under ``nonfinite="raise"`` (without data parallelism,
    whose check reads the reduced gradients) each complete gradient's finiteness is
    settled right there, on the host lane while shallower stages still run backward:
    by the bounds of its arrival (:meth:`CallGrads.known_finite`), else by its norm,
    taken then. The check at :meth:`commit` reads no gradient that was settled."""

    def __init__(self, host: HostState, grads: CallGrads, units: float, reduce=None,
                 owner: HostOptimizer | None = None, schedule: Schedule | None = None,
                 stage_pids: Callable[[str], list[int]] | None = None):
        self.host, self.grads, self.units, self.reduce = host, grads, units, reduce
        self.owner = owner
        trainable = set(host.trainable)
        self.by_key = {} if schedule is None else {
            a.key: [pid for pid in stage_pids(a.stage) if pid in trainable]
            for a in schedule.actions if a.kind is K.OPTIMIZER}
        self.left = Counter(pid for pids in self.by_key.values() for pid in pids)
        self.norms: dict[int, torch.Tensor] = {}     # pid -> its L2 norm
        self.checks = owner is not None and owner.nonfinite is NonFinite.RAISE \
            and not owner.scaler.dynamic
        self.changed: str | None = None
        """Set when :meth:`commit` failed after it had changed the state (a whole step
        raising part-way: nothing to undo it from): what stays, for the failure's
        report (:meth:`CallStream._fail`), which then calls :meth:`keep_changes`."""

    def handoff(self, key: str) -> None:
        if self.reduce is not None:
            # Data parallel: all-reduce what is complete now, overlapping shallower stages.
            self.reduce.handoff(key)
        elif self.checks:
            for pid in self._complete(key):
                if self.grads.known_finite(pid):
                    continue            # settled by the bounds of its arrival
                g = self.grads.get(pid, reuse=True)
                if g is not None:
                    self.norms[pid] = torch.linalg.vector_norm(g)

    def _complete(self, key: str) -> list[int]:
        """Count the hand-off ``key``; return the parameters it completes."""
        done = []
        for pid in self.by_key.get(key, ()):
            self.left[pid] -= 1
            if self.left[pid] == 0:
                done.append(pid)
        return done

    def check(self) -> None:
        """The finiteness check before anything is merged (``nonfinite="raise"``): the
        bounds of the arrivals and the norms taken at the hand-offs, the rest read
        now."""
        if self.checks:
            known = {pid for pid in self.grads.pids() if self.grads.known_finite(pid)}
            self.owner.finite(self.grads.checked(), self.norms, known)

    def commit(self) -> None:
        self.check()    # raises before anything is merged
        self.host.commit(self.grads, self.units)

    def abort(self) -> None:
        pass

    def keep_changes(self) -> None:
        """After a failed :meth:`commit` that set :attr:`changed`, once the workers
        stopped: leave the state it changed consistent (nothing here to do)."""


class WholeStep(CallHook):
    """``sync`` and ``stale``: once the call is complete, one whole step on the
    gradients accumulated since the last step plus this call's (clip, skip on
    overflow, step), written into the compute copies of ``view`` (``None``: every
    set; ``stale``: the set the calls two steps later read, the next step's calls
    read the other). Nothing changes if the call fails before its commit. The step
    itself keeps no snapshot (a copy of every weight and optimizer state per step): an
    optimizer raising part-way leaves the parameters it stepped before stepped and the
    merged gradients in ``.grad``; :attr:`changed` says so, and :meth:`keep_changes`
    makes the workers follow the masters, as :meth:`HostOptimizer.sync_step` does."""

    def __init__(self, owner: HostOptimizer, optimizer, grads: CallGrads, units: float,
                 cost: Cost, view: int | None, reduce=None, schedule: Schedule | None = None,
                 stage_pids: Callable[[str], list[int]] | None = None):
        super().__init__(owner.host, grads, units, reduce, owner, schedule, stage_pids)
        self.opt, self.cost, self.view = optimizer, cost, view

    def commit(self) -> None:
        host, params, owner = self.host, self.host.layerset.params, self.owner
        # The call's gradients are merged into param.grad in place (one fp32 gradient
        # per parameter, never a merged copy beside it). Under nonfinite="raise" they
        # are checked first, so a NonFiniteError leaves param.grad as it was; otherwise
        # a non-finite step is skipped and its gradients dropped anyway.
        checked = self.checks
        self.check()
        self.changed = "merging its gradients into .grad failed part-way"
        host.commit(self.grads, self.units)
        self.changed = partly_stepped(owner.max_norm is not None)
        pids = list(host.trainable)
        step_params(owner, self.opt, pids, {pid: params[pid].grad for pid in pids
                                            if params[pid].grad is not None}, self.cost,
                    checked=checked)
        self.changed = None
        host.write_back(view=self.view)
        host.zero_grad()
        self.grads.clear()     # the call object outlives its step: drop them now

    def keep_changes(self) -> None:
        # Every set of compute copies (stale keeps two): the next call, whichever set
        # it reads, computes with the masters as the failed step left them.
        self.host.write_back()
        self.grads.clear()


def partly_stepped(clipped: bool) -> str:
    """What a whole step that raised part-way left (:attr:`CallHook.changed`)."""
    return ("its gradients were merged into .grad" +
            (" (and clipped to clip_grad_norm)" if clipped else "") +
            " and the optimizer's step raised part-way: the parameters it updated "
            "before raising keep their update (the workers' copies follow them), the "
            "others do not, and .grad keeps the merged gradients")


def merged(prev: torch.Tensor | None, g: torch.Tensor | None, keep: float,
            new: float) -> torch.Tensor | None:
    """A call's gradient ``g`` merged with the accumulated ``prev`` as
    :meth:`HostState.commit` does, without changing ``prev``."""
    if prev is None:
        return None if g is None else (g.mul_(new) if new != 1.0 else g)
    if g is None:
        return torch.mul(prev, keep)
    return torch.mul(prev, keep).add_(g, alpha=new)


class Room:
    """Named host buffers that grow to the largest size asked for and are reused."""

    def __init__(self):
        self.buffers: dict[object, torch.Tensor] = {}
        self.turn = 0

    def take(self, name, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            buf = self.buffers[name] = torch.empty(n, dtype=dtype)
        return buf[:n].view(shape)


def per_element(optimizer) -> bool:
    """Whether ``optimizer`` updates each element from that element's gradient and
    state alone (rows of a table can then be stepped apart exactly): torch's Adam,
    AdamW and SGD themselves, not subclasses, which may change ``step``."""
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def clip(params: Iterable[nn.Parameter], max_norm: float | None) -> float | None:
    """Scale gradients to a global L2 norm of at most ``max_norm`` (``None``: no-op),
    exactly as ``torch.nn.utils.clip_grad_norm_``, which it calls; return the norm
    before clipping (``None`` when off or without gradients)."""
    if max_norm is not None:
        with_grad = [p for p in params if p.grad is not None]
        if with_grad:
            return float(torch.nn.utils.clip_grad_norm_(with_grad, max_norm))
    return None


def step_params(owner: HostOptimizer, optimizer: torch.optim.Optimizer, pids: list[int],
                grads: dict[int, torch.Tensor], cost: Cost, checked: bool = False) -> bool:
    """One whole step of the parameters ``pids`` on ``grads`` (the stale step): clip,
    skip on overflow under dynamic loss scaling or a non-finite gradient
    (:meth:`HostOptimizer.finite`), step, report the cost. The compute copies are left
    alone (workers may be reading them): the caller writes back. The parameters' own
    ``.grad`` is set aside and put back meanwhile. ``checked``: the caller already
    checked that ``grads`` are finite (nonfinite="raise"): no second pass over them."""
    params = owner.host.layerset.params
    saved = {pid: params[pid].grad for pid in pids}
    try:
        for pid in pids:
            params[pid].grad = grads.get(pid)
        overflow = not checked and not owner.finite(grads)
        if not overflow:
            owner.last_norm = clip((params[pid] for pid in pids), owner.max_norm)
            owner.states.step(optimizer, [params[pid] for pid in pids])
            if cost is not None:
                cost(pids)
        owner.skipped(overflow)
        return not overflow
    finally:
        for pid, g in saved.items():
            params[pid].grad = g


class Snapshot:
    """Weights and optimizer state of some parameters, taken before stepping them, so
    that the step can be undone exactly (one copy of each tensor); with ``compute``
    (a set of compute copies the step will overwrite), their compute copies too."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                 pids: list[int], compute: list[torch.Tensor] | None = None):
        self.optimizer, self.pids = optimizer, pids
        self.items = [(p, p.detach().clone(), copy_state(optimizer.state.get(p)))
                      for p in params]
        self.compute = None if compute is None else \
            [(compute[pid], compute[pid].clone()) for pid in pids]

    def restore(self) -> None:
        with torch.no_grad():
            for p, w, state in self.items:
                p.copy_(w)
                if state is None:
                    self.optimizer.state.pop(p, None)
                else:
                    self.optimizer.state[p] = state
            for dst, old in self.compute or ():
                dst.copy_(old)


def copy_state(state: dict | None) -> dict | None:
    if not state:
        return None
    return {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in state.items()}
