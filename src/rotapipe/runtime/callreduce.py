"""The bucketed gradient all-reduce of one training call (:class:`CallReduce`): its
buckets, started at the host lane's hand-offs and applied to the call's staged
gradients, and its timing (:class:`ReduceStats`). The protocol (buckets, ordering,
presence flags, failure) is described in ``allreduce.py``, whose
:class:`~rotapipe.runtime.allreduce.GradReducer` issues the collectives."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .callgrads import CallGrads
from .inflight import InFlight

if TYPE_CHECKING:
    from .allreduce import GradReducer

__all__ = ["CallReduce", "ReduceStats", "interval_union"]


@dataclass
class ReduceStats:
    """All-reduce timing of the last training call (seconds)."""

    buckets: int = 0
    bytes: int = 0
    busy_s: float = 0.0
    """Time at least one gradient bucket was in flight (launch to completion). A
    bucket's completion is when rotapipe first saw it (:meth:`CallReduce.observe`: at
    each hand-off, and within 0.5 ms while it is waited for), so a bucket that
    completed between two hand-offs counts until the second."""
    exposed_s: float = 0.0
    """Time after the schedule had finished during which a bucket was still in flight
    (what the caller waited for the all-reduce; a wait that ran on after the last
    bucket completed, e.g. for the GIL, does not count). At most ``busy_s``."""
    backward_done: float = 0.0
    """``time.perf_counter()`` when this rank's schedule finished and the wait began
    (comparable across processes of one machine: benchmarks use it for rank skew)."""

    @property
    def hidden_fraction(self) -> float:
        """Share of the all-reduce time hidden behind the backward."""
        return 1.0 - self.exposed_s / self.busy_s if self.busy_s > 0 else 1.0

class CallReduce:
    """The bucketed gradient all-reduce of one training call."""

    def __init__(self, reducer: GradReducer, layout: dict[str, list[list[int]]],
                 grads: CallGrads, gate: InFlight | None = None):
        self.r, self.layout, self.grads = reducer, layout, grads
        self.gate = gate if gate is not None else InFlight(1 << 62)
        self._inflight: list[_Bucket] = []
        self._lock = threading.Lock()   # finish() runs on the caller, handoff on the host lane

    def handoff(self, key: str) -> list[_Bucket]:
        """The O action ``key`` added its stage's gradients: start its buckets (the
        parameters whose last hand-off this is) and return them. A bucket waits for
        older ones while the buffers in flight would pass the cap (:class:`InFlight`)."""
        try:
            return self._handoff(key)
        finally:
            self.gate.leave(self.r.stage_of(key))

    def _apply_oldest(self) -> bool:
        """Wait for the oldest bucket not yet applied and apply it (its flat buffer
        becomes the staged gradients, the copy it was made from goes)."""
        with self._lock:
            oldest = next((b for b in self._inflight if not b.applied), None)
        if oldest is None:
            return False
        self.apply([oldest])
        return True

    def observe(self) -> None:
        """Stamp the end of every bucket seen complete for the first time. Polled
        rather than a done-callback on the collective's future: gloo completes a future
        on its own worker thread, and a Python callback there takes the GIL; when a
        peer's exit fails a bucket still in flight while this process is already
        shutting down (a call that failed with buckets in flight), that thread is
        torn down mid-callback and the process aborts ("terminate called after
        throwing an instance of 'gloo::IoException'", exit -6 instead of the error)."""
        now = time.perf_counter()
        with self._lock:
            pending = [b for b in self._inflight if b.end is None]
        for b in pending:
            if b.work.is_completed():
                b.end = now

    def _handoff(self, key: str) -> list[_Bucket]:
        self.observe()
        launched = []
        for pids in self.layout.get(key, ()):
            nbytes = 4 * (sum(self.r._shapes[pid].numel() for pid in pids) + len(pids))
            self.gate.admit(nbytes, self._apply_oldest)
            parts = []
            for pid in pids:
                g = self.grads.staged.get(pid)
                parts.append(g.reshape(-1) if g is not None
                             else torch.zeros(self.r._shapes[pid].numel(),
                                              dtype=torch.float32))
            present = torch.tensor([float(pid in self.grads.staged) for pid in pids],
                                   dtype=torch.float32)
            flat = torch.cat(parts + [present])
            start = time.perf_counter()
            seq = self.r.issued
            work = self.r._launch(flat)
            bucket = _Bucket(pids, flat, work, seq, start, nbytes=nbytes)
            with self._lock:
                self._inflight.append(bucket)
            launched.append(bucket)
        return launched

    def apply(self, buckets: Sequence[_Bucket]) -> None:
        """Wait for ``buckets`` (with the deadline) and replace their parameters' staged
        gradients by the reduced sums: a parameter no rank has a gradient for is
        dropped. The overlapped optimizer calls it before stepping them; each bucket is
        applied once."""
        self._wait(buckets)
        self._write(buckets)

    def _wait(self, buckets: Sequence[_Bucket]) -> None:
        for b in buckets:
            self.r._wait(b.work, b.seq, f"gradient all-reduce of {len(b.pids)} parameters")
            if b.end is None:          # the wait returns within 0.5 ms of completion
                b.end = time.perf_counter()

    def _write(self, buckets: Sequence[_Bucket]) -> None:
        """Put completed buckets' sums in place of the staged gradients (once each)."""
        staged = self.grads.staged
        for b in buckets:
            # Under the lock until written: a thread that finds the bucket applied must
            # find the reduced gradients in place (the caller's finish() and the
            # host lane's hand-offs may apply the same bucket).
            with self._lock:
                if b.applied:
                    continue
                n = len(b.pids)
                present = b.flat[-n:]
                off = 0
                for i, pid in enumerate(b.pids):
                    shape = self.r._shapes[pid]
                    numel = shape.numel()
                    if present[i] > 0:
                        staged[pid] = b.flat[off:off + numel].view(shape)
                    else:
                        staged.pop(pid, None)
                    off += numel
                b.applied = True
                self.gate.release(b.nbytes)

    def finish(self) -> ReduceStats:
        """Wait for every bucket; replace the staged gradients by the reduced sums."""
        self.observe()
        t0 = time.perf_counter()
        with self._lock:
            buckets = list(self._inflight)
        self._wait(buckets)
        waited = time.perf_counter() - t0
        self._write(buckets)
        ends = [b.end if b.end is not None else t0 + waited for b in buckets]
        # Every bucket was launched before t0, so this is within the union (busy_s).
        exposed = min(waited, max(0.0, max(ends, default=t0) - t0))
        stats = ReduceStats(len(buckets), sum(b.flat.numel() * 4 for b in buckets),
                            interval_union([(b.start, e) for b, e in zip(buckets, ends)]),
                            exposed, t0)
        self.r.last = stats
        return stats

@dataclass
class _Bucket:
    pids: list[int]
    flat: torch.Tensor
    work: object
    seq: int
    start: float
    end: float | None = field(default=None)
    applied: bool = False
    nbytes: int = 0


def interval_union(intervals: list[tuple[float, float]]) -> float:
    """The total length the ``(start, end)`` intervals cover (overlaps counted once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)
