"""Dispatcher threads, kept across calls.

Each worker's lanes are issued by one thread (``executor.py``). On CUDA that thread
runs the host side of the layers, and CUDA libraries keep per-thread state that a
fresh thread has to build again: PyTorch's cuDNN attention keeps its execution-graph
caches ``thread_local`` (``aten/src/ATen/native/cudnn/MHA.cpp``), and building one
graph took about 40 ms on an H200 (docs/gpu_check.md). A thread per call paid that
for every forward graph of every call. So the threads live in a :class:`DispatcherPool`
owned by the executor: a session borrows one per worker and gives it back when its
dispatch loop ends, unless the session failed (a thread that saw a failure is retired:
a failed call leaves no dispatcher behind, and the next call gets a fresh thread).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Collection

import torch


_OURS = threading.local()


def mark_worker_thread(owner: int) -> None:
    """Mark the calling thread as one of rotapipe's own (a dispatcher, a stream's or
    the host lane's: where a loss function, a layer, a hook or the optimizer runs),
    working for ``owner`` (the id of its dispatcher pool or emulated device: an id, so
    that the thread keeps no object alive)."""
    _OURS.owner = owner


def on_worker_thread(owners: Collection[int] | None = None) -> bool:
    """Whether the calling thread is one of rotapipe's own (:func:`mark_worker_thread`),
    working for one of ``owners`` (default: any)."""
    owner = getattr(_OURS, "owner", None)
    return owner is not None and (owners is None or owner in owners)


class _Dispatcher:
    """A daemon thread that runs one job after another until stopped."""

    def __init__(self, name: str, owner: int):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=_serve, args=(self._jobs, owner),
                                       daemon=True, name=name)
        self.thread.start()

    def start(self, job: Callable[[], None], after: Callable[[bool], None]) -> None:
        self._jobs.put((job, after))

    def stop(self) -> None:
        self._jobs.put(None)


def _serve(jobs: queue.SimpleQueue, owner: int) -> None:
    # Holds no reference to the pool or a session between jobs, so that an executor
    # dropped without close() is collected and its finalizer stops the idle threads.
    mark_worker_thread(owner)
    while True:
        item = jobs.get()
        if item is None:
            return
        job, after = item
        del item
        ended = False
        try:
            # Grad mode is per thread (TRAPS.md): each session starts as a fresh thread
            # would, whatever the previous one left.
            torch.set_grad_enabled(True)
            job()
            ended = True
        finally:
            del job
            after(ended)        # a job that raised: this thread ends, never pooled
            del after


class Borrowed:
    """The dispatcher threads one session borrowed: :meth:`wait` for their loops."""

    def __init__(self):
        self.threads: list[threading.Thread] = []
        self._done: list[threading.Event] = []

    def wait(self, deadline_of: Callable[[], float | None]) -> list[threading.Thread]:
        """Wait for every loop to end (``deadline_of()`` seconds left for each, ``None``
        without limit); return the threads whose loops did not."""
        stuck = []
        for t, done in zip(self.threads, self._done):
            if not done.wait(deadline_of()):
                stuck.append(t)
        return stuck


class DispatcherPool:
    """Idle dispatcher threads per worker (see the module's doc)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: dict[int, list[_Dispatcher]] = {}
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_all, self._idle, self._lock)

    def run(self, jobs: dict[int, Callable[[], None]],
            keep: Callable[[], bool]) -> Borrowed:
        """Run ``jobs[worker]`` on a dispatcher of that worker (an idle one, or a new
        thread). After its job a dispatcher goes back to the pool if ``keep()``, else
        its thread ends."""
        borrowed = Borrowed()
        for worker, job in jobs.items():
            with self._lock:
                idle = self._idle.get(worker)
                d = idle.pop() if idle else None
            if d is None:
                d = _Dispatcher("rotapipe-dispatch-" + (
                    "host" if worker < 0 else str(worker)), id(self))    # HOST is -1
            done = threading.Event()
            d.start(job, _after(self, worker, d, keep, done))
            borrowed.threads.append(d.thread)
            borrowed._done.append(done)
        return borrowed

    def _give_back(self, worker: int, d: _Dispatcher, keep: bool) -> None:
        with self._lock:
            if keep and not self._closed:
                self._idle.setdefault(worker, []).append(d)
                return
        d.stop()

    def close(self, timeout: float = 1.0) -> None:
        """Stop the idle threads and join them (for up to ``timeout`` seconds in all);
        dispatchers still running a job stop once it ends."""
        with self._lock:
            self._closed = True
        deadline = time.monotonic() + timeout
        for t in _stop_all(self._idle, self._lock):
            t.join(max(0.0, deadline - time.monotonic()))


def _after(pool: DispatcherPool, worker: int, d: _Dispatcher, keep: Callable[[], bool],
           done: threading.Event) -> Callable[[bool], None]:
    ref = weakref.ref(pool)

    def after(ended: bool) -> None:
        p = ref()
        if p is None:
            d.stop()
        else:
            p._give_back(worker, d, ended and keep())
        done.set()          # after the give-back: the next session finds it idle
    return after


def _stop_all(idle: dict[int, list[_Dispatcher]], lock: threading.Lock) -> list[threading.Thread]:
    with lock:
        stopping = [d for ds in idle.values() for d in ds]
        idle.clear()
    for d in stopping:
        d.stop()
    return [d.thread for d in stopping]
