"""The memory-aware partitioner and the automatic planner: exact cuts against brute
force, whole plans against exhaustive simulation, coverage and memory properties,
planning time, host-memory arithmetic and measured-cost refinement."""

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import rotapipe
from rotapipe.config import RecomputeGrain
from rotapipe.errors import PlanError
from rotapipe.plan import (LayerCost, ModelCosts, Plan, Stage, StageKind, hardware,
                           model_costs)
from rotapipe.plan.hostmem import host_memory, lora_params
from rotapipe.planner.measured import MeasuredCosts, Pass, PlanRefiner
from rotapipe.plan.balance import greedy_compute_plan
from rotapipe.plan.partitioner import (Direction, Footprint, candidate_plans,
                                      estimate_step_ms, min_max_cut)
from rotapipe.planner.autoplan import (PlannerConfig, all_plans, choose_plan, device_need,
                                   simulate_plan)
from rotapipe.planner.exact import call_lower_bound, step_lower_bound

FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _model(times, uploads=None, weights=None, saved=None, out=10):
    n = len(times)
    uploads = uploads or [0.0] * n
    weights = weights or [0] * n
    saved = saved or [0] * n
    return ModelCosts(tuple(LayerCost(f"l{i}", t, 2 * t, t, uploads[i], 0.1, weights[i],
                                      saved[i], out) for i, t in enumerate(times)), 1,
                      input_bytes=out)


def _compositions(a, b):
    n = b - a
    for mask in range(1 << (n - 1)):
        bounds = [a] + [a + i + 1 for i in range(n - 1) if mask >> i & 1] + [b]
        yield list(zip(bounds, bounds[1:]))


layer = st.tuples(st.floats(0.1, 10.0), st.floats(0.0, 20.0), st.integers(1, 50),
                  st.integers(0, 50))


@FAST
@given(layers=st.lists(layer, min_size=1, max_size=8), parts=st.integers(1, 8),
       direction=st.sampled_from([Direction.FORWARD, Direction.BACKWARD]),
       grain=st.sampled_from(list(RecomputeGrain)), mbs=st.integers(1, 4),
       memory=st.integers(60, 400), cap=st.integers(10, 200))
def test_min_max_cut_equals_brute_force(layers, parts, direction, grain, mbs, memory, cap):
    n = len(layers) + 1          # + a tail layer, so the body is the generated layers
    layers = layers + [(1.0, 0.0, 1, 0)]
    costs = _model(*map(list, zip(*layers)))
    fp = Footprint.of(costs, mbs, grain)
    body = n - 1
    best = None
    for runs in _compositions(0, body):
        if len(runs) != parts:
            continue
        ok = all(fp.resident(direction, a, b) <= cap
                 and fp.needs(direction, a, b, cap) <= memory for a, b in runs)
        if ok:
            worst = max(fp.cost(direction, a, b) for a, b in runs)
            best = worst if best is None else min(best, worst)
    if parts > body or best is None:
        with pytest.raises(PlanError):
            min_max_cut(fp, direction, 0, body, parts, cap=cap, memory=memory)
        return
    worst, runs = min_max_cut(fp, direction, 0, body, parts, cap=cap, memory=memory)
    assert worst == pytest.approx(best, rel=1e-9)
    assert len(runs) == parts and runs[0][0] == 0 and runs[-1][1] == body
    assert all(fp.needs(direction, a, b, cap) <= memory for a, b in runs)


def _brute_best(costs, workers, mbs, memory):
    best = None
    fp = Footprint.of(costs, mbs)
    for plan in all_plans(len(costs.layers)):
        if device_need(plan, fp) > memory:
            continue
        t = simulate_plan(plan, costs, workers, mbs).step_ms
        best = t if best is None else min(best, t)
    return best


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(times=st.lists(st.floats(0.5, 5.0), min_size=2, max_size=5),
       uploads=st.lists(st.floats(0.0, 3.0), min_size=5, max_size=5),
       workers=st.integers(1, 4), mbs=st.integers(1, 4), memory=st.integers(150, 600))
