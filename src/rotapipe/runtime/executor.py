"""The executor: walks a schedule's per-worker lists and runs them on the devices.

One dispatcher thread per worker (and one for the host lane; kept across calls in a
``dispatchers.DispatcherPool``) issues that worker's lanes, each in list order: an
action goes as soon as every dependency has been *recorded*; its stream waits on those
events, then the dispatcher submits the action body and records an event
(``backend.py``'s event protocol). ``host_deps`` must have
completed before an action is issued. A lane whose head cannot go yet never holds up
the worker's other lanes. Weight uploads and weight-gradient downloads go in gated
chunks (``transfer.py``). Nothing else orders the work: no global barrier.

On the first failure the call is aborted: dispatchers stop, streams skip queued work,
devices drain, and the caller gets a :class:`WorkerError` naming the action with the
schedule grid, the failing action marked.

The :class:`Executor` owns the devices and opens sessions; the dispatchers, waits and
failure handling of a session are ``session.py``'s (:class:`Session`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..errors import RotapipeError, WorkerError, worker_error_type
from ..schedule import HOST, Action, Schedule
from .backend import Device, HostStream
from .dispatchers import DispatcherPool
from .session import ABANDON_S, Session, abandon
from .store import Actor

__all__ = ["ABANDON_S", "Chunk", "Executor", "Session", "abandon"]


class Executor:
    """Runs schedules on a fixed set of devices (reused across calls)."""

    def __init__(self, devices: list[Device], timeout_s: float = 600.0):
        self.devices = devices
        self.timeout_s = timeout_s
        self.host_actor = Actor("host")
        self.host_stream = HostStream(self.host_actor)
        self.last_spans: list[tuple[Action, float, float]] = []
        """``(action, start, end)`` in seconds (``time.perf_counter``) of the last run's
        actions. Compute actions: when the device ran them (between timing events
        around them; on CUDA the host only issues their kernels). Copies and host
        work: when their bodies ran on their streams (on CUDA, when a copy was
        issued)."""
        self.drain_timeout_s = timeout_s
        self.broken: str | None = None
        """Why the pipeline cannot run again (a worker stuck past the drain timeout)."""
        self.abandoned: list[threading.Thread] = []
        """Threads stuck in an action that :meth:`Session.close` gave up waiting for."""
        self.dispatchers = DispatcherPool()

    def close(self) -> None:
        """Stop the idle dispatcher threads (the executor can still open sessions:
        they start new ones)."""
        self.dispatchers.close(ABANDON_S)

    def run(self, schedule: Schedule, body: Callable[[Action], None],
            describe: Callable[[Action], str] = lambda a: "",
            chunks: Callable[[Action], list[Chunk] | None] = lambda a: None,
            gate: bool = True) -> None:
        """Run every action of ``schedule`` with ``body``; raise on the first failure.

        ``chunks(action)`` splits a weight upload or weight-gradient download into
        :class:`Chunk` s (``None``: one piece, run by ``body``); ``gate`` issues them
        gated (``transfer.py``), else all at once."""
        session = self.open(body, describe, chunks, gate)
        self.last_spans = session.spans
        try:
            session.submit(schedule)
            session.wait_all()
        except BaseException:
            session.kill()       # e.g. KeyboardInterrupt: stop the workers first
            raise
        finally:
            session.close()
            session.release()

    def open(self, body: Callable[[Action], None],
             describe: Callable[[Action], str] = lambda a: "",
             chunks: Callable[[Action], list[Chunk] | None] = lambda a: None,
             gate: bool = True) -> Session:
        """A :class:`Session`: dispatchers that run the actions of every call submitted
        to it, calls overlapping as their dependencies allow, until it is closed."""
        if self.broken:
            raise WorkerError(self.broken)
        return Session(self, body, describe, chunks, gate)

    def _drain(self, running: Callable[[], str] = lambda: "") -> bool:
        """Wait for every stream to finish what it is running (queued work of the
        aborted call is skipped). A stream stuck in user code for longer than
        ``drain_timeout_s`` makes the pipeline unusable instead of hanging the caller;
        ``running()`` names what is still running then."""
        deadline = time.monotonic() + self.drain_timeout_s
        for d in self.devices:
            if not d.drain(max(0.0, deadline - time.monotonic())):
                what = running()
                self.broken = (f"worker {d.index} did not stop within "
                               f"{self.drain_timeout_s:g} s after the failure ("
                               + (f"still running: {what}" if what else "an action is stuck")
                               + "): this pipeline cannot run again; build a new one")
                return False
        return True

    def _error(self, schedule, action, exc, where) -> Exception:
        who = "the host" if action.worker == HOST else f"worker {action.worker}"
        mb = f" at microbatch {action.mb}" if action.mb is not None else ""
        call = f" of call {action.call}" if schedule.calls > 1 else ""
        msg = (f"{action.kind.verb} {action.key}{call} of stage {where}{mb} failed on "
               f"{who}: {type(exc).__name__}: {exc}\n\nschedule ({schedule.name}, failing "
               f"action marked):\n{schedule.grid(mark=action.key, context=8)}")
        cls = worker_error_type(type(exc)) if isinstance(exc, RotapipeError) else WorkerError
        return cls(msg, action=action.key, worker=action.worker, cause=exc)


class Chunk:
    """One piece of a chunked copy (a weight upload or weight-gradient download).

    ``copy`` is submitted to the lane's stream; ``stage`` runs first on the dispatcher
    thread (host work such as filling a pinned bounce buffer); ``ready()`` says whether
    it may be issued now (e.g. a bounce buffer is free); ``issued(event)`` receives the
    event recorded after it."""

    __slots__ = ("copy", "stage", "ready", "issued")

    def __init__(self, copy: Callable[[], None], stage=None, ready=None, issued=None):
        self.copy, self.stage, self.ready, self.issued = copy, stage, ready, issued

