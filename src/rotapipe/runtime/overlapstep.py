"""The per-stage optimizer step of an ``overlap`` call (and of a ``stale`` one without
clipping or dynamic loss scaling): each stage's parameters stepped on the host lane as
soon as their gradients are complete, speculatively, undone on failure or when the
step turns out to need the whole call (:class:`OverlapStep`)."""

from __future__ import annotations

import copy
import typing
from collections.abc import Callable

import torch
from torch import nn

from ..errors import ConfigError, NonFiniteError
from ..plan.costs import ROWS_FIRST_COST
from ..schedule import Schedule
from .callgrads import CallGrads
from .stepping import CallHook, Cost, Snapshot, clip, merged, partly_stepped, per_element

if typing.TYPE_CHECKING:
    from .optimizer import HostOptimizer

__all__ = ["OverlapStep"]

# What torch.optim.lr_scheduler changes, and weight_decay (a weight-decay schedule set
# by the caller after each step, as some training recipes do).
_HYPER = ("lr", "momentum", "betas", "weight_decay")


def _value(v):
    """A setting's value now: a tensor ``lr`` (or ``betas``) is changed in place by a
    scheduler (``fill_``), so the tensor itself would always equal itself."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else tuple(v.flatten().tolist())
    if isinstance(v, tuple):
        return tuple(_value(x) for x in v)
    return v


class OverlapStep(CallHook):
    """The optimizer side of one ``overlap`` call that ends a step (and of a ``stale``
    one without clipping or dynamic loss scaling: ``view`` is then the set of compute
    copies the calls two steps later read, which the running calls do not).

    Each ``O`` action (host lane) adds its stage's gradients to ``grads`` and calls
    :meth:`handoff`. A parameter is complete once every stage holding it has handed
    off (a tied weight: after its shallowest stage); the complete ones are stepped
    right there, on the host lane, and their compute copies refreshed, while
    shallower stages still run backward: the ``O`` action completes after the step,
    so the next call's weight uploads that wait for it read the new weights. Each step
    is speculative: a snapshot taken just before it lets :meth:`abort` (the call
    failed) or :meth:`commit` (the global norm needs clipping, or a gradient
    overflowed under dynamic loss scaling) undo it. On success nothing is left in
    ``param.grad``.

    Data parallel (``reduce``, a :class:`~rotapipe.runtime.allreduce.CallReduce`): a
    hand-off first starts the all-reduce of the parameters it completes, then waits
    for it and steps them on the reduced gradients, which are identical on every rank
    (so are the overflow check, the global norm and the step).

    Write-back right after the step is safe: once a backward stage has handed off, no
    action of this call uploads its layers again (forward stages uploaded them before
    the tail ran, shallower backward stages hold other layers, and a tied weight is
    stepped only after its last stage).
    """

    def __init__(self, owner: HostOptimizer, optimizer: torch.optim.Optimizer,
                 schedule: Schedule, stage_pids: Callable[[str], list[int]],
                 grads: CallGrads, units: float, cost: Cost, reduce=None,
                 view: int | None = None):
        host = owner.host
        super().__init__(host, grads, units, reduce, owner, schedule, stage_pids)
        self.opt, self.view = optimizer, view
        self.max_norm, self.scaler, self.cost = owner.max_norm, owner.scaler, cost
        self.params = host.layerset.params
        self.prev: dict[int, torch.Tensor | None] | None = None   # set by _begin
        self.final: dict[int, torch.Tensor] = {}     # pid -> gradient the step used
        # self.norms: pid -> the L2 norm of the gradient it was stepped on (clipping)
        self.snapshots: list[Snapshot] = []
        self.undo = owner.undo if owner is not None else True
        self.stepped: list[int] = []     # without undo: what a failure leaves stepped
        self.overflow = False
        self.early: dict[str, list[int]] = {}
        """Hand-off key -> the parameters its ``O`` still steps, for keys whose ``OR``
        (:meth:`step_rows`) did the rest."""
        self.hyper: list[dict] | None = None
        """What a scheduler changes, per parameter group, as the first stage's step saw
        it: every stage of one step must step with the same (:meth:`_same_hyper`)."""

    def _begin(self) -> None:
        """At the first hand-off (earlier calls have committed by then): set aside the
        gradients of earlier accumulated calls, merged with this call's as
        HostState.commit would (``keep``/``new`` weights), never modified in place."""
        host = self.host
        total = host.samples + self.units
        self.keep, self.new = host.samples / total, self.units / total
        self.prev = {pid: self.params[pid].grad for pid in host.trainable}
        for pid in host.trainable:
            self.params[pid].grad = None

    # -- during the call (host lane) -----------------------------------------------------
    def handoff(self, key: str) -> None:
        if key in self.early:           # its OR stepped the rest
            pids = self.early.pop(key)
            if pids:
                self._step(pids)
            return
        if self.prev is None:
            self._begin()
        # The reducer's buckets at ``key`` hold exactly the parameters completed here.
        buckets = self.reduce.handoff(key) if self.reduce is not None else []
        done = self._complete(key)
        if done or buckets:
            self._step(done, buckets)

    def step_rows(self, key: str, nxt) -> None:
        """An ``OR`` action before the hand-off ``key`` (host lane): the next call
        (``nxt``: its host store, ``None`` when it is not issued yet) uploads only the
        rows it looks up of the embedding tables this hand-off completes, so those
        rows' new values are computed first, from the same gradient and optimizer
        state, into ``("fresh", pid)`` of its store, which its row upload reads; the
        whole tables are stepped in place at the ``O`` that follows. Everything else
        the hand-off completes (and every table when the next call's rows are not
        known) is stepped here, so the next call's uploads that wait for this ``OR``
        read stepped weights."""
        if self.reduce is not None or nxt is None or not per_element(self.opt):
            self.handoff(key)
            self.early[key] = []
            return
        if self.prev is None:
            self._begin()
        done = self._complete(key)
        # A non-finite gradient fails the call at the O (nonfinite="raise": the only
        # setting with OR actions), and the next call, which read these rows, with it.
        tables = [pid for pid in done
                  if nxt.contains(("rows", pid)) and self._gradient(pid) is not None
                  and self._rows_pay(nxt.get(("rows", pid)).numel(),
                                     self.params[pid].shape[0])]
        rest = [pid for pid in done if pid not in tables]
        if rest:
            self._step(rest)
        for pid in tables:
            nxt.put(("fresh", pid), self._preview(pid, nxt.get(("rows", pid))))
        if tables and self.cost is not None:
            self.cost(tables, rows=True)
        self.early[key] = tables

    def _rows_pay(self, rows: int, table_rows: int) -> bool:
        """Whether stepping ``rows`` of a table first is cheaper than its whole step
        (:data:`ROWS_FIRST_COST`; timed emulation decides for the emulated model)."""
        pays = getattr(self.cost, "rows_first_pays", None)
        if pays is not None:
            return pays()
        return rows * ROWS_FIRST_COST < table_rows

    def _gradient(self, pid: int) -> torch.Tensor | None:
        """The gradient ``pid`` is stepped on: merged once with the accumulated one
        (:func:`merged`), kept in :attr:`final` until its step."""
        g = self.final.get(pid)
        if g is None:
            g = merged(self.prev.get(pid), self.grads.get(pid), self.keep, self.new)
            if g is not None:
                self.final[pid] = g
        return g

    def _preview(self, pid: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` of parameter ``pid`` after the step on :meth:`_gradient`, in
        its compute dtype, computed by the user's optimizer class with the parameter's
        group settings on a gathered copy of those rows and of their state (an
        optimizer whose update is element by element computes exactly these values
        when it steps the whole table); nothing of the model or optimizer changes."""
        p, opt, room = self.params[pid], self.opt, self.owner.rows_room
        shape = (rows.numel(),) + tuple(p.shape[1:])

        def gather(name, src: torch.Tensor) -> torch.Tensor:
            return torch.index_select(src, 0, rows, out=room.take(name, shape, src.dtype))
        part = nn.Parameter(gather("weight", p.detach()))
        part.grad = gather("grad", self._gradient(pid))
        group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
        shadow = type(opt)([{**{k: v for k, v in group.items() if k != "params"},
                             "params": [part]}])
        state = opt.state.get(p)
        if state:
            shadow.state[part] = {
                k: gather(k, v) if isinstance(v, torch.Tensor) and v.dim() and
                v.shape == p.shape else v.clone() if isinstance(v, torch.Tensor)
                else copy.deepcopy(v) for k, v in state.items()}
        self.owner.states.step(shadow, [part])
        # Two output buffers in turn: the previous call's rows may still be uploading.
        room.turn = 1 - room.turn
        return room.take(("out", room.turn), shape, self.host.dtype_of(pid)) \
            .copy_(part.detach())

    def _step(self, pids: list[int], buckets=()) -> None:
        if buckets:
            self.reduce.apply(buckets)      # the reduced gradients replace the staged
        stepped = []
        for pid in pids:
            g = self._gradient(pid)
            if g is None:
                continue        # no loss depends on it: torch would skip it too
            if self.max_norm is not None:
                self.norms[pid] = torch.linalg.vector_norm(g)
            stepped.append(pid)
        # A non-finite gradient: an overflow or a skip (commit() skips the whole step,
        # undoing the stages stepped before), or NonFiniteError (the call fails).
        # A gradient no earlier call adds to is this call's times new <= 1: finite
        # when the bounds of its arrival say this call's is (CallGrads.known_finite).
        known = set() if self.prev is None else {
            pid for pid in stepped
            if self.prev.get(pid) is None and self.grads.known_finite(pid)}
        if stepped and not self.overflow and not self.owner.finite(
                {pid: self.final[pid] for pid in stepped}, self.norms, known):
            self.overflow = True
            if not self.undo and self.stepped:
                # The lean layout kept no copies: the stages stepped before cannot be
                # undone, so the step cannot be skipped. Fail the call instead (the
                # pipeline then refuses training until a checkpoint is loaded).
                raise NonFiniteError(
                    "a gradient is not finite after some stages were already stepped, and "
                    "undo_steps=False kept no copies to undo them: the step cannot be "
                    "skipped. Resume from the last checkpoint (with undo_steps=True, or "
                    "clipping on, a non-finite step is skipped cleanly)")
        if not stepped or self.overflow:
            return
        self._same_hyper()
        params = [self.params[pid] for pid in stepped]
        # stale: the set of compute copies written may differ from the masters (it
        # holds the weights the failed call's retry must read): keep it too.
        view = None if self.view is None else self.host.views[self.view]
        if self.undo:
            self.snapshots.append(Snapshot(self.opt, params, stepped, view))
        self.stepped += stepped
        for pid, p in zip(stepped, params):
            p.grad = self.final[pid]
        try:
            self.owner.states.step(self.opt, params)
        finally:
            for p in params:
                p.grad = None
        self.host.write_back(stepped, view=self.view)
        for pid in stepped:
            if self.max_norm is None:
                # No redo can need them: the gradients die here, as each stage lands,
                # so the host never holds the whole model's (docs/memory.md).
                del self.final[pid]
                self.grads.discard(pid)
            elif self.grads.narrow(pid):
                # A clip redo widens the staged compute-dtype gradient again (the same
                # bits): no fp32 copy of it waits for the global norm.
                del self.final[pid]
        if self.cost is not None:
            self.cost(stepped)

    def pin_hyper(self) -> None:
        """Take the settings a scheduler changes as the call is issued (no scheduler is
        attached, so nothing but the caller changes them): a change before the call's
        step is done is then refused whichever stage it lands before, the first
        included. Otherwise a scheduler stepped right after ``train_step`` returned,
        landing before the first stage's step (the usual order: the loss is known
        before the tail's gradients are down), went unseen and the whole step ran at
        the next step's rate, one step early."""
        self.hyper = self._hyper_now()

    def _hyper_now(self) -> list[dict]:
        return [{k: _value(g[k]) for k in _HYPER if k in g} for g in self.opt.param_groups]

    def _same_hyper(self) -> None:
        """Refuse a step whose stages would step with different learning rates: the
        caller changed a group's ``lr`` (``momentum``, ``betas``, ``weight_decay``)
        while this call's step was under way, typically a scheduler stepped right after
        ``train_step`` returned. The call then fails and its stages' steps are undone.
        Compared with the settings as the call was issued (:meth:`pin_hyper`) or, with
        a scheduler attached (the pipeline steps it after the previous step), as the
        first stage's step saw them."""
        now = self._hyper_now()
        if self.hyper is None:
            self.hyper = now
            return
        for i, (was, got) in enumerate(zip(self.hyper, now)):
            for k in was:
                if got.get(k) != was[k]:
                    raise ConfigError(
                        f"param group {i}'s {k!r} changed from {was[k]!r} to {got.get(k)!r} "
                        "while a training call's optimizer step was under way (its "
                        "stages step one by one after train_step returns, in the "
                        "'overlap' and 'stale' modes), so its stages would step with "
                        "different values. Pass the scheduler to pipe.attach_optimizer("
                        "opt, scheduler=...) (the pipeline steps it between steps), or "
                        "call pipe.flush() before changing the optimizer's settings")
        if len(now) != len(self.hyper):
            self.hyper = now

    # -- once the call is complete -------------------------------------------------------
    def commit(self) -> None:
        """Complete the step (a skipped step, on overflow, lowers the loss scale)."""
        if self.prev is None:
            self._begin()
        missing = [pid for pid, n in self.left.items() if n > 0]
        assert not missing, f"parameters {missing} were never handed off"
        if self.max_norm is not None and self.norms:
            norms = [self.norms[pid] for pid in self.host.trainable if pid in self.norms]
            self.owner.last_norm = float(torch.linalg.vector_norm(torch.stack(norms)))
        written = set(self.stepped)
        if self.overflow:
            self._undo(grads=False)
            written = set()
        elif self.max_norm is not None and self.norms and self._needs_clipping():
            # The total norm is known only now: undo the speculative steps and redo one
            # whole step on the clipped gradients (exact, not overlapped).
            self._undo(grads=False)
            pids = [pid for pid in self.host.trainable if pid in self.norms]
            for pid in pids:
                g = self.final.pop(pid, None)
                if g is None:       # widened again from the compute-dtype one
                    g = merged(self.prev.get(pid), self.grads.pop(pid), self.keep,
                                self.new)
                self.prev[pid] = None       # the call commits: nothing to put back
                self.params[pid].grad = g
            # No snapshot of this whole step: an optimizer raising part-way leaves the
            # call partly stepped (CallHook.changed, reported by CallStream._fail).
            self.changed = partly_stepped(clipped=True)
            clip((self.params[pid] for pid in pids), self.max_norm)
            self.owner.states.step(self.opt, [self.params[pid] for pid in pids])
            self.changed = None
            self.host.write_back(pids, view=self.view)
            written = set(pids)
            if self.cost is not None:
                self.cost(pids)
        if self.view is not None:
            # stale: the calls two steps later read this set, which still holds the
            # weights one step older: every master goes there, also those the step
            # left alone (no gradient in this step, or the step skipped and undone,
            # which put the older weights back: only a failed call's retry reads those).
            self.host.write_back([pid for pid in self.host.trainable if pid not in written],
                                 view=self.view)
        for pid in self.host.trainable:
            self.params[pid].grad = None
        self.host.samples = 0.0
        self.owner.skipped(self.overflow)
        self._drop()

    def _drop(self) -> None:
        """The call is over: let its gradients die (the call object outlives it)."""
        self.snapshots = []
        self.final.clear()
        self.norms.clear()
        self.grads.clear()
        if self.prev is not None:
            self.prev.clear()

    def _needs_clipping(self) -> bool:
        # torch.nn.utils.clip_grad_norm_'s formula, on the per-parameter norms in
        # parameter order: coef = max_norm / (total + 1e-6), clamped at 1.
        norms = [self.norms[pid] for pid in self.host.trainable if pid in self.norms]
        total = torch.linalg.vector_norm(torch.stack(norms))
        return bool(self.max_norm / (total + 1e-6) < 1.0)

    def keep_changes(self) -> None:
        """The redo step of :meth:`commit` raised part-way: ``.grad`` holds the merged
        gradients (this call's samples included), every set of compute copies follows
        the masters."""
        self.host.samples += self.units
        self.host.write_back()
        self._drop()

    def abort(self) -> None:
        """The call failed: undo every step and put the accumulated gradients back
        (without snapshots, ``undo_steps=False``: mark the pipeline as partly stepped)."""
        if not self.undo and self.stepped and self.owner is not None:
            n = len(set(self.stepped))
            self.owner.broken = (
                f"a training call failed after the overlap optimizer had stepped {n} of "
                f"{len(self.host.trainable)} trainable parameters, and "
                "PipeConfig(undo_steps=False) keeps no copy to undo them: the model is "
                "partly stepped. Build a new pipeline from the last checkpoint (or keep "
                "undo_steps=True, which costs a copy of each stage's weights and "
                "optimizer state while a call runs)")
        self._undo()
        self._drop()

    def _undo(self, grads: bool = True) -> None:
        for snap in reversed(self.snapshots):
            snap.restore()
        pids = [pid for snap in self.snapshots for pid in snap.pids]
        if self.view is None:
            self.host.write_back(pids)
        else:
            self.host.settle(pids)      # the stale view was restored with the masters
        self.snapshots = []
        if grads and self.prev is not None:
            for pid, g in self.prev.items():
                self.params[pid].grad = g