def test_planner_equals_brute_force_on_small_instances(times, uploads, workers, mbs, memory):
    n = len(times)
    costs = _model(times, uploads[:n], weights=[40] * n, saved=[30] * n)
    best = _brute_best(costs, workers, mbs, memory)
    config = PlannerConfig(workers, memory, (mbs,), grains=(RecomputeGrain.STAGE,))
    if best is None:
        with pytest.raises(PlanError):
            choose_plan(lambda m: costs, config)
        return
    choice = choose_plan(lambda m: costs, config)
    assert choice.step_ms == pytest.approx(best, rel=1e-9)
    assert choice.device_bytes <= memory


def _random_model(rng, n, lora=False):
    """Layers with random compute, uploads and hops (the hops as large as compute on
    some layers, so transfers can decide the step), fixed bytes. ``lora``: each
    layer's weight-gradient download (``grad_ms``) is none or a random part of its
    upload, as LoRA's adapters on frozen weights."""
    costs = ModelCosts(tuple(
        LayerCost(f"l{i}", rng.uniform(0.2, 5.0), rng.uniform(0.2, 10.0), rng.uniform(0.2, 5.0),
                  rng.choice([0.0, rng.uniform(0.0, 6.0)]), rng.choice([0.1, rng.uniform(0, 3)]),
                  40, 30, 10) for i in range(n)), 1, input_hop_ms=rng.uniform(0, 1), input_bytes=10)
    if lora:
        costs = replace(costs, layers=tuple(
            replace(l, grad_ms=rng.choice([0.0, rng.uniform(0, 1) * l.upload_ms]))
            for l in costs.layers))
    return costs


def _every_plan(n):
    """Independent of the planner: every tail size x forward cut x backward cut."""
    if n == 1:
        yield Plan(1, (), Stage(StageKind.TAIL, 0, 0, 1), ())
        return
    for tail in range(1, n):
        body = n - tail
        for fwd in _compositions(0, body):
            for bwd in _compositions(0, body):
                yield Plan(n, tuple(Stage(StageKind.FORWARD, i, a, b) for i, (a, b) in enumerate(fwd)),
                           Stage(StageKind.TAIL, 0, body, n),
                           tuple(Stage(StageKind.BACKWARD, i, a, b) for i, (a, b) in enumerate(bwd)))


def _check_exact(rng, n, workers):
    costs = _random_model(rng, n)
    mbs, memory = rng.randint(1, 4), rng.randint(400, 1000)
    fp = Footprint.of(costs, mbs)
    steps = [simulate_plan(p, costs, workers, mbs).step_ms for p in _every_plan(n)
             if device_need(p, fp) <= memory]
    config = PlannerConfig(workers, memory, (mbs,), grains=(RecomputeGrain.STAGE,))
    if not steps:
        with pytest.raises(PlanError):
            choose_plan(lambda m: costs, config)
        return None
    choice = choose_plan(lambda m: costs, config)
    assert choice.step_ms == pytest.approx(min(steps), rel=1e-9), (n, workers, mbs, memory)
    assert choice.device_bytes <= memory
    return len(steps), choice.simulated


@pytest.mark.parametrize("lora", [False, True])
def test_step_lower_bound_never_exceeds_the_simulated_step(lora):
    """Every plan of random small models, the tail split into 1-3 jobs (``lora``: weight
    gradients shorter than the weights, or none)."""
    rng = random.Random(7)
    for n, workers, mbs in [(1, 2, 3), (3, 1, 2), (4, 3, 4), (5, 2, 1), (5, 4, 3), (4, 2, 5)]:
        costs = _random_model(rng, n, lora)
        for plan in _every_plan(n):
            for k in range(1, min(mbs, 3) + 1):
                split = replace(plan, tail_jobs=k)
                sim = simulate_plan(split, costs, workers, mbs).step_ms
                assert step_lower_bound(split, costs, workers, mbs) <= sim * (1 + 1e-9), split


