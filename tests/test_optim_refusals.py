"""Optimizers the host step can never run are refused at ``attach_optimizer``, naming
the fix, before anything changes.

``capturable=True`` (Adam, AdamW, ...) runs only on accelerator parameters, and the
pipeline steps the fp32 masters in host memory: torch refused it at the first step,
which failed the first training call (in ``sync`` reported as "partly stepped", with
a restore-a-checkpoint advice, though nothing had been stepped).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rotapipe
from models import emulated

D = 6


def mse(out, y):
    return ((out - y) ** 2).mean()


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=1e-2, capturable=True),
    lambda ps: torch.optim.AdamW([{"params": ps[:2]},
                                  {"params": ps[2:], "capturable": True}], foreach=True),
])
def test_a_capturable_optimizer_is_refused_at_attach(make):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(D, D) for _ in range(3)])
    x, y = torch.randn(4, D), torch.randn(4, D)
    with rotapipe.RoundPipe(model, mse, config=emulated(2, 2)) as pipe:
        with pytest.raises(rotapipe.ConfigError, match=r"capturable=True.*capturable=False"):
            pipe.attach_optimizer(make(list(pipe.parameters())))
        assert pipe.optimizer is None and pipe.calls == 0
        pipe.attach_optimizer(torch.optim.Adam(pipe.parameters(), lr=1e-2))
        pipe.train_step(x, y)
        assert pipe.calls == 1
