"""Pure tests of plans and schedules in their text form: generate, lower, validate."""

import itertools

import pytest

from rotapipe import Plan, PlanError, ScheduleError, even_plan, roundpipe_schedule, validate
from rotapipe.schedule import HOST, Action, ActionKind as K, Lane, Schedule


def test_even_plan_covers_layers_and_backward_is_finer():
    p = even_plan(10, 3, 9, tail_layers=2)
    assert [(s.start, s.stop) for s in p.forward] == [(0, 2), (2, 5), (5, 8)]
    assert (p.tail.start, p.tail.stop) == (8, 10)
    assert len(p.backward) == 8 and all(s.stop - s.start == 1 for s in p.backward)
    assert [s.name for s in p.jobs()] == ["F0", "F1", "F2", "T"] + [f"B{i}" for i in range(7, -1, -1)]
    assert Plan.from_text(p.to_text()) == p


@pytest.mark.parametrize("text, match", [
    ("F0[0:2] B0[0:2]", "no tail"),
    ("F0[0:2] T[3:4] B0[0:3]", "end at layer 2"),
    ("F0[0:2] T[2:4] B0[1:2]", "contiguous"),
    ("F0[0:2] T[2:4] Q0[0:2]", "unknown stage"),
    ("F0[0-2] T[2:4]", "cannot parse"),
])
def test_bad_plans_are_rejected_with_the_reason(text, match):
    with pytest.raises(PlanError, match=match):
        Plan.from_text(text)


def test_even_plan_rejects_zero_layers_and_oversized_tail():
    with pytest.raises(PlanError, match="zero layers"):
        even_plan(0, 1, 1)
    with pytest.raises(PlanError, match="tail_layers=5"):
        even_plan(3, 1, 1, tail_layers=5)


SWEEP = list(itertools.product([1, 2, 3, 4, 8], [1, 2, 5], [1, 3, 7], [1, 3, 8]))


@pytest.mark.parametrize("workers, nf, nb, mbs", SWEEP)
def test_sweep_generate_validate_roundtrip(workers, nf, nb, mbs):
    plan = even_plan(9, nf, nb, tail_layers=2)
    for side, buffers in ((False, ()), (True, (0, 4, 8))):
        s = roundpipe_schedule(plan, workers, mbs, side_inputs=side, buffer_layers=buffers)
        validate(s)
        assert Schedule.from_text(s.to_text()) == s
        _check_roundpipe_invariants(s, side)
    ev = roundpipe_schedule(plan, workers, mbs, training=False)
    validate(ev)
    assert Schedule.from_text(ev.to_text()) == ev


def _check_roundpipe_invariants(s: Schedule, side: bool):
    plan, W, M = s.plan, s.workers, s.microbatches
    jobs = plan.jobs()
    worker_of = {j.name: i % W for i, j in enumerate(jobs)}
    for a in s.actions:
        if a.worker != HOST:
            assert a.worker == worker_of[a.stage], f"{a.key} is not round-robin"
    for w in range(W):
        acts = s.worker_actions(w)
        # a worker runs its jobs one after another on its compute lane
        stages = [a.stage for a in acts if a.lane is Lane.COMPUTE]
        order = [j.name for j in jobs if worker_of[j.name] == w]
        assert [k for k, _ in itertools.groupby(stages)] == order
        # at most two stages' weights on a worker: each upload waits for the free two back
        uploads = [a for a in acts if a.kind is K.UPLOAD_WEIGHTS]
        for i, u in enumerate(uploads):
            assert u.host_deps == ((f"X:{uploads[i - 2].stage}",) if i >= 2 else ())
        if side and acts:
            assert sorted(a.mb for a in acts if a.kind is K.UPLOAD_SIDE) == list(range(M))
    # the optimizer gets gradients deepest stage first, on the host lane
    host = [a.stage for a in s.worker_actions(HOST)]
    assert host == ["T"] + [b.name for b in reversed(plan.backward)]


def _tiny():
    return roundpipe_schedule(even_plan(4, 2, 3), 2, 2)


def test_text_form_is_readable_and_round_trips():
    s = _tiny()
    text = s.to_text()
    assert "w0 F:F0:m0 <- UW:F0 UA:F0:m0@0" in text
    assert "host O:T <~ DW:T" in text
    assert Schedule.from_text(text) == s
    a = Action.from_line("w1 UA:B1:m0@2 <- DA:F0:m0@2 <~ B:B1:m0")
    assert (a.kind, a.worker, a.stage, a.mb, a.at) == (K.UPLOAD_ACT, 1, "B1", 0, 2)
    assert a.deps == ("DA:F0:m0@2",) and a.host_deps == ("B:B1:m0",)