@pytest.mark.parametrize("lora", [False, True])
def test_call_lower_bound_never_exceeds_any_plans_step(lora):
    """The bound of a microbatch count and tail split holds for every plan whose tail
    is at most ``max_tail`` layers (the planner skips the whole group with it)."""
    rng = random.Random(3)
    for n, workers, mbs in [(1, 2, 3), (2, 1, 1), (4, 3, 4), (5, 2, 4), (4, 2, 5), (3, 4, 6)]:
        costs = _random_model(rng, n, lora)
        for plan in _every_plan(n):
            tail = n - plan.tail.start
            for k in range(1, min(mbs, 3) + 1):
                sim = simulate_plan(replace(plan, tail_jobs=k), costs, workers, mbs).step_ms
                for longest in (None, tail, tail + 1):
                    bound = call_lower_bound(costs, workers, mbs, tail_jobs=k,
                                             max_tail=longest)
                    assert bound <= sim * (1 + 1e-9), (plan, k, longest)


def test_call_lower_bound_charges_the_first_heavy_layers_upload_and_download():
    """GPT-OSS-20B's shape: a free first layer (the embedding), then a block whose
    weights take longer to move than its compute. Nothing past the embedding computes
    before the block's weights are up (10 ms), and its gradients go down (10 ms) after
    every later layer's compute: the workers' 36 ms of work (4 microbatches of 6 + 3)
    fit only in between, so every plan takes at least 10 + 36 / 2 + 10 = 38 ms, more
    than the flow (29) or the work (18) shows."""
    costs = ModelCosts((LayerCost("embed", 0.0, 0.0, 0.0, 1.0, 0.1),
                        LayerCost("block", 2.0, 4.0, 2.0, 10.0, 0.1),
                        LayerCost("head", 1.0, 2.0, 1.0, 1.0, 0.1)), 1)
    assert call_lower_bound(costs, 2, 4) == pytest.approx(38.0)
    assert min(simulate_plan(p, costs, 2, 4).step_ms for p in _every_plan(3)) >= 38.0


def _same_choice(a, b):
    assert (a.plan.to_text(), a.microbatches, a.grain) == (b.plan.to_text(), b.microbatches,
                                                          b.grain)
    assert a.step_ms == b.step_ms and a.report == b.report


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(12, 20), workers=st.integers(2, 8), seed=st.integers(0, 10**6),
       lora=st.booleans())
def test_pruned_search_chooses_what_simulating_every_candidate_chooses(n, workers, seed,
                                                                       lora):
    """Ranked candidates (no exact search) over microbatch counts, grains and tail
    splits, heavy heads and costly uploads among them (``lora``: short or no weight
    gradient downloads): skipping what the bounds rule out changes neither the plan
    nor its simulated step."""
    rng = random.Random(seed)
    costs = _random_model(rng, n - 1, lora)
    head = costs.layers[-1]
    costs = replace(costs, layers=costs.layers + (replace(
        head, name="head", forward_ms=rng.uniform(2, 30), backward_ms=rng.uniform(4, 60)),))
    config = PlannerConfig(workers, 10**6, (1, 2, 4, 8), exhaustive=0,
                           tail_jobs=(1, 2, 3, 4))
    scaled = lambda m: replace(costs, layers=tuple(   # noqa: E731 -- microbatch of 8/m
        replace(l, forward_ms=l.forward_ms * 8 / m, recompute_ms=l.recompute_ms * 8 / m,
                backward_ms=l.backward_ms * 8 / m) for l in costs.layers))
    pruned = choose_plan(scaled, config)
    every = choose_plan(scaled, replace(config, prune=False))
    _same_choice(pruned, every)
    assert pruned.simulated <= every.simulated


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("model,lora", [
    pytest.param("qwen3-1.7b", None, marks=_SLOW), pytest.param("llama-3.1-8b", None, marks=_SLOW),
    pytest.param("gpt-oss-20b", None, marks=_SLOW), ("qwen3-32b", None),
    ("qwen3-235b-a22b", 16)])
