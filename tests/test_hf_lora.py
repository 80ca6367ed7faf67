"""LoRA through PEFT: adapter gradients equal PEFT's own; only adapter weights get fp32
masters and gradients, the frozen base stays once in the compute dtype; the adapter is
saved in PEFT format and loads back with ``PeftModel.from_pretrained``."""

from __future__ import annotations

import pytest
import torch

import rotapipe
import rotapipe.adapters
from hf_models import assert_grads_equal, batch, clone, hf_backward, pipe_backward, tiny

peft = pytest.importorskip("peft")
# PEFT calls a transformers method deprecated in 5.x; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

TARGETS = ["q_proj", "v_proj", "down_proj"]


def lora(model, **kw):
    kw = {"target_modules": TARGETS, **kw}
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                          **kw)   # non-zero B: real gradients
    return peft.get_peft_model(model, cfg)


VARIANTS = {
    # name: (family, LoraConfig keywords): PEFT options users combine with LoRA.
    "rslora": ("qwen3", dict(use_rslora=True)),
    "dora": ("qwen3", dict(use_dora=True)),
    "bias_all": ("qwen2", dict(bias="all")),
    "bias_lora_only": ("qwen2", dict(bias="lora_only")),
    "head_saved_tied": ("qwen3", dict(modules_to_save=["lm_head"])),
    "head_saved": ("llama", dict(modules_to_save=["lm_head"])),
    "embedding_lora_tied": ("qwen3", dict(target_modules=TARGETS + ["embed_tokens"])),
    "embedding_lora": ("llama", dict(target_modules=TARGETS + ["embed_tokens"])),
    "trainable_tokens": ("llama", dict(trainable_token_indices=[5, 7, 9])),
    "layers_to_transform": ("qwen3", dict(layers_to_transform=[0, 2])),
    "lora_bias": ("llama", dict(lora_bias=True)),
    "head_lora_tied": ("qwen3", dict(target_modules=TARGETS + ["lm_head"])),
    "head_lora": ("llama", dict(target_modules=TARGETS + ["lm_head"])),
    "all_linear_patterns": ("llama", dict(target_modules="all-linear",
                                          rank_pattern={"q_proj": 2},
                                          alpha_pattern={"v_proj": 3})),
    # LoRA on the fused expert tensors of an MoE block (nn.Parameter, not nn.Linear).
    "moe_expert_parameters": ("qwen3moe", dict(
        target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_peft_variants_equal_peft(variant):
    """Loss and every gradient of common LoRA options (rsLoRA, DoRA, trained biases, a
    saved LM head, LoRA on the embedding, trainable token rows) equal PEFT's own."""
    family, kw = VARIANTS[variant]
    torch.manual_seed(0)
    model = lora(tiny(family), **kw)
    ref, m = clone(model), clone(model)
    want = hf_backward(ref, *batch())
    got = pipe_backward(m, *batch(), 2, 2)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)


TUNERS = {
    # Other PEFT methods that inject modules into the layers (init to non-identity).
    "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                  feedforward_modules=["down_proj"], init_ia3_weights=False),
    "loha": lambda: peft.LoHaConfig(r=4, target_modules=TARGETS, init_weights=False),
    "lokr": lambda: peft.LoKrConfig(r=4, target_modules=TARGETS, init_weights=False),
    "adalora": lambda: peft.AdaLoraConfig(r=4, target_modules=TARGETS, total_step=10,
                                          init_lora_weights=False),
    "oft": lambda: peft.OFTConfig(r=4, oft_block_size=0, target_modules=TARGETS,
                                  init_weights=False),
    "boft": lambda: peft.BOFTConfig(boft_block_size=4, target_modules=["q_proj", "v_proj"],
                                    init_weights=False),
    "hra": lambda: peft.HRAConfig(r=4, target_modules=TARGETS, init_weights=False),
    "ln_tuning": lambda: peft.LNTuningConfig(target_modules=["input_layernorm", "norm"]),
    "fourierft": lambda: peft.FourierFTConfig(n_frequency=10, target_modules=TARGETS,
                                              init_weights=False),
    "road": lambda: peft.RoadConfig(target_modules=TARGETS, init_weights=False,
                                    group_size=4),
    # SHiRA saves a sparse tensor for backward: it failed in the first recompute
    # (counting the activation bytes read a sparse tensor's storage, which it has not).
    "shira": lambda: peft.ShiraConfig(r=4, target_modules=TARGETS, init_weights=False),
    "adaption_prompt": lambda: peft.AdaptionPromptConfig(task_type="CAUSAL_LM",
                                                         adapter_len=3, adapter_layers=2),
}
TUNER_FAMILY = {"adaption_prompt": "llama"}   # PEFT's LLaMA-Adapter takes Llama, Mistral


@pytest.mark.parametrize("tuner", sorted(TUNERS))
def test_other_tuners_equal_peft(tuner):
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny(TUNER_FAMILY.get(tuner, "qwen3")), TUNERS[tuner]())
    with torch.no_grad():      # LLaMA-Adapter's gates start at 0 (the identity)
        for name, p in model.named_parameters():
            if "adaption_gate" in name:
                p.fill_(0.7)
    ref, m = clone(model), clone(model)
    want = hf_backward(ref, *batch())
    got = pipe_backward(m, *batch(), 2, 2)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)


