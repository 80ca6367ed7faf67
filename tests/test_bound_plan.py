"""``bound_plan``: the baselines' cut prices what their schedules run (the last chunk is
never recomputed), and its heaviest chunk is the lightest any cut reaches (brute force);
the two recompute modes differ only in when a recompute may start."""

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from rotapipe.plan import LayerCost, ModelCosts, Recompute, bound_plan
from rotapipe.schedule import ActionKind as K, one_f_one_b_schedule, validate
from rotapipe.sim import simulate


def _costs(triples) -> ModelCosts:
    return ModelCosts(tuple(LayerCost(f"l{i}", f, b, r, hop_ms=0.05)
                            for i, (f, b, r) in enumerate(triples)), 1)


def _chunk_cost(costs: ModelCosts, a: int, b: int, recompute: bool) -> float:
    """What a bound schedule runs for chunk [a, b) per microbatch."""
    last = b == len(costs.layers)
    return sum(l.forward_ms + l.backward_ms + (l.recompute_ms if recompute and not last
                                                else 0.0) for l in costs.layers[a:b])


def _cuts(n: int, k: int):
    for inner in itertools.combinations(range(1, n), k - 1):
        bounds = (0,) + inner + (n,)
        yield list(zip(bounds, bounds[1:]))


def _score(costs, runs, recompute, devices):
    chunk = [_chunk_cost(costs, a, b, recompute) for a, b in runs]
    load = [sum(chunk[d::devices]) for d in range(devices)]
    return max(chunk), max(load)


def _runs(plan):
    return [(s.start, s.stop) for s in plan.forward] + [(plan.tail.start, plan.tail.stop)]


layer = st.tuples(st.floats(0.1, 10.0), st.floats(0.1, 20.0), st.floats(0.0, 10.0))


@settings(max_examples=150, deadline=None)
@given(layers=st.lists(layer, min_size=1, max_size=9), chunks=st.integers(1, 5),
       per_device=st.integers(1, 3), recompute=st.booleans())
def test_heaviest_chunk_is_the_brute_force_best(layers, chunks, per_device, recompute):
    costs = _costs(layers)
    n = len(layers)
    chunks = min(chunks * per_device, n)
    devices = max(1, chunks // per_device)
    plan = bound_plan(costs, chunks, devices=devices, recompute=recompute)
    runs = _runs(plan)
    assert len(runs) == chunks and runs[0][0] == 0 and runs[-1][1] == n
    got = _score(costs, runs, recompute, devices)
    best = min(_score(costs, r, recompute, devices)[0] for r in _cuts(n, chunks))
    assert got[0] == pytest.approx(best, rel=1e-9, abs=1e-12)
    if devices == chunks:
        return
    # Among the lightest-heaviest cuts the device balancing never makes the busiest
    # device worse than the first such cut the min-max search gives.
    first = bound_plan(costs, chunks, devices=chunks, recompute=recompute)
    assert got[1] <= _score(costs, _runs(first), recompute, devices)[1] + 1e-9


def test_the_tail_is_priced_without_recompute():
    # Five equal layers (forward 1, backward 2, recompute 1), four chunks. With
    # recompute a chunk costs 4 per layer, but the last chunk is never recomputed: 3 per
    # layer. Priced right, the last chunk takes two layers (6, the heaviest chunk);
    # pricing its recompute too would put two layers in a middle chunk (8).
    costs = _costs([(1.0, 2.0, 1.0)] * 5)
    plan = bound_plan(costs, 4, recompute=True)
    assert _runs(plan) == [(0, 1), (1, 2), (2, 3), (3, 5)]
    assert max(_chunk_cost(costs, a, b, True) for a, b in _runs(plan)) == 6.0
    # Without recompute every chunk costs 3 per layer (the cut split_balanced gives).
    assert _runs(bound_plan(costs, 4)) == [(0, 1), (1, 2), (2, 4), (4, 5)]


def test_recompute_modes_differ_in_when_a_recompute_may_start():
    costs = _costs([(1.0, 2.0, 1.0)] * 8)
    plan = bound_plan(costs, 4, recompute=True)
    ahead = one_f_one_b_schedule(plan, 4, 6, recompute="ahead")
    after = one_f_one_b_schedule(plan, 4, 6, recompute=Recompute.AFTER_GRAD)
    assert one_f_one_b_schedule(plan, 4, 6, recompute=True) == ahead
    for s in (ahead, after):
        validate(s, dataflow=True)
    deps = {s.name: {a.key: a.deps for a in s.actions if a.kind is K.RECOMPUTE}
            for s in (ahead,)}
    waits = {a.key: a.deps for a in after.actions if a.kind is K.RECOMPUTE}
    assert deps["1f1b"].keys() == waits.keys()
    for key, d in waits.items():
        grads = [x for x in d if x.startswith(("UG:", "BK:", "B:"))]
        assert len(grads) == 1 and grads[0] not in deps["1f1b"][key], key
    # Waiting can only cost time.
    t_ahead = simulate(ahead, costs).report.step_ms
    t_after = simulate(after, costs).report.step_ms
    assert t_after >= t_ahead - 1e-9
    with pytest.raises(Exception, match="after-grad"):
        one_f_one_b_schedule(plan, 4, 6, recompute="sometimes")
