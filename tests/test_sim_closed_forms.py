"""The simulator against closed forms and hand-worked timelines."""

import itertools

import pytest

import rotapipe
from rotapipe import even_plan, roundpipe_schedule
from rotapipe.plan import LayerCost, ModelCosts, bound_plan
from rotapipe.schedule import (Action, ActionKind as K, Schedule, gpipe_schedule,
                               interleaved_1f1b_schedule, looped_bfs_schedule,
                               one_f_one_b_schedule, roundpipe_stale_schedule)
from rotapipe.sim import (SCHEDULES, ActionTimes, SimConfig, build_schedule, compare, run,
                          simulate, table)

COSTS = [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)]   # (forward, backward) per layer


@pytest.mark.parametrize("make", [gpipe_schedule, one_f_one_b_schedule])
@pytest.mark.parametrize("p, m", [(1, 1), (2, 2), (3, 7), (4, 8), (8, 16), (6, 3)])
@pytest.mark.parametrize("f, b", COSTS)
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(make, p, m, f, b):
    costs = ModelCosts.uniform(p, f, b)
    r = simulate(make(bound_plan(costs, p), p, m), costs).report
    assert r.bubble.total == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert r.step_ms == pytest.approx((m + p - 1) * (f + b))
    assert r.exposed_comm == 0.0


@pytest.mark.parametrize("p, m, v", [(2, 2, 2), (2, 5, 3), (4, 8, 2), (4, 6, 3), (3, 7, 2),
                                     (8, 16, 2), (8, 12, 3)])
@pytest.mark.parametrize("f, b", COSTS)
def test_interleaved_1f1b_bubble_is_p_minus_1_over_vm_plus_p_minus_1(p, m, v, f, b):
    costs = ModelCosts.uniform(p * v, f, b)
    plan = bound_plan(costs, p * v, devices=p)
    expected = (p - 1) / (v * m + p - 1)
    r = simulate(interleaved_1f1b_schedule(plan, p, m), costs).report
    assert r.bubble.total == pytest.approx(expected, abs=1e-12)
    # looped BFS has the same fill and drain (m >= p, so no loop waits)
    r = simulate(looped_bfs_schedule(plan, p, m), costs).report
    assert r.bubble.total == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("workers, mbs", [(w, m) for w in (1, 2, 3, 4, 8)
                                          for m in (w, w + 1, 2 * w + 3)])
def test_roundpipe_with_equal_stages_has_no_steady_state_bubble(workers, mbs):
    # forward 1, recompute 1, backward 2 per layer: 3-layer forward stages, 1-layer
    # backward stages and the 1-layer fused tail all take 3 per microbatch.
    costs = ModelCosts.uniform(10, 1.0, 2.0, 1.0)
    plan = even_plan(10, 3, 9)
    r = simulate(roundpipe_schedule(plan, workers, mbs), costs)
    assert r.report.bubble.steady == 0.0 and r.report.bubble.switch == 0.0
    # only fill and drain remain: once a worker starts it never waits, except that a
    # recompute may run ahead and wait for its gradient (the pair counts as one pass)
    for w in range(workers):
        spans = sorted((sp for sp in r.timeline.spans
                        if sp.worker == w and sp.resource == "compute" and sp.end > sp.start),
                       key=lambda sp: sp.start)
        for prev, nxt in zip(spans, spans[1:]):
            if nxt.start > prev.end + 1e-9:
                assert (prev.action.kind, nxt.action.kind) == (K.RECOMPUTE, K.BACKWARD)
                assert (prev.action.stage, prev.action.mb) == (nxt.action.stage, nxt.action.mb)


def test_stale_roundpipe_hides_fill_and_drain():
    costs = ModelCosts.uniform(10, 1.0, 2.0, 1.0)
    plan = even_plan(10, 3, 9)
    for workers, mbs in [(2, 4), (3, 6), (4, 8), (12, 12)]:
        exact = simulate(roundpipe_schedule(plan, workers, mbs), costs).report
        stale = simulate(roundpipe_stale_schedule(plan, workers, mbs, calls=4), costs).report
        ideal = len(plan.jobs()) * mbs * 3 / workers
        assert stale.bubble.fill == 0.0 and stale.bubble.drain == 0.0
        assert stale.bubble.total < 0.02 and stale.step_ms == pytest.approx(ideal, rel=0.02)
        assert exact.step_ms > stale.step_ms


def test_hops_cost_two_link_transfers_per_device_boundary():
    """1F1B on 2 devices, 1 microbatch: F0 -> down -> up -> T(F,B) -> down -> up -> B0."""
    costs = ModelCosts(tuple(LayerCost(f"l{i}", 1.0, 2.0, 1.0, hop_ms=0.5) for i in range(2)), 1)
    r = simulate(one_f_one_b_schedule(bound_plan(costs, 2), 2, 1), costs)
    assert r.report.step_ms == pytest.approx(1 + 0.5 + 0.5 + 3 + 0.5 + 0.5 + 2)
    # device 1 waits 2 for its input, 1 of it on transfers; device 0 waits 5 for its
    # gradient, 1 of it on transfers
    assert r.report.exposed_comm == pytest.approx(2 / (2 * 8))
    assert r.report.bubble.fill == pytest.approx(2 / 16)
    # one device: no transfers at all
    one = simulate(one_f_one_b_schedule(bound_plan(costs, 1), 1, 1), costs).report
    assert one.step_ms == pytest.approx(6.0) and one.bubble.total == 0.0