def test_second_adapter_and_eval_dropout_equal_peft():
    """``set_adapter`` to a second adapter trains that one only; ``lora_dropout > 0`` in
    eval mode is the identity, as in PEFT."""
    torch.manual_seed(0)
    model = lora(tiny("qwen3"))
    model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.3,
                                                target_modules=["k_proj", "o_proj"],
                                                init_lora_weights=False))
    model.set_adapter("second")
    model.eval()
    ref, m = clone(model), clone(model)
    want = hf_backward(ref, *batch())
    got = pipe_backward(m, *batch(), 2, 2)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)
    assert {n for n, p in m.named_parameters() if p.grad is not None} == \
        {n for n, p in m.named_parameters() if ".second." in n}


PROMPT_LEARNING = {
    "prompt_tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                     num_virtual_tokens=3),
    "prefix_tuning": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM",
                                                     num_virtual_tokens=3),
    "p_tuning": lambda: peft.PromptEncoderConfig(task_type="CAUSAL_LM",
                                                 num_virtual_tokens=3,
                                                 encoder_hidden_size=16),
}


@pytest.mark.parametrize("method", sorted(PROMPT_LEARNING))
def test_prompt_learning_is_refused(method):
    """Prompt learning lives in the PeftModel's forward (virtual tokens, key/value
    prefixes), outside the layers rotapipe runs: it used to wrap and train the bare
    base model (loss 4.5719 where PEFT's is 4.5766 for prompt tuning, no gradient for
    the prompt encoder). Refused, naming the method."""
    model = peft.get_peft_model(tiny("qwen3"), PROMPT_LEARNING[method]())
    with pytest.raises(rotapipe.adapters.AdapterError, match="prompt learning"):
        rotapipe.adapters.wrap_hf(model)


def _xlora(tmp_path):
    for name in ("a", "b"):
        lora(tiny("llama")).save_pretrained(tmp_path / name)
    torch.manual_seed(0)
    base = tiny("llama")
    base.config.use_cache = False
    return peft.get_peft_model(base, peft.XLoraConfig(
        task_type="CAUSAL_LM", hidden_size=32, xlora_depth=1,
        adapters={"0": str(tmp_path / "a"), "1": str(tmp_path / "b")}))


NOT_IN_THE_LAYERS = {
    # method: (builder(tmp_path), what the refusal names)
    "xlora": (_xlora, "is XLORA: .* the adapters' scalings"),
    "poly": (lambda _: peft.get_peft_model(tiny("llama"), peft.PolyConfig(
        task_type="CAUSAL_LM", r=4, target_modules=TARGETS, n_tasks=2, n_skills=2,
        n_splits=1)), "is POLY: .* from its task_ids"),
    "alora": (lambda _: lora(tiny("llama"), task_type="CAUSAL_LM",
                             alora_invocation_tokens=[5, 6]),
              "with alora_invocation_tokens .* without alora_invocation_tokens"),
}


@pytest.mark.parametrize("method", sorted(NOT_IN_THE_LAYERS))
def test_adapters_fed_by_the_peft_forward_are_refused(method, tmp_path):
    """What the PeftModel's own forward computes from the batch and hands the adapted
    layers is never computed in the pipeline, which runs the base model's layers. It
    used to train silently wrong: X-LoRA (its classifier's scalings) gave loss 4.614858
    where PEFT's is 4.614796, and no gradient reached the classifier; activated LoRA
    (``alora_invocation_tokens``, ``task_type="CAUSAL_LM"``) applied the adapter nowhere
    (4.533887, the base model's loss, where PEFT's is 4.532606). Poly was refused as
    "a decoder layer failed" (its task_ids). All three are refused at wrap time, by
    name."""
    build, message = NOT_IN_THE_LAYERS[method]
    torch.manual_seed(0)
    with pytest.raises(rotapipe.adapters.AdapterError, match=message):
        rotapipe.adapters.wrap_hf(build(tmp_path))


