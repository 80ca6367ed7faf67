"""Training calls in flight on one executor session: a :class:`Call` (one call, built
from its schedule, changing the pipeline's state only at its commit), the
:class:`CallStream` that bounds how many run at once and reports each one's fate when
one fails, the :class:`StepResult` of the step a call ended, and the :func:`timeline` of
the calls completed. The machinery that runs one call is ``calls.py``'s
:class:`~rotapipe.runtime.calls.CallRunner`."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from ..plan import StageKind
from ..schedule import ActionKind as K, Schedule
from .callcontext import CallState
from .store import Store

if TYPE_CHECKING:
    from .calls import CallRunner

__all__ = ["Call", "CallStream", "StepResult", "timeline", "deferred_interrupt"]


@contextmanager
def deferred_interrupt():
    """Hold a Ctrl-C (``SIGINT``) that arrives on the main thread until the block is
    done, then deliver it: a commit or a whole optimizer step run by the caller's
    thread is not cut part-way (which would leave the state at no step boundary), and
    the ``KeyboardInterrupt`` comes right after it, the step kept. Elsewhere (another
    thread, a handler other than a Python function) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        before = signal.getsignal(signal.SIGINT)
    except ValueError:              # no signals here (a subinterpreter)
        yield
        return
    if not callable(before):        # SIG_IGN, SIG_DFL or a handler not set from Python
        yield
        return
    held: list = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
    if held:
        before(signal.SIGINT, held[0])


@dataclass(frozen=True)
class StepResult:
    """What the optimizer step a training call ended did: the learning rate of each
    parameter group, the global gradient norm before clipping (``None`` unless
    clipping is on), and whether it was skipped (overflow under dynamic loss scaling)."""

    lrs: tuple[float, ...]
    grad_norm: float | None
    skipped: bool


class Call:
    """One training call, built from its schedule: the schedule's actions are the
    call's shape (workers, microbatches, stages), nothing else is. ``number`` is the
    pipeline's call counter it runs as (its random streams), ``index`` its place in the
    :class:`CallStream` (its actions' call number). The call changes the pipeline's
    state only at :meth:`commit`: when every gradient of it is in host memory (in the
    last ``O`` action, on the host lane, when calls overlap; otherwise after it)."""

    def __init__(self, number: int, index: int, schedule: Schedule, state: CallState,
                 hook, step: bool, units: float, stages: dict, buffers: Callable[[Store], None],
                 on_host: bool, reduce=None, after_step: Callable[[], StepResult] | None = None):
        self.number, self.index, self.schedule, self.state = number, index, schedule, state
        self.hook, self.step, self.units, self.reduce = hook, step, units, reduce
        self._buffers, self._after_step = buffers, after_step
        self.committed = False
        self.partly: str | None = None
        """Set when the commit failed after changing the state (the hook's
        :attr:`~rotapipe.runtime.stepping.CallHook.changed`: a whole step raising
        part-way): what stays. The failure reports the call as partly stepped."""
        self.result: StepResult | None = None     # of the step it ended
        self.loss: float | None = None
        self.returned = False
        """Whether the caller got the call's loss (``train_step`` returns while the
        call drains): a failure after that must say the call was discarded anyway."""
        tails = [a.key for a in schedule.actions if a.kind is K.DOWNLOAD_GRAD
                 and stages[a.stage].kind is StageKind.TAIL]
        handoffs = [a.key for a in schedule.actions if a.kind is K.OPTIMIZER]
        self.loss_keys = tuple(tails)
        """The actions after which the call's loss is in host memory (empty: the end
        of the call)."""
        self.last_handoff = handoffs[-1] if handoffs and on_host else None
        self.next_store: Callable[[], Store | None] | None = None
        """The host store of the call after this one in the stream, once issued."""

    def rows_first(self, key: str) -> None:
        """An ``OR`` action, before the hand-off ``key`` (host lane): the hook steps
        first the embedding rows the next call of the stream looks up, when that call
        is issued (:meth:`OverlapStep.step_rows`)."""
        step_rows = getattr(self.hook, "step_rows", None)
        if step_rows is not None:
            step_rows(key, self.next_store() if self.next_store is not None else None)

    def handoff(self, key: str) -> None:
        """After an ``O`` action added its gradients (host lane)."""
        self.hook.handoff(key)
        if key == self.last_handoff:
            self.commit()

    def commit(self) -> None:
        if self.committed:
            return
        if self.reduce is not None:
            self.reduce.finish()        # the reduced gradients are in place
        # A Ctrl-C meanwhile waits for the end of the commit (and the scheduler's step):
        # the call is then kept whole, as if it had come a moment later.
        with deferred_interrupt():
            self._commit()

    def _commit(self) -> None:
        try:
            self.hook.commit()
        except BaseException:
            # Past the merge (a whole step raising part-way) the call has changed the
            # state and nothing can undo it: its forward's buffer updates stay with it.
            self.partly = getattr(self.hook, "changed", None)    # CallHook's, if one
            if self.partly is not None:
                self._buffers(self.state.host_store)
                self._buffers = self._after_step = None
            raise
        self._buffers(self.state.host_store)
        # Committed from here: a failing scheduler (after_step) leaves the step applied,
        # and the failure reports this call as kept.
        self.committed = True
        after, self._buffers, self._after_step = self._after_step, None, None
        if self.step and after is not None:
            self.result = after()

    def read_loss(self) -> float:
        self.loss = float(sum(self.losses()))
        return self.loss

    def losses(self) -> list[float]:
        """Each microbatch's weighted share of the loss (in host memory)."""
        store = self.state.host_store
        return [store.get(("loss", m)).item() for m in range(self.schedule.microbatches)]


