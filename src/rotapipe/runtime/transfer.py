"""The priority transfer engine: one arbiter per device and link direction.

A device's host link carries several lanes' copies in each direction: on the way up,
activation and gradient uploads (the ``upload`` lane, on the critical path) and
weight prefetches (``weights``); on the way down, activation and input-gradient
downloads (``download``, critical) and weight-gradient downloads (``grads``). Each
lane has its own stream, so a copy never waits for another lane's *queue*; what they
share is the wire. :class:`Link` decides who uses it: a copy takes the link one chunk
at a time, and when the link frees, the waiting chunk of the highest priority goes
next (first come, first served within a priority). Weight uploads and weight-gradient
downloads move one layer per chunk, so a critical copy waits behind at most one chunk
of them. Upload and download are separate links and run in parallel.

The simulator (``rotapipe.sim.engine``) arbitrates its links by the same rule, which
is what lets timed emulation (``rotapipe.sim.TimedEmulation``) compare the runtime
with it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from contextlib import contextmanager
from types import MappingProxyType

from ..schedule import ActionKind as K

__all__ = ["Link", "PRIORITY", "CRITICAL", "PREFETCH", "GRADIENTS", "sleep_until"]

CRITICAL, PREFETCH, GRADIENTS = 0, 1, 1
"""Priorities (lower goes first): activation and input-gradient copies, then weight
prefetch on the upload link and weight-gradient downloads on the download link."""

PRIORITY = MappingProxyType({
    K.UPLOAD_ACT: CRITICAL, K.UPLOAD_GRAD: CRITICAL, K.UPLOAD_SIDE: CRITICAL,
    K.DOWNLOAD_ACT: CRITICAL, K.DOWNLOAD_GRAD: CRITICAL, K.DOWNLOAD_BUFFERS: CRITICAL,
    K.UPLOAD_WEIGHTS: PREFETCH, K.DOWNLOAD_WGRAD: GRADIENTS,
})
"""Link priority of every copying action kind."""


class Link:
    """One direction of one device's host link, granted chunk by chunk by priority.

    ``record=True`` keeps ``(what, requested, start, end)`` of every chunk (seconds,
    ``time.perf_counter``) in :attr:`chunks`, for tests and traces."""

    def __init__(self, name: str, record: bool = False):
        self.name = name
        self._cond = threading.Condition()
        self._busy = False
        self._waiting: list[tuple[int, int]] = []   # heap of (priority, ticket)
        self._tickets = itertools.count()
        self.record = record
        self.chunks: list[tuple[str, float, float, float]] = []

    @contextmanager
    def hold(self, priority: int, seconds: float = 0.0, what: str = ""):
        """Hold the link for one chunk: wait for it (higher priorities first), then
        run the body (the real copy) and, in timed emulation, keep the link busy until
        ``seconds`` have passed since the grant."""
        ticket = (priority, next(self._tickets))
        requested = time.perf_counter()
        with self._cond:
            heapq.heappush(self._waiting, ticket)
            while self._busy or self._waiting[0] != ticket:
                self._cond.wait()
            heapq.heappop(self._waiting)
            self._busy = True
        start = time.perf_counter()
        try:
            yield
            if seconds > 0:
                sleep_until(start + seconds)
        finally:
            if self.record:
                self.chunks.append((what, requested, start, time.perf_counter()))
            with self._cond:
                self._busy = False
                self._cond.notify_all()


def sleep_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``deadline``."""
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left)
