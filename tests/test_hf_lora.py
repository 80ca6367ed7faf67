"""LoRA through PEFT: adapter gradients equal PEFT's own; only adapter weights get fp32
masters and gradients, the frozen base stays once in the compute dtype; the adapter is
saved in PEFT format and loads back with ``PeftModel.from_pretrained``."""

from __future__ import annotations

import pytest
import torch

import rotapipe
import rotapipe.adapters
from hf_models import assert_grads_equal, batch, clone, hf_backward, tiny

peft = pytest.importorskip("peft")
# PEFT calls a transformers method deprecated in 5.x; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

TARGETS = ["q_proj", "v_proj", "down_proj"]


def lora(model, **kw):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0,
                          init_lora_weights=False, **kw)   # non-zero B: real gradients
    return peft.get_peft_model(model, cfg)


@pytest.mark.parametrize("workers,microbatches", [(2, 1), (3, 4)])
def test_adapter_grads_equal_peft(workers, microbatches):
    torch.manual_seed(0)
    model = lora(tiny("qwen3"))
    ref = clone(model)
    want = hf_backward(ref, *batch())
    m = clone(model)
    wrapped = rotapipe.adapters.wrap_hf(m, loss_chunk_tokens=5)
    cfg = rotapipe.PipeConfig(workers=workers, microbatches=microbatches,
                              backend="emulated")
    with wrapped.pipe(cfg) as pipe:
        got = pipe.forward_backward(wrapped.inputs(*batch()[:2]), batch()[2])
        names = {n for n, _ in m.named_parameters() if _.requires_grad}
        assert len(list(pipe.parameters())) == len(names) == 3 * 3 * 2
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)
    assert all(p.grad is None for p in m.parameters() if not p.requires_grad)


def test_pipelined_lora_steps_equal_peft():
    """``overlap`` over four pipelined steps: the frozen base (and the embedding, moved by
    rows) uploads without waiting for the optimizer, the adapters after it (``UT``,
    staged through the pinned bounce buffers: ``pin="off"``); losses and adapter
    weights equal PEFT's own steps with AdamW."""
    pin = "off"
    torch.manual_seed(0)
    model = lora(tiny("qwen3"))
    ref, m = clone(model), clone(model)
    data = [batch(seed=s) for s in range(1, 5)]
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    want = []
    for ids, mask, labels in data:
        want.append(hf_backward(ref, ids, mask, labels))
        opt.step()
        opt.zero_grad(set_to_none=True)
    wrapped = rotapipe.adapters.wrap_hf(m, loss_chunk_tokens=5)
    cfg = rotapipe.PipeConfig(workers=3, microbatches=4, backend="emulated", pin=pin,
                              optimizer_mode="overlap")
    with wrapped.pipe(cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)) as pipe:
        got = [pipe.train_step(wrapped.inputs(ids, mask), labels) for ids, mask, labels in data]
        pipe.flush()
        ran = pipe.last_timeline(calls=len(data)).schedule
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert any(a.kind is rotapipe.schedule.ActionKind.UPLOAD_TRAINED for a in ran.actions)
    w = dict(ref.named_parameters())
    for name, p in m.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p, w[name], rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(p, w[name]), name


@pytest.mark.parametrize("pin", ["copy", "register", "off"])
def test_frozen_base_is_one_copy_in_compute_dtype(pin):
    model = lora(tiny("qwen3").to(torch.bfloat16))
    frozen = {id(p): p for p in model.parameters() if not p.requires_grad}
    ptrs = {id(p): p.data_ptr() for p in frozen.values()}
    wrapped = rotapipe.adapters.wrap_hf(model)
    cfg = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated", pin=pin,
                              precision=rotapipe.PrecisionConfig("bf16"))
    with wrapped.pipe(cfg) as pipe:
        pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-3))
        ids, mask, labels = batch()
        pipe.forward_backward(wrapped.inputs(ids, mask), labels)
        pipe.step()
        host = pipe.host
        storages: dict[int, int] = {}
        for pid, p in enumerate(pipe.layerset.params):
            for t in (p.data, host.compute[pid]):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            if id(p) in frozen:   # bf16, no master; the very tensor unless pinned by copy
                assert p.dtype == torch.bfloat16
                assert (p.data_ptr() == ptrs[id(p)]) == (pin != "copy")
                assert host.compute[pid].data_ptr() == p.data_ptr() and p.grad is None
            else:                 # an adapter weight: fp32 master + bf16 copy
                assert p.dtype == torch.float32 and p.grad is None   # stepped
                assert host.compute[pid].dtype == torch.bfloat16
        n_frozen = sum(p.numel() for p in frozen.values())
        n_lora = sum(p.numel() for p in pipe.parameters())
        assert sum(storages.values()) == 2 * n_frozen + (4 + 2) * n_lora


def test_saved_adapter_loads_with_peft(tmp_path):
    base = tiny("qwen3")
    base.save_pretrained(tmp_path / "base")
    model = lora(clone(base))
    wrapped = rotapipe.adapters.wrap_hf(model)
    cfg = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated")
    ids, mask, labels = batch()
    with wrapped.pipe(cfg) as pipe:
        pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-2))
        for _ in range(2):
            pipe.forward_backward(wrapped.inputs(ids, mask), labels)
            pipe.step()
        pipe_logits = pipe(wrapped.inputs(ids, mask))
    wrapped.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    fresh = transformers_load(tmp_path / "base")
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    trained = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p, trained[name], rtol=0, atol=0, msg=name)
    with torch.no_grad():
        out = loaded(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(pipe_logits, out, rtol=1e-5, atol=1e-5)


def transformers_load(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_sharded_optimizer_state_with_lora(one_rank_group, shard):
    """DataParallelConfig(shard=...) on a PEFT model (one gloo rank): only the adapters
    are cut into pieces (the optimizer's parameters), the frozen base stays one
    compute-dtype copy and is never touched, and 2 AdamW steps land on the adapter weights of a run
    without data parallelism; the shard's state_dict round-trips."""
    from rotapipe import distributed
    torch.manual_seed(0)
    base = lora(tiny("qwen3"))
    ids, mask, labels = batch()

    def train(dp):
        m = clone(base)
        wrapped = rotapipe.adapters.wrap_hf(m, loss_chunk_tokens=5)
        cfg = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated",
                                  data_parallel=dp, clip_grad_norm=1.0)
        with wrapped.pipe(cfg) as pipe:
            opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
            pipe.attach_optimizer(opt)
            for _ in range(2):
                pipe.forward_backward(wrapped.inputs(ids, mask), labels)
                pipe.step()
            pieces = list(pipe.parameters())
            shard_sd = distributed.shard_state_dict(pipe, opt)
            weights = {k: v.detach().float().clone() for k, v in pipe.state_dict().items()}
        return m, pieces, shard_sd, weights

    dp = rotapipe.DataParallelConfig(enabled=True, shard=shard, timeout_s=30)
    m, pieces, sd, got = train(dp)
    _, _, _, want = train(False)
    trainable = {n: p for n, p in base.named_parameters() if p.requires_grad}
    assert sum(q.numel() for q in pieces) == sum(p.numel() for p in trainable.values())
    assert len(sd["pieces"]) == len(trainable) and all("lora_" in n for n in sd["pieces"])
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
    frozen = {n: p for n, p in base.named_parameters() if not p.requires_grad}
    for n, p in m.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
