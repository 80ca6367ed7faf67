"""The baselines in the runtime: GPipe, 1F1B, interleaved 1F1B and looped BFS, generated
with ``offload_optimizer=True`` over a bound plan, run by the same executor and kernels as
RoundPipe on emulated workers.

fp32, three steps of two calls each (8 and 12 samples) from the same initial weights:
gradients, weights, buffers and losses match plain PyTorch element by element (the
reference trainer of ``test_exactness.py``), with dropout, a tied embedding/head weight
and a BatchNorm layer; with ``recompute=True`` (F/R/B for the forward chunks) too, and
Mobius (looped BFS swapping each chunk's weights in per phase; it fits a device budget
that holds two chunks' weights, where looped BFS, which keeps them all, runs out of
memory). A fault inside a kept forward or a backward through a kept graph reaches the caller as a
:class:`rotapipe.WorkerError` and changes nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import pathlib
import re
import runpy
import sys

import pytest
import torch
from torch import nn

import rotapipe
from rotapipe.plan import bound_plan
from rotapipe.schedule import (ActionKind as K, gpipe_schedule, interleaved_1f1b_schedule,
                               looped_bfs_schedule, mobius_schedule, one_f_one_b_schedule)
from models import emulated, lm_loss, tiny_transformer, token_batch
from test_exactness import (OPTIMIZERS, assert_bitwise_equal, assert_close_trained, run,
                            train_pipe, train_reference)
from test_exactness import assert_same_state as assert_same_weights
from test_faults import Trigger, assert_same_state, faulty_model, snapshot

GENERATORS = {"gpipe": (gpipe_schedule, 1), "1f1b": (one_f_one_b_schedule, 1),
              "interleaved-1f1b": (interleaved_1f1b_schedule, 2),
              "looped-bfs": (looped_bfs_schedule, 2),
              "mobius": (lambda plan, w, m, recompute, offload_optimizer, buffer_layers:
                         mobius_schedule(plan, w, m, buffer_layers=buffer_layers), 2)}
ALL = dict(dropout=0.1, tied=True, buffers=True)     # test_exactness's "accumulate"
NO_BUFFERS = dict(dropout=0.1, tied=True)            # recompute would update buffers twice
SIZES = (8, 12)


def use_baseline(name: str, workers: int, microbatches: int, recompute: bool = False):
    """``setup`` for ``train_pipe``: run the baseline ``name`` instead of RoundPipe."""
    make = GENERATORS[name][0]

    def setup(pipe: rotapipe.RoundPipe) -> None:
        pipe.use_schedule(make(pipe.plan, workers, microbatches, recompute=recompute,
                               offload_optimizer=True,
                               buffer_layers=pipe.layerset.buffer_layers()))
    return setup


def train_baseline(name, workers, microbatches, recompute=False, model_kw=ALL):
    model = tiny_transformer(**model_kw)
    plan = bound_plan([1.0] * len(model), workers * GENERATORS[name][1], devices=workers)
    return train_pipe(model, SIZES, emulated(workers, microbatches), "adamw", plan=plan,
                      setup=use_baseline(name, workers, microbatches, recompute))


@functools.lru_cache(maxsize=None)
def reference(microbatches: int, model_kw: tuple) -> object:
    return train_reference(tiny_transformer(**dict(model_kw)), SIZES, microbatches, "adamw")


@pytest.mark.parametrize("microbatches", [2, 4])
@pytest.mark.parametrize("workers", [2, 4])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_baseline_matches_plain_pytorch(name, workers, microbatches):
    got = train_baseline(name, workers, microbatches)
    assert_close_trained(got, reference(microbatches, tuple(ALL.items())))
    # Same per-layer random streams and the same order of gradient sums as RoundPipe.
    assert_bitwise_equal(got, run("accumulate", 1, microbatches, "stage"))


@pytest.mark.parametrize("name, workers, microbatches",
                         [("gpipe", 2, 3), ("1f1b", 4, 3), ("1f1b", 2, 4)])
def test_baseline_with_recompute_matches_plain_pytorch(name, workers, microbatches):
    got = train_baseline(name, workers, microbatches, recompute=True, model_kw=NO_BUFFERS)
    assert_close_trained(got, reference(microbatches, tuple(NO_BUFFERS.items())))


@pytest.mark.parametrize("name, workers, recompute", [
    ("interleaved-1f1b", 2, False), ("looped-bfs", 2, False),
    # One device: the chunks hand activations and gradients over on the device.
    ("interleaved-1f1b", 1, False), ("looped-bfs", 1, True)])
def test_several_chunks_per_device(name, workers, recompute):
    kw = NO_BUFFERS if recompute else ALL
    got = train_baseline(name, workers, 3, recompute=recompute, model_kw=kw)
    assert_close_trained(got, reference(3, tuple(kw.items())))


@pytest.mark.parametrize("workers, chunks, microbatches", [(2, 4, 3), (1, 3, 2), (2, 6, 4)])
def test_mobius_matches_plain_pytorch(workers, chunks, microbatches):
    model = tiny_transformer(**NO_BUFFERS)
    plan = bound_plan([1.0] * len(model), chunks, devices=workers)
    got = train_pipe(model, SIZES, emulated(workers, microbatches), "adamw", plan=plan,
                     setup=lambda pipe: pipe.use_schedule(
                         mobius_schedule(plan, workers, microbatches)))
    assert_close_trained(got, reference(microbatches, tuple(NO_BUFFERS.items())))


def test_mobius_swaps_weights_and_fits_where_looped_bfs_does_not():
    """Wide layers, 1 device x 4 chunks: Mobius uploads each forward chunk twice (its
    forwards, then its recompute and backward; the tail once) and holds at most two
    chunks' weights (and the gradients of the chunk running backward, and of the one
    before while they download: gated weight-gradient chunks may still be on the copy
    engine), so it runs within a budget in which looped BFS, keeping all four
    resident, runs out of memory."""
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64) for _ in range(8)]
    weights = sum(p.numel() * 4 for p in layers[0].parameters())      # bytes per layer
    plan = bound_plan([1.0] * 8, 4, devices=1)                          # 2 layers a chunk
    mobius = mobius_schedule(plan, 1, 2)
    uploads = sorted(a.stage for a in mobius.actions if a.kind is K.UPLOAD_WEIGHTS)
    assert uploads == ["B0", "B1", "B2", "F0", "F1", "F2", "T"]
    x, y = torch.randn(4, 64), torch.randn(4, 64)
    peaks = {}
    for name, schedule in (("mobius", mobius),
                           ("looped-bfs", looped_bfs_schedule(plan, 1, 2, recompute=True,
                                                              offload_optimizer=True))):
        config = emulated(1, 2, device_memory=int(8.5 * weights))
        with rotapipe.RoundPipe(copy.deepcopy(layers), nn.functional.mse_loss,
                                config=config, plan=plan) as pipe:
            pipe.use_schedule(schedule)
            try:
                pipe.forward_backward(x, y)
                peaks[name] = pipe.peak_memory()[0]
            except rotapipe.WorkerError as exc:
                peaks[name] = exc
    assert isinstance(peaks["looped-bfs"], rotapipe.WorkerError), peaks
    assert "out of memory" in str(peaks["looped-bfs"]) or \
        "budget" in str(peaks["looped-bfs"]), peaks["looped-bfs"]
    # At most two chunks of two layers, two chunks' gradients and the activations.
    assert not isinstance(peaks["mobius"], Exception), str(peaks["mobius"])
    assert 6 * weights <= peaks["mobius"] <= 8.5 * weights, (peaks["mobius"], weights)


def test_swap_needs_recompute_and_contiguous_phases():
    plan = bound_plan([1.0] * 8, 4, devices=2)
    with pytest.raises(rotapipe.ScheduleError, match="recompute=True and offload_optimizer"):
        looped_bfs_schedule(plan, 2, 2, offload_optimizer=True, swap=True)
    with pytest.raises(rotapipe.ScheduleError, match="interleaves chunk"):
        from rotapipe.schedule.bound import _lower, _Options, Pass
        orders = [[(Pass.FORWARD, 0, 0), (Pass.FORWARD, 2, 0), (Pass.FORWARD, 0, 1)],
                  []]
        _lower(plan, 2, 2, orders, True, "bad", _Options(True, swap=True))


def test_one_f_one_b_keeps_few_graphs_and_weights_stay_on_their_device():
    """1F1B's memory bound holds in the runtime: device 0 of 4 holds at most 4 kept
    graphs, GPipe all 8; every weight upload happens once per call per chunk."""
    model = tiny_transformer()
    plan = bound_plan([1.0] * len(model), 4)
    peaks = {}
    for name, make in (("1f1b", one_f_one_b_schedule), ("gpipe", gpipe_schedule)):
        with rotapipe.RoundPipe(tiny_transformer(), lm_loss, config=emulated(4, 8),
                                plan=plan) as pipe:
            schedule = make(plan, 4, 8, offload_optimizer=True)
            pipe.use_schedule(schedule)
            pipe.forward_backward(*token_batch(16, 6))
            peaks[name] = pipe.peak_memory()[0]
            uploads = [a for a in schedule.actions if a.kind is K.UPLOAD_WEIGHTS]
            assert sorted(a.stage for a in uploads) == ["B0", "B1", "B2", "T"]
    assert peaks["1f1b"] < peaks["gpipe"]


@pytest.mark.parametrize("mode", ["overlap", "stale"])
def test_optimizer_modes(mode):
    """``train_step`` with the overlapped or stale optimizer runs 1F1B as it runs
    RoundPipe's schedule: same losses and weights, bit for bit (same plan)."""
    model = tiny_transformer(dropout=0.1, tied=True)
    plan = bound_plan([1.0] * len(model), 2)
    config = rotapipe.PipeConfig(workers=2, microbatches=3, backend="emulated",
                                 optimizer_mode=mode)
    results = []
    for baseline in (False, True):
        with rotapipe.RoundPipe(copy.deepcopy(model), lm_loss, config=config, plan=plan,
                                optimizer=OPTIMIZERS["adamw"]) as pipe:
            if baseline:
                pipe.use_schedule(one_f_one_b_schedule(plan, 2, 3, offload_optimizer=True))
            losses = [pipe.train_step(*token_batch(8, 6, seed=s)) for s in range(3)]
            pipe.flush()
            results.append((losses, {k: v.clone() for k, v in pipe.state_dict().items()}))
    (want_losses, want), (got_losses, got) = results
    assert got_losses == want_losses
    assert_same_weights(got, want)


