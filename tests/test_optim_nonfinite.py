"""A step skipped for a non-finite gradient (``nonfinite="skip"``), in every mode,
against plain PyTorch element by element.

The infinite gradient lands in the shallowest layer, whose stage hands off last: in
``overlap`` and in ``stale`` without clipping the deeper stages were stepped
speculatively by then and must be undone. In ``stale`` the skipped step still
commits, so the calls two steps later must read the current masters: they used to
read the weights one step older (the undo's copy), and every later weight was off
(1.4e-3 on the 5-layer model below) with no error raised.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import rotapipe
from models import emulated

D = 8


class InfGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by inf when ``flag``."""

    @staticmethod
    def forward(ctx, h, flag):
        ctx.save_for_backward(flag)
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        flag, = ctx.saved_tensors
        return g * torch.where(flag, torch.tensor(float("inf")), torch.tensor(1.0)), None


class Bomb(nn.Module):
    """A linear layer whose weight gradient is infinite for a batch whose first
    column holds the marker 1e4 (the marker itself is read as 0)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        flag = (x[:, 0] > 999).any()
        x = torch.where(x > 999, torch.zeros_like(x), x)
        return torch.tanh(InfGrad.apply(self.lin(x), flag))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Bomb(), *[nn.Sequential(nn.Linear(D, D), nn.Tanh())
                                   for _ in range(4)])


def mse(out, y):
    return ((out - y) ** 2).mean()


def batches(steps: int, bad: int):
    g = torch.Generator().manual_seed(1)
    out = []
    for t in range(steps):
        x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
        if t == bad:
            x[0, 0] = 1e4
        out.append((x, y))
    return out


def make_opt(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def make_sched(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))


def reference(data, stale: bool, clip):
    """Plain PyTorch: a step with a non-finite gradient is skipped (the scheduler is
    stepped anyway, as after a skipped ``GradScaler`` step); ``stale``: g_t = grad
    L_t(w_{t-1})."""
    m, shadow = model(), model()
    opt = make_opt(m.parameters())
    sched = make_sched(opt)
    skipped = []

    def apply(grads):
        for n, p in m.named_parameters():
            p.grad = grads[n]
        ok = all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())
        if ok:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
            opt.step()
        skipped.append(not ok)
        sched.step()
        opt.zero_grad(set_to_none=True)

    runs_on, pending = copy.deepcopy(m.state_dict()), None
    for x, y in data:
        net = m
        if stale:
            shadow.load_state_dict(runs_on)
            net = shadow
        net.zero_grad(set_to_none=True)
        mse(net(x), y).backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        if not stale:
            apply(grads)
            continue
        if pending is not None:
            apply(pending)
        runs_on, pending = copy.deepcopy(m.state_dict()), grads
    if stale:
        apply(pending)
    return m.state_dict(), skipped


@pytest.mark.parametrize("mode,clip", [("sync", None), ("overlap", None),
                                       ("stale", None), ("stale", 0.5)])
def test_a_skipped_step_equals_plain_pytorch_in_every_mode(mode, clip):
    data = batches(5, bad=2)
    want, want_skipped = reference(data, mode == "stale", clip)
    config = emulated(2, 2, optimizer_mode=mode, nonfinite="skip", clip_grad_norm=clip)
    with rotapipe.RoundPipe(model(), mse, config=config) as pipe:
        opt = make_opt(pipe.parameters())
        pipe.attach_optimizer(opt, scheduler=make_sched(opt))
        calls = []
        for x, y in data:
            pipe.train_step(x, y)
            calls.append(pipe.calls - 1)
        results = [pipe.step_result(c) for c in calls]
        state = {k: v.clone() for k, v in pipe.state_dict().items()}
        assert pipe.nonfinite_skips == 1
    assert [r.skipped for r in results] == want_skipped
    for k, v in want.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=k: f"{k}: {m}")
