"""Checks that a schedule is complete, consistent, within memory and free of deadlock."""

from __future__ import annotations

from collections import defaultdict, deque

from ..errors import ScheduleError
from ..plan import Stage
from .actions import (COMPUTE_PASSES, CRITICAL, HOST, Action, ActionKind as K, Lane,
                      Schedule, action_key)
from .memory import MemorySizes, check_limit, peak_memory

_FORWARD_KINDS = (K.FORWARD, K.FORWARD_KEEP, K.FUSED, K.RECOMPUTE)


def validate(schedule: Schedule, *, dataflow: bool = False,
             sizes: MemorySizes | None = None, memory_limit: int | None = None) -> None:
    """Raise :class:`ScheduleError` unless the schedule is sound:

    - no action appears twice, every dependency names an action of the schedule, every
      action runs on a worker of the schedule (``0..workers - 1``; the optimizer
      hand-offs ``O``/``OR`` on the host lane, nothing else there), every compute
      action names a stage of the plan and a microbatch in range;
    - every optimizer hand-off ``O`` waits (directly, or through its stage's ``OR``) for
      its stage's weight-gradient download ``DW``: it hands what ``DW`` brought to the
      host, so one running first would hand over nothing;
    - an evaluation schedule (name ending in ``-eval``) has only forward work: uploads,
      ``F`` of the evaluation stages (``Plan.eval_jobs``) for every microbatch, and the
      last layer's output downloaded for every microbatch;
    - every (stage, microbatch, pass) of every call runs exactly once: a forward stage's
      forward (``F`` or ``FK``), the tail (``FT``, or ``FK`` then ``BK``), a backward
      stage's backward (``R`` then ``B``, or ``BK``);
    - a dry run in lane order finishes (no deadlock), and in it every backward follows
      its microbatch's tail, a recompute follows the forward checkpointing its input,
      and a ``BK`` the ``FK`` whose graph it uses;
    - with ``dataflow=True``, inputs are produced before use: a stage's forward follows
      the forward producing its input, a backward the backward producing its output
      gradient, an upload depends on the download that brought its data to the host, a
      download on the compute that made it, a compute on the uploads of its stage and
      microbatch, and on its stage's ``UT`` if it has one. (Off by default: the runtime
      accepts edited schedules with a missing transfer wait so that the emulated
      backend's race checker can catch it at run time; generators' output passes with
      it on.) A ``UT`` always depends on its stage's ``UW`` on its worker.
    - with ``memory_limit`` (bytes) and ``sizes``: no worker's device memory exceeds the
      limit in the unit-time dry run (every action takes one step; see ``memory.py``).
    """
    _check_workers(schedule)
    by_key = _unique(schedule)
    _check_trained(schedule, by_key)
    _check_rows(schedule, by_key)
    _check_hand_offs(schedule, by_key)
    eval_call = schedule.name.endswith("-eval")
    if eval_call:
        _check_eval(schedule, by_key)
    else:
        _check_passes(schedule, by_key)
    rounds = _dry_run(schedule)
    if memory_limit is not None:
        if sizes is None:
            raise ScheduleError("a memory limit needs the per-layer sizes (sizes=...)")
        peaks = peak_memory(schedule, sizes, rounds, {k: r + 1 for k, r in rounds.items()})
        check_limit(peaks, memory_limit, "in the unit-time dry run at step")
    if not eval_call:
        order = sorted(rounds, key=rounds.__getitem__)
        _check_order(schedule, by_key, _happens_before(schedule, order), dataflow)
    if dataflow:
        _check_data(schedule, by_key)