# -- what the pipeline refuses ---------------------------------------------------------

def test_schedules_that_do_not_move_host_state_are_refused():
    model = tiny_transformer(buffers=True)
    plan = bound_plan([1.0] * len(model), 2)
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2), plan=plan) as pipe:
        with pytest.raises(rotapipe.ConfigError, match=r"FK:F0:m0 .*UW:F0.*offload_optimizer=True"):
            pipe.use_schedule(one_f_one_b_schedule(plan, 2, 2))
        with pytest.raises(rotapipe.ConfigError, match=r"DB:F0.*buffer_layers=\[3\]"):
            pipe.use_schedule(one_f_one_b_schedule(plan, 2, 2, offload_optimizer=True))
    whole = bound_plan([1.0] * len(model), 1)       # one chunk: the tail is everything
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(1, 2), plan=whole) as pipe:
        no_loss = gpipe_schedule(whole, 1, 2, offload_optimizer=True, buffer_layers=[3])
        no_loss = dataclasses.replace(no_loss, actions=tuple(
            dataclasses.replace(a, deps=tuple(d for d in a.deps if d != "DG:T:m1@0"))
            for a in no_loss.actions if a.key != "DG:T:m1@0"))
        with pytest.raises(rotapipe.ConfigError, match=r"FK:T:m1 .*loss.*DG:T:m1"):
            pipe.use_schedule(no_loss)
        no_grads = gpipe_schedule(whole, 1, 2, offload_optimizer=True, buffer_layers=[3])
        no_grads = dataclasses.replace(no_grads, actions=tuple(
            a for a in no_grads.actions if a.kind not in (K.DOWNLOAD_WGRAD, K.OPTIMIZER)))
        with pytest.raises(rotapipe.ConfigError, match=r"BK:T:m0 .*never downloaded.*DW:T"):
            pipe.use_schedule(no_grads)
    with pytest.raises(rotapipe.ScheduleError, match="recompute=True.*update would count"):
        one_f_one_b_schedule(plan, 2, 2, recompute=True, buffer_layers=[3])
    with rotapipe.RoundPipe(tiny_transformer(buffers=True), lm_loss, config=emulated(2, 2),
                            plan=plan, tail_context=lambda xs, ys: None) as pipe:
        with pytest.raises(rotapipe.ConfigError, match="FK:T:m0 .*tail_context"):
            pipe.use_schedule(one_f_one_b_schedule(plan, 2, 2, offload_optimizer=True,
                                                   buffer_layers=[3]))


