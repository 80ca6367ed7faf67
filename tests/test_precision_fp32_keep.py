"""Tensors a model keeps in fp32 under a bf16 / fp16 compute dtype (``keep_fp32``).

A plain-PyTorch model with a router (trained weight, frozen scale, correction-bias
buffer, all fp32) trains exactly as plain PyTorch with fp32 masters, bf16 compute
copies of every other weight and those tensors in fp32 (element by element, in
``sync`` and ``overlap``, the embedding moved by rows too; ``stale``'s second set of
copies is fp32 too). A tiny DeepSeek-V3 loaded as
``transformers`` loads it in bf16 (routers fp32) gives the loss and gradients of its own
forward: rounding the correction biases to bf16 sends tokens to other experts
(measured: gradient of the routers 79-83% off, every tensor below 1% with them kept).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import rotapipe
from models import emulated

V, D, E = 29, 32, 4
RTOL, ATOL = 1e-5, 1e-6


class Router(nn.Module):
    """A projection in the compute dtype, then a softmax router computed in fp32 from
    an fp32 weight, frozen scale and bias buffer (cast as Hugging Face routers do)."""

    def __init__(self, buffer: bool):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.gate = nn.Parameter(torch.randn(E, D) * 0.5)
        self.scale = nn.Parameter(1.0 + torch.rand(E) * 1e-2, requires_grad=False)
        # bf16 rounds all four to 8.0: the router's choice would change. A layer with
        # a buffer keeps training calls from overlapping: a frozen parameter instead.
        bias = torch.tensor([8.03, 8.01, 8.02, 8.0])
        if buffer:
            self.register_buffer("bias", bias)
        else:
            self.bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x):
        h = self.proj(x.to(self.proj.weight.dtype))   # an fp32 embedding too
        scores = ((h.float() @ self.gate.t()) * self.scale + self.bias * 8).softmax(-1)
        return h + (scores @ self.gate).to(h.dtype)


def model(buffer: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, D), Router(buffer), nn.Linear(D, V))


def kept(m: nn.Sequential, embedding: bool = False) -> list[torch.Tensor]:
    r = m[1]
    return [r.gate, r.scale, r.bias] + ([m[0].weight] if embedding else [])


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.float().reshape(-1, V), labels.reshape(-1))


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, V, (4, 6), generator=g)
    return x, torch.roll(x, -1, dims=1)


def few_rows(step: int):
    """A batch looking up 6 of the table's rows (a different 6 each step): few enough
    that ``overlap`` steps them first for the next call."""
    x = batch(step)[0] % 6 + 3 * step
    return x, torch.roll(x, -1, dims=1)


def reference(steps: int, embedding: bool, batch=batch,
              buffer: bool = True) -> tuple[list[float], nn.Sequential]:
    """Plain PyTorch: fp32 masters, a bf16 copy to compute with each step (the kept
    tensors in fp32), gradients widened to fp32, AdamW on the masters."""
    masters = model(buffer)
    opt = torch.optim.AdamW(masters.parameters(), lr=1e-2)
    losses = []
    for s in range(steps):
        work = copy.deepcopy(masters).to(torch.bfloat16)
        for w, m in zip(kept(work, embedding), kept(masters, embedding)):
            w.data = m.data.clone()
        loss = loss_fn(work(batch(s)[0]), batch(s)[1])
        loss.backward()
        losses.append(loss.item())
        for m, w in zip(masters.parameters(), work.parameters()):
            if m.requires_grad:
                m.grad = w.grad.float()
        opt.step()
        opt.zero_grad()
    return losses, masters


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_kept_tensors_train_in_fp32_as_plain_pytorch(mode):
    # overlap: calls overlap only without buffers; the embedding kept fp32 too
    buffer = mode == "sync"
    embedding = not buffer
    want, ref = reference(3, embedding, buffer=buffer)
    m = model(buffer)
    frozen = m[1].scale.detach().clone()
    lookups = {m[0]: lambda x: x} if embedding else None
    cfg = emulated(2, 1, optimizer_mode=mode,
                   precision=rotapipe.PrecisionConfig(compute_dtype="bf16"))
    with rotapipe.RoundPipe(list(m), loss_fn, config=cfg, keep_fp32=kept(m, embedding),
                            lookups=lookups,
                            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)) as pipe:
        assert m[1].scale.dtype == torch.float32 and torch.equal(m[1].scale, frozen)
        got = [pipe.train_step(*batch(s)) for s in range(3)]
        pipe.flush()
        for name, t in m.named_parameters():
            assert t.dtype == torch.float32, name
            torch.testing.assert_close(t, ref.get_parameter(name), rtol=RTOL, atol=ATOL,
                                       msg=name)
        assert torch.equal(m[1].bias, ref[1].bias)     # kept, not rounded to bf16
        assert pipe._overlapping() == (mode == "overlap")
    assert got == pytest.approx(want, rel=RTOL, abs=ATOL)


def test_kept_embedding_rows_stepped_first_stay_fp32():
    """``overlap`` steps first the rows of an fp32-kept table the next call looks up
    (``OR``: :meth:`OverlapStep._preview`), uploaded into that call's fp32 table."""
    from rotapipe.runtime.calls import Call
    from rotapipe.runtime.overlapstep import OverlapStep
    want, ref = reference(3, True, few_rows, buffer=False)
    m = model(buffer=False)
    cfg = emulated(2, 1, optimizer_mode="overlap", timeout_s=60.0,
                   precision=rotapipe.PrecisionConfig(compute_dtype="bf16"))
    real_rows_first, real_preview, previews = Call.rows_first, OverlapStep._preview, []

    def rows_first(call, key):      # wait until the next call is issued (as tests do)
        if call.index < 2:
            for _ in range(30_000):
                if call.next_store() is not None:
                    break
                threading.Event().wait(0.001)
        real_rows_first(call, key)

    def preview(step, pid, rows):
        out = real_preview(step, pid, rows)
        previews.append(out.dtype)
        return out
    Call.rows_first, OverlapStep._preview = rows_first, preview
    try:
        with rotapipe.RoundPipe(
                list(m), loss_fn, config=cfg, keep_fp32=kept(m, True),
                plan=rotapipe.Plan.from_text("F0[0:1] F1[1:2] T[2:3] B0[0:1] B1[1:2]"),
                lookups={m[0]: lambda x: x},
                optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)) as pipe:
            got = [pipe.train_step(*few_rows(s)) for s in range(3)]
            pipe.flush()
    finally:
        Call.rows_first, OverlapStep._preview = real_rows_first, real_preview
    assert previews == [torch.float32, torch.float32]
    for name, t in m.named_parameters():
        torch.testing.assert_close(t, ref.get_parameter(name), rtol=RTOL, atol=ATOL,
                                   msg=name)
    assert got == pytest.approx(want, rel=RTOL, abs=ATOL)