def _check_workers(schedule: Schedule) -> None:
    """Each action on a worker of the schedule; the host lane holds the hand-offs only."""
    W = schedule.workers
    if isinstance(W, bool) or not isinstance(W, int) or W < 1:
        raise ScheduleError(f"the schedule has workers={W!r}: it must be an int >= 1")
    for a in schedule.actions:
        if a.lane is Lane.HOST:
            if a.worker != HOST:
                raise ScheduleError(f"action {a.key} is host work (the optimizer hand-off) "
                                    f"but is placed on worker {a.worker}: put it on the "
                                    "host lane (HOST, 'host' in the text form)")
        elif a.worker == HOST:
            raise ScheduleError(f"action {a.key} runs on a device ({a.lane.value} lane) but "
                                "is placed on the host lane: give it a worker "
                                f"0..{W - 1}")
        elif isinstance(a.worker, bool) or not isinstance(a.worker, int) or \
                not 0 <= a.worker < W:
            raise ScheduleError(f"action {a.key} is placed on worker {a.worker!r}, but the "
                                f"schedule has {W} worker(s), 0..{W - 1}")


def _check_hand_offs(schedule: Schedule, by_key: dict[str, Action]) -> None:
    """Each ``O`` waits for the ``DW`` of its stage and call (through its ``OR``)."""
    for a in schedule.actions:
        if a.kind is not K.OPTIMIZER:
            continue
        dw = action_key(K.DOWNLOAD_WGRAD, a.stage, call=a.call)
        rows = action_key(K.OPTIMIZER_ROWS, a.stage, call=a.call)
        waits = set(a.deps + a.host_deps)
        if rows in waits:
            waits |= set(by_key[rows].deps + by_key[rows].host_deps)
        if dw not in waits:
            got = f" ({dw} is not in the schedule)" if dw not in by_key else ""
            raise ScheduleError(f"{a.key} hands {a.stage}'s weight gradients to the "
                                f"optimizer but does not wait for {dw}, which brings them "
                                f"to the host{got}: run first, the hand-off would find no "
                                f"gradients and drop them. Give it the host dependency "
                                f"<~ {dw}")


_EVAL_KINDS = frozenset({K.UPLOAD_WEIGHTS, K.UPLOAD_SIDE, K.UPLOAD_ACT, K.FORWARD,
                         K.DOWNLOAD_ACT, K.FREE})


def _check_eval(schedule: Schedule, by_key: dict[str, Action]) -> None:
    """An evaluation call's schedule: forward work only, complete, output downloaded."""
    plan, M = schedule.plan, schedule.microbatches
    for a in schedule.actions:
        if a.kind not in _EVAL_KINDS:
            raise ScheduleError(
                f"schedule {schedule.name} is an evaluation call's (its name ends in "
                f"-eval) but has {a.key}: an evaluation runs forward stages only "
                f"({', '.join(sorted(k.value for k in _EVAL_KINDS))}); name a training "
                "schedule without -eval")
    names = {s.name for s in plan.eval_jobs()}
    for a in schedule.actions:
        if a.kind is K.FORWARD and a.stage not in names:
            raise ScheduleError(f"action {a.key} names stage {a.stage}, which is not a stage "
                                f"of an evaluation call of plan {plan.to_text()} "
                                f"({', '.join(sorted(names))})")
        if a.kind is K.FORWARD and (a.mb is None or not 0 <= a.mb < M):
            raise ScheduleError(f"action {a.key} names microbatch {a.mb}; the schedule has "
                                f"microbatches 0..{M - 1}")
    out = {a.mb for a in schedule.actions
           if a.kind is K.DOWNLOAD_ACT and a.at == plan.num_layers}
    for m in range(M):
        for s in plan.eval_jobs():
            if action_key(K.FORWARD, s.name, m) not in by_key:
                raise ScheduleError(f"forward of stage {s.name} microbatch {m} is missing "
                                    f"from evaluation schedule {schedule.name}")
        if m not in out:
            raise ScheduleError(f"evaluation schedule {schedule.name} never downloads "
                                f"microbatch {m}'s output (DA at layer {plan.num_layers}): "
                                "the call returns it")