def _tiny(actions):
    return Schedule(even_plan(1, 0, 0), 1, 1, tuple(actions), "t")


def test_link_priority_activations_cut_between_weight_chunks():
    """A weight upload moves per layer; an activation upload waiting behind it goes at
    the next chunk boundary, not after the whole upload."""
    costs = ModelCosts(tuple(LayerCost(f"l{i}", 1.0, 1.0, 1.0, upload_ms=2.0, hop_ms=1.0)
                             for i in range(3)), 1)
    plan = even_plan(3, 1, 1)
    s = Schedule(plan, 1, 1, (
        Action(K.UPLOAD_WEIGHTS, 0, "F0"),
        Action(K.FORWARD, 0, "F0", 0, deps=("UA:F0:m0@0", "UW:F0")),
        Action(K.UPLOAD_ACT, 0, "F0", 0, 0, host_deps=("X:F0",)),
        Action(K.FREE, 0, "F0"),
    ), "t")
    # X:F0 sits after F:F0:m0 in the compute lane, and F needs UA: a deadlock.
    with pytest.raises(Exception, match="cannot go on"):
        simulate(s, costs)
    s = Schedule(plan, 1, 1, (
        Action(K.UPLOAD_WEIGHTS, 0, "F0"),          # layers 0 and 1: chunks of 2 ms
        Action(K.DOWNLOAD_GRAD, 0, "T", 0, 1),      # 1 ms on the download link
        Action(K.UPLOAD_ACT, 0, "F0", 0, 2, host_deps=("DG:T:m0@1",)),
        Action(K.FORWARD, 0, "F0", 0, deps=("UA:F0:m0@2", "UW:F0")),
    ), "t")
    tl = simulate(s, costs).timeline
    assert tl.start["UA:F0:m0@2"] == pytest.approx(2.0)      # between the two chunks
    assert tl.end["UW:F0"] == pytest.approx(5.0)
    assert [sp.end - sp.start for sp in tl.spans if sp.action.kind is K.UPLOAD_WEIGHTS] == [2, 2]


def test_a_copy_made_runnable_by_a_zero_time_action_competes_at_that_instant():
    """At 1 ms the gradient download ends: the free it gates takes no time, and the
    activation upload waiting on that free becomes runnable at the same instant as the
    weight upload waiting on the download. The activation goes first, whichever
    resource the engine looks at first."""
    costs = ModelCosts(tuple(LayerCost(f"l{i}", 1.0, 1.0, 1.0, upload_ms=2.0, hop_ms=1.0)
                             for i in range(3)), 1)
    s = Schedule(even_plan(3, 1, 1), 1, 1, (
        Action(K.DOWNLOAD_GRAD, 0, "T", 0, 1),
        Action(K.FREE, 0, "F0", deps=("DG:T:m0@1",)),
        Action(K.UPLOAD_WEIGHTS, 0, "F0", host_deps=("DG:T:m0@1",)),
        Action(K.UPLOAD_ACT, 0, "F0", 0, 2, host_deps=("X:F0",)),
    ), "t")
    tl = simulate(s, costs).timeline
    assert tl.end["X:F0"] == 1.0
    assert (tl.start["UA:F0:m0@2"], tl.end["UA:F0:m0@2"]) == (1.0, 2.0)
    assert (tl.start["UW:F0"], tl.end["UW:F0"]) == (2.0, 6.0)


def test_bubble_categories_of_gpipe():
    """GPipe, p=2, m=2, f=1, b=2: device 0 idles 1 at the switch... worked by hand."""
    costs = ModelCosts.uniform(2, 1.0, 2.0)
    r = simulate(gpipe_schedule(bound_plan(costs, 2), 2, 2), costs).report
    # device 0: F F . . . . B B  -> idle 4 between forwards (end 2) and backwards (start 6)?
    # timeline: d0 F m0 [0,1] F m1 [1,2]; d1 FK m0 [1,2] FK m1 [2,3] BK m0 [3,5] BK m1 [5,7];
    # d0 BK m0 [5,7] BK m1 [7,9]. makespan 9.
    assert r.step_ms == 9.0
    assert r.bubble.fill == pytest.approx(1 / 18)        # d1 waits 1
    assert r.bubble.switch == pytest.approx(3 / 18)      # d0 waits 2..5
    assert r.bubble.drain == pytest.approx(2 / 18)       # d1 idle 7..9
    assert r.bubble.steady == 0.0