class Gained(nn.Module):
    """A layer reading a per-microbatch side input: ``tanh(lin(x)) * gain``."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x, gain):
        return torch.tanh(self.lin(x)) * gain


def test_side_inputs():
    torch.manual_seed(0)
    layers = [Gained(8) for _ in range(4)]
    ref = [Gained(8) for _ in range(4)]
    for a, b in zip(ref, layers):
        a.load_state_dict(b.state_dict())

    def side(x):
        return {"gain": 1.0 + x.abs().mean(dim=1, keepdim=True)}

    x, y = torch.randn(6, 8), torch.randn(6, 8)
    mse = nn.functional.mse_loss
    plan = bound_plan([1.0] * 4, 2)
    with rotapipe.RoundPipe(layers, mse, config=emulated(2, 3), plan=plan,
                            side_inputs=side) as pipe:
        with pytest.raises(rotapipe.ConfigError, match="side_inputs=True"):
            pipe.use_schedule(one_f_one_b_schedule(plan, 2, 3, offload_optimizer=True))
        pipe.use_schedule(one_f_one_b_schedule(plan, 2, 3, offload_optimizer=True,
                                               side_inputs=True))
        loss = pipe.forward_backward(x, y)
    want = 0.0
    for xm, ym in zip(x.tensor_split(3), y.tensor_split(3)):
        h = xm
        for layer in ref:
            h = layer(h, **side(xm))
        part = mse(h, ym) / 3
        part.backward()
        want += part.item()
    assert loss == pytest.approx(want, rel=1e-6)
    for p, q in zip(nn.Sequential(*layers).parameters(), nn.Sequential(*ref).parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


# -- faults ----------------------------------------------------------------------------

@pytest.mark.parametrize("pass_, layer, key", [
    ("recompute", 2, "FK:F0:m1"),          # grad-enabled forward of chunk 0 (layers 0-2)
    ("tail-forward", 5, "FK:T:m1"),        # the tail's forward + loss
    ("backward", 1, "BK:B0:m1"),           # backward through chunk 0's kept graph
    ("tail-backward", 4, "BK:T:m1")])
def test_fault_in_kept_forward_or_backward_changes_nothing(pass_, layer, key):
    trigger = Trigger()
    model = faulty_model(trigger, dropout=0.1)
    plan = bound_plan([1.0] * len(model), 2)
    batches = [token_batch(8, 5, seed=s) for s in (1, 2, 3)]
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 3), plan=plan) as pipe:
        assert (plan.forward[0].start, plan.forward[0].stop) == (0, 3)
        pipe.use_schedule(one_f_one_b_schedule(plan, 2, 3, offload_optimizer=True))
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        pipe.attach_optimizer(opt)
        pipe.forward_backward(*batches[0])
        pipe.step()
        pipe.forward_backward(*batches[1])
        before = snapshot(pipe, opt)
        trigger.arm(layer, 1, pipe.calls, pass_)
        with pytest.raises(rotapipe.WorkerError) as info:
            pipe.forward_backward(*batches[2])
        trigger.disarm()
        assert trigger.fired_at is not None, "the fault never fired"
        assert info.value.action == key, str(info.value)
        assert f">>{key}<<" in str(info.value)
        assert all(d.memory_in_use() == 0 for d in pipe.devices)
        assert_same_state(before, snapshot(pipe, opt))
        # The pipeline still works: the failed call did not count.
        pipe.forward_backward(*batches[2])
        assert pipe.calls == 3


def test_example_prints_equal_losses(capsys, monkeypatch):
    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "baselines_runtime.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--steps", "2"])
    runpy.run_path(str(script), run_name="__main__")
    rows = re.findall(r"^\s+\d+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
                      capsys.readouterr().out, re.M)
    # RoundPipe and 1F1B to the printed digit; Mobius (other chunks) within 1e-5.
    assert len(rows) == 2 and all(a == b for a, b, _ in rows), rows
    assert all(abs(float(a) - float(c)) <= 1e-5 * abs(float(a)) for a, _, c in rows), rows