def test_stale_views_and_memory_count_kept_tensors_at_four_bytes():
    m = model()
    cfg = emulated(2, 1, optimizer_mode="stale",
                   precision=rotapipe.PrecisionConfig(compute_dtype="bf16"))
    with rotapipe.RoundPipe(list(m), loss_fn, config=cfg, keep_fp32=kept(m),
                            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)) as pipe:
        for s in range(2):
            pipe.train_step(*batch(s))
        pipe.flush()
        ls = pipe.layerset
        gate = next(i for i, p in enumerate(ls.params) if p is m[1].gate)
        assert len(pipe.host.views) == 2
        for view in pipe.host.views:
            assert view[gate].dtype == torch.float32
            assert torch.equal(view[gate], m[1].gate.detach())
        assert pipe.host.device_bytes(gate) == E * D * 4
        # the planner's weight bytes of the router layer: fp32 gate and scale, bf16 rest
        want = (E * D + E) * 4 + (D * D + D) * 2
        assert pipe._planner.base.layers[1].weight_bytes == want
        assert pipe._planner.grad_bytes[1] == E * D * 4 + (D * D + D) * 2


def test_keep_fp32_refuses_what_it_cannot_keep():
    m = model()
    cfg = emulated(1, 1, precision=rotapipe.PrecisionConfig(compute_dtype="bf16"))
    with pytest.raises(rotapipe.ConfigError, match="tensors themselves"):
        rotapipe.RoundPipe(list(m), loss_fn, config=cfg, keep_fp32=["1.gate"])
    with pytest.raises(rotapipe.ConfigError, match="no parameter or buffer"):
        rotapipe.RoundPipe(list(m), loss_fn, config=cfg, keep_fp32=[torch.zeros(3)])
    # nothing was converted by the refused constructions
    assert m[0].weight.dtype == torch.float32 and m[1].bias.dtype == torch.float32


