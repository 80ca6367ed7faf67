"""The runtime's plan (rotapipe.planner.pipeline): the planner by default, explicit plans kept
or rejected with the fix, explicit stage counts honoured, and measured refinement that
converges, freezes, and never changes the numbers."""

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import rotapipe
from models import emulated, lm_loss, reference_forward_backward, tiny_transformer, token_batch
from rotapipe.planner import pipeline as pipe_plan
from rotapipe.config import PartitionMode, RecomputeGrain
from rotapipe.model import LayerSet, estimate_work, set_work
from rotapipe.model.work import MIN_FLOPS
from rotapipe.plan import Plan, even_plan
from rotapipe.planner.measured import Pass
from rotapipe.schedule import Action, ActionKind as K
from rotapipe.planner.autoplan import PlannerConfig, choose_plan


def _layer_params(model):
    return [sum(p.numel() for p in layer.parameters()) for layer in model]


def test_default_plan_comes_from_the_planner_and_is_exact():
    model = tiny_transformer(widths=(24, 160, 8, 32))   # one block 5x wider than the rest
    ref = copy.deepcopy(model)
    n = len(model)
    params = _layer_params(model)
    costs = pipe_plan.work_costs(estimate_work(model, 4), [4 * p for p in params])
    expected = choose_plan(lambda m: costs, PlannerConfig(
        2, 2**62, (2,), grains=(RecomputeGrain.STAGE,), exhaustive=pipe_plan.RUNTIME_EXHAUSTIVE,
        tail_layers=1)).plan
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2)) as pipe:
        assert pipe.plan == expected
        assert pipe.plan != even_plan(n, 4, 12, 1)
        assert pipe._planner.source == "planner"
        x, y = token_batch(8)
        loss = pipe.forward_backward(x, y)
        grads = {k: p.grad.clone() for k, p in pipe.named_parameters()}
    want = reference_forward_backward(ref, x, y, 2, call=0)
    assert loss == pytest.approx(want, rel=1e-5)
    for k, p in ref.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-6)


def test_explicit_plan_is_kept_and_explicit_counts_select_the_even_partition():
    model = tiny_transformer()
    n = len(model)
    plan = Plan.from_text("F0[0:1] F1[1:4] T[4:6] B0[0:2] B1[2:3] B2[3:4]")
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2), plan=plan) as pipe:
        assert pipe.plan is plan and pipe._planner.source == "explicit"
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2, forward_stages=2)) as pipe:
        assert pipe.plan == even_plan(n, 2, 6, 1) and pipe._planner.source == "even"
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2, partition="even")) as pipe:
        assert pipe.plan == even_plan(n, 4, 12, 1)


def test_an_invalid_explicit_plan_names_the_problem_and_the_fix():
    model = tiny_transformer()
    with pytest.raises(rotapipe.ConfigError, match=r"covers 5 layers but the model has 6: "
                                                    r"build the plan for 6 layers"):
        rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2), plan=even_plan(5, 2, 2))
    with pytest.raises(rotapipe.ConfigError, match=r"not a rotapipe.plan.Plan.*Plan.from_text"):
        rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2), plan="F0[0:5] T[5:6]")
    whole = Plan.from_text("F0[0:5] T[5:6] B0[0:5]")
    budget = sum(p.numel() * 4 for p in model[1:3].parameters())   # two blocks, not five
    with pytest.raises(rotapipe.ConfigError, match=r"stage F0\[0:5\] needs [\d.]+ KiB for its "
                                                    r"weights alone.*raise device_memory"):
        rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2, device_memory=budget),
                           plan=whole)
    with pytest.raises(rotapipe.ConfigError, match=r"partition='fast' is invalid: use one of "
                                                    r"'auto', 'even', 'refine'"):
        rotapipe.PipeConfig(partition="fast")


