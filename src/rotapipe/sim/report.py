"""What a simulated timeline means: step time, tokens/s, bubbles, exposed communication,
peak memory; and the side-by-side table.

Bubble = idle compute time / (devices x window). The window is the whole call for a
one-call schedule; for overlapping calls it is the steady state, from the end of the
first call to the end of the second-to-last (so neither the first fill nor the last
drain counts), and the step time is that window divided by the calls it spans (two
overlapping calls have no steady state, nor have calls that run side by side: the
window is then the whole timeline, the step its share per call). Each idle stretch of a device is one of:

- **fill**: before the device's first compute;
- **drain**: after its last compute;
- **switch**: between a forward-type pass (``F``, ``FK``) and a backward-type pass
  (``R``, ``B``, ``BK``, ``FT``), either way round;
- **steady**: between two passes of the same direction.

**Exposed communication** is the part of the idle time during which the device waited
on transfers: following the next compute's latest-finishing dependency back through
transfers to the compute that produced the data, the time after that compute ended.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..plan import Plan, StageKind
from ..schedule import ActionKind as K
from ..schedule.memory import MemoryPeak, MemorySizes, format_bytes, peak_memory
from ..schedule.actions import COMPUTE_PASSES, stage_map
from ..schedule.timeline import Resource, Span, Timeline

__all__ = ["Bubble", "Report", "report", "table", "loss_period", "steady_bubble"]

_FORWARD = frozenset({K.FORWARD, K.FORWARD_KEEP})


@dataclass(frozen=True)
class Bubble:
    """Idle compute time as fractions of devices x window."""

    fill: float
    switch: float
    drain: float
    steady: float

    @property
    def total(self) -> float:
        return self.fill + self.switch + self.drain + self.steady


@dataclass(frozen=True)
class Report:
    """The numbers of one simulated schedule."""

    schedule: str
    devices: int
    microbatches: int
    calls: int
    step_ms: float
    """One call's time: the makespan, or the steady-state period for overlapping calls."""
    makespan_ms: float
    """End of the whole timeline (all calls)."""
    window: tuple[float, float]
    tokens_per_s: float
    bubble: Bubble
    exposed_comm: float
    """Idle time spent waiting on transfers, as a fraction of devices x window."""
    memory: tuple[MemoryPeak, ...]
    """Peak device memory per device (weights and gradients + activations)."""
    memory_limit: int | None = None

    @property
    def peak_bytes(self) -> int:
        return max((p.total for p in self.memory), default=0)

    @property
    def fits(self) -> bool | None:
        """Whether every device's peak is within ``memory_limit`` (None: no limit)."""
        return None if self.memory_limit is None else self.peak_bytes <= self.memory_limit


def _window(tl: Timeline) -> tuple[float, float, float]:
    """(start, end, step) of the measured window."""
    calls = tl.schedule.calls
    if calls == 1:
        return 0.0, tl.makespan, tl.makespan
    ends = [0.0] * calls
    for a in tl.schedule.actions:
        ends[a.call] = max(ends[a.call], tl.end[a.key])
    whole = (0.0, tl.makespan, tl.makespan / calls)
    if calls == 2:
        # No steady state to measure: with enough workers the two calls may run side
        # by side and end together. Count both calls over the whole timeline.
        return whole
    last = calls - 2
    step = (ends[last] - ends[0]) / last
    # A period far shorter than one call's compute spread over every device means the
    # calls ran side by side (independent of each other): no steady state either.
    busy = sum(sp.end - sp.start for sp in tl.spans
               if sp.resource == Resource.COMPUTE and sp.action.call == 0)
    if step * tl.schedule.workers < 0.5 * busy:
        return whole
    # Calls that end irregularly (two nearly together, the next much later) leave a
    # window without a call's worth of work in it: no steady state either.
    inside = sum(_overlap(sp.start, sp.end, ends[0], ends[last]) for sp in tl.spans
                 if sp.resource == Resource.COMPUTE)
    if inside < 0.5 * busy * last:
        return whole
    return ends[0], ends[last], step


def loss_period(tl: Timeline, plan: Plan, measured: int) -> float:
    """Ms per call between the moments the losses of the last ``measured + 1`` calls
    of an overlapping-calls timeline reached the host (when the runtime's
    ``train_step`` returns; the tail's last input-gradient download): the steady step
    time as the runtime's tokens/s measure it."""
    stages = stage_map(plan)
    known: dict[int, float] = {}
    for a in tl.schedule.actions:
        if a.kind is K.DOWNLOAD_GRAD and stages[a.stage].kind is StageKind.TAIL:
            known[a.call] = max(known.get(a.call, 0.0), tl.end[a.key])
    calls = sorted(known)[-(measured + 1):]
    return (known[calls[-1]] - known[calls[0]]) / measured


