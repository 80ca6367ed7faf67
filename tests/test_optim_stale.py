"""``stale`` with parameters that get no gradient in some steps (a branch taken only
for some batches, an expert no token is routed to), against the one-step-delayed
plain-PyTorch reference g_t = grad L_t(w_{t-1}), element by element.

A parameter without a gradient is not stepped (``torch.optim`` skips it), but the set
of compute copies the calls two steps later read still has to receive its current
master: it used to keep the weights one step older, so the next call that took the
branch ran on them (with AdamW below the losses were off by up to 6.8e-3 and every
later weight differed, no error raised).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import rotapipe
from models import emulated

D = 8


class Branch(nn.Module):
    """``b`` for a batch whose first column holds the marker 5, ``a`` otherwise."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return torch.tanh(self.b(x) if bool(x[0, 0] == 5) else self.a(x))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Branch(), nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))


def mse(out, y):
    return ((out - y) ** 2).mean()


def batches(marked):
    g = torch.Generator().manual_seed(1)
    out = []
    for m in marked:
        x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
        if m:
            x[:, 0] = 5.0
        out.append((x, y))
    return out


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_stale_with_a_branch_some_steps_skip_equals_the_delayed_reference(optimizer):
    data = batches([True, False, False, True, True, False])
    make = OPTIMIZERS[optimizer]
    with rotapipe.RoundPipe(model(), mse, config=emulated(2, 2, optimizer_mode="stale"),
                            optimizer=make) as pipe:
        losses = [pipe.train_step(x, y) for x, y in data]
        state = {k: v.clone() for k, v in pipe.state_dict().items()}

    ref, shadow = model(), model()
    opt = make(ref.parameters())
    runs_on, pending, want = copy.deepcopy(ref.state_dict()), None, []
    for batch in data + [None]:
        if batch is not None:
            x, y = batch
            shadow.load_state_dict(runs_on)             # w_{t-1}
            shadow.zero_grad(set_to_none=True)
            loss = mse(shadow(x), y)
            loss.backward()
            want.append(loss.detach())
        if pending is not None:
            for n, p in ref.named_parameters():
                p.grad = pending.get(n)                 # None: not stepped
            opt.step()
        runs_on = copy.deepcopy(ref.state_dict())
        pending = {n: p.grad.clone() for n, p in shadow.named_parameters()
                   if p.grad is not None}
    torch.testing.assert_close(torch.tensor(losses), torch.stack(want), rtol=1e-5, atol=1e-6)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=k: f"{k}: {m}")