def test_stage_samples_spread_a_stage_over_its_layers_by_the_estimate():
    costs = pipe_plan.parameter_costs([9, 19, 0], [0, 0, 0])   # forward 10 : 20 : 1
    plan = Plan.from_text("F0[0:2] T[2:3] B0[0:2]")
    stages = {s.name: s for s in plan.jobs()}
    spans = [(Action(K.FORWARD, 0, "F0", 0), 1.0, 1.003),     # 3 ms over layers 0, 1
             (Action(K.FUSED, 1, "T", 0), 2.0, 2.006),        # forward 1 : backward 2
             (Action(K.UPLOAD_WEIGHTS, 0, "B0"), 0.0, 5.0)]   # not compute: ignored
    got = list(pipe_plan.stage_samples(spans, stages, costs))
    assert [(l, p) for l, p, _ in got] == [(0, Pass.FORWARD), (1, Pass.FORWARD),
                                           (2, Pass.FORWARD), (2, Pass.BACKWARD)]
    assert [ms for *_, ms in got] == pytest.approx([1.0, 2.0, 2.0, 4.0])


def test_refinement_converges_then_freezes_and_stays_exact(monkeypatch):
    """Fake, deterministic timings: block 3 (layer 3) turns out 40x slower than its
    parameters say. The plan moves once, then freezes; every call stays exact."""
    slow = {3: 40.0}

    def fake_samples(spans, stages, estimate):
        for i, l in enumerate(estimate.layers):
            base = 1.0 * slow.get(i, 1.0)
            for _ in range(3):
                yield i, Pass.FORWARD, base
                yield i, Pass.RECOMPUTE, base
                yield i, Pass.BACKWARD, 2 * base

    monkeypatch.setattr(pipe_plan, "stage_samples", fake_samples)
    model = tiny_transformer()
    ref = copy.deepcopy(model)
    x, y = token_batch(8)
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2, partition="refine")) as pipe:
        first = pipe.plan
        plans, losses = [], []
        for call in range(7):
            if call == 5:
                slow[3] = 1.0                       # timings move after the freeze
            losses.append(pipe.forward_backward(x, y))
            plans.append(pipe.plan)
        refiner = pipe._planner.refiner
        assert refiner.frozen and refiner.replans == 1
        assert plans[0] != first                    # re-planned after the first call
        assert len(set(plans)) == 1                 # then never again
        grads = {k: p.grad.clone() for k, p in pipe.named_parameters()}
    for call, loss in enumerate(losses):
        assert loss == pytest.approx(reference_forward_backward(ref, x, y, 2, call), rel=1e-5)
    for k, p in ref.named_parameters():   # accumulated: the mean over every call's samples
        torch.testing.assert_close(grads[k], p.grad / len(losses), rtol=1e-4, atol=1e-6)


def test_refinement_replans_take_the_ranked_candidates(monkeypatch):
    """The first plan of a 6-layer model is exact; a re-plan, run in the caller's
    thread between calls, is not (benchmarks/replan_time.py: 0.2-1.6 s a time with one
    worker, against milliseconds)."""
    import rotapipe.planner.autoplan as autoplan
    searched = []
    exact = autoplan.exact_search
    monkeypatch.setattr(autoplan, "exact_search",
                        lambda *a, **k: searched.append(1) or exact(*a, **k))
    with rotapipe.RoundPipe(tiny_transformer(), lm_loss,
                            config=emulated(1, 4, partition="refine")) as pipe:
        assert searched                       # the first plan
        searched.clear()
        planner = pipe._planner
        plan = planner.refiner.planner(planner.base)
        assert not searched and plan.num_layers == len(planner.base.layers)


def test_refinement_from_real_timings_runs_and_stops_after_its_calls():
    model = tiny_transformer()
    x, y = token_batch(8)
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2, partition="refine")) as pipe:
        pipe._planner.refine_calls = 3
        for _ in range(3):
            pipe.forward_backward(x, y)
        assert not pipe._planner.refining
        assert pipe._planner.measured.averages()    # the executor's spans were recorded


# -- costs without a hardware profile -------------------------------------------------


