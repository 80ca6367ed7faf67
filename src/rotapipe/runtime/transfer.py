"""How transfers get priority on hardware that has none: copy engines, the critical
copies in flight, and gated weight chunks.

The hardware model (docs/concepts.md, "Copy engines"): a device has one host-to-device
and one device-to-host copy engine. A copy reaches its engine once it is runnable on
its stream (every event its stream waits on has completed); the engine serves copies
in the order they reached it, across all streams, one at a time, and never preempts
one. Stream priority orders kernels only, not copies (CUDA driver API,
``cuStreamCreateWithPriority``). So an activation upload that becomes runnable after
a 300 MB weight prefetch was issued waits for all of it.

The runtime earns priority by issuing weight uploads and weight-gradient downloads in
chunks (:func:`layer_chunks`, at most ``PipeConfig.copy_chunk_mb`` each, never across a
layer) and gating them (:class:`CopyGate`): a chunk is issued only after the previous
chunk of its copy completed, and its stream first waits on the events of every
critical copy (activation, gradient, side-input, buffer) that is runnable on the same
engine and not yet complete. A critical copy therefore waits behind at most one chunk.
The gate uses only event queries and stream waits, so it runs unchanged on CUDA and on
the emulated backend, whose engines (:class:`CopyEngine`) are as strict as the
hardware's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from ..plan.hardware import layer_chunks
from ..schedule import Lane
from ..schedule.actions import CHUNKED, CRITICAL

__all__ = ["CRITICAL", "CHUNKED", "UP", "DOWN", "CopyEngine", "CopyGate", "direction",
           "layer_chunks", "split_bytes", "sleep_until"]

UP, DOWN = "host->device", "device->host"
"""The two copy-engine directions of a device."""


_DIRECTION = {Lane.WEIGHTS: UP, Lane.TRAINED: UP, Lane.UPLOAD: UP, Lane.DOWNLOAD: DOWN,
              Lane.GRADS: DOWN}


def direction(lane: Lane) -> str | None:
    """The copy engine a lane's copies use (``None`` for compute and host lanes)."""
    return _DIRECTION.get(lane)


def split_bytes(sizes: Sequence[int], parts: int) -> list[list[tuple[int, int, int]]]:
    """Cut the concatenation of buffers of ``sizes`` bytes into ``parts`` near-equal
    byte ranges: per part, ``(buffer index, start byte, stop byte)`` pieces. A part may
    be empty when there are fewer bytes than parts."""
    total = sum(sizes)
    cuts = [total * i // parts for i in range(parts + 1)]
    out: list[list[tuple[int, int, int]]] = []
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    for lo, hi in zip(cuts, cuts[1:]):
        pieces = []
        for i, s in enumerate(sizes):
            a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
            if a < b:
                pieces.append((i, a - offsets[i], b - offsets[i]))
        out.append(pieces)
    return out


class CopyGate:
    """The critical copies issued on one device's engine in one direction that are not
    yet complete (host-side bookkeeping of the dispatcher, no hardware arbiter).

    :meth:`pending` gives the events a chunk's stream must wait on: those of critical
    copies that are runnable and not complete. A copy is runnable when every event it
    waits on has completed and the copy before it on its stream is runnable or done
    (a stream runs in order). A critical copy still waiting for its producer is not
    pending: the chunk may go, and the copy waits for at most that chunk once it
    becomes runnable."""

    def __init__(self):
        self._lanes: dict[object, list[tuple[object, list]]] = {}   # lane -> (event, waits)

    def add(self, lane, event, waits_on: list) -> None:
        self._lanes.setdefault(lane, []).append((event, waits_on))

    def pending(self) -> list:
        out = []
        for lane, copies in self._lanes.items():
            done = 0
            while done < len(copies) and copies[done][0].query():
                done += 1                 # a stream completes in order: a done prefix
            del copies[:done]
            for ev, waits_on in copies:
                if not all(d.query() for d in waits_on):
                    break                 # it and everything behind it wait
                out.append(ev)
        return out


class CopyEngine:
    """One emulated copy engine: serves copies one at a time, in the order they reached
    it (:meth:`ticket`, taken when a copy becomes runnable on its stream), without
    preemption. ``record=True`` keeps ``(what, reached, start, end)`` per copy
    (seconds, ``time.perf_counter``) in :attr:`copies`."""

    def __init__(self, name: str, record: bool = False):
        self.name = name
        self.record = record
        self.copies: list[tuple[str, float, float, float]] = []
        self._cond = threading.Condition()
        self._issued = 0          # tickets handed out
        self._next = 0            # the ticket served next
        self._done: set[int] = set()
        self._reached: dict[int, float] = {}

    def ticket(self) -> int:
        """A place in the engine's queue for a copy that is runnable now."""
        with self._cond:
            t = self._issued
            self._issued += 1
            self._reached[t] = time.perf_counter()
            return t

    def acquire(self, ticket: int) -> float:
        """Block until every earlier copy was served; return the start time."""
        with self._cond:
            while self._next != ticket:
                self._cond.wait()
        return time.perf_counter()

    def release(self, ticket: int, what: str = "", start: float | None = None) -> None:
        """The copy of ``ticket`` finished (or was skipped: ``start`` is ``None``)."""
        end = time.perf_counter()
        with self._cond:
            reached = self._reached.pop(ticket, end)
            if self.record and start is not None:
                self.copies.append((what, reached, start, end))
            self._done.add(ticket)
            while self._next in self._done:
                self._done.discard(self._next)
                self._next += 1
            self._cond.notify_all()


def sleep_until(deadline: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``deadline``."""
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left)