def test_pruning_keeps_the_planners_choice_on_the_shipped_models(model, lora):
    """The paper's five models as ``rotapipe plan`` plans them (8x RTX 4090, 16 x 2048
    tokens, tails split up to 8 jobs, LoRA priced as LoRA): the pruned search picks
    the plan, grain and step that simulating every ranked candidate picks, after far
    fewer simulations. The three models whose heads split the tail are in the ``slow``
    set (4-10 s each): the random models above cover split tails and heavy heads."""
    hw = hardware("rtx4090x8")
    adapters = lora_params(model, lora) if lora else None
    grads = tuple(2 * x for x in adapters) if lora else None
    config = PlannerConfig(8, int(0.9 * hw.device.memory_bytes), (16,), grad_bytes=grads,
                           tail_jobs=tuple(range(1, 9)))
    costs = model_costs(model, hw, seq=2048, adapters=adapters)
    pruned = choose_plan(lambda m: costs, config)
    every = choose_plan(lambda m: costs, replace(config, prune=False))
    _same_choice(pruned, every)
    assert pruned.simulated <= every.simulated // 2


@pytest.mark.parametrize("n,workers,seed", [(1, 2, 5), (2, 3, 6), (7, 1, 0), (7, 2, 1),
                                            (7, 3, 2), (7, 4, 3),
                                            # 10 s; the 7-layer cases cover the same search
                                            pytest.param(8, 3, 4, marks=pytest.mark.slow)])
def test_planner_equals_brute_force_on_7_and_8_layers(n, workers, seed):
    _check_exact(random.Random(seed), n, workers)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [9, 10])
def test_planner_equals_brute_force_on_10_layers(n, workers):
    """Up to 87,381 plans each: minutes of simulation (the fast case is 7-8 layers)."""
    _check_exact(random.Random(100 * n + workers), n, workers)


@FAST
@given(times=st.lists(st.floats(0.1, 20.0), min_size=2, max_size=40),
       workers=st.integers(1, 8), mbs=st.integers(1, 16), memory=st.integers(200, 2000))
def test_every_candidate_covers_every_layer_once_and_fits(times, workers, mbs, memory):
    n = len(times)
    costs = _model(times, [t / 2 for t in times], weights=[30] * n, saved=[20] * n)
    fp = Footprint.of(costs, mbs)
    try:
        cands = candidate_plans(fp, workers, memory)
    except PlanError as exc:
        assert "layer" in str(exc) and "GiB" in str(exc)
        return
    for _, plan in cands:
        for stages in (plan.forward + (plan.tail,), plan.backward + (plan.tail,)):
            covered = [l for s in stages for l in s.layers]
            assert covered == list(range(n))
        assert device_need(plan, fp) <= memory


def test_a_plan_that_cannot_fit_names_the_layer_and_the_limit():
    costs = _model([1.0] * 4, weights=[10, 10, 500, 10], saved=[1] * 4)
    with pytest.raises(PlanError, match=r"layer 2 \(l2\) alone needs 2,051 bytes.*usable "
                                        r"device memory is 1,000 bytes"):
        choose_plan(lambda m: costs, PlannerConfig(2, 1000, (2,)))


def test_layer_grain_keeps_one_layer_of_activations_in_a_backward_stage():
    costs = _model([1.0] * 6, weights=[10] * 6, saved=[100] * 6)
    stage = Footprint.of(costs, 2, RecomputeGrain.STAGE)
    layer = Footprint.of(costs, 2, RecomputeGrain.LAYER)
    b = Direction.BACKWARD
    assert stage.working(b, 0, 3) - layer.working(b, 0, 3) == 300 - (100 + 3 * 10)
    assert layer.cost(b, 0, 3) == pytest.approx(2 * 3 * (2 * 1.0 + 2.0))   # 2x recompute


def test_planner_chooses_layer_grain_when_its_longer_stages_are_faster():
    """Tight memory and costly hops: at stage grain every backward stage must be one
    layer (a two-layer stage keeps both layers' activations); layer grain fits two-layer
    stages, crossing half the boundaries for a cheap second recompute."""
    costs = ModelCosts(tuple(LayerCost(f"l{i}", 0.01, 1.0, 0.01, 0.0, 2.0, 10, 100, 10)
                             for i in range(5)), 1, input_bytes=10)
    G = RecomputeGrain

    def best(grains):
        return choose_plan(lambda m: costs, PlannerConfig(2, 250, (2,), grains=grains))
    stage, layer, both = best((G.STAGE,)), best((G.LAYER,)), best((G.STAGE, G.LAYER))
    assert max(s.stop - s.start for s in stage.plan.backward) == 1
    assert max(s.stop - s.start for s in layer.plan.backward) == 2
    assert both.grain is G.LAYER and layer.step_ms < stage.step_ms
    assert both.step_ms == pytest.approx(min(stage.step_ms, layer.step_ms))


