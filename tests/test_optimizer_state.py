"""Optimizer-state precision (``PipeConfig.optimizer_state_dtype``).

- fp32 is untouched (the exactness suites run with it).
- bf16: the pipeline equals plain PyTorch whose AdamW state is rounded to bf16 after
  every step, element by element, in ``sync`` and ``overlap`` (and ``overlap`` equals
  ``sync`` bit for bit); a whole step in groups equals one step; the moments take half
  the bytes; the loss curve stays within a stated tolerance of fp32 state.
- int8 (bitsandbytes' 8-bit AdamW, its CPU kernel): equals the same optimizer on a
  plain PyTorch model; a quarter of the bytes; the loss curve stays close to fp32.
- Checkpoints: state saved and loaded resumes bit for bit; the dtype is recorded and a
  mismatch is refused with the setting to change. Unsupported combinations are refused.
  An optimizer moved from a bf16-state pipeline to an fp32 one is widened exactly.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

import rotapipe
from models import emulated, lm_loss, tiny_transformer
from rotapipe.runtime import optstate
from rotapipe.runtime.optstate import StatePrecision, state_bytes
from test_exactness import OPTIMIZERS, step_batches, train_reference
from test_optimizer_modes import CLIP

import bitsandbytes as bnb  # noqa: E402  (a test dependency: pyproject "test" extras)

MODEL = dict(dim=64, widths=(96, 128, 64, 96), tied=True)   # 64x64+: 8-bit state
# Untied, one call per step: the pipeline's fp32 gradients equal plain PyTorch's bit for
# bit, so a state rounded to bf16 (or 8 bits) can be compared bit for bit too (a 1-ulp
# gradient difference may flip a rounding and move an update by 0.4%).
EXACT = dict(MODEL, tied=False)


class RoundedAdamW(torch.optim.AdamW):
    """Plain PyTorch reference: AdamW whose moments are rounded to bf16 after each
    step (kept in fp32 tensors)."""

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        for st in self.state.values():
            for k in ("exp_avg", "exp_avg_sq"):
                st[k].copy_(st[k].to(torch.bfloat16))
        return out


def _moment_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for p, st in opt.state.items()
               for k, v in st.items() if k != "step" and v.shape == p.shape)


def _train(config, steps: int, make=OPTIMIZERS["adamw"], sizes=(8, 12), model=MODEL):
    """``steps`` optimizer steps of ``sizes`` calls each: (losses, state, optimizer bytes,
    moment bytes)."""
    data = step_batches(sizes, steps=steps)
    losses = []
    with rotapipe.RoundPipe(tiny_transformer(**model), lm_loss, config=config) as pipe:
        opt = make(pipe.parameters())
        pipe.attach_optimizer(opt)
        for calls in data:
            total = sum(y.shape[0] for _, y in calls)
            loss = sum(pipe.forward_backward(x, y) * y.shape[0] / total
                       for x, y in calls[:-1])
            loss += pipe.train_step(*calls[-1]) * calls[-1][1].shape[0] / total
            losses.append(float(loss))
        pipe.flush()
        state = {k: v.clone() for k, v in pipe.state_dict().items()}
        return losses, state, state_bytes(opt), _moment_bytes(opt)


@pytest.mark.parametrize("mode,clip", [("sync", "off"), ("sync", "hit"),
                                       ("overlap", "miss"), ("overlap", "hit")])
def test_bf16_state_matches_plain_pytorch_with_rounded_moments(monkeypatch, mode, clip):
    monkeypatch.setitem(OPTIMIZERS, "adamw-bf16",
                        lambda ps: RoundedAdamW(ps, lr=1e-2, eps=1e-3))
    sizes = (8,)
    want = train_reference(tiny_transformer(**EXACT), sizes, 2, "adamw-bf16",
                           data=step_batches(sizes), clip=CLIP[clip])
    losses, state, _, _ = _train(emulated(2, 2, optimizer_mode=mode,
                                          clip_grad_norm=CLIP[clip],
                                          optimizer_state_dtype="bf16"), 3,
                                 sizes=sizes, model=EXACT)
    assert tuple(losses) == want.losses
    for k in want.state:
        assert torch.equal(state[k], want.state[k]), k
    # Not vacuous: fp32 moments give other weights.
    fp32 = train_reference(tiny_transformer(**EXACT), sizes, 2, "adamw",
                           data=step_batches(sizes), clip=CLIP[clip])
    assert max(float((fp32.state[k] - want.state[k]).abs().max()) for k in want.state) > 1e-5


def test_bf16_overlap_equals_sync_and_grouped_steps_equal_one(monkeypatch):
    cfg = dict(optimizer_state_dtype="bf16", clip_grad_norm=CLIP["miss"])
    _, sync, _, _ = _train(emulated(2, 2, **cfg), 2)
    _, overlap, _, _ = _train(emulated(2, 2, optimizer_mode="overlap", **cfg), 2)
    monkeypatch.setattr(optstate, "GROUP_ELEMENTS", 3000)     # many groups per step
    _, grouped, _, _ = _train(emulated(2, 2, **cfg), 2)
    for k in sync:
        assert torch.equal(sync[k], overlap[k]), k
        assert torch.equal(sync[k], grouped[k]), k


@pytest.mark.parametrize("mode", ["sync", "overlap", "stale"])
def test_state_bytes_and_loss_curve(mode):
    """bf16 moments take half the bytes of fp32 ones, bitsandbytes' 8-bit state about a
    quarter; over 12 steps (lr 1e-2) the loss stays within 1% of fp32 state's."""
    steps = 12
    base, _, _, fp32_moments = _train(emulated(2, 2, optimizer_mode=mode), steps)
    bf16, _, _, bf16_moments = _train(emulated(2, 2, optimizer_mode=mode,
                                               optimizer_state_dtype="bf16"), steps)
    int8, _, int8_bytes, _ = _train(
        emulated(2, 2, optimizer_mode=mode, optimizer_state_dtype="int8"), steps,
        make=lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-2, eps=1e-3))
    _, _, fp32_bytes, _ = _train(emulated(2, 2, optimizer_mode=mode), 1)
    assert bf16_moments * 2 == fp32_moments
    assert int8_bytes < 0.4 * fp32_bytes, (int8_bytes, fp32_bytes)
    assert base[-1] < 0.8 * base[0]          # it learns
    for other in (bf16, int8):
        gap = max(abs(a - b) / b for a, b in zip(other, base))
        assert gap < 0.01, (gap, other, base)
    assert bf16 != base and int8 != base     # an approximation, not the same run


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_int8_equals_bitsandbytes_on_plain_pytorch(monkeypatch, mode):
    monkeypatch.setitem(OPTIMIZERS, "adamw8", lambda ps: bnb.optim.AdamW8bit(
        ps, lr=1e-2, eps=1e-3))
    sizes = (8,)
    want = train_reference(tiny_transformer(**EXACT), sizes, 2, "adamw8",
                           data=step_batches(sizes))
    losses, state, _, _ = _train(emulated(2, 2, optimizer_mode=mode,
                                          optimizer_state_dtype="int8"), 3,
                                 make=OPTIMIZERS["adamw8"], sizes=sizes, model=EXACT)
    assert tuple(losses) == want.losses
    for k in want.state:
        assert torch.equal(state[k], want.state[k]), k