# -- Hugging Face ----------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def deepseek_v3_bf16():
    """A tiny DeepSeek-V3 as ``from_pretrained(dtype=torch.bfloat16)`` leaves it: bf16,
    but for the routers' weights and correction biases
    (``_keep_in_fp32_modules_strict``), which bf16 would round to 8.0 each."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager",
        n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1, num_experts_per_tok=2)
    m = transformers.DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)
    for mod in m.modules():
        if type(mod).__name__ == "DeepseekV3TopkRouter":
            mod.weight.data = mod.weight.data.float()
            mod.e_score_correction_bias = torch.tensor([8.03, 8.01, 8.02, 8.0])
    return m


def test_deepseek_v3_bf16_routes_as_transformers():
    m = deepseek_v3_bf16()
    ref = copy.deepcopy(m)
    ids = torch.randint(3, 97, (4, 12), generator=torch.Generator().manual_seed(1))
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    wrapped = rotapipe.adapters.wrap_hf(m)
    cfg = emulated(2, 2, precision=rotapipe.PrecisionConfig(compute_dtype="bf16"))
    with wrapped.pipe(cfg) as pipe:
        loss = pipe.forward_backward({"input_ids": ids}, ids)
    assert loss == pytest.approx(out.loss.item(), rel=1e-5)
    for (name, p), (_, q) in zip(ref.named_parameters(), m.named_parameters()):
        err = ((q.grad - p.grad.float()).norm() / p.grad.float().norm()).item()
        assert err < 2e-2, f"{name}: relative gradient error {err:.3g}"
    for name, b in m.named_buffers():
        if name.endswith("e_score_correction_bias"):
            assert b.dtype == torch.float32
            assert torch.equal(b, torch.tensor([8.03, 8.01, 8.02, 8.0])), name


def test_lora_keeps_the_frozen_router_fp32():
    peft = pytest.importorskip("peft")
    m = deepseek_v3_bf16()
    m = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["q_a_proj", "o_proj"]))
    gates = {n: p.detach().clone() for n, p in m.named_parameters() if "mlp.gate." in n}
    assert gates and all(g.dtype == torch.float32 for g in gates.values())
    ref = copy.deepcopy(m)
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(2))
    want = ref(input_ids=ids, labels=ids).loss.item()
    wrapped = rotapipe.adapters.wrap_hf(m)
    with wrapped.pipe(emulated(2, 1, precision=rotapipe.PrecisionConfig(
            compute_dtype="bf16"))) as pipe:
        loss = pipe.forward_backward({"input_ids": ids}, ids)
    for n, p in m.named_parameters():
        if n in gates:
            assert p.dtype == torch.float32 and torch.equal(p, gates[n]), n
    assert loss == pytest.approx(want, rel=1e-5)


def test_which_tensors_transformers_keeps_by_dtype():
    """``_keep_in_fp32_modules_strict`` under bf16 and fp16, ``_keep_in_fp32_modules``
    (GPT-OSS's norms) under fp16 only, nothing under fp32: as transformers loads them."""
    from rotapipe.adapters.hf import _kept_fp32
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64)
    gpt_oss = transformers.GptOssForCausalLM(cfg)
    names = {id(t): n for n, t in gpt_oss.named_parameters()}
    assert _kept_fp32(gpt_oss, torch.bfloat16) == []
    assert sorted(names[id(t)] for t in _kept_fp32(gpt_oss, torch.float16)) == sorted(
        n for n, _ in gpt_oss.named_parameters() if n.endswith("norm.weight"))
    deepseek = deepseek_v3_bf16()
    got = {n for n, t in [*deepseek.named_parameters(), *deepseek.named_buffers()]
           if any(t is k for k in _kept_fp32(deepseek, torch.bfloat16))}
    assert got == {f"model.layers.{i}.mlp.gate.{k}" for i in (1, 2)
                   for k in ("weight", "e_score_correction_bias")}
    assert _kept_fp32(deepseek, torch.float32) == []