class CallStream:
    """Training calls on one executor session. The caller bounds how many are in flight
    (:meth:`reap`): with two, the next call's actions start on the workers the draining
    call frees (the asynchronous optimizer modes); with one (:meth:`drain` after each)
    every call completes before the next.

    A failure aborts every call in flight. Calls that committed keep their effect; the
    others are undone (:meth:`CallHook.abort`) and reported in the exception, which
    carries ``calls_committed`` (the pipeline's call count after it: the step boundary
    the state is at) and ``calls_discarded`` (the numbers of the calls dropped). A call
    whose commit failed after changing the state (its whole step raising part-way,
    :attr:`Call.partly`) can be neither: it counts in ``calls_committed`` and is listed
    in ``calls_partly_stepped``, and the state is at no step boundary."""

    def __init__(self, runner: CallRunner):
        self.runner = runner
        self.session = None
        self.inflight: list[Call] = []
        self.index = 0              # the next call's index in the session
        self.step_ends: list[int] = []
        self.steps = 0              # calls that ended a step
        self.committed = 0          # the pipeline's committed calls, in total
        self.last_spans: list = []  # the spans of the last call reaped
        self.results: dict[int, StepResult | None] = {}   # call number -> Call.result
        self.history: deque[tuple[Schedule, list]] = deque(maxlen=64)
        """``(schedule, spans)`` of the last calls completed, oldest first."""
        self.host_seconds: Counter[str] = Counter()
        """Seconds the caller's thread spent per phase of the calls, in total
        (:meth:`rotapipe.RoundPipe.host_seconds`)."""

    @property
    def next_number(self) -> int:
        return self.committed + len(self.inflight)

    def submit(self, call: Call) -> None:
        self._recover()
        r = self.runner
        if self.session is None:
            self.session = r.executor.open(r.runner.run, r.where, r.runner.chunks,
                                           gate=r.config.gate_copies)
        r.begin(call.index, call.state)
        self.inflight.append(call)
        self.index += 1
        if call.step:
            self.step_ends.append(call.index)
            self.steps += 1
        self.session.submit(call.schedule)

    def wait_loss(self, call: Call) -> float:
        """Block until ``call``'s loss is in host memory and return it."""
        t = time.perf_counter()
        if call.loss_keys:
            self._guarded(lambda: self.session.wait_keys(call.loss_keys))
        else:
            self._guarded(lambda: self.session.wait_call(call.index))
        self.host_seconds["wait for the loss"] += time.perf_counter() - t
        return call.read_loss()

    def reject(self, call: Call, exc: BaseException) -> NoReturn:
        """Fail ``call`` (the newest in flight) with ``exc`` once the calls before it
        completed: it is undone unless it already committed, and ``exc`` reports its
        fate (:meth:`_fail`)."""
        assert self.inflight and self.inflight[-1] is call
        self.reap(1)
        call.loss = None            # read, but never returned to the caller
        self._fail(exc)
        try:
            raise exc
        finally:
            del exc         # no cycle through this frame (Session.raise_failure)

    def reap(self, keep: int) -> list[Call]:
        """Complete the oldest calls until at most ``keep`` are in flight (committing
        those that commit after the call); return them."""
        self._recover()
        done = []
        while len(self.inflight) > keep:
            c = self.inflight[0]
            t0 = time.perf_counter()
            self._guarded(lambda: self.session.wait_call(c.index))
            t1 = time.perf_counter()
            if not c.committed:
                self._guarded(c.commit)
            self.host_seconds["wait for the rest of the call"] += t1 - t0
            self.host_seconds["check, merge and step"] += time.perf_counter() - t1
            self.committed += 1
            self.inflight.pop(0)
            self.last_spans = [s for s in self.session.spans if s[0].call == c.index]
            self.history.append((c.schedule, self.last_spans))
            self.results[c.number] = c.result
            self.results.pop(c.number - 64, None)
            self.runner.end(c.index)
            _unlink(c)
            done.append(c)
        return done

    def drain(self) -> list[Call]:
        """Complete every call in flight and close the session (the next call starts a
        fresh round-robin)."""
        done = self.reap(0)
        if self.session is not None:
            self.session.close()
        self._reset()
        return done

    def _reset(self) -> None:
        # ``steps`` goes on: it picks the compute copies a call uploads (stale keeps two
        # sets, which differ until the optimizer flushes).
        if self.session is not None:
            self.session.release()
        self.session = None
        self.index, self.step_ends = 0, []

    def _recover(self) -> None:
        """Finish an abort that a Ctrl-C cut short while the workers drained (the
        session is killed, its calls still listed): undo them now, as :meth:`_fail`
        would have, instead of waiting for calls that will never complete."""
        session = self.session
        if session is not None and session.abort.is_set() and session.failure is None:
            self._fail(KeyboardInterrupt())

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        """Abort the session, keep what committed, undo the rest (newest first)."""
        session = self.session
        if session is not None and session.failure is None:
            # A second Ctrl-C while the workers drain leaves the calls aborted but not
            # undone: the next use of the stream finishes the abort (:meth:`_recover`).
            session.kill()
        with deferred_interrupt():      # the undo is not cut part-way
            kept = [c for c in self.inflight if c.committed]
            partly = [c for c in self.inflight if not c.committed and c.partly is not None]
            dropped = [c for c in self.inflight if not c.committed and c.partly is None]
            for c in reversed(dropped):
                c.hook.abort()
            for c in partly:
                c.hook.keep_changes()  # the workers have stopped: nothing reads the copies
            for c in self.inflight:
                self.runner.end(c.index)
                _unlink(c)
            for c in kept:
                self.results[c.number] = c.result
            self.committed += len(kept) + len(partly)
            self.inflight = []
            # The next call uploads the compute copies it would have (stale keeps two
            # sets), as if the discarded calls had never run.
            self.steps -= sum(1 for c in dropped if c.step)
            self._reset()
        if kept or partly or dropped:
            note = "calls in flight when it failed: " + self._fates(kept, partly, dropped)
            if exc.args and isinstance(exc.args[0], str):
                exc.args = (exc.args[0] + "\n\n" + note,) + exc.args[1:]
            elif partly and hasattr(exc, "add_note"):      # e.g. KeyboardInterrupt()
                exc.add_note(note)
        exc.calls_committed = self.committed
        exc.calls_discarded = [c.number for c in dropped]
        exc.calls_partly_stepped = [c.number for c in partly]

    def _fates(self, kept: list[Call], partly: list[Call], dropped: list[Call]) -> str:
        """The failure's report of every call in flight, and what to do."""
        order = sorted(kept + partly + dropped, key=lambda c: c.number)
        fates = "; ".join(
            f"call {c.number}: completed, its update is kept" if c.committed else
            f"call {c.number}: partly stepped ({c.partly})" if c.partly is not None else
            f"call {c.number}: discarded" + (" (train_step already returned its loss)"
                                             if c.returned else "")
            for c in order)
        if partly:
            return (fates + f". The state is at no step boundary (pipe.calls = "
                    f"{self.committed} counts call {partly[0].number}): restore a "
                    "checkpoint (pipe.load_state_dict and the optimizer's "
                    "load_state_dict, or resume the training job) and run the batches "
                    "since it again.")
        state = f"that after call {self.committed - 1}" if self.committed else \
            "the one before the first call"
        return (fates + f". The state is {state} (pipe.calls = {self.committed}): run "
                "the discarded calls' batches again.")


