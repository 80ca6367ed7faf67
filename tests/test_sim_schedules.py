"""The baseline and stale-optimizer generators in the schedule format, and the validator's
new checks: passes exactly once, inputs before use, memory limit. Pure: no runtime."""

import itertools
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from rotapipe import Plan, ScheduleError, even_plan, roundpipe_schedule, validate
from rotapipe.plan import LayerCost, ModelCosts, bound_plan
from rotapipe.plan.balance import roundpipe_plans
from rotapipe.schedule import (HOST, Action, ActionKind as K, Lane, MemorySizes, Schedule,
                               action_key, gpipe_schedule, interleaved_1f1b_schedule,
                               looped_bfs_schedule, one_f_one_b_schedule, roundpipe_call,
                               roundpipe_stale_schedule)
from rotapipe.sim import SCHEDULES, ActionTimes, SimConfig, build_schedule, run, simulate

BOUND = {"gpipe": (gpipe_schedule, 1), "1f1b": (one_f_one_b_schedule, 1),
         "interleaved-1f1b": (interleaved_1f1b_schedule, 2), "looped-bfs": (looped_bfs_schedule, 2)}


def _bound(name, devices, mbs, recompute=False, v=None, layers=None):
    make, per = BOUND[name]
    v = v or per
    plan = bound_plan([1.0] * (layers or devices * v), devices * v, devices=devices)
    return make(plan, devices, mbs, recompute=recompute)


@pytest.mark.parametrize("name", list(BOUND))
@pytest.mark.parametrize("devices, mbs", list(itertools.product([1, 2, 3, 4], [1, 2, 5, 8])))
def test_bound_sweep_validates_round_trips_and_binds_stages(name, devices, mbs):
    for recompute in (False, True):
        s = _bound(name, devices, mbs, recompute, layers=devices * BOUND[name][1] + 3)
        validate(s, dataflow=True)
        assert Schedule.from_text(s.to_text()) == s
        chunks = s.plan.forward + (s.plan.tail,)
        device_of = {c.name: i % devices for i, c in enumerate(chunks)}
        device_of.update({b.name: i % devices for i, b in enumerate(s.plan.backward)})
        for a in s.actions:
            assert a.worker == device_of[a.stage], f"{a.key} is not on its chunk's device"
            assert a.kind not in (K.UPLOAD_WEIGHTS, K.FREE), "weights stay resident"
        kinds = {a.kind for a in s.actions}
        assert (K.RECOMPUTE in kinds) == (recompute and len(chunks) > 1)
        assert K.FUSED not in kinds and {K.FORWARD_KEEP, K.BACKWARD_KEPT} <= kinds


@pytest.mark.parametrize("name", list(BOUND))
@pytest.mark.parametrize("devices, mbs", [(1, 3), (2, 1), (2, 4), (3, 5), (4, 2)])
def test_bound_with_offload_optimizer_moves_host_state(name, devices, mbs):
    """``offload_optimizer=True``: per chunk one UW (under its backward stage's name) at
    the start, DW + O after its last backward, X at the end; every loss downloaded.
    Weight transfers that cost nothing leave the simulated step unchanged."""
    make, per = BOUND[name]
    layers = devices * per + 2
    plan = bound_plan([1.0] * layers, devices * per, devices=devices)
    model = ModelCosts(tuple(LayerCost(f"l{i}", 1.0, 2.0, 1.0, hop_ms=0.1)
                             for i in range(layers)), 1)
    for recompute, side in ((False, False), (True, True)):
        s = make(plan, devices, mbs, recompute=recompute, offload_optimizer=True,
                 side_inputs=side, buffer_layers=() if recompute else [layers - 1])
        validate(s, dataflow=True)
        assert Schedule.from_text(s.to_text()) == s
        chunks = plan.backward + (plan.tail,)
        for c, stage in enumerate(chunks):
            mine = [a for a in s.actions if a.stage == stage.name]
            kinds = [a.kind for a in mine if a.kind in (K.UPLOAD_WEIGHTS, K.DOWNLOAD_WGRAD,
                                                        K.OPTIMIZER, K.FREE)]
            assert sorted(k.value for k in kinds) == ["DW", "O", "UW", "X"]
            assert s.worker_actions(c % devices)[0].kind is K.UPLOAD_WEIGHTS
            lane = [a.key for a in s.worker_actions(c % devices) if a.lane is Lane.COMPUTE]
            last_bwd = max(i for i, k in enumerate(lane) if k.startswith(("BK:", "B:"))
                           and k.split(":")[1] == stage.name)
            dw = next(a for a in mine if a.kind is K.DOWNLOAD_WGRAD)
            # ... and after the input gradient that became ready with it (priority).
            dg = [a.key for a in mine if a.kind is K.DOWNLOAD_GRAD
                  and a.mb == int(lane[last_bwd].split(":m")[1])]
            assert dw.deps == (lane[last_bwd],) + tuple(dg)
        assert {a.key for a in s.actions if a.kind is K.DOWNLOAD_GRAD
                and a.stage == "T"} == {f"DG:T:m{m}@{plan.tail.start}" for m in range(mbs)}
        assert (K.UPLOAD_SIDE in {a.kind for a in s.actions}) == side
        plain = make(plan, devices, mbs, recompute=recompute)
        if devices > 1:   # on one device the tail's input now goes through the host
            assert simulate(s, model).report.step_ms == \
                pytest.approx(simulate(plain, model).report.step_ms)


