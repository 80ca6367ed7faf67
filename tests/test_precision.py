"""Mixed precision: bf16 / fp16 compute with fp32 masters, and fp16 dynamic loss scaling.

Tolerances, each against the same run in fp32 (same init, data and optimizer):

- gradients after one ``forward_backward`` (tiny transformer with tied embedding and a
  BatchNorm layer): relative error ``||g - g32|| / ||g32||`` over all gradients
  together below 5e-2 for bf16 and 2e-2 for fp16, and below 0.2 for every single
  tensor; the loss within 1 % (measured: 1.3e-2 / 8.7e-3 together, 4.6e-2 / 6.9e-2 for
  the worst tensor, loss 1e-4 / 4e-4);
- training 50 steps on a token-mapping task: the loss falls below a tenth of its
  start in every dtype, and each step's loss stays within 5 % (bf16) / 2 % (fp16) of
  the fp32 run's (measured: 0.9 % / 0.14 %).
"""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch

import rotapipe
from models import emulated, lm_loss, tiny_transformer, token_batch

GRAD_TOL = {"bf16": 5e-2, "fp16": 2e-2}
GRAD_TOL_PER_TENSOR = 0.2
LOSS_CURVE_TOL = {"bf16": 0.05, "fp16": 0.02}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def config(dtype: str, workers: int = 2, microbatches: int = 2, **precision):
    return emulated(workers, microbatches,
                    precision=rotapipe.PrecisionConfig(compute_dtype=dtype, **precision))


def mapping_batch(step: int, n: int = 8, t: int = 8):
    """Tokens 0..31, each to be mapped to ``(5 x + 3) mod 32``: learnable, and fast."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 32, (n, t), generator=g)
    return x, (5 * x + 3) % 32


@functools.lru_cache(maxsize=None)
def train(dtype: str, steps: int = 50) -> tuple[float, ...]:
    model = tiny_transformer(widths=(24, 40), buffers=True)
    with rotapipe.RoundPipe(model, lm_loss, config=config(dtype), optimizer=adamw) as pipe:
        losses = []
        for s in range(steps):
            losses.append(pipe.forward_backward(*mapping_batch(s)))
            pipe.step()
    return tuple(losses)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_trains_and_tracks_fp32(dtype):
    """The loss falls below a tenth of its start in 50 steps, and every step's loss is
    within LOSS_CURVE_TOL (relative) of the fp32 run's."""
    got, want = torch.tensor(train(dtype)), torch.tensor(train("fp32"))
    for losses in (got, want):
        assert losses[-5:].mean() < 0.1 * losses[0], losses
    torch.testing.assert_close(got, want, rtol=LOSS_CURVE_TOL[dtype], atol=0)


