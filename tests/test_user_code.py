"""User code the pipeline runs on its workers, against plain PyTorch.

- A loss function that reads a model parameter directly (an L2 term on a weight) would
  lose that term's gradient: the workers compute with copies of the weights, the tail's
  autograd would write the term's gradient into the master's ``.grad`` from a worker
  thread, outside the pipeline's merge. It is refused with an ``InputError`` naming the
  parameter and the fix, in every optimizer mode, and the refused call changes nothing.
- Layers that modify their input in place (``nn.ReLU(inplace=True)``, ``x.add_()``) as
  the first operation of a stage, of a recomputed layer, or anywhere: they train
  exactly as in plain PyTorch, whatever the plan, grain and optimizer mode.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import rotapipe
from rotapipe.plan import bound_plan
from rotapipe.schedule import interleaved_1f1b_schedule, looped_bfs_schedule
from models import emulated

RTOL, ATOL = 1e-5, 1e-6
MODES = ("sync", "overlap", "stale")


def mse(out, y):
    return nn.functional.mse_loss(out, y)


def small_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
                         nn.Linear(6, 3))


def batches(n: int, seed: int = 1, width: int = 6, out: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, width, generator=g), torch.randn(8, out, generator=g))
            for _ in range(n)]


def snapshot(pipe: rotapipe.RoundPipe, opt: torch.optim.Optimizer) -> dict:
    return {"state": {k: v.detach().clone() for k, v in pipe.state_dict().items()},
            "grads": {n: None if p.grad is None else p.grad.clone()
                      for n, p in pipe.named_parameters()},
            "opt": copy.deepcopy(opt.state_dict()), "calls": pipe.calls}


def assert_same(before: dict, after: dict) -> None:
    assert before["calls"] == after["calls"]
    for k, v in before["state"].items():
        assert torch.equal(v, after["state"][k]), f"{k} changed"
    for n, g in before["grads"].items():
        h = after["grads"][n]
        assert (g is None) == (h is None), f"grad of {n} appeared or vanished"
        assert g is None or torch.equal(g, h), f"grad of {n} changed"
    so, ao = before["opt"]["state"], after["opt"]["state"]
    assert so.keys() == ao.keys()
    for i in so:
        for name, v in so[i].items():
            assert torch.equal(v, ao[i][name]) if isinstance(v, torch.Tensor) \
                else v == ao[i][name], f"optimizer state {i}.{name} changed"


def assert_close_models(got: nn.Module, want: nn.Module, what: str) -> None:
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")


# -- a loss function reading a parameter -------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_a_loss_reading_a_parameter_is_refused_and_changes_nothing(mode):
    """The term's gradient would be lost (the loss value matched, the gradient was that
    of the loss without the term). Refused in the caller's thread before any backward:
    weights, gradients (also ones accumulated by an earlier call), optimizer state and
    the call counter stay; training then continues exactly."""
    model, ref = small_mlp(), small_mlp()
    penalty = {"on": False}

    def loss_fn(out, y):
        loss = mse(out, y)
        return loss + 0.1 * model[0].weight.pow(2).sum() if penalty["on"] else loss

    data = batches(4)
    with rotapipe.RoundPipe(model, loss_fn, config=emulated(2, 2, optimizer_mode=mode)) \
            as pipe:
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        pipe.attach_optimizer(opt)
        pipe.train_step(*data[0])                  # optimizer state exists
        pipe.flush()                               # stale: the next call reads step 0
        pipe.forward_backward(*data[1])            # gradients accumulated in .grad
        pipe.flush()
        before = snapshot(pipe, opt)
        penalty["on"] = True
        for call in (pipe.forward_backward, pipe.train_step):
            with pytest.raises(rotapipe.InputError) as info:
                call(*data[2])
                pipe.flush()
            msg = str(info.value)
            assert re.search(r"the loss function uses the model's parameter 0\.weight "
                             r"\(layer 0, Linear\)", msg), msg
            assert "weight_decay" in msg and "forward" in msg, msg
            assert info.value.calls_discarded == [2] and info.value.calls_committed == 2
            assert_same(before, snapshot(pipe, opt))
        penalty["on"] = False
        pipe.train_step(*data[3])
        pipe.flush()
        # Plain PyTorch on the calls that ran: call 1 and 3 accumulate into one step.
        mse(ref(data[0][0]), data[0][1]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for x, y in (data[1], data[3]):
            (mse(ref(x), y) / 2).backward()
        ref_opt.step()
        assert_close_models(model, ref, "after the refused calls")


def test_every_parameter_the_loss_reads_is_counted_and_a_frozen_one_is_allowed():
    """The message names the first parameter and counts the others; a frozen parameter
    (no gradient to lose) is read as in plain PyTorch."""
    model = small_mlp()
    x, y = batches(1)[0]

    def two(out, yy):
        return mse(out, yy) + model[2].bias.sum() + model[4].weight.abs().sum()

    with rotapipe.RoundPipe(model, two, config=emulated(2, 2)) as pipe:
        with pytest.raises(rotapipe.InputError,
                           match=re.escape("parameter 2.bias (layer 2, Linear) (and 1 "
                                           "more: 4.weight)")):
            pipe.forward_backward(x, y)
        assert all(p.grad is None for p in pipe.parameters()) and pipe.calls == 0

    model, ref = small_mlp(), small_mlp()
    for m in (model, ref):
        m[0].weight.requires_grad_(False)

    def frozen(out, yy, m=model):
        return mse(out, yy) + 0.1 * m[0].weight.pow(2).sum()

    with rotapipe.RoundPipe(model, frozen, config=emulated(2, 2)) as pipe:
        loss = pipe.forward_backward(x, y)
    want = frozen(ref(x), y, ref)
    want.backward()
    assert loss == pytest.approx(want.item(), rel=RTOL)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


class PenalizedHead(nn.Linear):
    """The fix the message names: the last layer computes the term on its own weight
    and returns it beside its output."""

    def forward(self, x):
        return super().forward(x), 0.1 * self.weight.pow(2).sum()


@pytest.mark.parametrize("mode", MODES)
def test_a_term_computed_in_a_layer_trains_exactly(mode):
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
                             PenalizedHead(6, 3))

    def loss_fn(out, y):
        return mse(out[0], y) + out[1]

    model, ref = build(), build()
    data = batches(3)
    with rotapipe.RoundPipe(model, loss_fn, config=emulated(3, 2, optimizer_mode=mode),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)) as pipe:
        for x, y in data:
            pipe.train_step(x, y)
            pipe.flush()        # stale: each call reads the last step, as plain PyTorch
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data:
        loss_fn(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_close_models(model, ref, "after 3 steps")


# -- layers that modify their input in place ---------------------------------------------

class AddInPlace(nn.Module):
    """``x.add_(0.5)``: not idempotent, so applying it twice (to a kept activation that
    a later recompute or upload reads again) shows."""

    def forward(self, x):
        return x.add_(0.5)


class ScaleShiftInPlace(nn.Module):
    """In place, with a parameter: ``x.mul_(2).add_(bias)``."""

    def __init__(self, dim: int):
        super().__init__()
        self.bias = nn.Parameter(torch.linspace(-0.5, 0.5, dim))

    def forward(self, x):
        return x.mul_(2.0).add_(self.bias)


class TanhInPlace(nn.Module):
    """``x.tanh_()``: its gradient depends on the value it is recomputed from."""

    def forward(self, x):
        return x.tanh_()


def inplace_mlp(seed: int = 0) -> nn.Sequential:
    """Every other layer modifies its input in place (never layer 0: plain PyTorch would
    write into the caller's batch)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 8),
                         AddInPlace(), nn.Linear(8, 8), ScaleShiftInPlace(8),
                         nn.Linear(8, 8), TanhInPlace(), nn.Linear(8, 8), nn.Linear(8, 3))