def test_one_f_one_b_orders_warmup_then_alternates():
    s = _bound("1f1b", 4, 6)
    order = [a.key for a in s.worker_actions(1) if a.lane is Lane.COMPUTE]
    assert order[:4] == ["FK:F1:m0", "FK:F1:m1", "FK:F1:m2", "BK:B1:m0"]
    last = [a.key for a in s.worker_actions(3) if a.lane is Lane.COMPUTE]
    assert last[:4] == ["FK:T:m0", "BK:T:m0", "FK:T:m1", "BK:T:m1"]


def test_one_device_hands_over_without_transfers():
    """Both ends on the same device: no download/upload pair, a direct dependency."""
    for name in BOUND:
        s = _bound(name, 1, 3, layers=4)
        transfers = [a.key for a in s.actions if a.kind in (K.DOWNLOAD_ACT, K.DOWNLOAD_GRAD,
                                                            K.UPLOAD_GRAD)]
        assert transfers == []
        assert all(a.at == 0 for a in s.actions if a.kind is K.UPLOAD_ACT)


def test_bound_generators_reject_plans_that_do_not_fit():
    with pytest.raises(ScheduleError, match="not bound"):
        one_f_one_b_schedule(even_plan(6, 2, 3), 3, 4)
    with pytest.raises(ScheduleError, match="2 devices x 1 chunk"):
        one_f_one_b_schedule(bound_plan([1.0] * 6, 3), 2, 4)
    with pytest.raises(ScheduleError, match="not a multiple"):
        interleaved_1f1b_schedule(bound_plan([1.0] * 6, 5), 2, 4)


@pytest.mark.parametrize("workers, mbs, calls, staleness", [
    (1, 1, 2, 1), (2, 3, 3, 1), (3, 2, 4, 1), (4, 8, 3, 0), (8, 16, 2, 1)])
def test_stale_schedule_overlaps_calls_and_validates(workers, mbs, calls, staleness):
    plan = even_plan(9, 2, 5, tail_layers=2)
    s = roundpipe_stale_schedule(plan, workers, mbs, calls=calls, staleness=staleness)
    validate(s, dataflow=True)
    # Each call's tail barrier waits for that call's microbatches (a whole-batch loss).
    validate(roundpipe_stale_schedule(plan, workers, mbs, calls=calls, staleness=staleness,
                                      tail_barrier=True), dataflow=True)
    assert s.calls == calls and Schedule.from_text(s.to_text()) == s
    jobs = plan.jobs()
    for a in s.actions:
        if a.lane is Lane.COMPUTE:   # the round-robin continues across calls
            g = a.call * len(jobs) + [j.name for j in jobs].index(a.stage)
            assert a.worker == g % workers, a.key
    # a stage's upload in call c reads the optimizer's update of call c - 1 - staleness
    by_key = s.by_key()
    uw = by_key[f"UW:F0/c{calls - 1}"]
    older = calls - 2 - staleness
    assert any(d.startswith("O:B0") and (older > 0 and d.endswith(f"/c{older}")
                                          or older == 0 and "/c" not in d)
               for d in uw.host_deps) == (older >= 0)


