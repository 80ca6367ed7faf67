"""Backpressure on the data-parallel gradient collectives (:class:`InFlight`): how many
bytes the host lane keeps in flight, and how far the workers' backward may run ahead of
the host lane's hand-offs (``DataParallelConfig.inflight_mb``). Used by the all-reduce
(``allreduce.py``, ``callreduce.py``) and the sharded modes (``shard.py``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["InFlight"]


class InFlight:
    """Backpressure on the gradient collectives of one training call (or of one whole
    step's collectives): how much a rank queues when its link is slower than its
    backward (``DataParallelConfig.inflight_mb``; docs/distributed.md, "Backpressure").

    Two bounds, so that a slow link makes the backward wait instead of queueing
    gradients in host memory:

    - :meth:`admit`: the host lane issues a collective only while the buffers of those
      issued and not yet collected (send and receive buffers of the sharded modes'
      all-to-alls, the flat buckets of the all-reduce) plus the new one's stay within
      ``cap`` bytes; else it first completes the oldest (``wait_oldest``, which calls
      :meth:`release`). A collective larger than the cap goes alone.
    - :meth:`enter`: a worker starts the backward of a stage (the first of its
      microbatches to run) only when the stage is among the next ``stages`` hand-offs
      of the host lane (``order``: a stage's place among the ``O`` actions; the host
      lane runs them in that order and :meth:`leave` counts them). With the host lane
      waiting in :meth:`admit`, the workers wait here next, and at most ``stages``
      stages' gradients wait between a worker and the host lane. The stage the host
      lane waits for is always admitted, so the wait cannot close a cycle. The
      planner's host-memory model counts both bounds
      (:func:`rotapipe.plan.hostmem.per_server`).

    The order of collectives is unchanged (the host lane issues them in schedule
    order; only *when* changes), so every rank still issues the same sequence.
    ``aborted()`` true (the call failed) releases every waiting worker."""

    def __init__(self, cap: int, stages: int | None = None,
                 order: dict[str, int] | None = None,
                 aborted: Callable[[], bool] = lambda: False):
        self.cap, self.stages, self.aborted = cap, stages, aborted
        self.order = order or {}
        self.bytes = 0                 # buffers of the collectives issued, not collected
        self.peak = 0                  # the most ``bytes`` ever was (after an admit)
        self.host_waits = 0            # admits that first completed an older collective
        self.backward_waits = 0        # enters that waited
        self.backward_wait_s = 0.0     # seconds workers spent waiting in enter
        self.handed_off = 0            # O actions done (leave)
        self.most_ahead = 0            # the most stages ever entered and not handed off
        self.waiting = 0               # workers waiting in enter now
        self._entered: set[str] = set()
        self._cv = threading.Condition()

    def admit(self, nbytes: int, wait_oldest: Callable[[], bool]) -> None:
        """Reserve ``nbytes`` for a collective about to be issued (host lane).
        ``wait_oldest()`` completes the oldest collective still counted and returns
        ``False`` when none is left."""
        waited = False
        while self.bytes > 0 and self.bytes + nbytes > self.cap:
            waited = True
            if not wait_oldest():
                break
        with self._cv:
            self.host_waits += waited
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)

    def release(self, nbytes: int) -> None:
        with self._cv:
            self.bytes -= nbytes

    def enter(self, stage: str) -> None:
        """A worker is about to run a backward of ``stage`` (blocks until it is among
        the next ``stages`` hand-offs; at once for a stage already entered)."""
        place = self.order.get(stage)
        if self.stages is None or place is None:
            return
        with self._cv:
            if stage in self._entered:
                return
            t0 = None
            while place >= self.handed_off + self.stages and not self.aborted():
                if t0 is None:
                    t0 = time.perf_counter()
                    self.waiting += 1
                self._cv.wait(0.01)
            if t0 is not None:
                self.waiting -= 1
                self.backward_waits += 1
                self.backward_wait_s += time.perf_counter() - t0
            self._entered.add(stage)
            ahead = sum(1 for st in self._entered if self.order[st] >= self.handed_off)
            self.most_ahead = max(self.most_ahead, ahead)

    def leave(self, stage: str | None) -> None:
        """An ``O`` action handed its stage's gradients off (its buckets issued)."""
        with self._cv:
            self.handed_off += 1
            self._cv.notify_all()