INPLACE_PLANS = {
    # name: (workers, microbatches, plan text or None for the default plan)
    "default-2x2": (2, 2, None),
    "default-3x4": (3, 4, None),
    # Every forward, backward and tail stage starts with an in-place layer.
    "starts-3x2": (3, 2, "F0[0:1] F1[1:3] F2[3:5] F3[5:7] T[7:10] B0[0:1] B1[1:3] "
                         "B2[3:5] B3[5:7]"),
    # Forward stages whose checkpoints (layers 3 and 7) their own next layer changes in
    # place; at layer grain, recomputed inputs the next layer changes in place.
    "checkpoints-2x4": (2, 4, "F0[0:5] F1[5:9] T[9:10] B0[0:3] B1[3:7] B2[7:9]"),
    # A tail that starts in place.
    "tail-3x2": (3, 2, "F0[0:3] F1[3:7] T[7:10] B0[0:1] B1[1:3] B2[3:7]"),
}


def train_inplace(mode: str, workers: int, microbatches: int, plan, grain: str,
                  setup=None):
    """Three steps: ``forward_backward`` + ``step`` (gradients compared), then two
    ``train_step`` calls (the mode's own step). ``setup(pipe)``: before training."""
    model = inplace_mlp()
    data = batches(3, width=6)
    config = emulated(workers, microbatches, optimizer_mode=mode, grain=grain)
    plan = rotapipe.Plan.from_text(plan) if isinstance(plan, str) else plan
    with rotapipe.RoundPipe(model, mse, config=config, plan=plan,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1,
                                                                 momentum=0.9)) as pipe:
        if setup is not None:
            setup(pipe)
        inputs = [x.clone() for x, _ in data]
        losses = [pipe.forward_backward(inputs[0], data[0][1])]
        pipe.flush()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        pipe.step()
        for x, (_, y) in zip(inputs[1:], data[1:]):
            losses.append(pipe.train_step(x, y))
            pipe.flush()       # stale: each call reads the last step, as plain PyTorch
        with torch.no_grad():
            out = pipe(data[0][0].clone())
        # The caller's batches are not written into.
        assert all(torch.equal(x, d[0]) for x, d in zip(inputs, data))
    return losses, grads, model, out