def _unique(schedule: Schedule) -> dict[str, Action]:
    by_key: dict[str, Action] = {}
    for a in schedule.actions:
        if a.key in by_key:
            raise ScheduleError(f"action {a.key} appears twice")
        by_key[a.key] = a
    for a in schedule.actions:
        for d in a.deps + a.host_deps:
            if d not in by_key:
                raise ScheduleError(f"action {a.key} depends on {d}, which is not in the "
                                    "schedule")
        for d in a.deps:
            if by_key[d].worker == HOST:
                raise ScheduleError(f"action {a.key} waits for host action {d} with a "
                                    f"stream dependency (<- {d}); work done on the host "
                                    f"has no stream event to wait on: make it a host "
                                    f"dependency (<~ {d})")
    return by_key


def _of_call(schedule: Schedule, c: int) -> str:
    return f" of call {c}" if schedule.calls > 1 else ""


def _check_passes(schedule: Schedule, by_key: dict[str, Action]) -> None:
    plan, M = schedule.plan, schedule.microbatches
    names = {s.name for s in plan.jobs()}
    for a in schedule.actions:
        if a.lane is Lane.COMPUTE and a.kind is not K.FREE:
            if a.stage not in names:
                raise ScheduleError(f"action {a.key} names stage {a.stage}, which is not "
                                    f"in the plan {plan.to_text()}")
            if a.mb is None or not 0 <= a.mb < M:
                raise ScheduleError(f"action {a.key} names microbatch {a.mb}; the schedule "
                                    f"has microbatches 0..{M - 1}")
    for c in range(schedule.calls):
        for m in range(M):
            def has(kind, stage):
                return action_key(kind, stage.name, m, call=c) in by_key

            def fail(what, stage):
                raise ScheduleError(f"{what} of stage {stage.name} microbatch {m}"
                                    f"{_of_call(schedule, c)} is missing")

            for s in plan.forward:
                if has(K.FORWARD, s) and has(K.FORWARD_KEEP, s):
                    raise ScheduleError(f"stage {s.name} microbatch {m} runs its forward "
                                        "twice (F and FK)")
                if not (has(K.FORWARD, s) or has(K.FORWARD_KEEP, s)):
                    fail("forward", s)
            t = plan.tail_for(m, M)
            if has(K.FUSED, t) and (has(K.FORWARD_KEEP, t) or has(K.BACKWARD_KEPT, t)):
                raise ScheduleError(f"the tail microbatch {m} runs both fused (FT) and "
                                    "split (FK/BK)")
            if not has(K.FUSED, t):
                if not has(K.FORWARD_KEEP, t):
                    fail("fused", t)
                if not has(K.BACKWARD_KEPT, t):
                    fail("backward", t)
            for s in plan.backward:
                if has(K.BACKWARD_KEPT, s):
                    if has(K.RECOMPUTE, s) or has(K.BACKWARD, s):
                        raise ScheduleError(f"stage {s.name} microbatch {m} runs its "
                                            "backward twice (BK and R/B)")
                    continue
                if not has(K.RECOMPUTE, s):
                    fail("recompute", s)
                if not has(K.BACKWARD, s):
                    fail("backward", s)


_MICROBATCH_DATA = (COMPUTE_PASSES | CRITICAL) - {K.DOWNLOAD_BUFFERS}
"""Actions that make or move one microbatch's activations or gradients."""


