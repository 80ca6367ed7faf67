"""Gradient accumulation over several calls keeps one fp32 gradient per parameter.

- Exact: 2-4 calls per step in ``sync`` and ``overlap``, clipping off / hit, equal plain
  PyTorch element by element (fp32); in bf16 compute, staging a call's gradients in the
  compute dtype gives the same bits as widening them on arrival, in every mode.
- Bytes: the fp32 gradients alive on the host (tests/gradcount.py, a deterministic
  count) peak at one copy of the model's plus one stage's being merged, where staging
  them in fp32 held two.
- A call that fails in the middle of an accumulation changes nothing, and the step
  then ends as an uninterrupted one does, bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

import rotapipe
from gradcount import GradCount
from models import emulated, lm_loss, tiny_transformer, token_batch
from rotapipe.runtime.callgrads import CallGrads, RowGrad
from test_exactness import OPTIMIZERS, RTOL, ATOL, step_batches, train_reference
from test_faults import Trigger, assert_same_state, faulty_model, snapshot
from test_optimizer_modes import CLIP, train_fused


@pytest.mark.parametrize("mode,sizes,clip", [("sync", (4, 6, 8), "off"),
                                             ("sync", (4, 4, 6, 8), "hit"),
                                             ("overlap", (4, 6), "hit"),
                                             ("overlap", (4, 4, 6, 8), "miss"),
                                             ("overlap", (6, 4, 8), "off")])
def test_accumulation_matches_plain_pytorch(mode, sizes, clip):
    data = step_batches(sizes, steps=2)
    model = tiny_transformer(tied=True)
    want = train_reference(copy.deepcopy(model), sizes, 2, "adamw", data=data,
                           clip=CLIP[clip])
    losses, _, state, _, _ = train_fused(model, data, emulated(
        2, 2, optimizer_mode=mode, clip_grad_norm=CLIP[clip]), "adamw")
    torch.testing.assert_close(losses, want.losses, rtol=RTOL, atol=ATOL)
    for k in want.state:
        torch.testing.assert_close(state[k], want.state[k], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, k=k: f"{k}: {m}")


def _train_bf16(mode: str, clip, calls: int, monkeypatch=None, keep_dtype=True,
                steps: int = 2, count: bool = False):
    """bf16 compute, ``calls`` calls per step: (state_dict, GradCount or None)."""
    if not keep_dtype:      # the former layout: every gradient widened on arrival
        init = CallGrads.__init__
        monkeypatch.setattr(CallGrads, "__init__",
                            lambda self, s, keep_dtype=False, **kw: init(self, s, False,
                                                                         **kw))
    torch.manual_seed(0)
    dims = [(37, 41), (41, 43), (43, 47), (47, 53), (53, 59), (59, 61)]
    layers = [torch.nn.Linear(a, b) for a, b in dims]
    config = emulated(2, 2, optimizer_mode=mode, clip_grad_norm=clip, precision="bf16")
    g = torch.Generator().manual_seed(1)
    meter = None
    with rotapipe.RoundPipe(layers, lambda y, t: ((y - t) ** 2).mean(), config=config,
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        meter = GradCount(pipe) if count else None
        if meter is not None:
            meter.__enter__()
        try:
            for _ in range(steps):
                for c in range(calls):
                    x, y = torch.randn(8, 37, generator=g), torch.randn(8, 61, generator=g)
                    if c < calls - 1:
                        pipe.forward_backward(x, y)
                    else:
                        pipe.train_step(x, y)
            pipe.flush()
        finally:
            if meter is not None:
                meter.__exit__(None, None, None)
        stages = (pipe.plan.tail,) + pipe.plan.backward
        stage = max(4 * sum(p.numel() for l in layers[s.start:s.stop]
                            for p in l.parameters()) for s in stages)
        return {k: v.clone() for k, v in pipe.state_dict().items()}, meter, stage


@pytest.mark.parametrize("mode,want", [
    # sync: each step's first call widens on arrival, the calls that accumulate keep bf16
    ("sync", [False, True, True, False, True, True]),
    # the asynchronous modes: every later call is issued behind an uncommitted one
    ("stale", [False, True, True, True, True, True]),
    ("overlap", [False, True, True, True, True, True])])
def test_a_call_that_starts_a_step_widens_its_gradients_on_arrival(monkeypatch, mode, want):
    """Only a call with nothing to keep apart from (no .grad held, no call in flight
    before it) stages in fp32; the others keep the compute dtype (docs/memory.md)."""
    seen = []
    init = CallGrads.__init__

    def spy(self, inv_scale, keep_dtype=False, **kw):
        seen.append(keep_dtype)
        init(self, inv_scale, keep_dtype, **kw)
    monkeypatch.setattr(CallGrads, "__init__", spy)
    _train_bf16(mode, None, 3)
    assert seen == want


@pytest.mark.parametrize("mode,clip,calls", [("sync", None, 1), ("sync", 1e-3, 3),
                                             ("stale", 1e3, 2)])
def test_the_finiteness_check_reads_norms_taken_at_the_hand_offs(monkeypatch, mode, clip,
                                                                  calls):
    """Each gradient's finiteness is settled on the host lane once its last stage
    handed off, from the bounds taken on arrival (or its norm, where they cannot
    tell): by the commit every parameter's is known, and the check reads no gradient
    (the whole-step hooks; ``overlap`` and an unclipped ``stale`` check per stage as
    they step)."""
    from rotapipe.runtime.optimizer import HostOptimizer
    seen = []
    finite = HostOptimizer.finite

    def spy(self, grads, norms=None, known=()):
        seen.append((len(list(grads)), len(norms or {}), len(known)))
        return finite(self, grads, norms, known)
    monkeypatch.setattr(HostOptimizer, "finite", spy)
    _train_bf16(mode, clip, calls)
    assert seen and all(n + k == arrived for arrived, n, k in seen), seen
    assert all(k for _, _, k in seen), seen       # the bounds settled some


def test_bounds_on_arrival_decide_finiteness_exactly():
    """``CallGrads(bounds=True)``: the largest magnitude of each contribution bounds the
    fp32 gradient's elements; it settles finite and non-finite gradients without a
    pass over them, leaves a sum that might overflow (and row gradients) to a check of
    the gradient itself, and changes no value."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(5, 7, generator=g).bfloat16() for _ in range(2)]
    for keep in (False, True):
        plain, bounded = CallGrads(0.5, keep_dtype=keep), CallGrads(0.5, keep_dtype=keep,
                                                                    bounds=True)
        for grads in (plain, bounded):
            for p in parts:
                grads.add(0, p)
        assert bounded.known_finite(0) is True and plain.known_finite(0) is None
        assert torch.equal(bounded.get(0), plain.get(0))
        for bad in (float("nan"), float("inf"), -float("inf")):
            grads = CallGrads(1.0, keep_dtype=keep, bounds=True)
            part = parts[0].clone()
            part[2, 3] = bad
            grads.add(1, parts[1])
            grads.add(1, part)
            assert grads.known_finite(1) is False
        # Two finite contributions whose sum overflows fp32: only the gradient can tell.
        big = torch.full((3,), 6e37, dtype=torch.bfloat16)
        grads = CallGrads(1.0, keep_dtype=keep, bounds=True)
        grads.add(2, big)
        assert grads.known_finite(2) is True
        for _ in range(5):
            grads.add(2, big)
        assert grads.known_finite(2) is None
        assert torch.isinf(grads.get(2)).all()
        grads.discard(2)
        assert grads.known_finite(2) is None
    rows = CallGrads(1.0, bounds=True)
    rows.add(3, RowGrad(torch.tensor([1]), torch.ones(1, 4), torch.Size([5, 4])))
    assert rows.known_finite(3) is None


