"""Checks that a schedule is complete, consistent and free of deadlock (a dry run)."""

from __future__ import annotations

from collections import defaultdict, deque

from ..errors import ScheduleError
from .actions import ActionKind as K, Schedule


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless every (stage, microbatch, pass) runs exactly
    once, every dependency names an action of the schedule, every backward depends
    (transitively) on the fused tail of its microbatch, and a dry run in lane order
    finishes."""
    actions = schedule.actions
    keys = [a.key for a in actions]
    seen = set()
    for k in keys:
        if k in seen:
            raise ScheduleError(f"action {k} appears twice")
        seen.add(k)
    by_key = schedule.by_key()
    for a in actions:
        for d in a.deps + a.host_deps:
            if d not in by_key:
                raise ScheduleError(f"action {a.key} depends on {d}, which is not in the "
                                    "schedule")
    plan, M = schedule.plan, schedule.microbatches
    if schedule.name.endswith("-eval"):
        _dry_run(schedule)
        return
    need = {(K.FORWARD, s.name) for s in plan.forward} | {(K.FUSED, plan.tail.name)}
    need |= {(k, s.name) for s in plan.backward for k in (K.RECOMPUTE, K.BACKWARD)}
    for kind, stage in need:
        for m in range(M):
            if f"{kind.value}:{stage}:m{m}" not in by_key:
                raise ScheduleError(f"{kind.name.lower()} of stage {stage} microbatch {m} "
                                    "is missing")
    order = _dry_run(schedule)
    before = _happens_before(schedule, order)

    def requires(later: str, earlier: str) -> bool:
        return bool(before[later] >> before["#"][earlier] & 1)

    for s in plan.backward:
        for m in range(M):
            if not requires(f"B:{s.name}:m{m}", f"FT:T:m{m}"):
                raise ScheduleError(f"backward of {s.name} microbatch {m} does not wait for "
                                    "the fused tail of that microbatch")
    for b in plan.backward:
        producer = [s for s in plan.forward if s.start < b.start <= s.stop]
        for s in producer:
            for m in range(M):
                if not requires(f"R:{b.name}:m{m}", f"F:{s.name}:m{m}"):
                    raise ScheduleError(f"recompute of {b.name} microbatch {m} does not wait "
                                        f"for the forward of {s.name} that checkpoints its input")


def _happens_before(schedule: Schedule, order: list[str]) -> dict:
    """For each action, a bitmask of the actions that must complete before it (through
    dependencies and lane order). ``result["#"]`` maps keys to bit positions."""
    pos = {k: i for i, k in enumerate(order)}
    by_key = schedule.by_key()
    prev_in_lane: dict[str, str] = {}
    last: dict[tuple[int, str], str] = {}
    for a in schedule.actions:
        lane = (a.worker, a.lane.value)
        if lane in last:
            prev_in_lane[a.key] = last[lane]
        last[lane] = a.key
    anc: dict = {}
    for k in order:
        a = by_key[k]
        mask = 0
        preds = a.deps + a.host_deps + ((prev_in_lane[k],) if k in prev_in_lane else ())
        for p in preds:
            mask |= anc[p] | (1 << pos[p])
        anc[k] = mask
    anc["#"] = pos
    return anc


def _dry_run(schedule: Schedule) -> list[str]:
    """Fire actions in lane order as their dependencies complete; return the order."""
    lanes: dict[tuple[int, str], deque] = defaultdict(deque)
    for a in schedule.actions:
        lanes[(a.worker, a.lane.value)].append(a)
    done: set[str] = set()
    order: list[str] = []
    progress = True
    while progress:
        progress = False
        for q in lanes.values():
            while q and all(d in done for d in q[0].deps + q[0].host_deps):
                a = q.popleft()
                done.add(a.key)
                order.append(a.key)
                progress = True
    stuck = [q[0] for q in lanes.values() if q]
    if stuck:
        lines = [f"  {a.to_line()}" for a in stuck]
        raise ScheduleError("the schedule deadlocks; these lane heads wait forever:\n"
                            + "\n".join(lines) + "\n" + schedule.grid())
    return order