def timeline(history: Sequence[tuple[Schedule, list]]):
    """Calls' actions as one :class:`rotapipe.sim.Timeline` (ms from the first action;
    a chunked copy has a span per chunk), or ``None`` without calls."""
    from ..schedule.timeline import RESOURCE, Span, Timeline
    spans = [s for _, sp in history for s in sp]
    if not spans:
        return None
    first = history[0][0]
    actions = tuple(a for sched, _ in history for a in sched.actions)
    schedule = first if len(history) == 1 else \
        Schedule(first.plan, first.workers, first.microbatches, actions, first.name)
    t0 = min(s for _, s, _ in spans)
    out = tuple(Span(a, RESOURCE[a.lane], (s - t0) * 1e3, (e - t0) * 1e3)
                for a, s, e in sorted(spans, key=lambda x: x[1]))
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    for sp in out:
        k = sp.action.key
        start[k] = min(start.get(k, sp.start), sp.start)
        end[k] = max(end.get(k, sp.end), sp.end)
    return Timeline(schedule, out, start, end)


def _unlink(c: Call) -> None:
    """A call's context points back at it (``ctx.handoff``): break the cycle once the
    call completed or failed, so that the call's host store (activation checkpoints,
    input gradients) and what it reaches (the pipeline, through its bound methods) are
    freed when the caller drops the call, not at some later garbage collection."""
    c.state.ctx.handoff = c.state.ctx.rows_first = c.next_store = None
