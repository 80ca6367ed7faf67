"""The discrete-event engine: runs a schedule's lanes on per-device resources.

Each device has three resources: its compute engine, its upload link (host to device)
and its download link (device to host); the host lane is a fourth, on the host. Lanes
map onto them (``rotapipe.schedule.timeline.RESOURCE``): ``compute`` -> compute,
``weights`` and ``upload`` -> the upload link, ``download`` and ``grads`` -> the
download link. An action starts when it heads its
lane (lanes run in list order, one action at a time), every dependency has finished,
and its resource is free. The links are the devices' copy engines
(``rotapipe.runtime.transfer``): with gating on (the runtime's default), weight uploads
and weight-gradient downloads move in chunks and a runnable activation or gradient
copy goes before the next chunk, so it waits at most one chunk; with ``gate=False``
each copy is one piece and the engine serves copies in the order they became
runnable, without priority or preemption. Zero-time actions (frees, hand-offs) finish
the moment they can start.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence

from ..errors import ScheduleError
from ..schedule import Action, Lane, Schedule
from ..schedule.actions import CHUNKED, LINK_PRIORITY
from ..schedule.timeline import RESOURCE, Span, Timeline

__all__ = ["run"]


def run(schedule: Schedule, durations: Callable[[Action], Sequence[float]], *,
        gate: bool = True) -> Timeline:
    """Simulate ``schedule``; ``durations(action)`` gives its time in ms as a list of
    chunks (one entry for all but weight uploads and weight-gradient downloads).
    ``gate``: chunked copies yield to critical ones between chunks (the runtime's
    ``PipeConfig.gate_copies``). Raise :class:`ScheduleError` if the schedule cannot
    finish (a deadlock)."""
    return _Engine(schedule, durations, gate).run()


class _Engine:
    def __init__(self, schedule: Schedule, durations, gate: bool = True):
        self.s, self.durations, self.gate = schedule, durations, gate
        self.ready_at: dict[str, float] = {}
        self.deps_done: dict[str, float] = {}       # when an action's last dependency ended
        self.lane_ready: dict[tuple[int, Lane], float] = {}
        self.lanes: dict[tuple[int, Lane], deque[Action]] = {}
        for a in schedule.actions:
            self.lanes.setdefault((a.worker, a.lane), deque()).append(a)
        # resource -> its lanes, highest priority first
        self.by_resource: dict[tuple[int, str], list[tuple[int, Lane]]] = {}
        for lane in sorted(self.lanes, key=lambda wl: LINK_PRIORITY.get(wl[1], 0)):
            self.by_resource.setdefault((lane[0], RESOURCE[lane[1]]), []).append(lane)
        self.missing: dict[str, int] = {}
        self.users: dict[str, list[str]] = {}
        for a in schedule.actions:
            deps = set(a.deps) | set(a.host_deps)
            self.missing[a.key] = len(deps)
            for d in deps:
                self.users.setdefault(d, []).append(a.key)
        self.by_key = schedule.by_key()
        self.busy: set[tuple[int, str]] = set()
        self.inflight: set[tuple[int, Lane]] = set()
        self.chunks: dict[str, deque[float]] = {}
        self.start: dict[str, float] = {}
        self.end: dict[str, float] = {}
        self.spans: list[Span] = []
        self.events: list[tuple[float, int, tuple[int, str], tuple[int, Lane]]] = []
        self.seq = 0
        self.dirty = set(self.by_resource)

    def run(self) -> Timeline:
        t = 0.0
        while True:
            self.dispatch(t)
            if not self.events:
                break
            t = self.events[0][0]
            while self.events and self.events[0][0] <= t:
                _, _, res, lane = heapq.heappop(self.events)
                self.busy.discard(res)
                self.inflight.discard(lane)
                self.dirty.add(res)
                if not self.chunks[self.lanes[lane][0].key]:
                    self.finish(lane, t)
        stuck = [q[0] for q in self.lanes.values() if q]
        if stuck:
            lines = "\n".join(f"  {a.to_line()}" for a in stuck)
            raise ScheduleError(f"the simulation of {self.s.name} cannot go on; these lane "
                                f"heads wait forever:\n{lines}")
        return Timeline(self.s, tuple(self.spans), self.start, self.end)

    def finish(self, lane: tuple[int, Lane], t: float) -> None:
        a = self.lanes[lane].popleft()
        self.end[a.key] = t
        self.dirty.add((lane[0], RESOURCE[lane[1]]))
        for u in self.users.get(a.key, ()):
            self.missing[u] -= 1
            if self.missing[u] == 0:
                self.deps_done[u] = t
                b = self.by_key[u]
                self.dirty.add((b.worker, RESOURCE[b.lane]))

    def dispatch(self, t: float) -> None:
        """Start every action that can start at ``t``."""
        while self.dirty:
            res = self.dirty.pop()
            candidates = []
            for lane in self.by_resource.get(res, ()):
                q = self.lanes[lane]
                if not q or lane in self.inflight or self.missing[q[0].key]:
                    continue
                a = q[0]
                if a.key not in self.ready_at:
                    # A copy reaches its engine once its dependencies ended and the copy
                    # before it on its stream reached it (issued back to back).
                    r = max(self.deps_done.get(a.key, 0.0), self.lane_ready.get(lane, 0.0))
                    self.ready_at[a.key] = self.lane_ready[lane] = r
                chunks = self.chunks.get(a.key)
                if chunks is None:
                    pieces = [d for d in self.durations(a) if d > 0]
                    if not self.gate and a.kind in CHUNKED and pieces:
                        pieces = [sum(pieces)]      # issued at once: one unit
                    chunks = self.chunks[a.key] = deque(pieces)
                if not chunks:              # zero time: done at once; look again
                    self.start.setdefault(a.key, t)
                    self.finish(lane, t)
                    candidates = None
                    break
                candidates.append(lane)
            if not candidates or res in self.busy:
                continue
            if not self.gate:               # first runnable, first served
                candidates.sort(key=lambda l: self.ready_at[self.lanes[l][0].key])
            lane = candidates[0]
            a = self.lanes[lane][0]
            d = self.chunks[a.key].popleft()
            self.start.setdefault(a.key, t)
            self.busy.add(res)
            self.inflight.add(lane)
            self.spans.append(Span(a, res[1], t, t + d))
            self.seq += 1
            heapq.heappush(self.events, (t + d, self.seq, res, lane))
