"""The runtime's own plan leaves room for activations (docs/planning.md, "The runtime's
plan"): the first plan sees weights only, the first call's microbatches are measured
on fake tensors, and a plan that no longer fits the worker budget with them is
replaced before any work; when no plan can fit, the call is refused with the budget,
the need and the fix. Results stay exact.

The model: residual layers of tiny width (16) run on long microbatches (32 rows), so
that a microbatch's activations are several times a layer's weights, the regime of long
sequences on small hidden sizes."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import rotapipe
from models import Residual, emulated, reference_forward_backward
from rotapipe.plan.partitioner import Footprint
from rotapipe.planner import pipeline as pipe_plan
from rotapipe.planner.autoplan import device_need

LAYERS, DIM, BATCH, MICROBATCHES = 8, 16, 64, 2
BUDGET = 24 * 2**10
"""The weights-only plan (stages of up to 4 layers) runs out of it on its first call
(its 2-layer backward stage keeps 2 layers' activations beside 2 stages of weights);
one-layer stages peak at 22,916 bytes. No plan passes the planner's (sufficient) bound
below 37,376 bytes."""

mse = nn.functional.mse_loss


def residual_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Residual(DIM, DIM) for _ in range(LAYERS)])


def batch(rows: int = BATCH, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, DIM, generator=g), torch.randn(rows, DIM, generator=g)


def bound(pipe) -> int:
    """The planner's bound on the busiest worker's bytes for the pipeline's plan, with
    the activations it measured."""
    p = pipe._planner
    fp = Footprint.of(p.base, pipe.config.microbatches, pipe.config.grain, p.grad_bytes,
                      pipe.config.prefetch)
    return device_need(pipe.plan, fp) + p.reserve


def test_the_first_call_replans_for_its_activations_and_stays_exact():
    model = residual_mlp()
    ref = copy.deepcopy(model)
    config = emulated(1, MICROBATCHES, device_memory=BUDGET)
    with rotapipe.RoundPipe(model, mse, config=config) as pipe:
        first = pipe.plan
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        pipe.attach_optimizer(opt)
        for call in range(2):         # the second on the weights of one step
            x, y = batch(seed=call)
            loss = pipe.forward_backward(x, y)
            want = reference_forward_backward(ref, x, y, MICROBATCHES, call, loss_fn=mse)
            assert abs(loss - want) <= 1e-6 + 1e-5 * abs(want)
            for p, q in zip(pipe.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
            pipe.step()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        for p, q in zip(pipe.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert pipe.plan != first and pipe._planner.source == pipe_plan.FALLBACK
        assert all(s.stop - s.start == 1 for s in pipe.plan.jobs())
        assert pipe._planner.activations.saved_bytes[0] > 0
        assert max(pipe.peak_memory()) <= BUDGET


def test_a_plan_that_passes_the_bound_with_the_activations_replaces_the_first():
    budget = 38 * 2**10
    with rotapipe.RoundPipe(residual_mlp(), mse, config=emulated(
            1, MICROBATCHES, device_memory=budget)) as pipe:
        first = pipe.plan
        pipe.forward_backward(*batch())
        assert pipe.plan != first and pipe._planner.source == "planner"
        assert max(pipe.peak_memory()) <= bound(pipe) <= budget


def test_a_longer_microbatch_later_replans_again():
    budget = 38 * 2**10
    config = emulated(1, MICROBATCHES, device_memory=budget)
    with rotapipe.RoundPipe(residual_mlp(), mse, config=config) as pipe:
        first = pipe.plan
        pipe.forward_backward(*batch(4))         # 2 rows a microbatch: weights dominate
        assert pipe.plan == first
        pipe.forward_backward(*batch(BATCH))     # 16x longer: no longer fits
        assert pipe.plan != first and bound(pipe) <= budget
        long = pipe.plan
        pipe.forward_backward(*batch(16))        # shorter again: the plan stays
        assert pipe.plan == long and max(pipe.peak_memory()) <= budget


def test_evaluation_first_leaves_room_for_its_activations():
    config = emulated(1, MICROBATCHES, device_memory=BUDGET)
    with rotapipe.RoundPipe(residual_mlp(), mse, config=config) as pipe:
        x, _ = batch()
        torch.testing.assert_close(pipe(x), residual_mlp()(x), rtol=1e-5, atol=1e-6)
        # An evaluation keeps nothing for a backward (before, it was measured as a
        # training call: a large evaluation batch re-planned, or was refused, for
        # activations no call keeps).
        assert pipe._planner.activations is not None
        assert not any(pipe._planner.activations.saved_bytes)
        pipe.forward_backward(*batch())         # and the training call after it
        assert all(pipe._planner.activations.saved_bytes)
        assert max(pipe.peak_memory()) <= BUDGET


def test_no_plan_can_fit_is_refused_before_any_work_with_the_fix():
    """The fused tail alone (its weights and a microbatch's activations) exceeds the
    budget: no plan fits. The call changes nothing; a shorter batch then trains."""
    model = residual_mlp()
    ref = copy.deepcopy(model)
    # Room to spare for the short batch: at 8 KiB its one-layer stages ran out of
    # memory in a loaded CI run (a download still in flight beside the bound).
    budget = 12 * 2**10
    with rotapipe.RoundPipe(model, mse, config=emulated(1, MICROBATCHES,
                                                       device_memory=budget)) as pipe:
        with pytest.raises(rotapipe.DeviceOutOfMemoryError,
                           match=r"no plan fits the worker budget of 12\.0 KiB: the fused "
                                 r"tail \[7:8\] alone needs [\d.]+ KiB .* Fix: raise "
                                 r"device_memory, or lower the activations of a microbatch "
                                 r"\(more microbatches, shorter sequences\) \(to at least"):
            pipe.forward_backward(*batch())
        assert all(p.grad is None for p in pipe.parameters()) and pipe.calls == 0
        x, y = batch(4)
        loss = pipe.forward_backward(x, y)
    want = reference_forward_backward(ref, x, y, MICROBATCHES, 0, loss_fn=mse)
    assert abs(loss - want) <= 1e-6 + 1e-5 * abs(want)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_when_only_the_bound_fits_nothing_the_call_runs_with_a_warning(caplog):
    """Between the two (the tail fits, no plan passes the sufficient bound) the call
    runs on the plan of one-layer stages, and a warning names budget, need and fix."""
    budget = 23 * 2**10
    with rotapipe.RoundPipe(residual_mlp(), mse, config=emulated(
            1, MICROBATCHES, device_memory=budget)) as pipe, \
            caplog.at_level(logging.WARNING, "rotapipe.planner.pipeline"):
        pipe.forward_backward(*batch())
        assert all(s.stop - s.start == 1 for s in pipe.plan.jobs())
        assert max(pipe.peak_memory()) <= budget
    assert "no plan fits the worker budget of 23.0 KiB" in caplog.text
    assert "raise device_memory" in caplog.text


@pytest.mark.parametrize("workers,microbatches,grain,mode,prefetch", [
    (1, 2, "stage", "sync", 1), (2, 4, "layer", "sync", 1), (2, 2, "stage", "overlap", 1),
    (3, 1, "layer", "stale", 1), (1, 2, "stage", "sync", 2)])
def test_the_planners_bound_covers_the_measured_peak(workers, microbatches, grain, mode,
                                                      prefetch):
    """Whatever the planner picks under a budget, the emulated meter's peak on every
    worker stays within the planner's bound with the measured activations."""
    torch.manual_seed(workers)
    model = nn.Sequential(*[Residual(DIM, w) for w in (8, 32, 16, 64, 8, 32)])
    x, y = batch()
    budget = 96 * 2**10
    config = emulated(workers, microbatches, grain=grain, optimizer_mode=mode,
                      device_memory=budget, prefetch=prefetch)
    with rotapipe.RoundPipe(model, mse, config=config) as pipe:
        pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=1e-2))
        for _ in range(2):
            pipe.train_step(x, y)
        pipe.flush()
        assert pipe._planner.source == "planner"
        assert max(pipe.peak_memory()) <= bound(pipe) <= budget


