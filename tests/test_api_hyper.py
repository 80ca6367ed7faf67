"""A learning rate changed while a pipelined step is under way is refused.

In ``overlap`` (and ``stale`` without clipping) ``train_step`` returns before its
step is done: each stage's parameters are stepped as its gradients land. The plain
PyTorch habit ``loss = pipe.train_step(x, y); sched.step()`` then changed the learning
rate between two stages of one step, so the stages stepped with different rates and
the weights silently differed from plain PyTorch (measured: 2e-3 on every weight of
an 8-layer model after 5 SGD steps). The step now fails, undone, naming the fix.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

import rotapipe
from models import emulated

D = 6


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(D, D) for _ in range(6)])


def mse(out, y):
    return ((out - y) ** 2).mean()


@pytest.mark.parametrize("mode", ["overlap", "stale"])
def test_a_learning_rate_changed_during_a_step_fails_it_and_changes_nothing(mode):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
    ref = model()
    with rotapipe.RoundPipe(model(), mse, config=emulated(2, 2, optimizer_mode=mode),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)) as pipe:
        opt = pipe.optimizer
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        stages = []

        def change_lr(pids):
            # What a scheduler stepped by the caller right after train_step returned
            # does: it lands between two stages' steps (here: after the first).
            stages.append(pids)
            opt.param_groups[0]["lr"] = 0.01
        pipe._optimizer_cost = change_lr
        with pytest.raises(rotapipe.ConfigError, match=r"param group 0's 'lr' changed from "
                           r"0\.1 to 0\.01 while a training call's optimizer step.*"
                           r"attach_optimizer"):
            pipe.train_step(x, y)
            pipe.flush()
        assert len(stages) == 1 and pipe.calls == 0
        for k, v in pipe.state_dict().items():
            assert torch.equal(v, before[k]), k
        # The pipeline trains on, at the rate now set, as plain PyTorch would.
        pipe._optimizer_cost = None
        pipe.train_step(x, y)
        state = pipe.state_dict()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    mse(ref(x), y).backward()
    ref_opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["overlap", "stale"])
def test_a_scheduler_stepped_before_the_first_stage_step_is_refused_too(mode, monkeypatch):
    """The usual order: ``train_step`` returns once the loss is known, before the
    tail's gradients are down, so the caller's ``sched.step()`` lands before the first
    stage is stepped. Compared with the rate the first stage's step saw, that went
    unseen and the whole step ran at the next step's rate (one step early, silently);
    compared with the rate as the call was issued, it is refused."""
    from rotapipe.runtime import overlapstep

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
    go = __import__("threading").Event()
    begin = overlapstep.OverlapStep._begin

    def held(self):
        assert go.wait(30), "the caller never changed the rate"
        begin(self)
    monkeypatch.setattr(overlapstep.OverlapStep, "_begin", held)
    with rotapipe.RoundPipe(model(), mse, config=emulated(2, 2, optimizer_mode=mode),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)) as pipe:
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        sched = torch.optim.lr_scheduler.StepLR(pipe.optimizer, step_size=1, gamma=0.1)
        with pytest.raises(rotapipe.ConfigError, match=r"'lr' changed from 0\.1 to "):
            pipe.train_step(x, y)
            sched.step()                  # before any stage's step: the gate holds them
            go.set()
            pipe.flush()
        go.set()
        assert pipe.calls == 0
        for k, v in pipe.state_dict().items():
            assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("mode", ["overlap", "stale"])
def test_a_tensor_learning_rate_changed_in_place_is_refused_too(mode):
    """A tensor ``lr`` (``torch.optim.SGD(ps, lr=torch.tensor(0.1))``, as used with
    fused or capturable kernels) is changed in place by a scheduler (``fill_``): the
    step compared the tensor with itself, so the change went unseen and the stages
    stepped with different rates (measured: 7e-3 off plain PyTorch after 4 steps of a
    scheduler stepped after each ``train_step``, no error)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
    ref = model()
    with rotapipe.RoundPipe(model(), mse, config=emulated(2, 2, optimizer_mode=mode),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=torch.tensor(0.1))
                            ) as pipe:
        opt = pipe.optimizer
        before = {k: v.clone() for k, v in pipe.state_dict().items()}

        def change_lr(pids):
            opt.param_groups[0]["lr"].fill_(0.01)     # what LambdaLR does to a tensor lr
        pipe._optimizer_cost = change_lr
        with pytest.raises(rotapipe.ConfigError, match=r"param group 0's 'lr' changed from "
                           r"0\.1\d* to 0\.0099"):
            pipe.train_step(x, y)
            pipe.flush()
        assert pipe.calls == 0
        for k, v in pipe.state_dict().items():
            assert torch.equal(v, before[k]), k
        pipe._optimizer_cost = None
        pipe.train_step(x, y)
        state = pipe.state_dict()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=torch.tensor(0.01))
    mse(ref(x), y).backward()
    ref_opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["overlap", "stale"])
def test_a_weight_decay_changed_during_a_step_is_refused(mode):
    """A weight-decay schedule set by the caller after each ``train_step`` (as some
    recipes do) changed the decay between two stages of one step: 1.4e-3 off plain
    PyTorch after 4 AdamW steps of a 6-layer model, no error. It is refused now, as
    for the learning rate."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
    with rotapipe.RoundPipe(model(), mse, config=emulated(2, 2, optimizer_mode=mode),
                            optimizer=lambda ps: torch.optim.AdamW(ps, weight_decay=0.5)
                            ) as pipe:
        opt = pipe.optimizer
        before = {k: v.clone() for k, v in pipe.state_dict().items()}

        def change_decay(pids):
            opt.param_groups[0]["weight_decay"] = 0.25
        pipe._optimizer_cost = change_decay
        with pytest.raises(rotapipe.ConfigError, match=r"param group 0's 'weight_decay' "
                           r"changed from 0\.5 to 0\.25"):
            pipe.train_step(x, y)
            pipe.flush()
        assert pipe.calls == 0 and not opt.state
        for k, v in pipe.state_dict().items():
            assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_step_results_keep_each_steps_rate_with_a_tensor_lr(mode):
    """``step_result(c).lrs`` held the tensor ``lr`` itself, which the scheduler then
    changes in place: every call reported the current rate (0.0025 for all three)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
    with rotapipe.RoundPipe(model(), mse, config=emulated(2, 2, optimizer_mode=mode)) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=torch.tensor(0.01))
        pipe.attach_optimizer(opt, scheduler=torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: 1 / (step + 1)))
        for _ in range(3):
            pipe.train_step(x, y)
        lrs = [pipe.step_result(c).lrs for c in range(3)]
    assert lrs == [(pytest.approx(0.01),), (pytest.approx(0.005),),
                   (pytest.approx(0.01 / 3),)]
