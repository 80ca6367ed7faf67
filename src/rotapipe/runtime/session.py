"""A session of the executor: the dispatcher threads that issue the actions of a stream
of calls on the devices (:class:`Session`, opened by
:meth:`~rotapipe.runtime.executor.Executor.open`), and how they wait, fail, stall and
close.

One dispatcher per worker (and one for the host lane) issues that worker's lanes, each
in list order: an action goes as soon as every dependency has been *recorded*; its
stream waits on those events, then the dispatcher submits the action body and records
an event (``backend.py``'s event protocol). Chunked copies go chunk by chunk, gated
(``transfer.py``).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..schedule import HOST, Action, Lane, Schedule
from ..schedule.actions import COMPUTE_PASSES
from .backend import Aborted
from .transfer import CHUNKED, CRITICAL, DOWN, UP, CopyGate, direction

if TYPE_CHECKING:
    from .executor import Chunk, Executor

__all__ = ["ABANDON_S", "Session", "abandon"]



class _Copy:
    """A chunked copy being issued: its chunks, the next one, the last event."""

    __slots__ = ("action", "chunks", "next", "last", "gate")

    def __init__(self, action: Action, chunks: list[Chunk], gate: CopyGate):
        self.action, self.chunks, self.next, self.last, self.gate = action, chunks, 0, None, gate


# Lanes in the order a dispatcher looks at them: critical copies first.
_LANE_ORDER = {Lane.UPLOAD: 0, Lane.DOWNLOAD: 1, Lane.COMPUTE: 2, Lane.TRAINED: 3,
               Lane.WEIGHTS: 4, Lane.GRADS: 5, Lane.HOST: 6}


class Session:
    """Dispatchers over a stream of calls (:meth:`Executor.open`).

    :meth:`submit` appends a call's actions to the per-worker lanes; one dispatcher
    thread per worker (and one for the host lane) issues each lane in order, an action
    as soon as its dependencies were recorded, whichever call they belong to, so the
    actions of the next call start while the previous call drains. The first failure
    aborts every call in flight: dispatchers stop, streams skip queued work, and the
    waits raise it (:meth:`error`)."""

    def __init__(self, ex: Executor, body, describe, chunks, gate: bool):
        self.ex, self.body, self.describe, self.chunks = ex, body, describe, chunks
        self.gate = gate
        self.abort = threading.Event()
        self.failure: tuple[Action, BaseException] | None = None
        self._fail_lock = threading.Lock()
        self._lock = threading.Lock()      # submissions against the dispatchers' reads
        self.events: dict[str, object] = {}
        self.last_progress = time.monotonic()
        self.spans: list[tuple[Action, float, float]] = []   # appended by stream threads
        self._timed: dict[int, list] = {}
        """call -> ``(action, start event, end event)`` of its compute actions, whose
        device times become spans when the call completes (:meth:`wait_call`)."""
        self.running: dict[int, tuple[Action, float]] = {}
        """Thread id -> the action whose work that thread is running now, and since when
        (``time.monotonic``): emulated streams run the work itself; on CUDA it is the
        host side of the work (issuing kernels, host-lane actions)."""
        self.actions: dict[int, list[Action]] = {}     # call -> its actions, in order
        self._lasts: dict[int, list[str]] = {}        # call -> last key of each lane
        self._done: set[int] = set()
        self._back = 0          # how many calls back a dependency reaches, at most
        self._closing = False
        self._drained = False      # the devices were drained after the failure
        workers = list(range(len(ex.devices))) + [HOST]
        self._queues: dict[int, dict[Lane, deque]] = {w: {} for w in workers}
        self._wake = {w: _Wake() for w in workers}
        self._watchers: dict[str, set] = defaultdict(set)
        try:
            self.dispatchers = ex.dispatchers.run(
                {w: (lambda w=w: self._dispatch(w)) for w in workers},
                keep=lambda: not self.abort.is_set())
        except BaseException:
            # No thread left to start one: the loops already started end at once.
            self.abort.set()
            raise

    # -- the caller's side ---------------------------------------------------------------
    def submit(self, schedule: Schedule) -> None:
        """Append ``schedule``'s actions to the lanes. Their dependencies may name
        actions of calls submitted before."""
        self.schedule = schedule
        with self._lock:
            lasts: dict[tuple[int, int, Lane], str] = {}     # (call, worker, lane) -> key
            for a in schedule.actions:
                self.actions.setdefault(a.call, []).append(a)
                lasts[(a.call, a.worker, a.lane)] = a.key
                wake = self._wake[a.worker]
                self._watchers[a.key].add(wake)
                for d in a.deps + a.host_deps:
                    self._watchers[d].add(wake)
                    self._back = max(self._back, a.call - _call_of(d))
                self._queues[a.worker].setdefault(a.lane, deque()).append(a)
            for (call, _, _), key in lasts.items():
                self._lasts.setdefault(call, []).append(key)
        for wake in self._wake.values():
            wake.set()

    def wait_keys(self, keys: Iterable[str]) -> None:
        """Block until every action in ``keys`` has completed; raise the first failure
        (aborting the session) instead, or a timeout when nothing progresses."""
        for key in keys:
            while True:
                if self.failure is not None:
                    self.raise_failure()
                ev = self.events.get(key)
                if ev is not None and ev.query():
                    break
                self.abort.wait(0.001)
                self._check_timeout()

    def wait_call(self, call: int) -> None:
        """Block until every action of ``call`` has completed (see :meth:`wait_keys`);
        then forget the events of calls no later dependency can name."""
        self.wait_keys(self._lasts.get(call, ()))
        self._resolve(call)
        self._done.add(call)
        self._prune()

    def wait_all(self) -> None:
        for call in sorted(self._lasts):
            if call not in self._done:
                self.wait_call(call)

    def close(self) -> None:
        """Stop the dispatchers (after the work submitted was issued, or at once after a
        failure). After a failure a dispatcher still stuck in an action (CUDA runs the
        host side of the work on it) past the drain timeout retires the pipeline and
        is abandoned with a warning instead of blocking the caller."""
        self._closing = True
        for wake in self._wake.values():
            wake.set()
        if self.failure is not None:
            self.abort.set()
        ex = self.ex
        limit = ABANDON_S if ex.broken else ex.drain_timeout_s if self.abort.is_set() \
            else None
        deadline = None if limit is None else time.monotonic() + limit
        stuck = self.dispatchers.wait(
            lambda: None if deadline is None else max(0.0, deadline - time.monotonic()))
        if stuck:
            running = self.describe_running()
            if not ex.broken:
                ex.broken = (f"{stuck[0].name} did not stop within {limit:g} s after the "
                             "failure (" + (f"still running: {running}" if running else
                                           "an action is stuck") + "): this pipeline "
                             "cannot run again; build a new one")
            abandon(ex, stuck)

    def release(self) -> None:
        """Forget the failure's exception once it was raised and the session is being
        dropped: its traceback holds the worker frames that ran this session's closures,
        so keeping it would make a reference cycle (session -> exception -> frames ->
        session) that keeps the dispatchers' work, the call's tensors and the pipeline
        alive until the cyclic collector runs. The failing action stays known."""
        if self.failure is not None:
            self.failure = (self.failure[0], None)

    def kill(self) -> None:
        """Abort everything in flight (e.g. on KeyboardInterrupt) and drain the devices."""
        self.abort.set()
        self.close()
        if not self._drained:
            self.ex._drain(self.describe_running)
            self._drained = True        # not before: a Ctrl-C in the drain drains again

    def describe_running(self) -> str:
        """The actions running now, oldest first, with their worker and for how long."""
        now = time.monotonic()
        items = sorted(self.running.copy().values(), key=lambda r: r[1])
        return "; ".join(f"{a.key} ({a.kind.verb}) on "
                         f"{'the host' if a.worker == HOST else f'worker {a.worker}'} for "
                         f"{now - t0:.0f} s" for a, t0 in items)

    def raise_failure(self):
        """Drain the devices after the first failure and raise it as a WorkerError."""
        action, exc = self.failure
        self.close()
        if not self._drained:
            self._drained = True
            self.ex._drain(self.describe_running)
        error = self.ex._error(self.schedule_of(action), action, exc, self.describe(action))
        if self.ex.broken:
            error.args = (error.args[0] + f"\n\n{self.ex.broken}",)
        try:
            raise error from exc
        finally:
            # The traceback holds this frame: a local naming the error would make a
            # reference cycle that keeps the caller's frames (the pipeline, its threads)
            # alive until the cyclic collector runs.
            del error, exc

    def schedule_of(self, action: Action) -> Schedule:
        """The submitted actions around ``action`` as one schedule (for messages)."""
        s = self.schedule
        if len(self.actions) == 1:
            return s
        acts = [a for c in sorted(self.actions) if abs(c - action.call) <= 1
                for a in self.actions[c]]
        return Schedule(s.plan, s.workers, s.microbatches, tuple(acts), s.name)

    def _prune(self) -> None:
        """Drop the events and spans of complete calls that no action submitted now or
        later can depend on (a dependency reaches at most ``_back`` calls back; two
        more are kept in case a later plan reaches further)."""
        pending = [c for c in self._lasts if c not in self._done]
        low = min(pending) if pending else max(self._lasts, default=-1) + 1
        old = {c for c in self._done if c < low - self._back - 2}
        if not old:
            return
        for c in old:
            for a in self.actions.pop(c, ()):
                self.events.pop(a.key, None)
                self._watchers.pop(a.key, None)
            self._lasts.pop(c, None)
            self._timed.pop(c, None)
            self._done.discard(c)
        self.spans[:] = [s for s in self.spans if s[0].call not in old]

    def fail(self, action: Action, exc: BaseException) -> None:
        with self._fail_lock:
            if self.failure is None:
                self.failure = (action, exc)
        self.abort.set()
        for wake in self._wake.values():
            wake.set()

    # -- the dispatchers -----------------------------------------------------------------
    def _dispatch(self, worker: int) -> None:
        """Issue one device's lanes (or the host lane): each lane in list order, each
        action as soon as its dependencies were recorded, chunked copies chunk by
        chunk; never blocking on one lane while another could go."""
        if worker == HOST:
            streams = defaultdict(lambda: self.ex.host_stream)
            notify_ok = True
        else:
            dev = self.ex.devices[worker]
            streams = {lane: dev.stream(lane) for lane in Lane if lane is not Lane.HOST}
            notify_ok = dev.notifies
        gates = {UP: CopyGate(), DOWN: CopyGate()}
        queues = self._queues[worker]
        wake = self._wake[worker]
        copies: dict[Lane, _Copy] = {}
        idle = _IDLE_MIN
        a = None
        try:
            while True:
                generation = wake.generation
                progressed = False
                with self._lock:
                    lanes = [l for l in sorted(queues, key=_LANE_ORDER.get) if queues[l]]
                if not lanes and not copies and self._closing:
                    return
                for lane in lanes + [l for l in copies if l not in lanes]:
                    if self.abort.is_set():
                        return
                    stream = streams[lane]
                    if lane in copies:
                        a = copies[lane].action
                        # Every chunk the gate lets go now (the previous one already
                        # complete), without a pass over the lanes per chunk.
                        while lane in copies and not self.abort.is_set() and \
                                self._next_chunk(stream, lane, copies):
                            progressed = True
                        continue
                    q = queues[lane]
                    a = q[0]
                    if not self._ready(a):
                        continue
                    with self._lock:
                        q.popleft()
                    progressed = True
                    self._issue(a, stream, lane, gates, copies)
                if self.abort.is_set():
                    return
                if progressed:
                    idle = _IDLE_MIN
                    continue
                # Emulated events wake us when they complete; on CUDA we poll, backing
                # off while nothing moves.
                wake.wait(generation, _IDLE_NOTIFIED if notify_ok else idle)
                # A chunk in flight: its completion lets the next one go; keep polling
                # fast so that the copy engine does not sit idle between chunks.
                idle = _IDLE_MIN if copies else min(idle * 2, _IDLE_MAX)
        except Aborted:
            return
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            self.fail(a, exc)

    def _ready(self, a: Action) -> bool:
        """Every dependency recorded, every host dependency complete."""
        events = self.events
        for d in a.deps:
            if d not in events:
                return False
        for d in a.host_deps:
            if d not in events or not events[d].query():
                return False
        return True

    def _issue(self, a: Action, stream, lane: Lane, gates, copies) -> None:
        for d in a.host_deps:
            stream.host_wait(self.events[d], self.abort)
        waits_on = [self.events[d] for d in a.deps]
        for ev in waits_on:
            stream.wait(ev)
        chunks = self.chunks(a) if a.kind in CHUNKED else None
        if chunks:
            copies[lane] = _Copy(a, chunks, gates[direction(lane)])
            self._next_chunk(stream, lane, copies)
            return
        # A compute action's span is the device's (events around it, read once its
        # call completed: wait_call): on CUDA its body only issues the kernels.
        timed = a.kind in COMPUTE_PASSES and a.worker != HOST
        start = stream.record(timing=True) if timed else None
        stream.submit(self._runner(a, lambda: self.body(a), span=not timed),
                      lambda exc, a=a: self.fail(a, exc), self.abort, a.key)
        ev = stream.record(self._notifier(a), timing=timed)
        if timed:
            self._timed.setdefault(a.call, []).append((a, start, ev))
        if a.kind in CRITICAL:
            gates[direction(lane)].add(lane, ev, waits_on)
        self._recorded(a, ev)

    def _next_chunk(self, stream, lane: Lane, copies: dict) -> bool:
        """Issue the next chunk of the copy on ``lane`` if it may go now; True if it did.
        Gated: only after the previous chunk completed, and behind every pending
        critical copy on the same engine (``transfer.py``). A weight chunk also waits
        while a trained-weight upload (``UT``) of the device is runnable and not yet
        issued whole: its stage waits for it, so it goes before the prefetches (the
        simulator's ``LINK_PRIORITY``)."""
        c = copies[lane]
        chunk = c.chunks[c.next]
        if self.gate and c.last is not None and not c.last.query():
            return False
        if self.gate and lane is Lane.WEIGHTS and self._trained_runnable(copies):
            return False
        if chunk.ready is not None and not chunk.ready():
            return False
        if self.gate:
            for ev in c.gate.pending():
                stream.wait(ev)
        if chunk.stage is not None:
            chunk.stage()
        a = c.action
        stream.submit(self._runner(a, chunk.copy), lambda exc, a=a: self.fail(a, exc),
                      self.abort, f"{a.key}#{c.next}")
        c.last = ev = stream.record(self._notifier(a))
        if chunk.issued is not None:
            chunk.issued(ev)
        c.next += 1
        if c.next == len(c.chunks):
            del copies[lane]
            self._recorded(a, ev)
        return True

    def _trained_runnable(self, copies: dict) -> bool:
        """Whether a ``UT`` is being issued on this device and everything it waits on
        has completed (its ``UW`` included: a weight upload it still waits for is never
        held back by it)."""
        t = copies.get(Lane.TRAINED)
        return t is not None and all(self.events[d].query() for d in t.action.deps)

    def _recorded(self, a: Action, ev) -> None:
        self.events[a.key] = ev
        for wake in tuple(self._watchers.get(a.key, ())):
            wake.set()

    def _notifier(self, a: Action):
        """What an event of ``a`` calls on completion: wake the dispatchers that wait
        for ``a`` (host dependencies, gated chunks and the copy gate: its own)."""
        key = a.key

        def notify():
            for wake in tuple(self._watchers.get(key, ())):
                wake.set()
        return notify

    def _runner(self, a: Action, work: Callable[[], None], span: bool = True):
        """``work`` (the body of ``a``, or one of its chunks), recording its span
        (``span``: the host time of the body) and, while it runs, that it is running
        (:attr:`running`)."""
        running = self.running

        def run():
            me = threading.get_ident()
            running[me] = (a, time.monotonic())
            t0 = time.perf_counter()
            try:
                work()
            finally:
                running.pop(me, None)
            if span:
                self.spans.append((a, t0, time.perf_counter()))
            self.last_progress = time.monotonic()
        return run

    def _resolve(self, call: int) -> None:
        """The device spans of ``call``'s compute actions (all complete) into
        :attr:`spans`."""
        for a, start, end in self._timed.pop(call, ()):
            t0 = start.seconds()
            self.spans.append((a, t0, t0 + end.since(start)))

    def _check_timeout(self) -> None:
        idle = time.monotonic() - self.last_progress
        if idle > self.ex.timeout_s and self.failure is None:
            stuck, what = self._stalled()
            self.fail(stuck, TimeoutError(
                f"no action completed for {idle:.0f} s (timeout_s={self.ex.timeout_s}); "
                f"{what}"))

    def _stalled(self) -> tuple[Action, str]:
        """The action a stall is blamed on (marked in the message), and what to say.

        An action whose work is running (:attr:`running`) is the culprit; otherwise
        (on CUDA, where the device runs the kernels after the host issued them) the
        oldest issued action whose dependencies all completed: a stream runs in order,
        so that one is what its stream is executing."""
        running = self.describe_running()
        if running:
            oldest = min(self.running.copy().values(), key=lambda r: r[1])[0]
            return oldest, f"running: {running} (marked)"
        events = self.events
        acts = [a for c in sorted(self.actions) for a in self.actions[c]]
        issued = [a for a in acts if a.key in events and not events[a.key].query()]
        for a in issued:
            if all(d in events and events[d].query() for d in a.deps):
                who = "the host" if a.worker == HOST else f"worker {a.worker}"
                return a, (f"{a.key} ({a.kind.verb}) on {who} was issued with its "
                           "inputs ready and has not completed (marked)")
        if issued:
            return issued[0], "the oldest issued action not yet complete is marked"
        pending = [a for a in acts if a.key not in events]
        return (pending or [self.schedule.actions[0]])[0], \
            "the first action not yet issued is marked"


def _call_of(key: str) -> int:
    """The call number in an action key (``.../c3``; 0 without the suffix)."""
    _, sep, call = key.rpartition("/c")
    return int(call) if sep and call.isdigit() else 0


class _Wake:
    """A dispatcher's wake-up: a generation counter under a condition."""

    __slots__ = ("cond", "generation")

    def __init__(self):
        self.cond = threading.Condition(threading.Lock())
        self.generation = 0

    def set(self) -> None:
        with self.cond:
            self.generation += 1
            self.cond.notify()

    def wait(self, seen: int, timeout: float) -> None:
        """Sleep until woken after generation ``seen`` (or ``timeout``)."""
        with self.cond:
            if self.generation == seen:
                self.cond.wait(timeout)


def abandon(ex: Executor, threads: list[threading.Thread]) -> None:
    """Give up waiting for threads stuck in an action of a retired pipeline
    (``ex.broken`` says which): they are daemon threads, so they do not keep the
    process alive."""
    ex.abandoned.extend(threads)
    warnings.warn(f"rotapipe: abandoning {', '.join(t.name for t in threads)}, stuck in "
                  f"an action ({ex.broken}); daemon threads, they end with the process",
                  RuntimeWarning, stacklevel=3)


ABANDON_S = 1.0
"""How long closing a retired pipeline waits for a thread stuck in an action."""

_IDLE_MIN, _IDLE_MAX = 1e-4, 2e-3
"""Polling interval of a dispatcher waiting for a completion on CUDA (seconds)."""
_IDLE_NOTIFIED = 0.05
"""Safety-net interval where completions notify (emulated)."""
