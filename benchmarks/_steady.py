"""The steady state of overlapping calls in a timeline, measured as the runtime's
tokens/s are (shared by the benchmarks of pipelined calls; no torch)."""

from __future__ import annotations

from rotapipe.plan import StageKind
from rotapipe.schedule import ActionKind as K
from rotapipe.schedule.actions import stage_map


def loss_period(tl, plan, measured: int) -> float:
    """Emulated ms per call between the moments the losses of the last ``measured + 1``
    calls reached the host (when ``train_step`` returns): the steady step time."""
    stages = stage_map(plan)
    known: dict[int, float] = {}
    for a in tl.schedule.actions:
        if a.kind is K.DOWNLOAD_GRAD and stages[a.stage].kind is StageKind.TAIL:
            known[a.call] = max(known.get(a.call, 0.0), tl.end[a.key])
    calls = sorted(known)[-(measured + 1):]
    return (known[calls[-1]] - known[calls[0]]) / measured


def steady_bubble(tl, plan, measured: int) -> tuple[float, float]:
    """``(period ms, bubble)``: :func:`loss_period`, and the share of it a worker
    computes nothing (one middle call's compute over the workers, against the period)."""
    s = tl.schedule
    period = loss_period(tl, plan, measured)
    work = sum(tl.end[a.key] - tl.start[a.key] for a in s.actions
               if a.lane.value == "compute" and a.call == s.calls // 2)
    return period, 1 - work / s.workers / period
