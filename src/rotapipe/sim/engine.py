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
the moment they can start, before anything else is chosen at that instant: a copy they
make runnable competes for its link at once (the choice never depends on which
resource the engine looks at first).
"""

from __future__ import annotations

import bisect
import heapq
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


_RUN = 256
"""Most chunks one event covers. A run is cut at the first chunk end after a critical
copy becomes runnable, and the chunk ends past the cut were computed for nothing; so
each resource's runs start at the length that ran before its last cut and double
while uncut, up to this."""


class _Engine:
    """The event loop over integer ids: actions by position in the schedule, lanes
    and resources by first appearance (the planner simulates thousands of actions
    per candidate, so the loop avoids string keys and per-action objects)."""

    def __init__(self, schedule: Schedule, durations, gate: bool = True):
        self.s, self.durations, self.gate = schedule, durations, gate
        acts = self.acts = schedule.actions
        n = len(acts)
        index = {a.key: i for i, a in enumerate(acts)}
        lane_of: dict[tuple[int, Lane], int] = {}
        self.lane = [0] * n                        # action -> its lane
        self.queue: list[list[int]] = []           # lane -> its actions, in list order
        lanes: list[tuple[int, Lane]] = []
        for i, a in enumerate(acts):
            wl = (a.worker, a.kind.lane)
            li = lane_of.get(wl)
            if li is None:
                li = lane_of[wl] = len(lanes)
                lanes.append(wl)
                self.queue.append([])
            self.lane[i] = li
            self.queue[li].append(i)
        self.head = [0] * len(lanes)               # lane -> position of its head
        # resource -> its lanes, highest priority first
        res_of: dict[tuple[int, str], int] = {}
        self.res_name: list[str] = []
        self.by_resource: list[list[int]] = []
        self.lane_res = [0] * len(lanes)
        for li in sorted(range(len(lanes)), key=lambda li: LINK_PRIORITY.get(lanes[li][1], 0)):
            w, lane = lanes[li]
            key = (w, RESOURCE[lane])
            r = res_of.get(key)
            if r is None:
                r = res_of[key] = len(self.res_name)
                self.res_name.append(key[1])
                self.by_resource.append([])
            self.by_resource[r].append(li)
            self.lane_res[li] = r
        self.res = [self.lane_res[li] for li in self.lane]   # action -> its resource
        self.missing = [0] * n
        self.users: list[list[int]] = [[] for _ in range(n)]
        for i, a in enumerate(acts):
            deps = set(a.deps) | set(a.host_deps)
            self.missing[i] = len(deps)
            for d in deps:
                j = index.get(d)
                if j is not None:               # an unknown key is never done: deadlock
                    self.users[j].append(i)
        self.deps_done = [0.0] * n             # when an action's last dependency ended
        self.ready_at: list[float | None] = [None] * n
        self.lane_ready = [0.0] * len(lanes)
        self.chunks: list[list[float] | None] = [None] * n
        self.done = [0] * n                        # chunks of an action already run
        self.start: list[float | None] = [None] * n
        self.end: list[float | None] = [None] * n
        self.busy = [False] * len(self.res_name)
        # resource -> (action, start, chunk end times, cut short) of the chunks it runs
        # now, and the sequence number of the event that ends them (older ones are void)
        self.running: list[tuple[int, float, list[float], bool] | None] = \
            [None] * len(self.res_name)
        self.valid = [0] * len(self.res_name)
        self.stride = [8] * len(self.res_name)    # chunks the next run covers at most
        self.lane_pos = [0] * len(lanes)           # lane -> rank among its resource's
        for lanes_of in self.by_resource:
            for pos, li in enumerate(lanes_of):
                self.lane_pos[li] = pos
        self.inflight = [False] * len(lanes)
        self.spans: list[Span] = []
        self.events: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.dirty = list(range(len(self.res_name)))
        self.is_dirty = [True] * len(self.res_name)

    def run(self) -> Timeline:
        t = 0.0
        events, busy, inflight = self.events, self.busy, self.inflight
        queue, head, valid = self.queue, self.head, self.valid
        while True:
            self.dispatch(t)
            if not events:
                break
            t = events[0][0]
            while events and events[0][0] <= t:
                _, seq, res, lane = heapq.heappop(events)
                if seq != valid[res]:
                    continue                # the chunks it would end yielded earlier
                a = queue[lane][head[lane]]
                self.record(res, a)
                busy[res] = False
                inflight[lane] = False
                self.mark(res)
                if self.done[a] == len(self.chunks[a]):
                    self.finish(lane, t)
        stuck = [self.acts[q[h]] for q, h in zip(queue, head) if h < len(q)]
        if stuck:
            lines = "\n".join(f"  {a.to_line()}" for a in stuck)
            raise ScheduleError(f"the simulation of {self.s.name} cannot go on; these lane "
                                f"heads wait forever:\n{lines}")
        acts = self.acts
        return Timeline(self.s, tuple(self.spans),
                        {a.key: t for a, t in zip(acts, self.start) if t is not None},
                        {a.key: t for a, t in zip(acts, self.end) if t is not None})

    def record(self, res: int, a: int) -> None:
        """The chunks of ``a`` that ``res`` ran (to the event just ended) as spans."""
        _, t, ends, cut = self.running[res]
        self.running[res] = None
        self.stride[res] = len(ends) if cut else min(2 * len(ends), _RUN)
        act, name = self.acts[a], self.res_name[res]
        for e in ends:
            self.spans.append(Span(act, name, t, e))
            t = e
        self.done[a] += len(ends)

    def mark(self, res: int) -> None:
        if not self.is_dirty[res]:
            self.is_dirty[res] = True
            self.dirty.append(res)

    def finish(self, lane: int, t: float) -> None:
        a = self.queue[lane][self.head[lane]]
        self.head[lane] += 1
        self.end[a] = t
        self.mark(self.lane_res[lane])
        missing = self.missing
        for u in self.users[a]:
            missing[u] -= 1
            if missing[u] == 0:
                self.deps_done[u] = t
                self.mark(self.res[u])

    def dispatch(self, t: float) -> None:
        """Start every action that can start at ``t``: first every zero-time action
        that can run (each may make others runnable), then, on each resource whose
        lanes changed, the runnable lane that ranks first. So a copy made runnable at
        ``t`` by a zero-time action competes at ``t`` whatever order the resources
        are looked at in."""
        dirty, is_dirty = self.dirty, self.is_dirty
        # res -> its runnable lanes, as last looked at (any change marks it again)
        touched: dict[int, list[int]] = {}
        while dirty:
            res = dirty.pop()
            is_dirty[res] = False
            candidates = self.runnable(res, t)
            if candidates is not None:
                touched[res] = candidates
        queue, head = self.queue, self.head
        for res, candidates in touched.items():
            if not candidates:
                continue
            if self.busy[res]:
                self.yield_to(res, candidates[0], t)
                continue
            if not self.gate:               # first runnable, first served
                candidates.sort(key=lambda l: self.ready_at[queue[l][head[l]]])
            lane = candidates[0]
            a = queue[lane][head[lane]]
            if self.start[a] is None:
                self.start[a] = t
            self.busy[res] = True
            self.inflight[lane] = True
            self.begin(res, lane, a, t)

    def runnable(self, res: int, t: float) -> list[int] | None:
        """The lanes of ``res`` whose head can start at ``t``, highest rank first;
        None if a zero-time head finished instead (``res`` is looked at again)."""
        queue, head, inflight, missing = self.queue, self.head, self.inflight, self.missing
        ready_at, lane_ready, chunks = self.ready_at, self.lane_ready, self.chunks
        candidates = []
        for lane in self.by_resource[res]:
            q, h = queue[lane], head[lane]
            if h == len(q) or inflight[lane]:
                continue
            a = q[h]
            if missing[a]:
                continue
            if ready_at[a] is None:
                # A copy reaches its engine once its dependencies ended and the copy
                # before it on its stream reached it (issued back to back).
                r = self.deps_done[a]
                if lane_ready[lane] > r:
                    r = lane_ready[lane]
                ready_at[a] = lane_ready[lane] = r
            c = chunks[a]
            if c is None:
                act = self.acts[a]
                c = [d for d in self.durations(act) if d > 0]
                if not self.gate and act.kind in CHUNKED and c:
                    c = [sum(c)]                # issued at once: one unit
                chunks[a] = c
            if not c:                       # zero time: done at once
                if self.start[a] is None:
                    self.start[a] = t
                self.finish(lane, t)
                return None
            candidates.append(lane)
        return candidates

    def begin(self, res: int, lane: int, a: int, t: float) -> None:
        """Start ``a``'s next chunk on ``res`` at ``t``. Gated, its later chunks follow
        back to back in the same event: at each chunk's end the lane would be chosen
        again unless a lane ranked above it had become runnable, and then
        :meth:`yield_to` ends the run at that chunk instead."""
        c, e = self.chunks[a], t
        if self.gate:
            ends = []
            for d in c[self.done[a]:self.done[a] + self.stride[res]]:
                e = e + d
                ends.append(e)
        else:
            ends = [e + c[self.done[a]]]
        self.running[res] = (a, t, ends, False)
        self.seq += 1
        self.valid[res] = self.seq
        heapq.heappush(self.events, (ends[-1], self.seq, res, lane))

    def yield_to(self, res: int, lane: int, t: float) -> None:
        """``lane`` became runnable at ``t`` while ``res`` is busy: if it outranks the
        running lane, the running chunks stop at the first chunk end at or after
        ``t`` (a chunk is never cut)."""
        run = self.running[res]
        if run is None or not self.gate:
            return
        a, t0, ends, _ = run
        if self.lane_pos[lane] > self.lane_pos[self.lane[a]]:
            return
        i = bisect.bisect_left(ends, t)
        if i >= len(ends) - 1:
            return                          # it ends with that chunk anyway
        self.running[res] = (a, t0, ends[:i + 1], True)
        self.seq += 1
        self.valid[res] = self.seq
        heapq.heappush(self.events, (ends[i], self.seq, res, self.lane[a]))