@pytest.mark.parametrize("mode", ["sync", "overlap", "stale"])
def test_a_clean_call_takes_no_gradient_norm_for_its_check(monkeypatch, mode):
    """``nonfinite="raise"`` without clipping: the check of a clean call is the bounds
    of its arrivals, no norm of any gradient (``overlap`` and ``stale`` step each
    stage as it hands off, ``sync`` checks at the commit)."""
    norms = []
    real = torch.linalg.vector_norm
    monkeypatch.setattr(torch.linalg, "vector_norm",
                        lambda *a, **k: norms.append(1) or real(*a, **k))
    with rotapipe.RoundPipe(tiny_transformer(tied=True), lm_loss,
                            config=emulated(2, 2, optimizer_mode=mode),
                            optimizer=OPTIMIZERS["sgd"]) as pipe:
        for seed in (1, 2):
            pipe.train_step(*token_batch(8, 6, seed=seed))
        pipe.flush()
        assert pipe.calls == 2
    assert not norms


def test_widening_into_a_reused_buffer_gives_the_same_tensor():
    g = torch.Generator().manual_seed(0)
    grads = CallGrads(0.25, keep_dtype=True)
    parts = [torch.randn(5, 7, generator=g).bfloat16() for _ in range(3)]
    for p in parts:
        grads.add(0, p)
    grads.add(1, torch.randn(3, generator=g).bfloat16())
    buffers = set()
    for pid in (0, 1):
        want = grads.get(pid)
        got = grads.get(pid, reuse=True)
        assert got.shape == want.shape and torch.equal(got, want)
        assert got.untyped_storage().data_ptr() != want.untyped_storage().data_ptr()
        buffers.add(got.untyped_storage().data_ptr())
    assert len(buffers) == 1          # one buffer, sized for the largest, for both
    checked = grads.checked()
    assert torch.equal(checked[0], grads.get(0)) and sorted(checked) == [0, 1]