def _check_data(schedule: Schedule, by_key: dict[str, Action]) -> None:
    """Each transfer and compute depends directly on the action producing its data."""
    consumers = {K.UPLOAD_ACT: _FORWARD_KINDS, K.UPLOAD_GRAD: (K.BACKWARD, K.BACKWARD_KEPT)}
    sources = {K.UPLOAD_ACT: K.DOWNLOAD_ACT, K.UPLOAD_GRAD: K.DOWNLOAD_GRAD}
    computes = (K.FORWARD, K.FORWARD_KEEP, K.FUSED, K.BACKWARD, K.BACKWARD_KEPT)
    for a in schedule.actions:
        if a.mb is None:
            continue
        for d in a.deps:     # a microbatch's data belongs to its call
            if by_key[d].call != a.call and by_key[d].kind in _MICROBATCH_DATA:
                raise ScheduleError(f"{a.key} (call {a.call}) depends on {d}, microbatch "
                                    f"data of call {by_key[d].call}: a call reads only "
                                    "its own activations and gradients")
        if a.kind in sources and (a.at or a.kind is K.UPLOAD_GRAD):
            want = sources[a.kind]
            if not any(by_key[d].kind is want and (by_key[d].mb, by_key[d].at, by_key[d].call)
                       == (a.mb, a.at, a.call) for d in a.deps):
                raise ScheduleError(f"upload {a.key} does not depend on a {want.name} of "
                                    f"microbatch {a.mb} at layer {a.at}: its data would not "
                                    "be in host memory yet")
        if a.kind in (K.DOWNLOAD_ACT, K.DOWNLOAD_GRAD):
            if not any(by_key[d].kind in computes and by_key[d].stage == a.stage
                       and by_key[d].mb == a.mb for d in a.deps):
                raise ScheduleError(f"download {a.key} does not depend on the compute of "
                                    f"stage {a.stage} microbatch {a.mb} that produces it")
        if a.kind in computes + (K.RECOMPUTE,):
            ut = action_key(K.UPLOAD_TRAINED, a.stage, call=a.call)
            if ut in by_key and by_key[ut].worker == a.worker and not _reaches(
                    by_key, a, ut):
                raise ScheduleError(f"{a.key} does not wait for {ut}, the upload of its "
                                    "stage's trained weights")
        if a.kind in consumers:
            for kind in consumers[a.kind]:
                user = by_key.get(action_key(kind, a.stage, a.mb, call=a.call))
                if user is not None and a.key not in user.deps:
                    raise ScheduleError(f"{user.key} does not depend on {a.key}, the upload "
                                        "of its input")


def _check_trained(schedule: Schedule, by_key: dict[str, Action]) -> None:
    """Each ``UT`` follows a ``UW`` of its stage on its worker in its call."""
    for a in schedule.actions:
        if a.kind is K.UPLOAD_TRAINED:
            uw = action_key(K.UPLOAD_WEIGHTS, a.stage, call=a.call)
            if uw not in a.deps or by_key[uw].worker != a.worker:
                raise ScheduleError(f"{a.key} (the trained part of a split weight upload) "
                                    f"does not depend on {uw} on worker {a.worker}: a "
                                    "stage's UT completes the weights its UW uploaded")


def _check_rows(schedule: Schedule, by_key: dict[str, Action]) -> None:
    """Each ``OR`` (the next call's rows stepped first) is followed by the ``O`` of its
    stage and call, which waits for it: the ``O`` steps the rest of the tables."""
    for a in schedule.actions:
        if a.kind is K.OPTIMIZER_ROWS:
            o = action_key(K.OPTIMIZER, a.stage, call=a.call)
            if o not in by_key or a.key not in by_key[o].host_deps:
                raise ScheduleError(f"{a.key} (the next call's embedding rows stepped "
                                    f"first) has no {o} waiting for it: the whole "
                                    "tables are stepped by the stage's O after its OR")


def _reaches(by_key: dict[str, Action], a: Action, key: str) -> bool:
    """Whether ``a`` depends on ``key`` directly or through an action of its own stage
    and call (a backward through its recompute)."""
    return key in a.deps or any(
        key in by_key[d].deps for d in a.deps
        if d in by_key and (by_key[d].stage, by_key[d].call) == (a.stage, a.call))