def test_recompute_is_an_explicit_setting_for_the_baselines():
    costs = ModelCosts.uniform(4, 1.0, 2.0, 1.0)
    plan = bound_plan(costs, 4)
    keep = simulate(one_f_one_b_schedule(plan, 4, 8), costs).report
    rec = simulate(one_f_one_b_schedule(plan, 4, 8, recompute=True), costs).report
    # every chunk but the tail re-runs its forward: 3 extra per microbatch over 4 devices
    assert rec.step_ms * 4 * (1 - rec.bubble.total) == pytest.approx(
        keep.step_ms * 4 * (1 - keep.bubble.total) + 8 * 3)


def test_compare_and_table_cover_all_seven_schedules():
    costs = ModelCosts.explicit(12, 2.0, 4.0, head_forward_ms=6.0, head_backward_ms=12.0,
                                hop_ms=0.3, upload_ms=1.0, tokens=100)
    results = compare(costs, SimConfig(4, 8))
    assert [r.schedule.name for r in results] == list(SCHEDULES)
    text = table([r.report for r in results])
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["schedule", "step", "ms"] and len(lines) == 2 + 7
    assert "1.00x" in lines[3] and "(4 calls)" in lines[-1]
    by = {r.schedule.name: r.report for r in results}
    assert by["roundpipe-stale"].bubble.total < by["roundpipe"].bubble.total
    assert by["roundpipe"].bubble.total < by["1f1b"].bubble.total
    # Mobius recomputes every forward chunk and swaps weights: slower than RoundPipe.
    assert by["roundpipe"].step_ms < by["mobius"].step_ms
    for r in results:
        assert r.report.tokens_per_s == pytest.approx(100 * 8 / r.report.step_ms * 1e3)


def test_build_schedule_names_errors():
    costs = ModelCosts.uniform(4, 1.0, 2.0)
    with pytest.raises(Exception, match="needs 16 chunks"):
        build_schedule("interleaved-1f1b", costs, SimConfig(8, 8))
    with pytest.raises(Exception, match="unknown schedule"):
        build_schedule("zero-bubble", costs, SimConfig(2, 2))
    with pytest.raises(Exception, match=r"calls=1: use an int in \[2, 64\]"):
        SimConfig(2, 2, calls=1)


@pytest.mark.parametrize("field,value", [
    ("devices", 2.5), ("devices", True), ("devices", 10**6), ("microbatches", 4.0),
    ("microbatches", 10**6), ("virtual_stages", 10**5), ("calls", 10**6),
    ("refine", 10**7), ("memory_limit", -5), ("memory_limit", "24GB")])
def test_sim_config_refuses_what_simulate_would_choke_on(field, value):
    """A float count was a TypeError deep in the schedule builder and a million devices
    simulated for two minutes: each field is checked against `rotapipe simulate`'s
    range, naming it."""
    with pytest.raises(rotapipe.ConfigError, match=f"^{field}="):
        SimConfig(**{"devices": 2, "microbatches": 2, field: value})


def test_sweep_all_schedules_simulate_consistently():
    costs = ModelCosts.explicit(9, 1.0, 2.2, head_forward_ms=3.0, head_backward_ms=6.0,
                                hop_ms=0.1, upload_ms=0.4)
    for p, m in itertools.product([1, 2, 3, 4], [1, 4, 9]):
        for r in compare(costs, SimConfig(p, m, refine=1)):
            b = r.report.bubble
            assert 0.0 <= b.total < 1.0 and min(b.fill, b.switch, b.drain, b.steady) >= 0.0
            assert r.report.exposed_comm <= b.total + 1e-9


@pytest.mark.parametrize("workers, mbs", [(2, 4), (3, 6), (4, 8), (8, 16)])
@pytest.mark.parametrize("upload_ms, opt_ms", [(0.0, 0.0), (0.3, 0.5), (1.0, 2.0)])
def test_exact_overlapping_calls_cannot_beat_one_call(workers, mbs, upload_ms, opt_ms):
    """The ceiling of the exact ``overlap`` mode (docs/optimizer.md): call ``c + 1``'s
    first forward stage reads the update of call ``c``'s last backward stage, and every
    other action of call ``c + 1`` depends on that stage's output, so each added call
    costs at least one call alone, from its first weight upload to its last hand-off
    (the gradient download and step of the last backward stage); ``stale`` (which never
    waits for the latest update) is faster whenever the call has a fill or drain."""
    costs = ModelCosts.explicit(10, 1.0, 2.0, head_forward_ms=1.5, head_backward_ms=3.0,
                                upload_ms=upload_ms)
    plan = even_plan(11, 3, 5, tail_layers=2)
    times = ActionTimes(plan, costs, optimizer_ms=lambda stage: opt_ms)
    one = run(roundpipe_schedule(plan, workers, mbs), times)
    assert one.makespan == one.end[f"O:{plan.backward[0].name}"]
    spans = {}
    for staleness in (0, 1):
        ends = [run(roundpipe_stale_schedule(plan, workers, mbs, calls=n,
                                             staleness=staleness), times).makespan
                for n in (3, 4)]
        spans[staleness] = ends[1] - ends[0]
    assert spans[0] >= one.makespan - 1e-9
    assert spans[1] < spans[0]