def test_planning_100_layers_stays_within_a_fixed_number_of_estimates(monkeypatch):
    """The candidate search on 100 layers (Qwen3-32B's blocks) stays polynomial: a
    fixed budget of job-grain estimates (374 today, about 1 ms each on 2 cores;
    ``benchmarks/plan_time.py`` prints the CPU time), not a timed assertion."""
    import rotapipe.plan.partitioner as partitioner
    hw = hardware("rtx4090x8")
    base = model_costs("qwen3-32b", hw).layers
    layers = tuple(base[1 + i % 64] for i in range(98))
    costs = ModelCosts((base[0],) + layers + (base[-1],), 2048)
    assert len(costs.layers) == 100
    calls = []
    estimate = partitioner.estimate
    monkeypatch.setattr(partitioner, "estimate",
                        lambda *a, **k: calls.append(1) or estimate(*a, **k))
    cands = candidate_plans(Footprint.of(costs, 16), 8, int(21.6 * 2**30))
    assert cands and 0 < len(calls) <= 1000, len(calls)


def test_planner_beats_the_compute_only_greedy_on_qwen3_32b():
    hw = hardware("rtx4090x8")
    choice = choose_plan(lambda m: model_costs("qwen3-32b", hw, seq=2048),
                         PlannerConfig(8, int(21.6 * 2**30), (16,)))
    greedy = simulate_plan(greedy_compute_plan(choice.costs), choice.costs, 8, 16)
    assert choice.step_ms < greedy.step_ms
    assert choice.report.bubble.total <= greedy.bubble.total



def test_the_estimate_ends_a_call_with_its_last_weight_gradient_download():
    """One worker, one microbatch, plan F0[0:1] T[1:2] B0[0:1] (hops free): F0 uploads
    0-10 and runs 10-11; T uploads 10-15 and runs 15-18; B0 uploads once F0 has ended
    and the link is free (15-25), recomputes and runs backward 25-28, and its weight
    gradients take as long as its upload (28-38). The simulator gives the same."""
    layers = (LayerCost("l0", 1.0, 2.0, 1.0, 10.0), LayerCost("l1", 1.0, 2.0, 1.0, 5.0))
    costs = ModelCosts(layers, 1)
    plan = Plan.from_text("F0[0:1] T[1:2] B0[0:1]")
    fp = Footprint.of(costs, 1)
    assert estimate_step_ms(plan, fp, 1) == pytest.approx(38.0)
    assert simulate_plan(plan, costs, 1, 1).step_ms == pytest.approx(38.0)


def test_a_lora_call_ends_with_the_adapters_gradient_download():
    """The plan above with LoRA: the weight gradients are the adapters' only
    (``grad_ms`` 1 and 0.5 ms against uploads of 10 and 5). T's download runs 18-18.5
    and B0's 28-29, so the call ends at 29, not 38; the estimate, the simulator and
    both lower bounds agree (the bounds price the same downloads)."""
    layers = (LayerCost("l0", 1.0, 2.0, 1.0, 10.0, grad_ms=1.0),
              LayerCost("l1", 1.0, 2.0, 1.0, 5.0, grad_ms=0.5))
    costs = ModelCosts(layers, 1)
    plan = Plan.from_text("F0[0:1] T[1:2] B0[0:1]")
    assert estimate_step_ms(plan, Footprint.of(costs, 1), 1) == pytest.approx(29.0)
    assert simulate_plan(plan, costs, 1, 1).step_ms == pytest.approx(29.0)
    assert step_lower_bound(plan, costs, 1, 1) <= 29.0 + 1e-9
    # ends (above flow's 10 + 6 + 1): layer 0's upload, all the work on the one
    # worker (every forward and backward, layer 0's recompute), layer 0's gradient
    # download
    assert call_lower_bound(costs, 1, 1) == pytest.approx(10.0 + 7.0 + 1.0)


