"""The executor: walks a schedule's per-worker lists and runs them on the devices.

One dispatcher thread per (worker, lane) walks that lane's actions in list order. For
each action it waits (host side) until every dependency has been *recorded*, makes its
stream wait on those events, then submits the action body and records an event
(``backend.py``'s event protocol). ``host_deps`` are waited on to completion before
submitting. Nothing else orders the work: no global barrier.

On the first failure the call is aborted: dispatchers stop, streams skip queued work,
devices drain, and the caller gets a :class:`WorkerError` naming the action with the
schedule grid, the failing action marked.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable

from ..errors import RotapipeError, WorkerError, worker_error_type
from ..schedule import HOST, Action, ActionKind as K, Schedule
from .backend import Aborted, Device, HostStream
from .store import Actor

_VERBS = {K.UPLOAD_WEIGHTS: "weight upload", K.UPLOAD_SIDE: "side-input upload",
          K.UPLOAD_ACT: "activation upload", K.UPLOAD_GRAD: "gradient upload",
          K.FORWARD: "forward", K.FUSED: "fused forward+loss+backward",
          K.RECOMPUTE: "recompute", K.BACKWARD: "backward", K.FREE: "weight free",
          K.FORWARD_KEEP: "forward (keeping its graph)",
          K.BACKWARD_KEPT: "backward (through the kept graph)",
          K.DOWNLOAD_ACT: "activation download", K.DOWNLOAD_GRAD: "gradient download",
          K.DOWNLOAD_BUFFERS: "buffer download", K.DOWNLOAD_WGRAD: "weight-gradient download",
          K.OPTIMIZER: "gradient hand-off to the optimizer"}


class Executor:
    """Runs schedules on a fixed set of devices (reused across calls)."""

    def __init__(self, devices: list[Device], timeout_s: float = 600.0):
        self.devices = devices
        self.timeout_s = timeout_s
        self.host_actor = Actor("host")
        self.host_stream = HostStream(self.host_actor)
        self.last_spans: list[tuple[Action, float, float]] = []
        """``(action, start, end)`` in seconds (``time.perf_counter``) of the last run's
        actions, as their bodies ran on their streams. On CUDA that is when the work
        was *issued* (kernels run asynchronously), not when the device ran it."""
        self.drain_timeout_s = timeout_s
        self.broken: str | None = None

    def run(self, schedule: Schedule, body: Callable[[Action], None],
            describe: Callable[[Action], str] = lambda a: "") -> None:
        """Run every action of ``schedule`` with ``body``; raise on the first failure."""
        if self.broken:
            raise WorkerError(self.broken)
        run = _Run(self, schedule, body)
        self.last_spans = run.spans
        run.start()
        try:
            failure = run.wait()
        except BaseException:
            # KeyboardInterrupt in the caller: stop the workers before unwinding.
            run.abort.set()
            run.join()
            self._drain()
            raise
        if failure is None:
            return
        action, exc = failure
        drained = self._drain()
        error = self._error(schedule, action, exc, describe(action))
        if not drained:
            error.args = (error.args[0] + f"\n\n{self.broken}",)
        raise error from exc

    def _drain(self) -> bool:
        """Wait for every stream to finish what it is running (queued work of the
        aborted call is skipped). A stream stuck in user code for longer than
        ``drain_timeout_s`` makes the pipeline unusable instead of hanging the caller."""
        deadline = time.monotonic() + self.drain_timeout_s
        for d in self.devices:
            if not d.drain(max(0.0, deadline - time.monotonic())):
                self.broken = (f"worker {d.index} did not stop within "
                               f"{self.drain_timeout_s:g} s after the failure (an action is "
                               "stuck): this pipeline cannot run again; build a new one")
                return False
        return True

    def _error(self, schedule, action, exc, where) -> Exception:
        who = "the host" if action.worker == HOST else f"worker {action.worker}"
        mb = f" at microbatch {action.mb}" if action.mb is not None else ""
        msg = (f"{_VERBS[action.kind]} {action.key} of stage {where}{mb} failed on {who}: "
               f"{type(exc).__name__}: {exc}\n\nschedule ({schedule.name}, failing action "
               f"marked):\n{schedule.grid(mark=action.key, context=8)}")
        cls = worker_error_type(type(exc)) if isinstance(exc, RotapipeError) else WorkerError
        return cls(msg, action=action.key, worker=action.worker, cause=exc)


class _Run:
    """State of one call: events, recorded flags, the first failure."""

    def __init__(self, ex: Executor, schedule: Schedule, body):
        self.ex, self.schedule, self.body = ex, schedule, body
        self.abort = threading.Event()
        self.failure: tuple[Action, BaseException] | None = None
        self._fail_lock = threading.Lock()
        self.events: dict[str, object] = {}
        self.recorded = {a.key: threading.Event() for a in schedule.actions}
        self.last_progress = time.monotonic()
        self.lanes: dict[tuple[int, str], list[Action]] = defaultdict(list)
        for a in schedule.actions:
            self.lanes[(a.worker, a.lane.value)].append(a)
        self.threads: list[threading.Thread] = []
        self.spans: list[tuple[Action, float, float]] = []   # appended by stream threads
        self.last_events: list = []

    def fail(self, action: Action, exc: BaseException) -> None:
        with self._fail_lock:
            if self.failure is None:
                self.failure = (action, exc)
        self.abort.set()

    def start(self) -> None:
        for (worker, lane), actions in self.lanes.items():
            if worker == HOST:
                stream = self.ex.host_stream
            else:
                stream = self.ex.devices[worker].stream(actions[0].lane)
            t = threading.Thread(target=self._dispatch, args=(stream, actions),
                                 name=f"rotapipe-dispatch-{worker}-{lane}", daemon=True)
            self.threads.append(t)
            t.start()

    def _wait_recorded(self, key: str) -> None:
        flag = self.recorded[key]
        while not flag.wait(0.02):
            if self.abort.is_set():
                raise Aborted()

    def _dispatch(self, stream, actions: list[Action]) -> None:
        a = None
        try:
            for a in actions:
                for d in a.host_deps:
                    self._wait_recorded(d)
                    stream.host_wait(self.events[d], self.abort)
                for d in a.deps:
                    self._wait_recorded(d)
                    stream.wait(self.events[d])
                stream.submit(self._runner(a), lambda exc, a=a: self.fail(a, exc), self.abort)
                self.events[a.key] = stream.record()
                self.recorded[a.key].set()
            if actions:
                self.last_events.append(self.events[actions[-1].key])
        except Aborted:
            return
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            self.fail(a, exc)

    def _runner(self, a: Action):
        def run():
            t0 = time.perf_counter()
            self.body(a)
            self.spans.append((a, t0, time.perf_counter()))
            self.last_progress = time.monotonic()
        return run

    def join(self) -> None:
        for t in self.threads:
            t.join()

    def wait(self):
        """Wait for the dispatchers, then for every stream; return the failure if any."""
        pending = list(self.threads)
        while pending:
            pending[0].join(0.05)
            pending = [t for t in pending if t.is_alive()]
            self._check_timeout()
        for ev in self.last_events:
            while self.failure is None and not ev.query():
                self.abort.wait(0.001)
                self._check_timeout()
        return self.failure

    def _check_timeout(self) -> None:
        idle = time.monotonic() - self.last_progress
        if idle > self.ex.timeout_s and self.failure is None:
            first = self.schedule.actions[0]
            for a in self.schedule.actions:
                if a.key not in self.events:
                    first = a
                    break
            self.fail(first, TimeoutError(
                f"no action completed for {idle:.0f} s (timeout_s={self.ex.timeout_s}); "
                "the first action not yet issued is marked"))