@pytest.mark.parametrize("dtype,make", [
    ("bf16", lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)),
    ("int8", lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-2))])
def test_checkpoint_round_trip(dtype, make):
    """Save after 2 steps, load into a new pipeline and optimizer, run 2 more: the
    same bits as 4 steps in one go; the state dtype is recorded and checked."""
    data = step_batches((8,), steps=4)
    config = emulated(2, 2, optimizer_mode="overlap", optimizer_state_dtype=dtype)

    def run(calls, ckpt=None):
        with rotapipe.RoundPipe(tiny_transformer(**MODEL), lm_loss, config=config) as pipe:
            opt = make(pipe.parameters())
            pipe.attach_optimizer(opt)
            if ckpt is not None:
                pipe.load_state_dict(ckpt["model"])
                opt.load_state_dict(torch.load(io.BytesIO(ckpt["opt"])))
                pipe.load_pipeline_state(ckpt["pipe"])
            for (x, y), in calls:
                pipe.train_step(x, y)
            pipe.flush()
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            kept = {k: v.dtype for st in opt.state.values() for k, v in st.items()
                    if isinstance(v, torch.Tensor)}
            return {"model": {k: v.clone() for k, v in pipe.state_dict().items()},
                    "opt": buf.getvalue(), "pipe": pipe.pipeline_state()}, kept

    whole, _ = run(data)
    half, _ = run(data[:2])
    assert half["pipe"]["optimizer_state_dtype"] == dtype
    resumed, kept = run(data[2:], half)
    assert kept == ({"step": torch.float32, "exp_avg": torch.bfloat16,
                     "exp_avg_sq": torch.bfloat16} if dtype == "bf16" else kept)
    assert dtype == "bf16" or kept["state1"] in (torch.uint8, torch.float32)
    for k in whole["model"]:
        assert torch.equal(whole["model"][k], resumed["model"][k]), k
    with rotapipe.RoundPipe(tiny_transformer(**MODEL), lm_loss,
                            config=emulated(2, 2)) as pipe:
        with pytest.raises(rotapipe.errors.CheckpointError,
                           match=f"kept as '{dtype}'.*optimizer_state_dtype='{dtype}'"):
            pipe.load_pipeline_state(half["pipe"])