def test_call_suffix_round_trips_in_keys_and_lines():
    a = Action(K.FORWARD, 2, "F1", 3, None, ("UA:F1:m3@4/c2",), (), call=2)
    assert a.key == "F:F1:m3/c2"
    assert Action.from_line(a.to_line()) == a and Action.from_line(a.to_line()).call == 2
    assert Action(K.FORWARD, 0, "F1", 3).key == "F:F1:m3"


def _edit(s: Schedule, key: str, **changes) -> Schedule:
    import dataclasses
    return dataclasses.replace(s, actions=tuple(
        dataclasses.replace(a, **changes) if a.key == key else a for a in s.actions))


def test_validator_rejects_a_pass_run_twice_or_missing():
    s = _bound("1f1b", 2, 2)
    twice = Schedule(s.plan, 2, 2, s.actions + (Action(K.FORWARD, 0, "F0", 1),), s.name)
    with pytest.raises(ScheduleError, match="runs its forward twice"):
        validate(twice)
    gone = tuple(a for a in s.actions if a.key != "BK:T:m1")
    gone = tuple(Action(a.kind, a.worker, a.stage, a.mb, a.at,
                        tuple(d for d in a.deps if d != "BK:T:m1"), a.host_deps) for a in gone)
    with pytest.raises(ScheduleError, match="backward of stage T microbatch 1 is missing"):
        validate(Schedule(s.plan, 2, 2, gone, s.name))
    stray = Schedule(s.plan, 2, 2, s.actions + (Action(K.FORWARD, 0, "F7", 0),), s.name)
    with pytest.raises(ScheduleError, match="stage F7, which is not in the plan"):
        validate(stray)


def test_validator_rejects_a_kept_backward_without_its_graph():
    s = _bound("gpipe", 2, 2, recompute=True)   # F0 runs F (no graph), backward is R + B
    acts = [a for a in s.actions if a.key not in ("R:B0:m0", "B:B0:m0")]
    acts.append(Action(K.BACKWARD_KEPT, 0, "B0", 0, deps=("F:F0:m0", "UG:B0:m0@1")))
    with pytest.raises(ScheduleError, match="keeps none: run it as FK"):
        validate(Schedule(s.plan, 2, 2, tuple(acts), s.name))


@pytest.mark.parametrize("key, old, new, match", [
    # ordered by lane order through the later microbatch, but reading the wrong data
    ("UA:F1:m1@1", "DA:F0:m1@1", "DA:F0:m2@1", "does not depend on a DOWNLOAD_ACT of microbatch 1"),
    ("FK:F1:m1", "UA:F1:m1@1", "DA:F0:m1@1", "FK:F1:m1 does not depend on UA:F1:m1@1"),
    ("DG:B1:m1@1", "BK:B1:m1", "BK:B1:m2", "does not depend on the compute of stage B1 microbatch 1"),
    # no path at all: caught by the order checks
    ("DG:B1:m0@1", "BK:B1:m0", None, "does not wait for the tail's backward"),
])
def test_dataflow_mode_rejects_a_missing_input_dependency(key, old, new, match):
    s = _bound("1f1b", 3, 3)
    a = s.by_key()[key]
    deps = tuple(d for d in a.deps if d != old) + ((new,) if new else ())
    edited = _edit(s, key, deps=deps)
    if new:
        validate(edited)      # the lenient default accepts it
    with pytest.raises(ScheduleError, match=match):
        validate(edited, dataflow=True)


def test_dataflow_mode_rejects_a_forward_before_its_input_exists():
    s = roundpipe_schedule(even_plan(4, 2, 3), 2, 2)
    bad = _edit(s, "UA:F1:m0@1", deps=())
    validate(bad)      # lenient default: the runtime's race checker catches this one
    with pytest.raises(ScheduleError, match="forward of F1 microbatch 0 does not wait"):
        validate(bad, dataflow=True)