def _adalora(**kw):
    torch.manual_seed(0)
    return peft.get_peft_model(tiny("qwen3"), peft.AdaLoraConfig(
        target_modules=["q_proj", "v_proj", "down_proj"], total_step=10,
        init_lora_weights=False, **kw))


@pytest.mark.filterwarnings("ignore:.*is not used in AdaLora:UserWarning")
def test_adalora_orthogonality_penalty_is_refused_and_trains_without_it():
    """With a task type, PEFT's forward is ``AdaLoraModel.forward``, which adds
    ``orth_reg_weight`` (default 0.5) times the orthogonality penalty of every
    ``lora_A`` / ``lora_B`` to the loss. rotapipe never runs that forward: it trained
    the cross-entropy alone (4.599279 where PEFT's loss is 68.909447 on this model,
    adapter gradients off by up to 0.108). Refused, naming the fix; with it, PEFT's loss and every
    gradient. Without a task type PEFT adds no penalty (``test_other_tuners_equal_peft``)."""
    with pytest.raises(rotapipe.adapters.AdapterError,
                       match=r"ADALORA with orth_reg_weight=0\.5 .*AdaLoraConfig\("
                       r"orth_reg_weight=0\.0"):
        rotapipe.adapters.wrap_hf(_adalora(task_type="CAUSAL_LM"))
    model = _adalora(task_type="CAUSAL_LM", orth_reg_weight=0.0)
    ref, m = clone(model), clone(model)
    want = hf_backward(ref, *batch())
    got = pipe_backward(m, *batch(), 2, 2)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)


def test_shadow_peft_is_refused_at_wrap_time():
    """ShadowPEFT's forward runs a shadow network and carries its state through the
    blocks by hooks on the whole model: it wrapped, then failed inside a worker
    (``'ShadowCarrier' object has no attribute 'dtype'``)."""
    if not hasattr(peft, "ShadowConfig"):
        pytest.skip("this peft has no ShadowPEFT")
    torch.manual_seed(0)
    model = peft.get_peft_model(tiny("qwen3"), peft.ShadowConfig(task_type="CAUSAL_LM"))
    with pytest.raises(rotapipe.adapters.AdapterError, match="is SHADOW: .* shadow state"):
        rotapipe.adapters.wrap_hf(model)


SHARED_BUFFERS = {
    # PEFT methods whose layers hold one buffer between them: VeRA's frozen projections
    # (every adapted block), trainable token rows on tied embeddings (embedding and head).
    "vera": lambda: peft.get_peft_model(tiny("qwen3"), peft.VeraConfig(
        r=4, target_modules=["q_proj", "v_proj"], init_weights=False)),
    "trainable_tokens_tied": lambda: lora(tiny("qwen3"), trainable_token_indices=[5, 7, 9]),
}


def peft_steps(model, data, stale: bool):
    """PEFT's own steps with AdamW: (losses, each call's gradients by name). ``stale``:
    call ``t`` runs on the weights before step ``t - 1`` and step ``t`` applies its
    gradients (``test_optimizer_modes``); ``model`` ends with the weights stepped."""
    runs = clone(model) if stale else model        # the weights the calls run on
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(trained.values(), lr=1e-2)
    losses, grads = [], []
    for ids, mask, labels in data:
        runs.zero_grad(set_to_none=True)
        losses.append(hf_backward(runs, ids, mask, labels))
        grads.append({n: p.grad.clone() for n, p in runs.named_parameters()
                      if p.grad is not None})
        before = {n: p.detach().clone() for n, p in trained.items()}
        for n, p in trained.items():
            p.grad = grads[-1].get(n)
        opt.step()
        if stale:
            with torch.no_grad():
                for n, p in runs.named_parameters():
                    if n in before:
                        p.copy_(before[n])
    return losses, grads