def first_grads(dtype: str, **precision):
    model = tiny_transformer(tied=True, buffers=True)
    with rotapipe.RoundPipe(model, lm_loss, config=config(dtype, 3, 3, **precision)) as pipe:
        loss = pipe.forward_backward(*token_batch(8, 6))
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return loss, grads, pipe.state_dict()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gradients_close_to_fp32(dtype):
    """After one call the (unscaled, fp32) gradients are within GRAD_TOL of fp32's."""
    # init_scale 2**8: at the default 2**16 this model's first fp16 backward overflows
    # (and the step would be skipped), which test_fp16_overflow_* covers.
    loss, grads, state = first_grads(dtype, init_scale=2.0 ** 8)
    loss32, grads32, state32 = first_grads("fp32")
    assert loss == pytest.approx(loss32, rel=1e-2)
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())
    per_tensor = {k: ((grads[k] - g).norm() / g.norm()).item() for k, g in grads32.items()}
    assert max(per_tensor.values()) < GRAD_TOL_PER_TENSOR, per_tensor
    diff = torch.cat([(grads[k] - g).flatten() for k, g in grads32.items()])
    ref = torch.cat([g.flatten() for g in grads32.values()])
    assert (diff.norm() / ref.norm()).item() < GRAD_TOL[dtype]
    # BatchNorm statistics computed in the compute dtype, kept in fp32 on the host.
    for k in ("3.bn.running_mean", "3.bn.running_var"):
        assert state[k].dtype == torch.float32
        torch.testing.assert_close(state[k], state32[k], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fixed_power_of_two_scale_changes_no_bit(dtype):
    """A fixed loss scale of 2**10 is undone exactly: scaling by a power of two only
    moves exponents, so the gradients equal the unscaled run's bitwise."""
    _, grads, _ = first_grads(dtype, loss_scale=1024.0)
    _, plain, _ = first_grads(dtype)
    differ = [k for k in plain if not torch.equal(grads[k], plain[k])]
    assert not differ


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_masters_stay_fp32_and_compute_copies_follow(dtype):
    """Masters, their gradients and the optimizer state are fp32 (even for a model
    handed over in the compute dtype); after each step the compute copy is exactly the
    master cast to the compute dtype (fp32: the master itself)."""
    dt = DTYPES[dtype]
    model = tiny_transformer(tied=True).to(dt)
    with rotapipe.RoundPipe(model, lm_loss, config=config(dtype, init_scale=2.0 ** 8),
                            optimizer=adamw) as pipe:
        params = pipe.layerset.params
        for s in range(3):
            pipe.forward_backward(*token_batch(8, 6, seed=s))
            assert all(p.grad.dtype == torch.float32 for p in pipe.parameters())
            assert pipe.step()
            for pid in pipe.host.trainable:
                master, compute = params[pid], pipe.host.compute[pid]
                assert master.dtype == torch.float32 and compute.dtype == dt
                assert torch.equal(compute, master.detach().to(dt))
                if dt == torch.float32:
                    assert compute.data_ptr() == master.data_ptr()
        for state in pipe.optimizer.state.values():
            for v in state.values():
                assert v.dtype == torch.float32
        assert all(v.dtype == torch.float32 for v in pipe.state_dict().values()
                   if v.is_floating_point())


def _masters(pipe):
    return [p.detach().clone() for p in pipe.parameters()]


def _compute(pipe):
    return [c.clone() for c in pipe.host.compute]


def _assert_unchanged(pipe, masters, compute):
    assert all(torch.equal(a, b) for a, b in zip(_masters(pipe), masters))
    assert all(torch.equal(a, b) for a, b in zip(_compute(pipe), compute))


def test_fp16_overflow_skips_steps_until_the_scale_fits():
    """At a loss scale of 2**40 fp16 gradients overflow: each ``step()`` returns False,
    halves the scale, leaves weights, compute copies and optimizer state untouched and
    drops the gradients; once the scale fits, steps proceed and the model trains."""
    model = tiny_transformer(widths=(24, 40))
    cfg = config("fp16", init_scale=2.0 ** 40, growth_interval=1000)
    with rotapipe.RoundPipe(model, lm_loss, config=cfg, optimizer=adamw) as pipe:
        assert pipe.config.precision.loss_scale == "dynamic"
        masters, compute = _masters(pipe), _compute(pipe)
        batch = mapping_batch(0)
        skipped = 0
        while True:
            scale = pipe.scaler.scale
            pipe.forward_backward(*batch)
            if pipe.step():
                break
            skipped += 1
            assert pipe.scaler.scale == scale / 2
            assert all(p.grad is None for p in pipe.parameters())
            assert not pipe.optimizer.state
            _assert_unchanged(pipe, masters, compute)
            assert skipped < 40
        assert skipped >= 20       # 2**40 is far beyond fp16's range (max 65504)
        assert pipe.scaler.scale == 2.0 ** (40 - skipped)
        assert not all(torch.equal(a, b) for a, b in zip(_masters(pipe), masters))
        losses = []
        for s in range(1, 30):
            losses.append(pipe.forward_backward(*mapping_batch(s)))
            assert pipe.step()
        assert losses[-1] < 0.5 * losses[0]
        assert pipe.scaler.scale == 2.0 ** (40 - skipped)


def test_a_fixed_loss_scale_that_overflows_names_the_scale():
    """A fixed fp16 loss scale of 2**40 overflows every gradient: the step is refused
    (the call changes nothing), and the error says to lower the scale, not only the learning
    rate."""
    model = tiny_transformer(widths=(24, 40))
    with rotapipe.RoundPipe(model, lm_loss, config=config("fp16", loss_scale=2.0 ** 40),
                            optimizer=adamw) as pipe:
        masters, compute = _masters(pipe), _compute(pipe)
        with pytest.raises(rotapipe.NonFiniteError, match=re.escape(
                "with a fixed loss scale of 1.09951e+12, which can overflow a "
                "low-precision gradient: lower PrecisionConfig(loss_scale=...)")):
            pipe.forward_backward(*mapping_batch(0))
        assert pipe.calls == 0 and all(p.grad is None for p in pipe.parameters())
        _assert_unchanged(pipe, masters, compute)


def test_fp16_overflow_from_one_bad_batch():
    """A loss that overflows fp16 mid-training skips that one step: the scale halves,
    nothing changes (the optimizer's step count included), and the next step runs."""
    factor = [1.0]

    def loss_fn(out, labels):
        return lm_loss(out, labels) * factor[0]

    model = tiny_transformer(widths=(24, 40))
    cfg = config("fp16", init_scale=2.0 ** 10, growth_interval=1000)
    with rotapipe.RoundPipe(model, loss_fn, config=cfg, optimizer=adamw) as pipe:
        for s in range(3):
            pipe.forward_backward(*mapping_batch(s))
            assert pipe.step()
        masters, compute = _masters(pipe), _compute(pipe)
        steps = [st["step"].item() for st in pipe.optimizer.state.values()]
        factor[0] = 1e8
        pipe.forward_backward(*mapping_batch(3))
        assert not pipe.step()
        assert pipe.scaler.scale == 2.0 ** 9
        _assert_unchanged(pipe, masters, compute)
        assert [st["step"].item() for st in pipe.optimizer.state.values()] == steps
        factor[0] = 1.0
        pipe.forward_backward(*mapping_batch(4))
        assert pipe.step()
        assert [st["step"].item() for st in pipe.optimizer.state.values()] == \
            [v + 1 for v in steps]
        assert not all(torch.equal(a, b) for a, b in zip(_masters(pipe), masters))


def test_dynamic_scale_grows_after_clean_steps():
    model = tiny_transformer(widths=(24, 40))
    cfg = config("fp16", init_scale=2.0 ** 8, growth_interval=2)
    with rotapipe.RoundPipe(model, lm_loss, config=cfg, optimizer=adamw) as pipe:
        scales = []
        for s in range(4):
            pipe.forward_backward(*mapping_batch(s))
            assert pipe.step()
            scales.append(pipe.scaler.scale)
    assert scales == [2.0 ** 8, 2.0 ** 9, 2.0 ** 9, 2.0 ** 10]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_eval_close_to_fp32_model(dtype):
    """``pipe(x)`` in eval mode (BatchNorm on running statistics) computes in the compute
    dtype; its relative error against the fp32 model's output, ``||y - y32|| / ||y32||``,
    stays below 2e-2 (measured: 5e-3 bf16, 7e-4 fp16)."""
    model = tiny_transformer(tied=True, buffers=True)
    x = token_batch(6, 6, seed=3)[0]
    with torch.no_grad():
        want = model.eval()(x)
    with rotapipe.RoundPipe(model, lm_loss, config=config(dtype, 3, 3)) as pipe:
        got = pipe.eval()(x)
    assert got.dtype == DTYPES[dtype]
    assert ((got.float() - want).norm() / want.norm()).item() < 2e-2


def _fp16_state(steps: int, **precision):
    """``(weights, optimizer state, pipeline state)`` after ``steps`` fp16 steps."""
    model = tiny_transformer(widths=(24, 40))
    with rotapipe.RoundPipe(model, lm_loss, config=config("fp16", **precision),
                            optimizer=adamw) as pipe:
        losses = [pipe.train_step(*mapping_batch(s)) for s in range(steps)]
        return ({k: v.clone() for k, v in pipe.state_dict().items()},
                copy.deepcopy(pipe.optimizer.state_dict()), pipe.pipeline_state(), losses,
                pipe.scaler.state_dict())


def test_dynamic_scaler_resumes_exactly():
    """fp16 with overflows and growth (init 2**20, growth every 3 steps): 12 steps in
    one run equal 6 steps, a save (weights, optimizer, pipeline state) and 6 more in a
    new pipeline, loss by loss, weight by weight, and the scaler's state."""
    precision = dict(init_scale=2.0 ** 20, growth_interval=3)
    weights, opt, state, want, scaler = _fp16_state(12, **precision)
    saved = _fp16_state(6, **precision)
    assert not saved[2]["scaler"]["scale"] == 2.0 ** 20        # it moved
    model = tiny_transformer(widths=(24, 40))
    with rotapipe.RoundPipe(model, lm_loss, config=config("fp16", **precision),
                            optimizer=adamw) as pipe:
        pipe.load_state_dict(saved[0])
        pipe.optimizer.load_state_dict(saved[1])
        pipe.load_pipeline_state(saved[2])
        got = [pipe.train_step(*mapping_batch(s)) for s in range(6, 12)]
        assert pipe.scaler.state_dict() == scaler
        for k, v in pipe.state_dict().items():
            torch.testing.assert_close(v, weights[k], rtol=1e-5, atol=1e-6, msg=k)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want[6:]), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("dtype,precision", [
    ("fp16", dict(loss_scale=16.0)), ("bf16", {}), ("fp32", {})])