def test_validator_checks_device_memory_against_a_limit():
    s = _bound("gpipe", 2, 4)
    sizes = MemorySizes.uniform(2, weights=100, saved=1000, outputs=10)
    # GPipe keeps all 4 microbatches' activations: 4 x (1000 + 10) + 2 x 100 (weights
    # and their gradients), plus in-flight boundary buffers.
    validate(s, sizes=sizes, memory_limit=5000)
    with pytest.raises(ScheduleError, match=r"worker \d needs 4\.\d KiB at its peak \(weights "
                                            r"200 B \+ activations .*the limit is 3\.9 KiB"):
        validate(s, sizes=sizes, memory_limit=4000)
    s1 = _bound("1f1b", 2, 4)
    validate(s1, sizes=sizes, memory_limit=2500)   # 1F1B: at most 2 in flight on device 0
    with pytest.raises(ScheduleError, match="a memory limit needs the per-layer sizes"):
        validate(s1, memory_limit=10)


# -- properties: every generated schedule is sound ------------------------------------

layer_costs = st.lists(st.floats(0.1, 20.0), min_size=2, max_size=14)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(costs=layer_costs, devices=st.integers(1, 5), mbs=st.integers(1, 9),
       v=st.integers(1, 3), recompute=st.booleans())
def test_property_bound_schedules_validate_and_simulate(costs, devices, mbs, v, recompute):
    for name, (make, per) in BOUND.items():
        chunks = devices * (v if per > 1 else 1)
        if chunks > len(costs):
            continue
        plan = bound_plan(costs, chunks, devices=devices, recompute=recompute)
        s = make(plan, devices, mbs, recompute=recompute)
        validate(s, dataflow=True)
        model = ModelCosts(tuple(LayerCost(f"l{i}", c, 2 * c, c, hop_ms=0.1 * c)
                                 for i, c in enumerate(costs)), 1)
        r = simulate(s, model).report
        busy = mbs * sum(model.sum(f, 0, len(costs)) for f in ("forward_ms", "backward_ms"))
        busy += mbs * model.sum("recompute_ms", 0, plan.tail.start) * recompute
        assert r.step_ms * devices * (1 - r.bubble.total) == pytest.approx(busy, rel=1e-6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(costs=layer_costs, workers=st.integers(1, 6), mbs=st.integers(1, 9),
       calls=st.integers(2, 3))
# Found by hypothesis: calls 0 and 1 end almost together, call 2 much later, so the
# window between the first two call ends held no compute (bubble 1.0).
@example(costs=[1.0, 1.0, 12.0, 20.0, 6.0], workers=5, mbs=1, calls=3)
def test_property_roundpipe_schedules_validate_and_simulate(costs, workers, mbs, calls):
    model = ModelCosts(tuple(LayerCost(f"l{i}", c, 2 * c, c, upload_ms=0.5 * c, hop_ms=0.1)
                             for i, c in enumerate(costs)), 1)
    plan = roundpipe_plans(model, workers, mbs)[0]
    for s in (roundpipe_schedule(plan, workers, mbs),
              roundpipe_stale_schedule(plan, workers, mbs, calls=calls)):
        validate(s, dataflow=True)
        r = simulate(s, model).report
        assert 0.0 <= r.bubble.total < 1.0 and r.step_ms > 0


def test_every_named_schedule_builds_and_validates_with_memory():
    model = ModelCosts(tuple(LayerCost(f"l{i}", 1.0, 2.0, 1.0, 0.5, 0.2, 1000, 300, 20)
                             for i in range(12)), 64)
    for name in SCHEDULES:
        s = build_schedule(name, model, SimConfig(3, 6))
        validate(s, dataflow=True)
        assert s.name == name
    assert isinstance(Plan.from_text(s.plan.to_text()), Plan)


@pytest.mark.parametrize("workers, mbs, staleness", [(1, 1, 0), (2, 3, 0), (3, 4, 1),
                                                     (8, 16, 0)])
def test_frozen_weights_upload_without_waiting_for_the_hand_off(workers, mbs, staleness):
    """A stage holding frozen layers splits a gated upload: ``UW`` (frozen part) waits
    for room only, ``UT`` (trained part) for the hand-offs; the stage computes after
    the ``UT``. Stages without frozen layers and ungated uploads keep one ``UW``."""
    plan = even_plan(9, 2, 5, tail_layers=2)
    frozen = (1, 2, 3)
    s = roundpipe_stale_schedule(plan, workers, mbs, calls=3, staleness=staleness,
                                 frozen=frozen)
    validate(s, dataflow=True)
    assert Schedule.from_text(s.to_text()) == s
    plain = roundpipe_stale_schedule(plan, workers, mbs, calls=3, staleness=staleness)
    by_key, plain_keys = s.by_key(), plain.by_key()
    split = {(a.stage, a.call) for a in s.actions if a.kind is K.UPLOAD_TRAINED}
    for a in plain.actions:
        if a.kind is not K.UPLOAD_WEIGHTS:
            continue
        reads = [d for d in a.host_deps if d.startswith("O:")]
        holds = not set(plan.stage(a.stage).layers).isdisjoint(frozen)
        assert ((a.stage, a.call) in split) == bool(reads and holds), a.key
        if (a.stage, a.call) not in split:
            assert by_key[a.key].host_deps == a.host_deps
            continue
        ut = by_key[a.key.replace("UW:", "UT:")]
        assert ut.lane is Lane.TRAINED and ut.deps == (a.key,) and tuple(ut.host_deps) == \
            tuple(reads)
        assert set(by_key[a.key].host_deps) == set(a.host_deps) - set(reads)
        for c in s.actions:      # every compute of the stage waits for its UT
            if c.lane is Lane.COMPUTE and c.kind is not K.FREE and \
                    (c.stage, c.call) == (a.stage, a.call):
                assert ut.key in c.deps or any(ut.key in by_key[d].deps for d in c.deps)
    assert split == {k for k in split if k[1] >= 1 + staleness}
    assert len(plain_keys) + len(split) == len(by_key)


def test_validator_refuses_a_compute_that_skips_its_trained_upload():
    plan = even_plan(6, 2, 3, tail_layers=1)
    s = roundpipe_stale_schedule(plan, 2, 2, calls=2, staleness=0, frozen=(0, 1, 2))
    ut = next(a for a in s.actions if a.kind is K.UPLOAD_TRAINED)
    broken = tuple(Action(a.kind, a.worker, a.stage, a.mb, a.at,
                          tuple(d for d in a.deps if d != ut.key) + (
                              (ut.deps[0],) if ut.key in a.deps else ()),
                          a.host_deps, a.call) for a in s.actions)
    with pytest.raises(ScheduleError, match=f"does not wait for {ut.key}"):
        validate(Schedule(plan, 2, 2, broken, s.name), dataflow=True)
    orphan = tuple(Action(a.kind, a.worker, a.stage, a.mb, a.at, (), a.host_deps, a.call)
                   if a.key == ut.key else a for a in s.actions)
    with pytest.raises(ScheduleError, match="does not depend on UW"):
        validate(Schedule(plan, 2, 2, orphan, s.name), dataflow=True)


def test_frozen_first_shortens_an_upload_bound_lora_step():
    """LoRA-like costs (uploads longer than the forward, tiny adapters): uploading the
    frozen base before the hand-off shortens the exact mode's steady step, and a ``UT``
    takes its layers' adapter (gradient) time."""
    block = LayerCost("block", 1.0, 2.0, 1.0, upload_ms=6.0, hop_ms=0.1,
                      weight_bytes=64 << 20, grad_ms=0.05)
    costs = ModelCosts(tuple(replace(block, name=f"b{i}") for i in range(12)), 1)
    assert costs.frozen == tuple(range(12))
    plan = even_plan(12, 6, 12, tail_layers=1)

    def period(frozen):
        s = roundpipe_stale_schedule(plan, 3, 4, calls=5, staleness=0, frozen=frozen)
        tl = simulate(s, costs).timeline
        loss = [max(tl.end[a.key] for a in s.actions if a.kind is K.DOWNLOAD_GRAD and
                    a.call == c and a.stage == "T") for c in (1, 4)]
        return (loss[1] - loss[0]) / 3
    assert period(costs.frozen) < 0.95 * period(())     # 78.6 vs 84.3 ms
    ut = Action(K.UPLOAD_TRAINED, 0, "B3")
    assert sum(ActionTimes(plan, costs)(ut)) == pytest.approx(0.05)


def test_roundpipe_candidates_that_fit_beat_faster_ones_that_do_not():
    """``build_schedule`` picks the fastest RoundPipe candidate that fits the memory
    limit; a faster one that does not fit (the compute-only search knows no memory) is
    taken only when nothing fits."""
    block = LayerCost("b", 1.0, 2.0, 1.0, upload_ms=0.5, hop_ms=0.05, weight_bytes=100,
                      saved_bytes=10, output_bytes=5)
    costs = ModelCosts(tuple(replace(block, name=f"b{i}") for i in range(16))
                       + (replace(block, name="head", forward_ms=3.0, backward_ms=6.0),), 1)
    free = simulate(build_schedule("roundpipe-stale", costs, SimConfig(4, 8)), costs,
                    memory_limit=2000).report
    assert free.fits is False            # the fastest overall needs 2,210 bytes
    s = build_schedule("roundpipe-stale", costs, SimConfig(4, 8, memory_limit=2000))
    bounded = simulate(s, costs, memory_limit=2000).report
    assert bounded.fits and bounded.step_ms > free.step_ms
    tight = build_schedule("roundpipe-stale", costs, SimConfig(4, 8, memory_limit=300))
    assert simulate(tight, costs, memory_limit=300).report.fits is False


def test_looked_up_rows_are_stepped_before_the_next_call_reads_them():
    """Exact overlapping calls with an embedding moved by rows (``rows_first``): the
    backward stage holding only the table steps the next call's rows first (``OR``,
    before its ``O``); the next call's first forward stage waits for that ``OR``, a
    stage reading the table whole (the tied head in the tail) for the ``O``."""
    plan = Plan.from_text("F0[0:1] F1[1:3] T[3:4] B0[0:1] B1[1:3]")
    s = roundpipe_stale_schedule(plan, 2, 4, calls=3, staleness=0, ties=[(0, 3)],
                                 rows_first=(0,))
    validate(s, dataflow=True)
    assert Schedule.from_text(s.to_text()) == s
    by_key = s.by_key()
    rows = [a for a in s.actions if a.kind is K.OPTIMIZER_ROWS]
    assert [(a.stage, a.call) for a in rows] == [("B0", c) for c in range(3)]
    for a in rows:
        o = by_key[action_key(K.OPTIMIZER, "B0", call=a.call)]
        assert a.lane is Lane.HOST and a.host_deps == (
            action_key(K.DOWNLOAD_WGRAD, "B0", call=a.call),) and o.host_deps == (a.key,)
    for c in (1, 2):
        def reads(stage):
            return {d for d in by_key[action_key(K.UPLOAD_WEIGHTS, stage, call=c)].host_deps
                    if d.startswith("O")}
        def key(kind, stage):
            return action_key(kind, stage, call=c - 1)
        assert reads("F0") == {key(K.OPTIMIZER_ROWS, "B0"), key(K.OPTIMIZER, "T")}
        assert reads("F1") == {key(K.OPTIMIZER, "B1")}
        assert reads("T") == {key(K.OPTIMIZER, "T"), key(K.OPTIMIZER, "B0")}
    # Only the exact optimizer's per-stage steps have rows to step first.
    for kw in (dict(staleness=1), dict(staleness=0, whole_step=True)):
        other = roundpipe_stale_schedule(plan, 2, 4, calls=3, rows_first=(0,), **kw)
        assert K.OPTIMIZER_ROWS not in {a.kind for a in other.actions}
    with pytest.raises(ScheduleError, match="whole_step"):
        roundpipe_call(plan, 2, 4, 1, reads=0, whole_step=True, rows_first=(0,))
    # A stage holding more than the table steps it whole, at its O.
    merged = Plan.from_text("F0[0:1] F1[1:3] T[3:4] B0[0:2] B1[2:3]")
    s2 = roundpipe_stale_schedule(merged, 2, 4, calls=2, staleness=0, rows_first=(0,))
    assert K.OPTIMIZER_ROWS not in {a.kind for a in s2.actions}
    # The validator refuses an OR whose O does not wait for it.
    loose = tuple(Action(a.kind, a.worker, a.stage, a.mb, a.at, a.deps,
                         ("DW:B0",) if a.key == "O:B0" else a.host_deps, a.call)
                  for a in s.actions)
    with pytest.raises(ScheduleError, match="has no O:B0 waiting for it"):
        validate(Schedule(plan, 2, 4, loose, s.name))


def test_stepping_the_rows_first_shortens_an_exact_step():
    """An embedding-heavy model whose host step of the table is long and whose calls
    look up an eighth of its rows: with them stepped first, the next call's first
    forward stage waits for the rows' step only, and the exact mode's steady step is
    shorter."""
    from rotapipe.plan.costs import ROWS_FIRST_COST
    from rotapipe.runtime.emulation import TimedEmulation
    block = LayerCost("block", 1.0, 2.0, 1.0, upload_ms=0.5, hop_ms=0.05,
                      weight_bytes=8 << 20)
    table = replace(block, name="embed", forward_ms=0.0, backward_ms=0.0,
                    recompute_ms=0.0, weight_bytes=64 << 20)
    costs = ModelCosts((table,) + tuple(replace(block, name=f"b{i}") for i in range(6))
                       + (replace(block, name="head"),), 1, rows_bytes=8 << 20)
    plan = Plan.from_text("F0[0:1] F1[1:3] F2[3:5] F3[5:7] T[7:8] "
                          "B0[0:1] B1[1:3] B2[3:5] B3[5:7]")
    em = TimedEmulation(costs, optimizer_params_per_s=2e9)
    times = ActionTimes(plan, costs, optimizer_ms=em.optimizer_ms(plan, False))
    # An eighth of the rows, each at ROWS_FIRST_COST rows of the whole step.
    assert sum(times(Action(K.OPTIMIZER_ROWS, HOST, "B0"))) == pytest.approx(
        sum(times(Action(K.OPTIMIZER, HOST, "B0"))) * ROWS_FIRST_COST / 8)

    def period(rows):
        s = roundpipe_stale_schedule(plan, 3, 4, calls=5, staleness=0, rows_first=rows)
        tl = run(s, times)
        loss = [max(tl.end[a.key] for a in s.actions if a.kind is K.DOWNLOAD_GRAD and
                    a.call == c and a.stage == "T") for c in (1, 4)]
        return (loss[1] - loss[0]) / 3
    assert period((0,)) < 0.9 * period(())     # 57.2 vs 66.6 ms


def test_host_step_times_follow_the_optimizer_modes():
    """``host_step_ms``: per-stage steps (each layer once, at the last job holding it:
    a split tail steps the head once), or the whole step at the last hand-off
    (``whole_step``); LoRA costs step their adapters only."""
    from rotapipe.plan import StageKind
    from rotapipe.sim.timing import host_step_ms
    block = LayerCost("block", 1.0, 2.0, 1.0, weight_bytes=6 << 20)
    costs = ModelCosts(tuple(replace(block, name=f"b{i}") for i in range(5)), 1)
    plan = Plan.from_text("F0[0:2] F1[2:4] T[4:5]x2 B0[0:1] B1[1:2] B2[2:4]")
    stages = [s for s in plan.jobs() if s.kind is not StageKind.FORWARD]
    whole = 5 * (3 << 20) / 1e9 * 1e3          # 5 layers of 3 Mi parameters at 1e9/s

    def per_stage(**kw):
        ms = host_step_ms(plan, costs, 1e9, **kw)
        return [ms(s) for s in stages]
    own = per_stage()
    assert sum(own) == pytest.approx(whole) and own[0] == 0.0 < own[1]  # T1 steps the head
    assert own[-1] == pytest.approx(whole / 5)                           # B0: layer 0
    assert per_stage(whole_step=True) == [0.0] * (len(stages) - 1) + [pytest.approx(whole)]
    lora = replace(costs, layers=tuple(replace(l, grad_ms=0.1, grad_bytes=2 << 10)
                                       for l in costs.layers))
    assert host_step_ms(plan, lora, 1e9)(stages[-1]) == pytest.approx((1 << 10) / 1e9 * 1e3)
    # a head tied to the embedding: its weight is the embedding's, stepped once with it
    # at the embedding's stage (B0), so the tail steps only the head's own 1 Mi
    ms = host_step_ms(plan, replace(costs, shared_bytes=4 << 20), 1e9)
    assert sum(ms(s) for s in stages) == pytest.approx(whole - 2 * (1 << 20) / 1e9 * 1e3)
    assert ms(stages[1]) == pytest.approx((1 << 20) / 1e9 * 1e3) and \
        ms(stages[-1]) == pytest.approx(whole / 5)
