"""The discrete-event engine: runs a schedule's lanes on per-device resources.

Each device has three resources: its compute engine, its upload link (host to device)
and its download link (device to host); the host lane is a fourth, on the host. Lanes
map onto them: ``compute`` -> compute, ``weights`` and ``upload`` -> the upload link,
``download`` and ``grads`` -> the download link. An action starts when it heads its
lane (lanes run in list order, one action at a time), every dependency has finished,
and its resource is free. Where two lanes share a link, activation and gradient copies go first; weight
uploads and weight-gradient downloads move in per-layer chunks, so a critical copy
waits at most one chunk (the runtime's priority transfer engine does the same).
Zero-time actions (frees, hand-offs) finish the moment they can start.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import ScheduleError
from ..schedule import Action, ActionKind as K, Lane, Schedule

__all__ = ["Resource", "Span", "Timeline", "run"]


class Resource:
    """Resource names (plain strings, used in spans and traces)."""

    COMPUTE = "compute"
    UP = "upload link"
    DOWN = "download link"
    HOST = "host"


_RESOURCE = {Lane.COMPUTE: Resource.COMPUTE, Lane.WEIGHTS: Resource.UP,
             Lane.UPLOAD: Resource.UP, Lane.DOWNLOAD: Resource.DOWN, Lane.GRADS: Resource.DOWN,
             Lane.HOST: Resource.HOST}
_PRIORITY = {Lane.UPLOAD: 0, Lane.WEIGHTS: 1, Lane.DOWNLOAD: 0, Lane.GRADS: 1}
"""Lower runs first on a shared link (as ``rotapipe.runtime.transfer.PRIORITY``)."""

COMPUTE_PASSES = frozenset({K.FORWARD, K.FORWARD_KEEP, K.FUSED, K.RECOMPUTE, K.BACKWARD,
                            K.BACKWARD_KEPT})
"""Action kinds that do model math (busy time of a device)."""


@dataclass(frozen=True)
class Span:
    """One stretch of time an action held a resource (a chunk of it, for weights)."""

    action: Action
    resource: str
    start: float
    end: float

    @property
    def worker(self) -> int:
        return self.action.worker


@dataclass(frozen=True)
class Timeline:
    """When every action of a schedule ran (milliseconds from the call's start)."""

    schedule: Schedule
    spans: tuple[Span, ...]
    start: Mapping[str, float]
    end: Mapping[str, float]

    @property
    def makespan(self) -> float:
        return max(self.end.values(), default=0.0)


def run(schedule: Schedule, durations: Callable[[Action], Sequence[float]]) -> Timeline:
    """Simulate ``schedule``; ``durations(action)`` gives its time in ms as a list of
    chunks (one entry for all but weight uploads). Raise :class:`ScheduleError` if the
    schedule cannot finish (a deadlock)."""
    return _Engine(schedule, durations).run()


class _Engine:
    def __init__(self, schedule: Schedule, durations):
        self.s, self.durations = schedule, durations
        self.lanes: dict[tuple[int, Lane], deque[Action]] = {}
        for a in schedule.actions:
            self.lanes.setdefault((a.worker, a.lane), deque()).append(a)
        # resource -> its lanes, highest priority first
        self.by_resource: dict[tuple[int, str], list[tuple[int, Lane]]] = {}
        for lane in sorted(self.lanes, key=lambda wl: _PRIORITY.get(wl[1], 0)):
            self.by_resource.setdefault((lane[0], _RESOURCE[lane[1]]), []).append(lane)
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
        self.dirty.add((lane[0], _RESOURCE[lane[1]]))
        for u in self.users.get(a.key, ()):
            self.missing[u] -= 1
            if self.missing[u] == 0:
                b = self.by_key[u]
                self.dirty.add((b.worker, _RESOURCE[b.lane]))

    def dispatch(self, t: float) -> None:
        """Start every action that can start at ``t``."""
        while self.dirty:
            res = self.dirty.pop()
            for lane in self.by_resource.get(res, ()):
                q = self.lanes[lane]
                if not q or lane in self.inflight or self.missing[q[0].key]:
                    continue
                a = q[0]
                chunks = self.chunks.get(a.key)
                if chunks is None:
                    chunks = self.chunks[a.key] = deque(d for d in self.durations(a) if d > 0)
                if not chunks:              # zero time: done at once; look again
                    self.start.setdefault(a.key, t)
                    self.finish(lane, t)
                    break
                if res in self.busy:
                    continue
                d = chunks.popleft()
                self.start.setdefault(a.key, t)
                self.busy.add(res)
                self.inflight.add(lane)
                self.spans.append(Span(a, res[1], t, t + d))
                self.seq += 1
                heapq.heappush(self.events, (t + d, self.seq, res, lane))