def test_loaded_fp32_state_is_narrowed():
    """``load_state_dict`` casts state to the parameters' dtype (fp32): narrowed again."""
    with rotapipe.RoundPipe(tiny_transformer(**MODEL), lm_loss, config=emulated(
            2, 2, optimizer_state_dtype="bf16")) as pipe:
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        pipe.attach_optimizer(opt)
        pipe.train_step(*step_batches((8,), 1)[0][0])
        saved = copy.deepcopy(opt.state_dict())
        opt.load_state_dict(saved)
        dtypes = {v.dtype for st in opt.state.values() for k, v in st.items() if k != "step"}
        assert dtypes == {torch.bfloat16}


def test_an_optimizer_moved_from_bf16_to_fp32_state_is_widened():
    """The same model and optimizer, trained by a bf16-state pipeline, then by an fp32
    one (a second phase with other settings): its bf16 moments used to stay bf16 and
    the first fp32 step failed part-way ("expected dtype c10::BFloat16"), and the bf16
    pipeline's load hook went on narrowing every state loaded. Now they are widened
    exactly, loads stay fp32, and the step equals one from the widened state."""
    model = tiny_transformer(widths=(24, 40))
    batch = step_batches((8,), 1)[0][0]
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(
            2, 2, optimizer_state_dtype="bf16")) as pipe:
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        pipe.attach_optimizer(opt)
        pipe.train_step(*batch)
    kept = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(model)
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2)) as pipe:
        pipe.attach_optimizer(opt)
        for i, st in opt.state_dict()["state"].items():
            for k, v in st.items():
                assert v.dtype == torch.float32 and torch.equal(v, kept["state"][i][k].float())
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        assert {v.dtype for st in opt.state.values() for v in st.values()} == {torch.float32}
        pipe.train_step(*batch)
        got = {k: v.clone() for k, v in pipe.state_dict().items()}
    with rotapipe.RoundPipe(twin, lm_loss, config=emulated(2, 2)) as pipe:
        fresh = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        fresh.load_state_dict(kept)             # cast to the parameters' fp32 by torch
        pipe.attach_optimizer(fresh)
        pipe.calls = 1
        pipe.train_step(*batch)
        for k, v in pipe.state_dict().items():
            assert torch.equal(v, got[k]), k


@pytest.mark.parametrize("dtype,make,match", [
    ("bf16", lambda ps: torch.optim.Adagrad(ps), "Adam, AdamW and SGD.*Adagrad"),
    ("int8", lambda ps: torch.optim.AdamW(ps), "8-bit state.*AdamW8bit"),
    ("fp32", lambda ps: bnb.optim.AdamW8bit(ps), "keeps 8-bit.*optimizer_state_dtype='int8'"),
    ("bf16", lambda ps: bnb.optim.AdamW8bit(ps), "keeps 8-bit.*optimizer_state_dtype='int8'"),
])
def test_unsupported_combinations_are_refused(dtype, make, match):
    with rotapipe.RoundPipe(tiny_transformer(), lm_loss, config=emulated(
            2, 2, optimizer_state_dtype=dtype)) as pipe:
        with pytest.raises(rotapipe.ConfigError, match=match):
            pipe.attach_optimizer(make(pipe.parameters()))
        assert pipe.optimizer is None