@pytest.mark.parametrize("mode", ["sync", "overlap", "stale"])
@pytest.mark.parametrize("workers,microbatches", [(2, 2), (3, 4)])
@pytest.mark.parametrize("method", sorted(SHARED_BUFFERS))
def test_buffers_shared_across_layers_train_like_peft(method, workers, microbatches, mode):
    """VeRA's projections are one buffer held by every adapted block, trainable tokens
    on tied embeddings one held by the embedding and the head: the runtime orders a
    buffer's copies per buffer (``rotapipe.schedule.roundpipe``). Over three steps the
    losses, the gradients (``sync``) and the trained weights equal PEFT's own. (Ordered
    per layer, they raced: a RaceError on a backward stage's upload in a CI run.)"""
    torch.manual_seed(0)
    model = SHARED_BUFFERS[method]()
    ref, m = clone(model), clone(model)
    data = [batch(seed=s) for s in range(1, 4)]
    want, want_grads = peft_steps(ref, data, stale=mode == "stale")
    wrapped = rotapipe.adapters.wrap_hf(m, loss_chunk_tokens=5)
    cfg = rotapipe.PipeConfig(workers=workers, microbatches=microbatches,
                              backend="emulated", optimizer_mode=mode)
    got = []
    with wrapped.pipe(cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)) as pipe:
        for (ids, mask, labels), grads in zip(data, want_grads):
            if mode != "sync":
                got.append(pipe.train_step(wrapped.inputs(ids, mask), labels))
                continue
            got.append(pipe.forward_backward(wrapped.inputs(ids, mask), labels))
            names = {n for n, p in m.named_parameters() if p.grad is not None}
            assert names == grads.keys()
            for n, p in m.named_parameters():
                if n in grads:
                    torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6,
                                               msg=n)
            assert pipe.step()
        pipe.flush()
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    w = dict(ref.named_parameters())
    for name, p in m.named_parameters():
        torch.testing.assert_close(p, w[name], rtol=1e-5, atol=1e-6, msg=name)
    assert {n for n, b in m.named_buffers()} == {n for n, b in ref.named_buffers()}


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
    """Trained through rotapipe: the adapter saved by PEFT loads back with the same
    weights and logits, and so does the model merged with ``merge_and_unload``."""
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
    # Merged into the base (a plain transformers model), saved and loaded back.
    model.merge_and_unload().save_pretrained(tmp_path / "merged")
    with torch.no_grad():
        out = transformers_load(tmp_path / "merged")(input_ids=ids,
                                                     attention_mask=mask).logits
    torch.testing.assert_close(pipe_logits, out, rtol=1e-4, atol=1e-5)


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


def test_a_lora_heads_dropout_runs_on_its_own_stream():
    """LoRA on ``lm_head`` with ``lora_dropout > 0`` in train mode: the chunked loss runs
    the head inside ``loss_fn``, which used to draw from the caller's stream (shared
    with the other workers): identical runs gave different losses, and the caller's
    stream moved. It now runs on ``layer_seed(seed, call, microbatch, layers)``: the
    same runs give the same loss and gradients bit for bit, whatever the caller's
    stream, which the call leaves alone."""
    model = peft.get_peft_model(tiny("llama"), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["q_proj", "v_proj", "lm_head"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)          # the dropout shows in the loss
    ids, mask, labels = batch()
    runs = []
    for caller_seed in (0, 0, 123):
        m = clone(model)
        m.eval()
        wrapped = rotapipe.adapters.wrap_hf(m, loss_chunk_tokens=5)
        with wrapped.pipe(rotapipe.PipeConfig(workers=2, microbatches=2,
                                              backend="emulated", seed=3)) as pipe:
            pipe.train()
            torch.manual_seed(caller_seed)
            before = torch.random.get_rng_state()
            loss = pipe.forward_backward(wrapped.inputs(ids, mask), labels)
            assert torch.equal(before, torch.random.get_rng_state())
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        runs.append((loss, grads))
    for loss, grads in runs[1:]:
        assert loss == runs[0][0]
        assert grads.keys() == runs[0][1].keys()
        for name in grads:
            torch.testing.assert_close(grads[name], runs[0][1][name], rtol=0, atol=0,
                                       msg=name)


@pytest.mark.parametrize("mode", ["overlap", "stale"])
def test_adapter_saved_inside_the_pipeline_has_every_step(mode, tmp_path):
    """``wrapped.save_pretrained`` between ``train_step`` calls (a checkpoint every N
    steps) with the pipelined optimizer modes: it used to write the weights as they
    were while the last step was still running or pending (two AdamW steps at lr 1e-2:
    the saved adapter 0.010 off the trained one, a whole step missing). It flushes
    first: the file holds PEFT's weights after both steps."""
    torch.manual_seed(0)
    model = lora(tiny("qwen3"))
    ref, m = clone(model), clone(model)
    data = [batch(seed=s) for s in range(1, 3)]
    peft_steps(ref, data, stale=mode == "stale")
    wrapped = rotapipe.adapters.wrap_hf(m, loss_chunk_tokens=5)
    cfg = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated",
                              optimizer_mode=mode)
    with wrapped.pipe(cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)) as pipe:
        for ids, mask, labels in data:
            pipe.train_step(wrapped.inputs(ids, mask), labels)
        wrapped.save_pretrained(tmp_path)
    saved = peft.utils.load_peft_weights(tmp_path)
    want = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    assert len(saved) == len(want) == 3 * 3 * 2
    for key, v in saved.items():
        name = key.replace(".weight", ".default.weight")
        torch.testing.assert_close(v, want[name], rtol=1e-5, atol=1e-6, msg=key)