@FAST
@given(times=st.lists(st.floats(0.1, 20.0), min_size=3, max_size=30),
       uploads=st.lists(st.floats(0.0, 30.0), min_size=30, max_size=30),
       workers=st.integers(2, 8), mbs=st.integers(1, 16), memory=st.integers(200, 2000))
def test_recut_candidates_only_add_plans_that_fit_and_estimate_no_slower(
        times, uploads, workers, mbs, memory):
    """The thin-first-stage and local-search families (``polish``) join the min-max
    candidates: every plan still fits, and the best estimate never gets worse."""
    n = len(times)
    costs = _model(times, uploads[:n], weights=[30] * n, saved=[20] * n)
    fp = Footprint.of(costs, mbs)
    try:
        plain = candidate_plans(fp, workers, memory, polish=0)
    except PlanError:
        return
    recut = candidate_plans(fp, workers, memory)
    assert recut[0][0] <= plain[0][0] + 1e-9 * plain[0][0]
    assert {p.to_text() for _, p in plain} <= {p.to_text() for _, p in recut}
    for est, plan in recut:
        assert device_need(plan, fp) <= memory
        assert est == pytest.approx(estimate_step_ms(plan, fp, workers))


@FAST
@given(times=st.lists(st.floats(0.1, 20.0), min_size=3, max_size=20),
       uploads=st.lists(st.floats(0.0, 30.0), min_size=20, max_size=20),
       workers=st.integers(1, 8), mbs=st.integers(1, 8), tail_jobs=st.integers(1, 3),
       calls=st.sampled_from([1, 1, 3]), seed=st.integers(0, 2**16))
def test_the_local_search_retimes_a_move_exactly_as_the_estimate(
        times, uploads, workers, mbs, tail_jobs, calls, seed):
    """The local search times a move from the first job it changes, on the state of
    the cut it starts from: the same float as :func:`estimate` of the whole plan,
    along a random walk of moves (each accepted move becomes the new base)."""
    from rotapipe.plan.estimate import Retimer, estimate
    from rotapipe.plan.partitioner import _moves
    n = len(times)
    tail_jobs = min(tail_jobs, mbs)
    fp = Footprint.of(_model(times, uploads[:n]), mbs)
    body = n - 1
    rng = random.Random(seed)
    fwd, bwd = [(i, i + 1) for i in range(body)], [(0, body)]
    timed = Retimer(fp, body, tail_jobs, workers, calls)
    timed.rebase(fwd, bwd)
    for _ in range(12):
        d = rng.random() < 0.5
        moves = list(_moves(fwd if d else bwd))
        if not moves:
            d = not d
            moves = list(_moves(fwd if d else bwd))
        runs = rng.choice(moves)
        f2, b2 = (runs, bwd) if d else (fwd, runs)
        assert timed(f2, b2) == estimate(fp, f2, body, b2, tail_jobs, workers, calls)
        if rng.random() < 0.5:
            fwd, bwd = f2, b2
            timed.rebase(fwd, bwd)


def test_recut_candidates_thin_the_first_stages_of_qwen3_32b_and_simulate_faster():
    """Qwen3-32B on 8x4090: the min-max cut makes every forward stage three blocks, so
    worker w starts its first stage w x 66 ms after worker 0; the re-cut plan starts
    with one-layer stages and its simulated step is shorter (11,848.6 -> 11,557.3 ms,
    bubble 7.9 -> 5.6%)."""
    hw = hardware("rtx4090x8")
    costs = model_costs("qwen3-32b", hw, seq=2048)
    fp = Footprint.of(costs, 16)
    memory = int(21.6 * 2**30)
    plain = candidate_plans(fp, 8, memory, polish=0, limit=1)[0][1]
    recut = candidate_plans(fp, 8, memory, limit=1)[0][1]
    assert [s.stop - s.start for s in recut.forward[:2]] == [1, 1]
    assert min(s.stop - s.start for s in plain.forward[:2]) > 1
    fast, slow = (simulate_plan(p, costs, 8, 16) for p in (recut, plain))
    assert fast.step_ms < 0.985 * slow.step_ms
    assert fast.bubble.total < slow.bubble.total - 0.015