def test_bad_settings_are_refused():
    with pytest.raises(rotapipe.ConfigError, match="optimizer_state_dtype='fp16'"):
        rotapipe.PipeConfig(optimizer_state_dtype="fp16")
    with pytest.raises(rotapipe.ConfigError, match="shard='none'"):
        rotapipe.PipeConfig(optimizer_state_dtype="bf16",
                            data_parallel=rotapipe.DataParallelConfig(shard="optimizer"))
    from rotapipe.train import TrainConfig
    with pytest.raises(rotapipe.ConfigError, match="optimizer_state='fp16'"):
        TrainConfig(optimizer_state="fp16")
    assert TrainConfig(optimizer_state="bf16").pipe_config().optimizer_state_dtype.value \
        == "bf16"


def test_resume_checks_the_state_dtype(tmp_path):
    import dataclasses
    from rotapipe.train import TrainConfig
    from rotapipe.train.resume import check_resume_config
    cfg = TrainConfig(optimizer_state="bf16")
    saved = dataclasses.asdict(cfg)
    check_resume_config(tmp_path, saved, cfg)
    with pytest.raises(rotapipe.ConfigError, match="optimizer_state='bf16'.*"
                       "--optimizer-state bf16"):
        check_resume_config(tmp_path, saved, cfg.replace(optimizer_state="fp32"))
    # A checkpoint written before the setting existed had fp32 state.
    del saved["optimizer_state"]
    check_resume_config(tmp_path, saved, cfg.replace(optimizer_state="fp32"))
    with pytest.raises(rotapipe.ConfigError, match="--optimizer-state"):
        check_resume_config(tmp_path, saved, cfg)


def test_group_steps_keep_other_gradients():
    """A grouped step leaves every parameter's .grad as it was and steps each once."""
    params = [torch.nn.Parameter(torch.randn(40, 40)) for _ in range(5)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, ref):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    opt, ref_opt = torch.optim.AdamW(params, lr=0.1), RoundedAdamW(ref, lr=0.1)
    states = StatePrecision("bf16")
    states.attach(opt)
    grads = [p.grad for p in params]
    old = optstate.GROUP_ELEMENTS
    optstate.GROUP_ELEMENTS = 2000
    try:
        assert len(optstate._groups(params)) == 5
        for _ in range(2):
            states.step(opt, params)
            ref_opt.step()
    finally:
        optstate.GROUP_ELEMENTS = old
    assert all(p.grad is g for p, g in zip(params, grads))
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16


def test_planner_counts_the_state_dtype(capsys):
    from rotapipe.cli import main
    from rotapipe.plan import hardware, model_costs
    from rotapipe.plan.hostmem import host_memory
    from rotapipe.planner.advise import _singles_plan
    costs = model_costs("qwen3-1.7b", hardware("rtx4090x1"), seq=512)
    plan = _singles_plan(len(costs.layers))
    mems = {d: host_memory(costs, plan, 4, 1, state_dtype=d, layout="overlap")
            for d in ("fp32", "bf16", "int8")}
    n = mems["fp32"].masters // 4
    assert mems["fp32"].optimizer == 8 * n and mems["bf16"].optimizer == 4 * n
    assert mems["int8"].optimizer == int(2 * (1 + 4 / 256) * n)
    # The undo snapshot copies the state as it is kept.
    assert mems["bf16"].snapshots == 4 * n + 4 * n
    assert "(bf16 state)" in mems["bf16"].describe() and "state)" not in \
        mems["fp32"].describe()
    with pytest.raises(rotapipe.ConfigError, match="state_dtype='fp16'"):
        host_memory(costs, plan, 4, 1, state_dtype="fp16")
    assert main(["plan", "qwen3-32b", "--hardware", "rtx4090x1", "--host-ram", "512",
                 "--optimizer-state", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "optimizer 131.0 (bf16 state)" in text, text