def test_a_dynamic_scalers_state_leaves_a_fixed_scale_alone(dtype, precision):
    """A pipeline state saved under fp16 dynamic scaling (scale 2**40 here), loaded into
    a pipeline with a fixed scale or none, keeps that pipeline's scale: it used to take
    the saved scale as its fixed one (a fixed fp16 scale of 16 became 2**40 and every
    step then failed, naming a scale the config never set)."""
    state = {"calls": 3, "evals": 0, "scaler": {"scale": 2.0 ** 40, "good_steps": 2,
                                                "dynamic": True}}
    model = tiny_transformer(widths=(24, 40))
    fresh = copy.deepcopy(model)
    with rotapipe.RoundPipe(model, lm_loss, config=config(dtype, **precision)) as pipe:
        scale = pipe.scaler.scale
        pipe.load_pipeline_state(state)
        assert pipe.scaler.scale == scale and pipe.calls == 3
        pipe.calls = 0
        pipe.forward_backward(*mapping_batch(0))
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    with rotapipe.RoundPipe(fresh, lm_loss, config=config(dtype, **precision)) as pipe:
        pipe.forward_backward(*mapping_batch(0))
        for n, p in pipe.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_a_fixed_scales_state_leaves_dynamic_scaling_at_its_init_scale():
    """A bf16 run's pipeline state (no scaling: scale 1) resumed under fp16 dynamic
    scaling starts from ``init_scale``, not from 1 (where small fp16 gradients flush to
    zero until ``growth_interval`` clean steps double it, 16 times over)."""
    model = tiny_transformer(widths=(24, 40))
    with rotapipe.RoundPipe(model, lm_loss, config=config("bf16")) as pipe:
        state = pipe.pipeline_state()
    assert state["scaler"] == {"scale": 1.0, "good_steps": 0, "dynamic": False}
    with rotapipe.RoundPipe(model, lm_loss, config=config("fp16")) as pipe:
        pipe.load_pipeline_state(state)
        assert pipe.scaler.scale == 2.0 ** 16


class _Scaled(torch.nn.Module):
    """A linear layer scaled by an fp32 buffer its forward reads and never writes
    (a rotary table, a fixed normaliser)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 1.0 + 2.0 ** -12))

    def forward(self, x):
        return self.lin(x) * self.scale


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_buffer_the_forward_only_reads_keeps_its_fp32_value(dtype):
    """The workers compute with the buffer in the compute dtype, but the user's module
    keeps its own value: before, every training call wrote the rounded copy back
    (1 + 2^-12 became 1.0 in bf16), so the model evaluated or saved afterwards was not
    the one trained."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Scaled(), _Scaled())
    before = [m.scale.clone() for m in model]
    with rotapipe.RoundPipe(model, lambda y, t: ((y - t) ** 2).mean(),
                            config=config(dtype)) as pipe:
        pipe.attach_optimizer(adamw(pipe.parameters()))
        for _ in range(2):
            pipe.train_step(torch.randn(4, 8), torch.randn(4, 8))
    for m, want in zip(model, before):
        assert m.scale.dtype == torch.float32 and torch.equal(m.scale, want)
