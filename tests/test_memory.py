"""Device-memory budget of emulated workers: a worker with a budget of one stage's
working set trains a model whose weights are many times that budget, within budget;
a budget too small for one stage fails with a clear out-of-memory error.

How the budget is chosen. The model is ``LAYERS`` identical residual MLP layers run one
layer per stage (``forward_stages = backward_stages = LAYERS - 1``, a one-layer fused
tail), so a stage's weights are one layer's weights ``L``. What one stage job needs on
a worker under the RoundPipe schedule:

- its weights, plus the next job's weights being prefetched: the generator keeps at
  most two stages' weights resident per worker (an upload waits for the free of the
  job two back on that worker): ``2 L``;
- its weight gradients until they are downloaded, plus the previous job's if that
  download is still in flight: ``2 L`` at most;
- activations, input gradients and the autograd working set of a few microbatches: a
  few KiB here, given ``L / 4`` of room.

So ``BUDGET = 4.25 L``, and the model's weights are ``LAYERS x L = 40 L``, 9.4x it.
"""

from __future__ import annotations

import copy
import gc
import re
import threading
import time

import pytest
import torch
from torch import nn

import rotapipe
from models import Residual, emulated, reference_forward_backward
from rotapipe.runtime.chunks import ChunkedCopies

DIM, HIDDEN, LAYERS = 64, 256, 40
BATCH, MICROBATCHES = 16, 2


def deep_mlp(layers: int = LAYERS) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[Residual(DIM, HIDDEN) for _ in range(layers)])
    with torch.no_grad():               # keep 40 residual layers well conditioned
        for layer in model:
            layer.down.weight.mul_(0.1)
    return model


def layer_bytes(model: nn.Sequential) -> int:
    return sum(p.numel() * p.element_size() for p in model[0].parameters())


def one_layer_stages(workers: int, **kw) -> rotapipe.PipeConfig:
    return emulated(workers, MICROBATCHES, forward_stages=LAYERS - 1,
                    backward_stages=LAYERS - 1, tail_layers=1, **kw)


def task(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, DIM, generator=g)
    return x, 0.5 * x.flip(1)            # a linear map the residual layers can learn


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_worker_with_one_stage_budget_trains_a_model_8x_larger(grain):
    model = deep_mlp()
    ref = copy.deepcopy(model)
    L = layer_bytes(model)
    budget = 4 * L + L // 4
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weights >= 8 * budget, (weights, budget)
    config = one_layer_stages(2, grain=grain, device_memory=budget)
    loss_fn = nn.functional.mse_loss
    with rotapipe.RoundPipe(model, loss_fn, config=config) as pipe:
        assert all(s.stop - s.start == 1 for s in pipe.plan.jobs())
        opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
        pipe.attach_optimizer(opt)
        losses = []
        for step in range(3):
            x, y = task(step)
            losses.append(pipe.forward_backward(x, y))
            ref_loss = reference_forward_backward(ref, x, y, MICROBATCHES, call=step,
                                                  loss_fn=loss_fn)
            assert abs(losses[-1] - ref_loss) < 1e-5
            if step == 0:
                for p, q in zip(pipe.parameters(), ref.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
            pipe.step()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        x, y = task(0)
        final = loss_fn(pipe(x), y).item()    # evaluation, under the same budget
        assert final < 0.8 * losses[0], (losses, final)
        for p, q in zip(pipe.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        peaks = pipe.peak_memory()
        assert all(0 < peak <= budget for peak in peaks), (peaks, budget)
        # The budget is tight, not loose: each worker did hold two stages' weights.
        assert all(peak >= 2 * L for peak in peaks), (peaks, L)
        assert all(d.memory_in_use() == 0 for d in pipe.devices)


@pytest.mark.parametrize("optimizer_mode", ["sync", "overlap"])
def test_slow_gradient_downloads_keep_two_stages_of_gradients(monkeypatch, optimizer_mode):
    """The budget holds whatever the copies' timing: with every weight-gradient download
    slowed far behind the compute, a backward waits for the download two gradient jobs
    back on its worker (schedule/roundpipe.py) instead of piling up gradients."""
    download = ChunkedCopies.download

    def slow(self, a):
        chunks = download(self, a)
        for chunk in chunks:           # small chunks: input gradients pass between them
            def late(copy=chunk.copy):
                time.sleep(0.004)
                copy()
            chunk.copy = late
        return chunks
    monkeypatch.setattr(ChunkedCopies, "download", slow)
    model = deep_mlp(16)
    L = layer_bytes(model)
    budget = 4 * L + L // 4
    config = emulated(2, MICROBATCHES, forward_stages=15, backward_stages=15, tail_layers=1,
                      device_memory=budget, optimizer_mode=optimizer_mode,
                      copy_chunk_mb=L / 8 / 2**20)
    with rotapipe.RoundPipe(model, nn.functional.mse_loss, config=config) as pipe:
        pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=1e-2))
        for step in range(2):
            pipe.train_step(*task(step))
        pipe.flush()
        assert all(2 * L <= peak <= budget for peak in pipe.peak_memory()), \
            (pipe.peak_memory(), budget)


def test_budget_smaller_than_one_stage_fails_before_any_work():
    model = deep_mlp(6)
    L = layer_bytes(model)
    budget = L // 2                      # not even one stage's weights fit
    config = emulated(2, 2, device_memory=budget)
    threads = threading.active_count()
    with pytest.raises(rotapipe.ConfigError) as info:
        rotapipe.RoundPipe(model, nn.functional.mse_loss, config=config)
    msg = str(info.value)
    m = re.search(r"stage (F\d)\[\d+:\d+\] needs ([\d.]+) (B|KiB|MiB) for its weights "
                  r"alone, over the worker memory budget of ([\d.]+) (B|KiB|MiB): it "
                  r"holds one layer \(0\), so no plan can cut it smaller: raise "
                  r"device_memory", msg)
    assert m, msg
    unit = {"B": 1, "KiB": 2**10, "MiB": 2**20}
    assert float(m.group(2)) == pytest.approx(L / unit[m.group(3)], abs=0.051)
    assert float(m.group(4)) == pytest.approx(budget / unit[m.group(5)], abs=0.051)
    gc.collect()
    assert threading.active_count() == threads   # the failed constructor left no threads


def test_peak_memory_resets_and_unlimited_budget_never_raises():
    model = deep_mlp(6)
    with rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(2, 2)) as pipe:
        assert pipe.peak_memory() == [0, 0]
        x, y = task(0)
        pipe.forward_backward(x, y)
        peaks = pipe.peak_memory()
        assert all(p >= layer_bytes(model) for p in peaks)
        pipe.reset_peak_memory()
        assert pipe.peak_memory() == [0, 0]    # nothing stays resident between calls
