"""The host optimizer: its modes, global-norm clipping, undoable steps, overlapped steps.

Three ways to step (``PipeConfig.optimizer_mode``, docs/optimizer.md): ``sync`` steps every
master after the call; ``overlap`` steps each stage's parameters on the host lane as
soon as their gradients are complete (:class:`OverlapStep`), and the next call's
weight uploads wait only for the steps of their own layers; ``stale`` steps a
complete call's gradients while the next call runs, on weights one step old
(:class:`WholeStep`); :class:`HostOptimizer` is the mode of a pipeline.

Stepping a subset of the parameters with the user's optimizer works by giving only
those parameters a ``.grad``: ``torch.optim`` skips parameters whose gradient is
``None``, and optimizers whose state is per parameter (SGD with momentum, Adam, AdamW
and their foreach/fused kernels) then compute exactly what one step over all of them
would. Optimizers that couple parameters (LBFGS, or a global-norm trust ratio inside
``step``) are not exact in ``overlap``.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping

import torch
from torch import nn

from ..config import NonFinite, OptimizerMode
from ..errors import CheckpointError, NonFiniteError
from ..plan.costs import ROWS_FIRST_COST
from ..schedule import ActionKind as K, Schedule
from .host import CallGrads, HostState, LossScaler
from .optstate import StatePrecision

Cost = Callable[[list[int]], None] | None


class HostOptimizer:
    """The optimizer side of a pipeline in its mode, chosen once at construction.

    A training call gets a :class:`CallHook` (:meth:`call_hook`) that does the mode's
    optimizer work as the call's gradients reach the host: ``sync`` only accumulates
    them, and the call that ends a step steps once it is complete (:class:`WholeStep`); ``overlap`` steps each
    stage's parameters as soon as their gradients are complete (:class:`OverlapStep`);
    ``stale`` steps all of them once the call is complete, into the compute copies
    that the calls two steps later read (:class:`WholeStep`). In the two asynchronous
    modes calls overlap: :meth:`reads` says which earlier call's update a call's weight
    uploads wait for. The optimizer and the cost hook are passed per call: the user may
    attach the optimizer late, timed emulation sets the hook."""

    def __init__(self, host: HostState, scaler: LossScaler, mode: OptimizerMode,
                 max_norm: float | None, nonfinite: NonFinite = NonFinite.RAISE,
                 undo: bool = True, states: StatePrecision | None = None):
        self.host, self.scaler, self.mode, self.max_norm = host, scaler, mode, max_norm
        self.states = states or StatePrecision()
        """``PipeConfig.optimizer_state_dtype``: every step goes through it."""
        self.nonfinite = nonfinite
        self.undo = undo
        """``PipeConfig.undo_steps``: snapshot what each speculative step changes."""
        self.broken: str | None = None
        """Set when a call failed after stepping some stages without snapshots: the
        model is partly stepped and later training calls are refused."""
        self.last_norm: float | None = None
        """Global gradient norm (before clipping) of the last step taken, when
        clipping is on (``None`` otherwise)."""
        self.last_skipped = False
        """Whether the last step was skipped (overflow under dynamic loss scaling, or a
        non-finite gradient with ``nonfinite="skip"``)."""
        self.nonfinite_skips = 0
        """Steps skipped for a non-finite gradient (``nonfinite="skip"``)."""
        self.rows_room = _Room()
        """Host buffers the rows stepped first (``OR``) are gathered into, kept
        between steps: fresh allocations of that size each step cost more than the
        gathers (page faults)."""

    def finite(self, grads: Mapping[int, torch.Tensor],
               norms: dict[int, torch.Tensor] | None = None,
               known: Collection[int] = ()) -> bool:
        """Whether every gradient in ``grads`` (parameter index -> gradient; ``norms``:
        their L2 norms where already computed; ``known``: parameters already known to
        be finite, not read) is finite, judged by its norm. If not:
        under dynamic loss scaling it is an fp16 overflow (``False``: skip the step);
        otherwise ``nonfinite="raise"`` raises :class:`NonFiniteError` naming the
        parameters, ``"skip"`` returns ``False`` (the step is skipped)."""
        norms = norms or {}
        bad = [pid for pid in grads if pid not in known and not torch.isfinite(
            norms[pid] if pid in norms else torch.linalg.vector_norm(grads[pid]))]
        if not bad:
            return True
        if self.scaler.dynamic or self.nonfinite is NonFinite.SKIP:
            return False
        names = self.host.layerset.param_names
        kind = "NaN" if any(torch.isnan(grads[pid]).any() for pid in bad) else "infinite"
        raise NonFiniteError(
            f"the gradient of {names[bad[0]]}" + (f" (and {len(bad) - 1} more)"
                                                  if len(bad) > 1 else "") +
            f" is not finite ({kind}); no weight, gradient or optimizer state changed. "
            + (f"The backward ran with a fixed loss scale of {self.scaler.scale:g}, which "
               "can overflow a low-precision gradient: lower "
               "PrecisionConfig(loss_scale=...) or use loss_scale='dynamic'. "
               if self.scaler.scale > 1 else "") +
            "Lower the learning rate, check the data, clip gradients (clip_grad_norm), "
            "or set PipeConfig(nonfinite='skip') to skip such steps")

    def skipped(self, skip: bool) -> None:
        """Record whether the step just finished was skipped (and count a non-finite
        skip); the loss scale follows."""
        self.scaler.update(skip)
        self.last_skipped = skip
        if skip and not self.scaler.dynamic:
            self.nonfinite_skips += 1

    @property
    def clipped(self) -> bool:
        """Whether the last step's clip took effect (its norm was above ``max_norm``:
        ``torch.nn.utils.clip_grad_norm_``'s coefficient below 1). ``overlap`` then
        takes its next step whole once the call is complete instead of speculatively
        per stage (the schedule makes the next call wait for the whole step either way);
        a step whose norm stays below the limit brings the speculation back."""
        return self.max_norm is not None and self.last_norm is not None and \
            self.max_norm / (self.last_norm + 1e-6) < 1.0

    @property
    def overlapping(self) -> bool:
        """Whether this mode lets the next call start while this one drains."""
        return self.mode is not OptimizerMode.SYNC

    def reads(self, step_ends: list[int]) -> int | None:
        """The earlier call (index in the stream) whose update the next call's weight
        uploads must wait for, given the stream's calls that ended a step so far:
        ``overlap`` reads the last step (exact), ``stale`` the one before (the calls of
        step ``t`` run on the weights after step ``t - 2``); ``None``: none."""
        if self.mode is OptimizerMode.OVERLAP and step_ends:
            return step_ends[-1]
        if self.mode is OptimizerMode.STALE and len(step_ends) >= 2:
            return step_ends[-2]
        return None

    @property
    def rows_first(self) -> bool:
        """Whether this mode steps first the embedding rows the next call looks up
        (``OR`` actions): ``overlap`` with per-stage steps, a non-finite gradient
        failing the call (``nonfinite="raise"``: a skipped step would have to undo
        rows the next call already read)."""
        return self.mode is OptimizerMode.OVERLAP and not self.whole_step \
            and self.nonfinite is NonFinite.RAISE

    @property
    def reads_whole_step(self) -> bool:
        """Whether the next call's weight uploads wait for every hand-off of the step
        they read (the schedule's ``whole_step``): when the step needs every gradient
        (:attr:`whole_step`), and in ``overlap`` with ``nonfinite="skip"``, whose step
        is skipped (its speculative per-stage steps undone) when a stage handing off
        late brings a non-finite gradient: the next call must not have read the
        deeper stages' steps by then."""
        return self.whole_step or (self.mode is OptimizerMode.OVERLAP
                                   and self.nonfinite is NonFinite.SKIP)

    @property
    def whole_step(self) -> bool:
        """Whether a step needs the whole call's gradients before it updates any
        weight (``sync``; clipping to a global norm or dynamic loss scaling, whose
        step depends on every gradient). Otherwise ``overlap`` and ``stale`` step each
        stage's parameters as soon as their gradients are complete."""
        return self.mode is OptimizerMode.SYNC or self.max_norm is not None \
            or self.scaler.dynamic

    def view(self, steps: int) -> int:
        """Which set of compute copies the calls of step ``steps`` (counted in the
        stream) upload (``stale`` keeps two: :attr:`HostState.views`)."""
        return steps % len(self.host.views)

    def call_hook(self, optimizer, schedule: Schedule, stage_pids: Callable[[str], list[int]],
                  grads: CallGrads, units: float, step: bool, cost: Cost, reduce=None,
                  view: int = 0) -> CallHook:
        """The optimizer work of one training call (``step``: the call ends a step;
        ``reduce``: its data-parallel all-reduce)."""
        if self.broken is not None:
            raise CheckpointError(self.broken)
        stale = self.mode is OptimizerMode.STALE
        if step and self.mode is OptimizerMode.OVERLAP and self.whole_step and \
                (not self.undo or self.clipped):
            # Lean layout with clipping (or dynamic scaling): no speculative steps to
            # undo; one exact whole step once the call is complete (not overlapped).
            # The same after a step whose clip took effect: the next one likely clips
            # too, and its speculative steps would only be undone and redone.
            return WholeStep(self, optimizer, grads, units, cost, None, reduce, schedule,
                             stage_pids)
        if step and (self.mode is OptimizerMode.OVERLAP or stale and not self.whole_step):
            return OverlapStep(self, optimizer, schedule, stage_pids, grads, units, cost,
                               reduce, view=view if stale else None)
        if step:
            # sync: every set of compute copies; stale: the set two steps ahead reads.
            return WholeStep(self, optimizer, grads, units, cost,
                             view if self.mode is OptimizerMode.STALE else None, reduce,
                             schedule, stage_pids)
        return CallHook(self.host, grads, units, reduce, self, schedule, stage_pids)

    def sync_step(self, optimizer: torch.optim.Optimizer, cost: Cost,
                  view: int | None = None) -> bool:
        """Step every master on its ``.grad`` now; ``False``: skipped (overflow).
        Refreshes the compute copies of ``view`` (default: all)."""
        host = self.host
        params = host.layerset.params
        # With nonfinite="raise" every call's gradients were checked at its commit, and
        # the accumulated ones are a convex combination of them: finite, no second pass.
        checked = self.nonfinite is NonFinite.RAISE and not self.scaler.dynamic
        overflow = not checked and not self.finite(
            {pid: params[pid].grad for pid in host.trainable if params[pid].grad is not None})
        if not overflow:
            self.last_norm = clip((params[pid] for pid in host.trainable), self.max_norm)
            try:
                self.states.step(optimizer, [params[pid] for pid in host.trainable])
            except Exception as exc:
                # No snapshot in a synchronous step: what the optimizer updated before
                # it raised stays updated. Keep the workers' copies on the masters
                # (consistent) and say so.
                host.write_back(view=view)
                if hasattr(exc, "add_note"):      # Python 3.11+
                    exc.add_note(
                        "rotapipe: the optimizer's step() raised; a synchronous step keeps "
                        "no snapshot, so parameters it updated before raising keep their "
                        "update (the workers' copies follow them; the gradients are kept, "
                        "not cleared): restore a checkpoint (pipe.load_state_dict and the "
                        "optimizer's load_state_dict) before stepping again")
                raise
            host.write_back(view=view)
            if cost is not None:
                cost(list(host.trainable))
        self.skipped(overflow)
        host.zero_grad()
        return not overflow

    def flush(self) -> None:
        """After the calls in flight completed: every set of compute copies follows
        the masters (``stale``: the next call runs on the current weights)."""
        if len(self.host.views) > 1:
            self.host.write_back()


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


class WholeStep(CallHook):
    """``sync`` and ``stale``: once the call is complete, one whole step on the
    gradients accumulated since the last step plus this call's (clip, skip on
    overflow, step), written into the compute copies of ``view`` (``None``: every
    set; ``stale``: the set the calls two steps later read, the next step's calls
    read the other). Nothing changes if the call fails."""

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
        host.commit(self.grads, self.units)
        pids = list(host.trainable)
        step_params(owner, self.opt, pids, {pid: params[pid].grad for pid in pids
                                            if params[pid].grad is not None}, self.cost,
                    checked=checked)
        host.write_back(view=self.view)
        host.zero_grad()
        self.grads.clear()     # the call object outlives its step: drop them now


def _merged(prev: torch.Tensor | None, g: torch.Tensor | None, keep: float,
            new: float) -> torch.Tensor | None:
    """A call's gradient ``g`` merged with the accumulated ``prev`` as
    :meth:`HostState.commit` does, without changing ``prev``."""
    if prev is None:
        return None if g is None else (g.mul_(new) if new != 1.0 else g)
    if g is None:
        return torch.mul(prev, keep)
    return torch.mul(prev, keep).add_(g, alpha=new)


class _Room:
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


def _per_element(optimizer) -> bool:
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
        self.items = [(p, p.detach().clone(), _copy_state(optimizer.state.get(p)))
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


def _copy_state(state: dict | None) -> dict | None:
    if not state:
        return None
    return {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in state.items()}


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
        if self.reduce is not None or nxt is None or not _per_element(self.opt):
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
        (:func:`_merged`), kept in :attr:`final` until its step."""
        g = self.final.get(pid)
        if g is None:
            g = _merged(self.prev.get(pid), self.grads.get(pid), self.keep, self.new)
            if g is not None:
                self.final[pid] = g
        return g

    def _preview(self, pid: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` of parameter ``pid`` after the step on :meth:`_gradient`, in
        the compute dtype, computed by the user's optimizer class with the parameter's
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
        return room.take(("out", room.turn), shape, self.host.dtype).copy_(part.detach())

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
        if self.overflow:
            self._undo(grads=False)
        elif self.max_norm is not None and self.norms and self._needs_clipping():
            # The total norm is known only now: undo the speculative steps and redo one
            # whole step on the clipped gradients (exact, not overlapped).
            self._undo(grads=False)
            pids = [pid for pid in self.host.trainable if pid in self.norms]
            for pid in pids:
                g = self.final.pop(pid, None)
                if g is None:       # widened again from the compute-dtype one
                    g = _merged(self.prev.get(pid), self.grads.pop(pid), self.keep,
                                self.new)
                self.prev[pid] = None       # the call commits: nothing to put back
                self.params[pid].grad = g
            clip((self.params[pid] for pid in pids), self.max_norm)
            self.owner.states.step(self.opt, [self.params[pid] for pid in pids])
            self.host.write_back(pids, view=self.view)
            if self.cost is not None:
                self.cost(pids)
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