# -- host memory --------------------------------------------------------------------


def test_host_memory_arithmetic_full_and_lora():
    costs = _model([1.0] * 3, weights=[200, 400, 600], out=50)   # bf16: 100/200/300 params
    plan = next(p for p in all_plans(3) if len(p.forward) == 2 and len(p.backward) == 1
                and p.tail.start == 2)   # F0[0:1] F1[1:2] T[2:3] B0[0:2]
    full = host_memory(costs, plan, microbatches=4, workers=2)
    assert full.weights == 1200                       # compute dtype, every parameter
    # fp32 .grad + the accumulating call's gradients, staged in the compute dtype (bf16)
    assert full.masters == 4 * 600 and full.gradients == 4 * 600 + 2 * 600
    assert full.staged == 2 * 600
    fp32 = host_memory(costs, plan, 4, 2, dtype_bytes=4)        # fp32 compute: two copies
    assert fp32.gradients == 2 * fp32.masters and fp32.staged == fp32.masters
    one = host_memory(costs, plan, 4, 2, staged_grads=False)    # one call per step
    assert one.gradients == 4 * 600 and one.staged == 0
    assert host_memory(costs, plan, 4, 2, staged_bytes=4).gradients == 2 * 4 * 600
    lean = host_memory(costs, plan, 4, 2, layout="lean")        # one call per step
    assert lean.staged == 0 and lean.gradients == 4 * 600       # the window covers all 3
    assert full.optimizer == 8 * 600                  # Adam: two fp32 moments
    assert full.pinned_buffers == 2 * 2 * 600         # two of the largest grad stage
    # boundaries 0 (B0 start: the input), 1 (F0 out), 2 (F1 out, tail start), plus an
    # input and a gradient per microbatch in flight; _model's input is 50 bytes too
    assert full.checkpoints == 4 * (50 + 50 + 50 + 50 + 50)
    # fp32 compute: each master is its own compute copy
    assert fp32.weights == 0 and fp32.masters == 4 * 300
    # stale: a second compute copy; the next call's staged gradients even with one call
    # per step; without a clip the per-stage steps' undo copies (weights, state, the
    # compute copy overwritten), with one none
    stale = host_memory(costs, plan, 4, 2, layout="stale", staged_grads=False)
    assert stale.weights == 2 * 1200 and stale.gradients == 4 * 600 + 2 * 600
    assert stale.snapshots == 4 * 600 + 8 * 600 + 2 * 600
    assert host_memory(costs, plan, 4, 2, layout="stale", clip=True).snapshots == 0
    assert host_memory(costs, plan, 4, 2, layout="stale", dtype_bytes=4).weights == 2 * 1200
    # a head tied to the embedding: one tensor (the head's 300 parameters hold 100 of
    # the embedding's)
    tied = host_memory(replace(costs, shared_bytes=200), plan, 4, 2)
    assert tied.weights == 1000 and tied.masters == 4 * 500
    lora = host_memory(costs, plan, 4, 2, trainable_params=[0, 7, 0])
    assert lora.masters == 28 and lora.optimizer == 56 and lora.gradients == 28 + 14
    assert lora.weights == 1200 + 14                  # frozen weights + adapter copies


