"""Data parallelism when the user's loop or the optimizer does something unexpected.

- Sharded (``shard="optimizer" | "gradients"``): the user's own
  ``optimizer.zero_grad()`` between calls starts a new accumulation, as without
  sharding; clearing part of the pieces is refused, and so is editing them
  (``clip_grad_norm_`` over the pieces); the user's own
  ``optimizer.step()`` on the pieces is refused before it changes anything (it would
  never reach the workers' weights).
- Sharded: an optimizer whose step raises part-way is reported as partly stepped, the
  workers' copies follow the pieces, and data parallelism is retired.
- A rank that leaves the collectives (its call failed) fails the others at once, not
  at ``timeout_s``.

In process on a one-rank gloo group (the sharded code paths with ``W = 1``), except
the last, which runs 2 ranks (``dist_job.py``).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

import rotapipe
from models import emulated, lm_loss, tiny_transformer, token_batch
from test_distributed import ATOL, RTOL, _finish, _launch

SHARDS = ["optimizer", "gradients"]


def _pipe(shard, **kw):
    dp = rotapipe.DataParallelConfig(enabled=True, shard=shard, timeout_s=10)
    model = tiny_transformer()
    ref = copy.deepcopy(model)
    pipe = rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2, data_parallel=dp, **kw))
    return pipe, ref


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def _assert_weights(pipe, ref, what):
    got = pipe.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k].float(), v, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what} {k}: {m}")


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("shard", SHARDS)
def test_sharded_users_own_zero_grad_starts_a_new_accumulation(one_rank_group, shard,
                                                               set_to_none):
    """``forward_backward`` on a batch, ``optimizer.zero_grad()`` (discarding it), then
    ``forward_backward`` on another and ``pipe.step()``: plain PyTorch's step on the
    second batch alone. Before, the sharded pipeline did not see the clearing:
    ``"optimizer"`` kept the discarded batch in its local sum, ``"gradients"`` weighted
    the second batch by 1/2 (max abs weight error 0.036 / 0.004 after 2 steps)."""
    pipe, ref = _pipe(shard)
    with pipe:
        opt = _adamw(pipe.parameters())
        pipe.attach_optimizer(opt)
        ref_opt = _adamw(ref.parameters())
        for step in range(2):
            pipe.forward_backward(*token_batch(8, seed=100 + step))
            opt.zero_grad(set_to_none=set_to_none)
            x, y = token_batch(8, seed=step)
            pipe.forward_backward(x, y)
            pipe.step()
            ref_opt.zero_grad()
            lm_loss(ref(x), y).backward()
            ref_opt.step()
        _assert_weights(pipe, ref, f"{shard}")


def test_sharded_gradients_cleared_in_part_are_refused(one_rank_group):
    pipe, _ = _pipe("gradients")
    with pipe:
        pipe.attach_optimizer(_adamw(pipe.parameters()))
        pipe.forward_backward(*token_batch(8))
        next(iter(pipe.parameters())).grad = None
        with pytest.raises(rotapipe.InputError, match=r"gradient piece of 0\.emb\.weight "
                           r"was cleared.*pipe\.zero_grad\(\)"):
            pipe.forward_backward(*token_batch(8))
        with pytest.raises(rotapipe.DistributedError, match="cleared in part"):
            pipe.forward_backward(*token_batch(8))


@pytest.mark.parametrize("shard", SHARDS)
def test_sharded_users_own_clip_grad_norm_is_refused(one_rank_group, shard):
    """``torch.nn.utils.clip_grad_norm_(pipe.parameters())`` between
    ``forward_backward`` and ``pipe.step()`` (the unsharded loop of
    docs/distributed.md) clipped each rank's pieces by their own norm (``"optimizer"``:
    this rank's part of the unreduced sum only): on 2 ranks after 3 steps the weights
    were off plain PyTorch's by up to 0.038 / 0.0038, silently. Now ``pipe.step()``
    raises an InputError naming PipeConfig.clip_grad_norm before any weight changes."""
    pipe, _ = _pipe(shard)
    with pipe:
        pipe.attach_optimizer(_adamw(pipe.parameters()))
        pipe.forward_backward(*token_batch(8))
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        pieces = [q.detach().clone() for q in pipe.parameters()]
        torch.nn.utils.clip_grad_norm_(pipe.parameters(), 1e-3)
        with pytest.raises(rotapipe.InputError, match=r"changed since the last call.*"
                           r"PipeConfig\(clip_grad_norm=max_norm\)"):
            pipe.step()
        assert all(torch.equal(a, q.detach()) for a, q in zip(pieces, pipe.parameters()))
        for k, v in pipe.state_dict().items():
            assert torch.equal(v, before[k]), k
        with pytest.raises(rotapipe.DistributedError, match="gradients were edited"):
            pipe.forward_backward(*token_batch(8))


@pytest.mark.parametrize("shard", SHARDS)
def test_sharded_users_own_optimizer_step_is_refused(one_rank_group, shard):
    """``opt.step()`` on the pieces, outside the pipeline, updated this rank's fp32
    pieces only (``"gradients"``) or nothing at all (``"optimizer"``: the pieces have
    no reduced gradient before the pipeline's step), and never the workers' weights:
    training silently did not follow plain PyTorch (max abs weight error 0.029 after
    3 steps). Now an InputError before anything changes; ``pipe.step()`` then trains
    exactly."""
    pipe, ref = _pipe(shard)
    with pipe:
        opt = _adamw(pipe.parameters())
        ref_opt = _adamw(ref.parameters())
        x, y = token_batch(8)
        pipe.forward_backward(x, y)
        before = [q.detach().clone() for q in pipe.parameters()]
        with pytest.raises(rotapipe.InputError, match=r"optimizer\.step\(\) was called on "
                           r"the pieces.*Call pipe\.step\(\)"):
            opt.step()
        assert all(torch.equal(a, q) for a, q in zip(before, pipe.parameters()))
        assert not opt.state       # nothing stepped
        pipe.attach_optimizer(opt)
        pipe.step()
        lm_loss(ref(x), y).backward()
        ref_opt.step()
        _assert_weights(pipe, ref, shard)


class _StepsThenRaises(torch.optim.SGD):
    """SGD that, once ``armed``, updates the first two parameters with a gradient and
    then raises."""

    armed = False

    def step(self, closure=None):
        if not self.armed:
            return super().step()
        with torch.no_grad():
            ps = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            for p in ps[:2]:
                p.add_(p.grad, alpha=-self.param_groups[0]["lr"])
        raise RuntimeError("whole step failed part-way")


@pytest.mark.parametrize("how", ["step", "train_step"])
@pytest.mark.parametrize("shard", SHARDS)
def test_sharded_step_raising_part_way_is_reported(one_rank_group, shard, how):
    """Before: the pieces the optimizer stepped kept their update while the workers'
    copies (and ``state_dict``) did not; ``train_step`` reported the call as
    "discarded" ("the state is that after call 0"), and after ``pipe.step()`` data
    parallelism went on (a peer would wait in the all-gather this rank never
    issues). Now: partly stepped, the copies follow the pieces, data parallelism is
    retired."""
    pipe, _ = _pipe(shard)
    with pipe:
        opt = _StepsThenRaises(pipe.parameters(), lr=0.5)
        pipe.attach_optimizer(opt)
        x, y = token_batch(8)
        pipe.train_step(x, y)
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        opt.armed = True
        with pytest.raises(RuntimeError, match="whole step failed part-way") as info:
            if how == "step":
                pipe.forward_backward(x, y)
                pipe.step()
            else:
                pipe.train_step(x, y)
        err = info.value
        if how == "train_step":
            assert err.calls_partly_stepped == [1] and err.calls_discarded == [], str(err)
            assert "data parallelism is retired" in str(err)
        else:
            assert any("raised part-way through a sharded whole step" in n
                       for n in err.__notes__)
        after = pipe.state_dict()
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        assert changed == ["0.emb.weight", "1.norm1.weight"], changed
        for name, q in pipe.named_parameters():       # the workers' copies: the pieces
            assert torch.equal(after[name].reshape(-1), q.detach()), name
        torch.testing.assert_close(pipe(x), copy.deepcopy(pipe._container)(x))
        with pytest.raises(rotapipe.DistributedError, match="step raised part-way"):
            pipe.train_step(x, y)


def test_a_rank_that_left_fails_the_others_at_once(tmp_path):
    """Rank 1's loss raises at step 1 (its call fails, it stays alive): rank 0 fails
    naming it within seconds, not after ``timeout_s`` (60 s here; before, it waited
    all of it: rank 1 marks why it left, and rank 0's wait reads the mark)."""
    timeout = 60.0
    procs = _launch(tmp_path, 2, "--raise-at", "1", "--timeout", str(timeout))
    try:
        rc, err = _finish(procs[0], 120)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert rc == 3, err
    assert "lost_ranks=[1]" in err and "rank 1 left the collectives: its own call failed" \
        in err, err
    began = float((tmp_path / "rank1.pt.fault").read_text())
    failed = float(re.search(r"at=([0-9.]+)", err).group(1))
    assert 0 < failed - began < 10, (failed - began, err)