def train_inplace_reference():
    model = inplace_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, grads = [], None
    for x, y in batches(3, width=6):
        loss = mse(model(x.clone()), y)
        loss.backward()
        losses.append(loss.item())
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        out = model(batches(1, width=6)[0][0].clone())
    return losses, grads, model, out


def _assert_like_reference(losses, grads, model, out) -> None:
    """Losses, gradients, weights after 3 steps and evaluation equal plain PyTorch's."""
    want_losses, want_grads, ref, want_out = train_inplace_reference()
    torch.testing.assert_close(losses, want_losses, rtol=RTOL, atol=ATOL)
    for n, g in want_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=n: f"grad {n}: {m}")
    assert_close_models(model, ref, "after 3 steps")
    torch.testing.assert_close(out, want_out, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("case", list(INPLACE_PLANS))
def test_layers_modifying_their_input_in_place_train_exactly(case, grain, mode):
    workers, microbatches, plan = INPLACE_PLANS[case]
    _assert_like_reference(*train_inplace(mode, workers, microbatches, plan, grain))


@pytest.mark.parametrize("name, workers, chunks, recompute", [
    # Chunks on one device hand activations over on the device (a forward's output is
    # the next chunk's input); with recompute an uploaded input is also the
    # recompute's. Chunks start at layers 3 and 6 (4 chunks of 10 layers).
    ("interleaved-1f1b", 1, 4, False), ("looped-bfs", 1, 4, True),
    ("interleaved-1f1b", 2, 4, False), ("looped-bfs", 2, 4, True)])
def test_layers_modifying_their_input_in_place_train_exactly_in_bound_schedules(
        name, workers, chunks, recompute):
    make = {"interleaved-1f1b": interleaved_1f1b_schedule,
            "looped-bfs": looped_bfs_schedule}[name]
    plan = bound_plan([1.0] * len(inplace_mlp()), chunks, devices=workers)

    def setup(pipe):
        pipe.use_schedule(make(pipe.plan, workers, 3, recompute=recompute,
                               offload_optimizer=True))
    _assert_like_reference(*train_inplace("sync", workers, 3, plan, "stage", setup))