def test_host_memory_counts_what_each_pin_mode_page_locks():
    costs = _model([1.0] * 3, weights=[200, 400, 600], out=50)
    plan = next(p for p in all_plans(3) if len(p.forward) == 2 and len(p.backward) == 1
                and p.tail.start == 2)
    reg = host_memory(costs, plan, 4, workers=2)            # the default: register
    copy = host_memory(costs, plan, 4, 2, pin="copy")
    off = host_memory(costs, plan, 4, 2, pin=rotapipe.PinMode.OFF, chunk_mb=1)
    base = reg.total
    assert reg.pin is rotapipe.PinMode.REGISTER
    # register: the weights are page-locked in place, no extra bytes
    assert reg.bounce_buffers == reg.transient == 0
    assert reg.pinned == 1200 + reg.pinned_buffers + reg.checkpoints
    assert reg.pageable == reg.masters + reg.optimizer + reg.gradients
    # copy: the same steady state, plus the largest weight held twice while copied
    assert copy.transient == 600 and copy.total == base + 600
    assert copy.pinned == reg.pinned and copy.pageable == reg.pageable + 600
    assert host_memory(costs, plan, 4, 2, pin="copy", largest_tensor=256).transient == 256
    # off: weights pageable; two chunks of 1 MiB per worker page-locked for uploads
    assert off.bounce_buffers == 2 * 2 * 2**20 and off.total == base + 2 * 2 * 2**20
    assert off.pinned == off.pinned_buffers + off.checkpoints + off.bounce_buffers
    assert off.pageable == reg.pageable + 1200
    assert sum(v for k, v in off.as_dict().items() if k != "total") == off.total
    # below a GB in MB: 4 MiB of bounce buffers
    assert "bounce buffers 4.2" in off.describe() and "transient" not in off.describe()
    assert " MB = " in off.describe()
    assert 'pin="off"' in off.describe_pinned()
    with pytest.raises(rotapipe.ConfigError, match=r"pin='pinned': use one of 'copy', "
                                                    r"'register', 'off'"):
        host_memory(costs, plan, 4, 2, pin="pinned")


def test_lora_params_follow_the_config():
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}
    p = lora_params(cfg, rank=8)
    per_block = 8 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64))
    assert p == (0, per_block, per_block, 0)


def test_qwen3_32b_full_needs_about_600_gb_of_host_ram():
    hw = hardware("rtx4090x1")
    costs = model_costs("qwen3-32b", hw)
    plan = greedy_compute_plan(costs)
    host = host_memory(costs, plan, 16, 1)
    # 32.8 B parameters x (2 bf16 + 4 master + 8 Adam + 4 grads + 2 staged bf16) = 656 GB
    # + checkpoints
    assert 656e9 < host.total < 690e9
    lora = host_memory(costs, plan, 16, 1,
                       trainable_params=lora_params("qwen3-32b"))
    assert lora.total < 0.15 * host.total


# -- measured costs -----------------------------------------------------------------


def test_measured_costs_average_and_override_the_estimate():
    base = _model([1.0, 1.0, 1.0])
    m = MeasuredCosts(3, alpha=0.5, min_samples=2)
    m.record(1, Pass.FORWARD, 4.0)
    assert m.apply(base).layers[1].forward_ms == 1.0      # one sample: not yet used
    m.record(1, "forward_ms", 2.0)
    assert m.apply(base).layers[1].forward_ms == pytest.approx(3.0)
    assert m.apply(base).layers[0].forward_ms == 1.0
    with pytest.raises(Exception, match="layer 5"):
        m.record(5, Pass.BACKWARD, 1.0)


def test_plan_refiner_replans_on_change_and_freezes_when_stable():
    base = _model([1.0] * 6)
    calls = []

    def planner(costs):
        calls.append(costs)
        return choose_plan(lambda m: costs, PlannerConfig(2, 10**9, (4,), exhaustive=0)).plan

    first = planner(base)
    refiner = PlanRefiner(planner, base, first, patience=2)
    m = MeasuredCosts(6, alpha=1.0, min_samples=1)
    for step in range(8):
        slow = 8.0 if step >= 1 else 1.0             # layer 0 turns out 8x slower
        for i in range(6):
            m.record(i, Pass.FORWARD, slow if i == 0 else 1.0)
        refiner.update(m)
    assert refiner.frozen
    n = len(calls)
    m.record(0, Pass.FORWARD, 50.0)
    refiner.update(m)
    assert len(calls) == n                            # frozen: no more re-planning
    assert refiner.replans >= 1 and refiner.plan != first   # the slowdown moved cuts