def test_a_deeper_weight_prefetch_is_in_the_memory_bound():
    """``prefetch=2`` keeps three stages' weights on a worker: the planner counts two
    prefetched stages beside each (it counted one, and the plan it chose ran out of
    memory on every call: 8 layers of L bytes, one worker, a budget of 5 L)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Residual(64, 256) for _ in range(8)])
    ref = copy.deepcopy(model)
    L = sum(p.numel() * 4 for p in model[0].parameters())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
    config = emulated(1, MICROBATCHES, device_memory=5 * L, prefetch=2)
    with rotapipe.RoundPipe(model, mse, config=config) as pipe:
        loss = pipe.forward_backward(x, y)
        assert max(pipe.peak_memory()) <= 5 * L
        fp = Footprint.of(pipe._planner.base, MICROBATCHES, pipe.config.grain,
                          pipe._planner.grad_bytes, prefetch=2)
        assert fp.needs("forward", 0, 1, 10) == fp.needs("forward", 0, 1, 0) + 20
    want = reference_forward_backward(ref, x, y, MICROBATCHES, 0, loss_fn=mse)
    assert abs(loss - want) <= 1e-6 + 1e-5 * abs(want)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_weights_that_fit_no_plan_get_one_layer_stages_and_the_fix(caplog):
    """At construction, when the planner's bound fits no plan with the weights alone,
    the pipeline takes the plan of one-layer stages (the least device memory; it took
    the even partition, whose stages hold several layers) and says what to raise."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Residual(64, 256) for _ in range(6)])
    L = sum(p.numel() * 4 for p in model[0].parameters())
    with caplog.at_level(logging.WARNING, "rotapipe.planner.pipeline"), \
            rotapipe.RoundPipe(model, mse, config=emulated(
                1, MICROBATCHES, device_memory=7 * L // 2)) as pipe:
        assert pipe._planner.source == pipe_plan.FALLBACK
        assert all(s.stop - s.start == 1 for s in pipe.plan.jobs())
    assert "with its weights by the planner's bound" in caplog.text
    assert "Fix: raise device_memory" in caplog.text


def test_rotapipe_plan_counts_the_prefetched_stages_in_device_memory():
    """``rotapipe plan --prefetch 2`` plans for three resident stages per worker: a
    plan for one prefetched stage filled 19.0 of 21.6 GiB, and a second one would not
    fit beside it."""
    from rotapipe.plan import hardware
    from rotapipe.planner import analyze
    hw = hardware("rtx4090x1")
    one, two = (analyze("qwen3-32b", hw, seq=2048, global_batch=16, microbatches=16,
                        prefetch=p) for p in (1, 2))
    limit = int(0.9 * hw.device.memory_bytes)
    assert one.choice.device_bytes < two.choice.device_bytes <= limit
    assert two.longest_seq < one.longest_seq


class _ScaledBy(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(DIM))

    def forward(self, x):
        return x * self.scale


@pytest.mark.parametrize("keep", [False, True])
def test_activations_are_measured_in_the_dtypes_the_workers_hold(keep):
    """Under bf16 a floating buffer computes in bf16 (one kept in fp32, ``keep_fp32``,
    in fp32), and the measured output bytes follow: the measurement used to run every
    buffer in its own dtype (an fp32 buffer promoted the output to 4 bytes a value)."""
    from rotapipe.model.layers import LayerSet
    from rotapipe.planner.activations import measure_activations
    model = nn.Sequential(_ScaledBy(), _ScaledBy())
    layerset = LayerSet(model, [model[0].scale] if keep else ())
    x = torch.randn(8, DIM, dtype=torch.bfloat16)
    acts = measure_activations(layerset, x, None, torch.bfloat16, 1, training=False)
    assert acts.output_bytes == (8 * DIM * (4 if keep else 2), 8 * DIM * (4 if keep else 2))