def test_estimate_prices_lookups_by_bytes_and_weights_by_flops():
    dim, vocab = 16, 61
    untied, tied = tiny_transformer(dim=dim), tiny_transformer(dim=dim, tied=True)
    for model in (untied, tied):
        works = estimate_work(list(model) + [nn.ReLU()], dtype_bytes=2)
        embed, blocks, head, relu = works[0], works[1:-2], works[-2], works[-1]
        # The embedding is a lookup: one row read and written per token, no FLOPs.
        assert embed.forward_flops == 0 and embed.memory_bytes == 2 * dim * 2
        assert embed.params == vocab * dim
        for block, layer in zip(blocks, list(model)[1:-1]):
            n = sum(p.numel() for p in layer.parameters())
            assert block.forward_flops == 2 * n and block.backward_flops == 4 * n
        # The head multiplies by its (own or tied) vocab x dim weight: 2 FLOPs a weight.
        assert head.forward_flops == 2 * (vocab * dim + 2 * dim) and head.memory_bytes == 0
        assert relu.forward_flops == MIN_FLOPS > 0   # parameter-free: cheap, not free
    costs = pipe_plan.work_costs(estimate_work(untied, 2), [0] * len(untied))
    assert costs.layers[0].forward_ms == pytest.approx(
        pipe_plan.NOMINAL_FLOPS_PER_BYTE * 2 * dim * 2 * 1e-9)
    assert costs.layers[0].backward_ms == pytest.approx(2 * costs.layers[0].forward_ms)
    # At a real vocabulary, parameter counts price the embedding like the head; the
    # estimate prices it at a row per token (a 32k vocabulary: 1/160 of the head).
    pair = [nn.Embedding(32000, 64), nn.Linear(64, 32000, bias=False)]
    by_params = pipe_plan.parameter_costs(_layer_params(pair), [0, 0])
    assert by_params.layers[0].forward_ms == by_params.layers[1].forward_ms
    by_work = pipe_plan.work_costs(estimate_work(pair, 2), [0, 0])
    assert by_work.layers[1].forward_ms == pytest.approx(160 * by_work.layers[0].forward_ms)


def test_work_set_on_a_layer_overrides_the_estimate():
    model = tiny_transformer()
    work = rotapipe.plan.LayerWork("mine", 1e6, 3e6, 0, 0.0, 0.0)
    set_work(model[2], work)
    works = estimate_work(copy.deepcopy(model))     # kept through the workers' copies
    assert works[2] is not work and works[2] == work
    assert works[1].forward_flops < 1e6
    with pytest.raises(TypeError, match="LayerWork"):
        set_work(model[1], {"forward_flops": 1.0})


def _fake_cuda(workers: int):
    return [SimpleNamespace(torch_device=torch.device("cuda", i), budget=2**30)
            for i in range(workers)]


def test_auto_refines_on_cuda_unless_data_parallel(monkeypatch):
    layers = LayerSet(tiny_transformer())

    def planner(devices, **kw):
        config = rotapipe.PipeConfig(workers=2, microbatches=2, **kw)
        p = pipe_plan.PipePlanner.for_pipeline(config, layers, devices, False)
        p.initial(None)
        return p

    cuda = planner(_fake_cuda(2))
    assert cuda.mode is PartitionMode.REFINE and cuda.refining
    cpu = planner([SimpleNamespace(torch_device=torch.device("cpu"), budget=None)] * 2)
    assert cpu.mode is PartitionMode.AUTO and cpu.refiner is None
    assert planner(_fake_cuda(2), partition="even").mode is PartitionMode.EVEN
    # Data parallel ranks must keep one plan: asked for, or auto with several ranks.
    assert planner(_fake_cuda(2), data_parallel=True).refiner is None
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert planner(_fake_cuda(2)).mode is PartitionMode.AUTO
    assert planner(_fake_cuda(2), data_parallel=False).mode is PartitionMode.REFINE