@pytest.mark.parametrize("mode,clip,calls", [("sync", 1e-3, 3), ("overlap", 1e-3, 2),
                                             ("overlap", None, 4), ("stale", 1e3, 3)])
def test_bf16_staging_gives_the_same_bits(monkeypatch, mode, clip, calls):
    got, _, _ = _train_bf16(mode, clip, calls)
    want, _, _ = _train_bf16(mode, clip, calls, monkeypatch, keep_dtype=False)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("mode,clip", [("sync", None), ("overlap", None),
                                       ("overlap", 1e-3), ("stale", 1e-3)])
def test_accumulation_holds_one_fp32_gradient_per_parameter(monkeypatch, mode, clip):
    _, meter, stage = _train_bf16(mode, clip, 3, steps=1, count=True)
    # One fp32 gradient per parameter, plus the one stage being merged or stepped.
    assert meter.samples > 0 and 0 < meter.peak <= meter.model_bytes + stage, \
        (meter.peak, meter.model_bytes, stage)
    # Widened on arrival (the former layout), the call in flight is a second copy:
    # the count sees it.
    _, before, _ = _train_bf16(mode, clip, 3, monkeypatch, keep_dtype=False, steps=1,
                               count=True)
    assert before.peak >= 2 * before.model_bytes, (before.peak, before.model_bytes)


@pytest.mark.parametrize("mode,clip,last", [("sync", "off", False), ("overlap", "off", True),
                                            ("overlap", "miss", True), ("stale", "off", False),
                                            ("sync", "hit", True)])
def test_failed_call_in_the_middle_of_accumulation_changes_nothing(mode, clip, last):
    """Step 0 runs; step 1 is three calls, one of which fails (the second, or the last:
    ``train_step``); retried, the step ends as an uninterrupted run does."""
    M = 2
    trigger = Trigger()
    model = faulty_model(trigger, tied=True)
    clean = copy.deepcopy(model)
    batches = [token_batch(6, 5, seed=s) for s in range(4)]
    config = emulated(2, M, optimizer_mode=mode, clip_grad_norm=CLIP[clip],
                      precision="bf16")

    def run(pipe, fail: bool):
        opt = OPTIMIZERS["adamw"](pipe.parameters())
        pipe.attach_optimizer(opt)
        pipe.train_step(*batches[0])
        pipe.forward_backward(*batches[1])
        failing = 3 if last else 2
        # The failed run flushes there (stale: the next call then runs on the current
        # weights, docs/optimizer.md); so does the clean one.
        if not last:
            if fail:
                before = snapshot(pipe, opt)
                trigger.arm(1, M - 1, pipe.calls, "backward")
                with pytest.raises(rotapipe.WorkerError):
                    pipe.forward_backward(*batches[2])
                    pipe.flush()
                trigger.disarm()
                assert_same_state(before, snapshot(pipe, opt))
            pipe.flush()
            pipe.forward_backward(*batches[2])
        else:
            pipe.forward_backward(*batches[2])
            if fail:
                pipe.flush()
                before = snapshot(pipe, opt)
                trigger.arm(1, M - 1, pipe.calls, "backward")
                with pytest.raises(rotapipe.WorkerError):
                    pipe.train_step(*batches[failing])
                    pipe.flush()
                trigger.disarm()
                assert_same_state(before, snapshot(pipe, opt))
        pipe.train_step(*batches[3])
        pipe.train_step(*batches[0])
        pipe.flush()
        return {k: v.clone() for k, v in pipe.state_dict().items()}

    with rotapipe.RoundPipe(model, lm_loss, config=config) as pipe:
        got = run(pipe, True)
    with rotapipe.RoundPipe(clean, lm_loss, config=config) as pipe:
        want = run(pipe, False)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_a_steps_gradients_reuse_the_storage_of_the_last_unless_it_is_held():
    """Widened on arrival into HostState.grad_pool: the next step's gradients land in
    the storages the last step dropped (no fresh memory to page-fault in), never in
    one the caller still holds."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(160, 160) for _ in range(4)]     # 100 KiB weights: pooled
    config = emulated(2, 2, precision="bf16")
    g = torch.Generator().manual_seed(1)
    with rotapipe.RoundPipe(layers, lambda y, t: ((y - t) ** 2).mean(), config=config,
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        weights = [p for p in pipe.parameters() if p.dim() == 2]

        def call():
            pipe.forward_backward(torch.randn(8, 160, generator=g),
                                  torch.randn(8, 160, generator=g))
            return [p.grad.untyped_storage().data_ptr() for p in weights]
        first = call()
        pipe.step()
        assert call() == first           # the dropped storages, reused
        held = [p.grad for p in weights]
        kept = [h.clone() for h in held]
        pipe.step()
        third = call()
        assert not set(third) & set(first)
        assert all(torch.equal(h, k) for h, k in zip(held, kept))
