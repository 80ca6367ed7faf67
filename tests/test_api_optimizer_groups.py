"""The attached optimizer's parameter groups changed after ``attach_optimizer``.

``attach_optimizer`` refuses a parameter that is not a trainable parameter of the
pipeline; before, one added later with ``optimizer.add_param_group`` (or put into a
group's ``params``) was accepted silently and never trained: the pipeline gives only
its own masters a gradient. Now the step refuses it the same way, with nothing
changed. A trained parameter of the model left out at attach and added later trains as
in plain PyTorch; one frozen when the pipeline was built (unfrozen since or not) is
refused, naming it; a group removed just stops stepping its parameters, as in PyTorch.
"""

from __future__ import annotations

import copy

import pytest
import torch

import rotapipe
from models import emulated, lm_loss, reference_forward_backward, tiny_transformer, token_batch

MODES = ["sync", "overlap", "stale"]


def _pipe(mode="sync", model=None, **kw):
    model = model if model is not None else tiny_transformer()
    return rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2, optimizer_mode=mode, **kw))


def _state(pipe, opt):
    return ({k: v.clone() for k, v in pipe.state_dict().items()},
            {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v
                     for k, v in st.items()} for p, st in opt.state.items()},
            [None if p.grad is None else p.grad.clone() for p in pipe.parameters()])


def _assert_same(a, b):
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k
    assert a[1].keys() == b[1].keys()
    for pid in a[1]:
        for k, v in a[1][pid].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b[1][pid][k]))
    assert all((g is None and h is None) or torch.equal(g, h) for g, h in zip(a[2], b[2]))


@pytest.mark.parametrize("mode", MODES)
def test_a_foreign_parameter_added_after_attach_is_refused_with_nothing_changed(mode):
    x, y = token_batch(4)
    with _pipe(mode) as pipe:
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        pipe.attach_optimizer(opt)
        pipe.train_step(x, y)
        pipe.flush()
        foreign = torch.nn.Parameter(torch.randn(5))
        opt.add_param_group({"params": [foreign], "lr": 1e-3})
        before = _state(pipe, opt)
        with pytest.raises(rotapipe.ConfigError, match=r"not a trainable parameter of the "
                           r"wrapped layers \(shape \(5,\)\).*added or changed after "
                           r"attach_optimizer.*nothing was stepped"):
            pipe.train_step(x, y)
        _assert_same(before, _state(pipe, opt))
        opt.param_groups.pop()          # fixed: trains on
        pipe.train_step(x, y)


def test_step_refuses_a_parameter_put_into_a_group_and_keeps_the_gradients():
    x, y = token_batch(4)
    with _pipe() as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        pipe.attach_optimizer(opt)
        pipe.forward_backward(x, y)
        first = opt.param_groups[0]["params"][0]
        opt.param_groups[0]["params"][0] = torch.nn.Parameter(first.detach().clone())
        before = _state(pipe, opt)
        with pytest.raises(rotapipe.ConfigError, match="added or changed after attach"):
            pipe.step()
        _assert_same(before, _state(pipe, opt))
        opt.param_groups[0]["params"][0] = first
        pipe.step()
        assert all(p.grad is None for p in pipe.parameters())


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_a_model_parameter_added_later_trains_as_in_plain_pytorch(mode):
    """The head is left out of the optimizer for the first step and added for the
    second (with its own learning rate); the first block's group is then removed:
    plain PyTorch doing the same gives the same weights. ``overlap`` changes the groups
    after ``pipe.flush()``: a step may still run when ``train_step`` returns."""
    model = tiny_transformer()
    ref = copy.deepcopy(model)
    batches = [token_batch(4, seed=s) for s in (1, 2, 3)]

    def schedule(opt, head, first, step):
        if step == 1:
            opt.add_param_group({"params": list(head.parameters()), "lr": 3e-2})
        if step == 2:
            del opt.param_groups[1]    # the first block's group: no longer stepped

    def groups(m):
        head, first = m[-1], m[1]
        rest = [p for l in list(m)[:1] + list(m)[2:-1] for p in l.parameters()]
        return head, first, [{"params": rest}, {"params": list(first.parameters())}]

    head, first, gs = groups(ref)
    opt = torch.optim.AdamW(gs, lr=1e-2)
    for step, (x, y) in enumerate(batches):
        schedule(opt, head, first, step)
        reference_forward_backward(ref, x, y, 2, step)
        opt.step()
        ref.zero_grad()         # every parameter's, as pipe.step() clears them
    with _pipe(mode, model) as pipe:
        head, first, gs = groups(model)
        popt = torch.optim.AdamW(gs, lr=1e-2)
        pipe.attach_optimizer(popt)
        for step, (x, y) in enumerate(batches):
            pipe.flush()
            schedule(popt, head, first, step)
            pipe.train_step(x, y)
        got = pipe.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("unfreeze", [False, True])
def test_a_parameter_frozen_at_build_is_refused_when_added_later(unfreeze):
    model = tiny_transformer()
    model[-1].out.weight.requires_grad_(False)
    x, y = token_batch(4)
    with _pipe(model=model) as pipe:
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        pipe.attach_optimizer(opt)
        pipe.train_step(x, y)
        w = model[-1].out.weight
        w.requires_grad_(unfreeze)
        opt.add_param_group({"params": [w]})
        before = _state(pipe, opt)
        with pytest.raises(rotapipe.ConfigError,
                           match=r"parameter 5\.out\.weight, which was frozen when the "
                           r"pipeline was built.*added or changed after attach"):
            pipe.train_step(x, y)
        _assert_same(before, _state(pipe, opt))


def test_attach_names_a_frozen_parameter():
    model = tiny_transformer()
    model[-1].out.weight.requires_grad_(False)
    with _pipe(model=model) as pipe:
        with pytest.raises(rotapipe.ConfigError, match=r"parameter 5\.out\.weight, which "
                           r"was frozen.*build it over pipe.parameters\(\)"):
            pipe.attach_optimizer(torch.optim.AdamW(model.parameters()))


def test_bf16_state_rechecks_an_added_group():
    with _pipe(optimizer_state_dtype="bf16") as pipe:
        opt = torch.optim.AdamW(list(pipe.parameters())[:-1], lr=1e-2)
        pipe.attach_optimizer(opt)
        opt.add_param_group({"params": list(pipe.parameters())[-1:], "capturable": True})
        with pytest.raises(rotapipe.ConfigError, match="capturable"):
            pipe.train_step(*token_batch(4))


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_sharded_pipeline_refuses_a_whole_parameter_added_later(one_rank_group, shard):
    dp = rotapipe.DataParallelConfig(enabled=True, shard=shard, timeout_s=10)
    model = tiny_transformer()
    x, y = token_batch(4)
    with _pipe(model=model, data_parallel=dp) as pipe:
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        pipe.attach_optimizer(opt)
        pipe.train_step(x, y)
        opt.add_param_group({"params": [model[1].down.weight]})
        with pytest.raises(rotapipe.ConfigError, match=r"parameter 1\.down\.weight itself, "
                           r"but a sharded pipeline steps this rank's fp32 pieces"):
            pipe.train_step(x, y)
        opt.param_groups.pop()
        pipe.train_step(x, y)