def _check_order(schedule: Schedule, by_key: dict[str, Action], before: dict,
                 dataflow: bool) -> None:
    plan, M = schedule.plan, schedule.microbatches
    pos = before["#"]

    def first(stage: Stage, m: int, c: int, kinds) -> str:
        for kind in kinds:
            k = action_key(kind, stage.name, m, call=c)
            if k in by_key:
                return k
        raise AssertionError(f"pass check missed {stage.name} m{m}")

    def need(later: str, earlier: str, message: str) -> None:
        if not before[later] >> pos[earlier] & 1:
            raise ScheduleError(message)

    for c in range(schedule.calls):
        of = _of_call(schedule, c)
        for m in range(M):
            tail = plan.tail_for(m, M)
            fwd = {s.name: first(s, m, c, (K.FORWARD, K.FORWARD_KEEP, K.FUSED))
                   for s in plan.forward + (tail,)}
            bwd = {s.name: first(s, m, c, (K.BACKWARD, K.BACKWARD_KEPT, K.FUSED))
                   for s in plan.backward + (tail,)}
            fused = bwd[tail.name].startswith("FT:")
            what = "the fused tail" if fused else "the tail's backward"
            for s in plan.backward:
                need(bwd[s.name], bwd[tail.name], f"backward of {s.name} microbatch {m}{of} "
                     f"does not wait for {what} of that microbatch")
            for prev, s in zip(plan.forward, plan.forward[1:] + (tail,)) if dataflow else ():
                need(fwd[s.name], fwd[prev.name], f"forward of {s.name} microbatch {m}{of} "
                     f"does not wait for the forward of {prev.name} that produces its input")
            deeper = plan.backward[1:] + (tail,)
            for s, d in zip(plan.backward, deeper) if dataflow else ():
                need(bwd[s.name], bwd[d.name], f"backward of {s.name} microbatch {m}{of} does "
                     f"not wait for the backward of {d.name} that produces its output gradient")
            for b in plan.backward:
                r = action_key(K.RECOMPUTE, b.name, m, call=c)
                if r in by_key:
                    for s in plan.forward:
                        if s.start < b.start <= s.stop:
                            need(r, fwd[s.name], f"recompute of {b.name} microbatch {m}{of} "
                                 f"does not wait for the forward of {s.name} that "
                                 "checkpoints its input")
                else:
                    _check_kept(b, plan.forward, fwd, bwd, need, m, of)
            if not fused:
                need(bwd[tail.name], fwd[tail.name], f"backward of the tail microbatch {m}{of} "
                     "does not wait for its forward")


def _check_kept(b, forward, fwd, bwd, need, m, of) -> None:
    twin = [s for s in forward if (s.start, s.stop) == (b.start, b.stop)]
    if not twin:
        raise ScheduleError(f"{bwd[b.name]} needs a forward stage with layers "
                            f"[{b.start}:{b.stop}] that keeps its graph (FK); the plan has none")
    s = twin[0]
    if not fwd[s.name].startswith("FK:"):
        raise ScheduleError(f"{bwd[b.name]} uses the graph of {s.name}, but {fwd[s.name]} "
                            "keeps none: run it as FK (or recompute B with R)")
    need(bwd[b.name], fwd[s.name], f"backward of {b.name} microbatch {m}{of} does not wait "
         f"for the forward {fwd[s.name]} whose graph it uses")


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


def _dry_run(schedule: Schedule) -> dict[str, int]:
    """Run the lanes in unit time steps: in each step every lane whose head's
    dependencies finished in an earlier step runs that head. Return each action's step;
    raise if some lane head can never run (a deadlock)."""
    lanes: dict[tuple[int, str], deque] = defaultdict(deque)
    for a in schedule.actions:
        lanes[(a.worker, a.lane.value)].append(a)
    step_of: dict[str, int] = {}
    queues = [q for q in lanes.values() if q]
    step = 0
    while queues:
        fired = []
        for q in queues:
            head = q[0]
            if all(d in step_of for d in head.deps) and all(d in step_of for d in head.host_deps):
                fired.append(q.popleft())
        if not fired:
            lines = [f"  {q[0].to_line()}" for q in queues]
            raise ScheduleError("the schedule deadlocks; these lane heads wait forever:\n"
                                + "\n".join(lines) + "\n" + schedule.grid())
        for a in fired:
            step_of[a.key] = step
        queues = [q for q in queues if q]
        step += 1
    return step_of


# Re-exported: check_runnable lived here (docs/api.md imports it from this module).
from .runnable import check_runnable  # noqa: E402,F401