def steady_bubble(tl: Timeline, plan: Plan, measured: int) -> tuple[float, float]:
    """``(period ms, bubble)``: :func:`loss_period`, and the share of it a worker
    computes nothing (one middle call's compute over the workers, against the period)."""
    s = tl.schedule
    period = loss_period(tl, plan, measured)
    work = sum(tl.end[a.key] - tl.start[a.key] for a in s.actions
               if a.lane.value == "compute" and a.call == s.calls // 2)
    return period, 1 - work / s.workers / period


def report(tl: Timeline, tokens_per_call: int, sizes: MemorySizes | None = None,
           memory_limit: int | None = None) -> Report:
    """Measure ``tl`` (see the module docstring)."""
    s = tl.schedule
    t0, t1, step = _window(tl)
    width = max(t1 - t0, 1e-12)
    per_device: dict[int, list[Span]] = {w: [] for w in range(s.workers)}
    for sp in tl.spans:
        if sp.resource == Resource.COMPUTE and sp.action.kind in COMPUTE_PASSES:
            per_device[sp.worker].append(sp)
    idle = dict(fill=0.0, switch=0.0, drain=0.0, steady=0.0)
    exposed = 0.0
    chain = _Chain(tl)
    for spans in per_device.values():
        for kind, a, b, nxt in _gaps(spans, tl.makespan):
            idle[kind] += _overlap(a, b, t0, t1)
            if nxt is not None:
                exposed += _overlap(max(a, chain.data_ready(nxt)), b, t0, t1)
    norm = s.workers * width
    if s.calls > 1:
        # Steady state: the window holds idle time and parts of several calls; one
        # call's work at the window's utilisation is the step time.
        work = sum(sp.end - sp.start for spans in per_device.values() for sp in spans)
        step = work / s.calls / max(norm - sum(idle.values()), 1e-12) * width
    memory = tuple(peak_memory(s, sizes, tl.start, tl.end)) if sizes is not None else ()
    return Report(s.name, s.workers, s.microbatches, s.calls, step, tl.makespan, (t0, t1),
                  tokens_per_call / step * 1e3 if step > 0 else 0.0,
                  Bubble(**{k: v / norm for k, v in idle.items()}), exposed / norm,
                  memory, memory_limit)


def _passes(spans: list[Span]) -> list[Span]:
    """A device's compute spans in time order, each recompute merged into the backward
    right after it: a recompute that ran early and then waited for its output gradient
    counts as if it ran just before the backward (the idle time is the same; it belongs
    to whatever the device was waiting for before)."""
    spans = sorted(spans, key=lambda sp: sp.start)
    out: list[Span] = []
    for sp in spans:
        prev = out[-1] if out else None
        if (prev is not None and prev.action.kind is K.RECOMPUTE
                and sp.action.kind is K.BACKWARD and sp.action.stage == prev.action.stage
                and sp.action.mb == prev.action.mb and sp.action.call == prev.action.call):
            out[-1] = Span(sp.action, sp.resource, sp.start - (prev.end - prev.start), sp.end)
        else:
            out.append(sp)
    return out


def _gaps(spans: list[Span], makespan: float):
    """(category, start, end, next span's action) of every idle stretch of a device."""
    spans = _passes(spans)
    if not spans:
        yield "fill", 0.0, makespan, None
        return
    yield "fill", 0.0, spans[0].start, spans[0].action
    for prev, nxt in zip(spans, spans[1:]):
        if nxt.start > prev.end:
            same = (prev.action.kind in _FORWARD) == (nxt.action.kind in _FORWARD)
            yield ("steady" if same else "switch"), prev.end, nxt.start, nxt.action
    yield "drain", spans[-1].end, makespan, None


def _overlap(a: float, b: float, t0: float, t1: float) -> float:
    return max(0.0, min(b, t1) - max(a, t0))


class _Chain:
    """Walks back from an action through its latest-finishing predecessors."""

    def __init__(self, tl: Timeline):
        self.tl = tl
        self.by_key = tl.schedule.by_key()
        self.prev: dict[str, str] = {}
        last: dict[tuple, str] = {}
        for a in tl.schedule.actions:
            lane = (a.worker, a.lane)
            if lane in last:
                self.prev[a.key] = last[lane]
            last[lane] = a.key

    def data_ready(self, action) -> float:
        """When the compute feeding ``action``'s critical path ended (0: none)."""
        key = action.key
        while True:
            preds = list(self.by_key[key].deps + self.by_key[key].host_deps)
            if key in self.prev:
                preds.append(self.prev[key])
            # A window of overlapping calls: actions of calls outside it are ignored.
            preds = [p for p in preds if p in self.tl.end]
            if not preds:
                return 0.0
            key = max(preds, key=self.tl.end.__getitem__)
            if self.by_key[key].kind in COMPUTE_PASSES:
                return self.tl.end[key]


def table(reports: Sequence[Report], baseline: str = "1f1b") -> str:
    """The reports side by side; speedup is the baseline's step time over each one's."""
    base = next((r for r in reports if r.schedule == baseline), None)
    head = ["schedule", "step ms", "tokens/s", "bubble", "fill", "switch", "drain",
            "steady", "exp.comm", f"vs {baseline}", "peak mem"]
    rows = [head]
    for r in reports:
        b = r.bubble
        mem = format_bytes(r.peak_bytes) if r.memory and r.peak_bytes else "-"
        if r.fits is False:
            mem += " OOM"
        speed = f"{base.step_ms / r.step_ms:.2f}x" if base and r.step_ms > 0 else "-"
        name = r.schedule + (f" ({r.calls} calls)" if r.calls > 1 else "")
        rows.append([name, f"{r.step_ms:.1f}", f"{r.tokens_per_s:,.0f}",
                     *(f"{100 * v:.1f}%" for v in (b.total, b.fill, b.switch, b.drain,
                                                     b.steady, r.exposed_comm)),
                     speed, mem])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