def test_grid_marks_the_failing_action():
    s = _tiny()
    grid = s.grid(mark="R:B1:m1", context=2)
    assert ">>R:B1:m1<<" in grid
    assert grid.splitlines()[0].split() == ["row", "w0", "w1", "host"]
    assert "rows above" in grid and "rows below" in grid


def test_validator_rejects_unknown_dependency_duplicates_and_missing_work():
    s = _tiny()
    acts = list(s.actions)
    bad = Schedule(s.plan, 2, 2, tuple(Action(K.FORWARD, 0, "F0", 0, deps=("UW:F9",))
                                       if a.key == "F:F0:m0" else a for a in acts))
    with pytest.raises(ScheduleError, match="UW:F9, which is not in the schedule"):
        validate(bad)
    with pytest.raises(ScheduleError, match="appears twice"):
        validate(Schedule(s.plan, 2, 2, tuple(acts + [acts[0]])))
    missing = tuple(a for a in acts if a.key != "R:B0:m1")
    missing = tuple(Action(a.kind, a.worker, a.stage, a.mb, a.at,
                           tuple(d for d in a.deps if d != "R:B0:m1"), a.host_deps)
                    for a in missing)
    with pytest.raises(ScheduleError, match="recompute of stage B0 microbatch 1 is missing"):
        validate(Schedule(s.plan, 2, 2, missing))


def test_validator_finds_deadlock_from_lane_order():
    s = _tiny()
    # make the forward of F0 m0 wait for its own stage's weight free (later in its lane)
    acts = [Action(a.kind, a.worker, a.stage, a.mb, a.at, a.deps + ("X:F0",), a.host_deps)
            if a.key == "F:F0:m0" else a for a in s.actions]
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(Schedule(s.plan, 2, 2, tuple(acts)))


def test_validator_rejects_backward_before_its_fused_tail():
    s = _tiny()
    acts = [Action(a.kind, a.worker, a.stage, a.mb, a.at,
                   tuple(d for d in a.deps if not d.startswith("UG:")), a.host_deps)
            for a in s.actions if not a.key.startswith("UG:")]
    with pytest.raises(ScheduleError, match="does not wait for the fused tail"):
        validate(Schedule(s.plan, 2, 2, tuple(acts)))


def test_validator_rejects_a_call_reading_another_calls_microbatch_data():
    """Overlapping calls: the second call's tail may wait for the first call's
    downloads (a legal order) but must not take them as its own data."""
    from rotapipe.schedule import roundpipe_stale_schedule
    s = roundpipe_stale_schedule(_tiny().plan, 2, 2, calls=2, tail_barrier=True)
    validate(s, dataflow=True)
    theirs = next(a.key for a in s.actions if a.kind is K.DOWNLOAD_ACT and a.call == 0)
    acts = tuple(Action(a.kind, a.worker, a.stage, a.mb, a.at, a.deps + (theirs,),
                        a.host_deps, a.call)
                 if a.kind is K.FUSED and a.call == 1 and a.mb == 0 else a for a in s.actions)
    with pytest.raises(ScheduleError, match=r"microbatch data of call 0: a call reads only"):
        validate(Schedule(s.plan, 2, 2, acts, s.name), dataflow=True)


@pytest.mark.parametrize("workers,microbatches", [(2, 4), (3, 4), (4, 8)])
def test_the_tail_barrier_waits_on_the_host_for_every_tail_input(workers, microbatches):
    """The barrier's body (``tail_context``) reads every microbatch's tail input from
    host memory with CPU code: stream waits on the downloads do not order that on CUDA
    (the body runs on the dispatcher thread once the action is issued, while the copies
    may still run; 30 of 30 barrier downloads were still in flight in a probe). The
    first fused-tail action therefore has every such download as a host dependency."""
    from rotapipe.schedule import roundpipe_stale_schedule
    plan = even_plan(8, 3, 4)
    for s in (roundpipe_schedule(plan, workers, microbatches, tail_barrier=True),
              roundpipe_stale_schedule(plan, workers, microbatches, calls=2,
                                       tail_barrier=True)):
        validate(s, dataflow=True)
        for call in {a.call for a in s.actions}:
            first = next(a for a in s.actions
                         if a.kind is K.FUSED and a.mb == 0 and a.call == call)
            downloads = {a.key for a in s.actions if a.kind is K.DOWNLOAD_ACT
                         and a.at == plan.tail.start and a.call == call}
            assert len(downloads) == microbatches
            assert downloads <= set(first.host_deps), (call, first.host_deps)
