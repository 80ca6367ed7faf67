"""QLoRA: frozen base weights kept in host memory as NF4 (bitsandbytes), uploaded packed
and dequantized on the worker. The loss and adapter gradients equal a plain PEFT model
whose frozen weights are the same NF4 weights dequantized by the same library; the
host holds the packed bytes only; the adapter saves in PEFT format."""

from __future__ import annotations

import re

import pytest
import torch

import rotapipe
import rotapipe.adapters
from hf_models import assert_grads_equal, batch, clone, hf_backward, tiny
from rotapipe.model.quant import NF4Weight, dequantize_frozen, nf4_bytes, quantized

peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora(model):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0,
                          init_lora_weights=False)     # non-zero B: real gradients
    return peft.get_peft_model(model, cfg)


def reference(original, quantized_model):
    """A plain PEFT model on the quantized model's base: each quantized weight replaced
    by bitsandbytes' dequantization of the very same NF4 bytes."""
    ref = clone(original)
    q = dict(quantized_model.named_parameters())
    n = 0
    for name, p in ref.named_parameters():
        w = quantized(q[name])
        if w is not None:
            p.data = w.dequantize()
            n += 1
    return ref, n


def assert_trains_like(wrapped, m, ref, workers: int = 2, microbatches: int = 2) -> float:
    """One call of the pipeline ``wrapped`` builds gives the loss and every gradient of
    the reference model's own forward and backward on the same batch; the loss."""
    ids, mask, labels = batch()
    want = hf_backward(ref, ids, mask, labels)
    cfg = rotapipe.PipeConfig(workers=workers, microbatches=microbatches,
                              backend="emulated")
    with wrapped.pipe(cfg) as pipe:
        got = pipe.forward_backward(wrapped.inputs(ids, mask), labels)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)
    return want


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("workers,microbatches", [(2, 1), (3, 4), (2, 3)])
def test_qlora_grads_equal_peft_on_the_same_nf4_base(family, workers, microbatches):
    torch.manual_seed(0)
    model = lora(tiny(family))
    m = clone(model)
    wrapped = rotapipe.adapters.wrap_hf(m, loss_chunk_tokens=5, quantize="nf4")
    ref, n = reference(model, m)
    assert n == 3 * 7          # every projection of the 3 blocks, nothing else
    want = assert_trains_like(wrapped, m, ref, workers, microbatches)
    # The quantization is not a no-op: the original base gives another loss.
    assert hf_backward(clone(model), *batch()) != pytest.approx(want, rel=1e-4)


def test_packed_nf4_is_what_bitsandbytes_linear4bit_computes():
    torch.manual_seed(0)
    w = torch.randn(48, 32)
    lin = bnb.nn.Linear4bit(32, 48, bias=False, compute_dtype=torch.float32,
                            quant_type="nf4", compress_statistics=True)
    lin.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type="nf4",
                                   compress_statistics=True)
    lin = lin.to("cpu")                        # quantizes, as on a CUDA device
    x = torch.randn(5, 32)
    q = NF4Weight.quantize(w)
    assert torch.equal(lin(x), x @ q.dequantize().t())
    assert q.nbytes == nf4_bytes(w.numel())
    # From a copy of the packed bytes alone (what a worker receives).
    assert torch.equal(q.dequantize(q.packed.clone()), q.dequantize())


def test_host_holds_packed_bytes_only():
    model = lora(tiny("qwen3").to(torch.bfloat16))
    wrapped = rotapipe.adapters.wrap_hf(model, quantize="nf4")
    cfg = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated", pin="copy",
                              precision=rotapipe.PrecisionConfig("bf16"))
    with wrapped.pipe(cfg) as pipe:
        host = pipe.host
        assert len(host.quantized) == 21
        for pid, q in host.quantized.items():
            p = pipe.layerset.params[pid]
            assert p.untyped_storage().nbytes() == 2       # the NaN placeholder
            assert host.compute[pid] is q.packed and q.packed.dtype == torch.uint8
            assert q.nbytes == nf4_bytes(p.numel()) and host.is_pinned(pid)
            assert host.device_bytes(pid) == 2 * p.numel()
        pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-3))
        ids, mask, labels = batch()
        loss = pipe.forward_backward(wrapped.inputs(ids, mask), labels)
        pipe.step()
        assert loss == loss      # finite: no NaN placeholder reached a worker
        assert sum(p.numel() for p in pipe.parameters()) > 0


def test_outside_the_pipeline_the_model_fails_loudly_until_dequantized():
    model = lora(tiny("qwen3"))
    wrapped = rotapipe.adapters.wrap_hf(model, quantize="nf4")
    ids, mask, labels = batch()
    assert torch.isnan(model(input_ids=ids, attention_mask=mask).logits).all()
    assert dequantize_frozen(wrapped.layers) == 3 * 7
    assert torch.isfinite(model(input_ids=ids, attention_mask=mask).logits).all()


def test_moe_experts_are_quantized_routers_are_not():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=48,
                                      moe_intermediate_size=16, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = lora(transformers.AutoModelForCausalLM.from_config(cfg))
    m = clone(model)
    wrapped = rotapipe.adapters.wrap_hf(m, loss_chunk_tokens=5, quantize="nf4")
    names = {n for n, p in m.named_parameters() if quantized(p) is not None}
    assert any(n.endswith("gate_up_proj") for n in names)
    assert any(n.endswith("experts.base_layer.base_layer.down_proj") for n in names)
    assert not any(n.endswith("mlp.gate.weight") for n in names)
    ref, _ = reference(model, m)
    assert_trains_like(wrapped, m, ref)


def test_saved_adapter_loads_with_peft(tmp_path):
    base = tiny("qwen3")
    base.save_pretrained(tmp_path / "base")
    model = lora(clone(base))
    wrapped = rotapipe.adapters.wrap_hf(model, quantize="nf4")
    with wrapped.pipe(rotapipe.PipeConfig(workers=2, backend="emulated")) as pipe:
        pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
        ids, mask, labels = batch()
        pipe.forward_backward(wrapped.inputs(ids, mask), labels)
        pipe.step()
    wrapped.save_pretrained(tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(
        transformers_model(tmp_path / "base"), tmp_path / "adapter")
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(dict(loaded.named_parameters())[name], p.data,
                                       rtol=0, atol=0)


def test_bad_quantize_value_names_the_choices():
    with pytest.raises(rotapipe.adapters.AdapterError, match="'nf4'"):
        rotapipe.adapters.wrap_hf(lora(tiny("qwen3")), quantize="int4")
    with pytest.raises(rotapipe.adapters.AdapterError, match="add LoRA adapters first"):
        rotapipe.adapters.wrap_hf(tiny("qwen3"), quantize="nf4")


def transformers_model(path):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(path)


def test_qlora_command_from_a_saved_checkpoint_lowers_held_out_loss(capsys, tmp_path):
    from rotapipe.cli import main
    from train_util import flags, text_jsonl
    data = text_jsonl(tmp_path / "d.jsonl", 300)
    # The demo model (a small Qwen3 from scratch), briefly trained and exported.
    assert main(["train", *flags(data=str(data), out_dir=str(tmp_path / "base"),
                                 steps=10, eval_interval=0)]) == 0
    capsys.readouterr()
    rc = main(["train", *flags(data=str(data), out_dir=str(tmp_path / "q"), steps=80,
                               eval_interval=40, lr=1e-2),
               "--model", str(tmp_path / "base" / "final"), "--qlora", "--lora-rank", "8"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "(QLoRA)" in out and "exported LoRA adapter" in out
    first, last = map(float, re.search(r"held-out loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < 0.98 * first, out      # measured: -2.6% at 40 steps before the
    # pretrained defaults (issue 18); 80 steps keep a margin
    assert (tmp_path / "q" / "final" / "adapter_config.json").is_file()


def test_state_dict_round_trip_leaves_the_nf4_base_out():
    """``pipe.state_dict()`` of a QLoRA pipeline holds the adapters, norms, embedding and
    head, not the NF4 weights (their modules hold a NaN placeholder: 21 all-NaN tensors
    came back before); loading it back works and changes nothing (it raised a bare
    RuntimeError, copying into the placeholder, after loading the keys before it); a
    state naming an NF4 weight is refused by name, nothing loaded."""
    torch.manual_seed(0)
    model = lora(tiny("qwen3"))
    m = clone(model)
    wrapped = rotapipe.adapters.wrap_hf(m, quantize="nf4")
    ids, mask, labels = batch()
    cfg = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated")
    with wrapped.pipe(cfg) as pipe:
        pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
        pipe.train_step(wrapped.inputs(ids, mask), labels)
        state = {k: v.clone() for k, v in pipe.state_dict().items()}
        assert len(state) == 78 - 21
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
        nf4 = {n for n, p in pipe._container.named_parameters() if quantized(p) is not None}
        assert len(nf4) == 21 and not nf4 & state.keys()
        logits = pipe.eval()(wrapped.inputs(ids, mask))
        # Another state (adapters zeroed), then the saved one back.
        other = dict(state)
        for k in other:
            if "lora_" in k:
                other[k] = torch.zeros_like(other[k])
        pipe.load_state_dict(other)
        assert not torch.equal(pipe(wrapped.inputs(ids, mask)), logits)
        pipe.load_state_dict(state)
        torch.testing.assert_close(pipe(wrapped.inputs(ids, mask)), logits, rtol=0, atol=0)
        key = sorted(nf4)[0]
        bad = {**other, key: torch.zeros(pipe._container.state_dict(keep_vars=True)[key].shape)}
        for strict in (True, False):
            with pytest.raises(rotapipe.ConfigError, match=rf"'{re.escape(key)}' is a "
                               r"frozen weight kept as NF4 .*Nothing was loaded"):
                pipe.load_state_dict(bad, strict=strict)
        torch.testing.assert_close(pipe(wrapped.inputs(ids, mask)), logits, rtol=0, atol=0)


def test_a_model_quantized_by_bitsandbytes_is_refused_with_the_way_to_qlora():
    """A model whose linears are already ``bnb.nn.Linear4bit`` (as
    ``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True))``
    builds) is refused at wrap time, naming the weight and the fix; it used to fail in
    the side-input probe ("a decoder layer failed ... shape '[32, 0]' is invalid"),
    with advice to build the layers by hand."""
    model = tiny("llama")
    lin = model.model.layers[1].mlp.down_proj
    q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False,
                          compute_dtype=torch.float32, quant_type="nf4")
    q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False,
                                 quant_type="nf4")
    model.model.layers[1].mlp.down_proj = q.to("cpu")          # quantizes
    for quantize in (None, "nf4"):
        with pytest.raises(rotapipe.adapters.AdapterError, match=re.escape(
                "LlamaForCausalLM is quantized by bitsandbytes (model.layers.1.mlp."
                "down_proj.base_layer.weight is a Params4bit of torch.uint8): load the model "
                "without quantization_config") + ".*wrap_hf\\(model, quantize='nf4'\\)"):
            rotapipe.adapters.wrap_hf(lora(clone(model)), quantize=quantize)


def test_a_model_wrapped_with_nf4_wraps_again():
    """Wrapping the same QLoRA model again (a second pipeline) keeps its NF4 weights and
    computes the same logits; with ``quantize='nf4'`` it used to be refused as a model
    with no frozen weights ("add LoRA adapters first"), LoRA and all."""
    torch.manual_seed(0)
    model = lora(tiny("qwen3"))
    ids, mask, _ = batch()
    cfg = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated")
    wrapped = rotapipe.adapters.wrap_hf(model, quantize="nf4")
    packed = {n: quantized(p).packed.clone() for n, p in model.named_parameters()
              if quantized(p) is not None}
    with wrapped.pipe(cfg) as pipe:
        want = pipe.eval()(wrapped.inputs(ids, mask))
    again = rotapipe.adapters.wrap_hf(model, quantize="nf4")
    now = {n: quantized(p).packed for n, p in model.named_parameters()
           if quantized(p) is not None}
    assert len(packed) == 21 and now.keys() == packed.keys()
    assert all(torch.equal(now[n], packed[n]) for n in now)     # not quantized twice
    with again.pipe(cfg) as pipe:
        torch.testing.assert_close(pipe.eval()(again.inputs(ids, mask)), want, rtol=0,
                                   atol=0)


def test_frozen_adapters_are_not_quantized(tmp_path):
    """QLoRA quantizes the base model's weights, never a PEFT adapter's: an adapter that
    is not active (frozen, 2-D) used to become NF4 with the base, so ``save_pretrained``
    wrote it all NaN (and a frozen adapter in use computed with 4-bit copies). Now the
    inactive adapter saves with its values, and the active one trains like PEFT on the
    same NF4 base."""
    torch.manual_seed(0)
    model = lora(tiny("llama"))
    model.add_adapter("second", peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["k_proj", "o_proj"], init_lora_weights=False))
    model.set_adapter("second")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    m = clone(model)
    wrapped = rotapipe.adapters.wrap_hf(m, loss_chunk_tokens=5, quantize="nf4")
    names = {n for n, p in m.named_parameters() if quantized(p) is not None}
    assert len(names) == 3 * 7 and not any("lora_" in n for n in names)
    ref, _ = reference(model, m)
    assert_trains_like(wrapped, m, ref)
    m.save_pretrained(tmp_path)
    saved = peft.utils.load_peft_weights(tmp_path)          # the "default" adapter
    assert len(saved) == 3 * 7 * 2
    for key, v in saved.items():
        name = key.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight")
        assert torch.equal(v, before[name]), key


def test_an_nf4_weight_made_trainable_is_refused_by_name():
    """A base weight unfrozen after ``wrap_hf(quantize='nf4')`` holds only the NaN
    placeholder: the pipeline made it an fp32 master of NaN and the first call failed
    as "the loss of training call 0 is nan ... check the data and the learning rate".
    Building the pipeline now refuses it, naming the weight and the two ways out."""
    model = lora(tiny("llama"))
    wrapped = rotapipe.adapters.wrap_hf(model, quantize="nf4")
    weight = model.base_model.model.model.layers[0].mlp.down_proj.base_layer.weight
    weight.requires_grad_(True)
    cfg = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated")
    with pytest.raises(rotapipe.ConfigError, match=re.escape(
            "base_model.model.model.layers.0.mlp.down_proj.base_layer.weight is kept as "
            "NF4 (wrap_hf(quantize='nf4')) and has requires_grad=True") +
            ".*requires_grad_\\(False\\).*dequantize_frozen"):
        wrapped.pipe(cfg)
    assert quantized(weight) is not None
    weight.requires_grad_(False)
    ids, mask, labels = batch()
    with wrapped.pipe(cfg) as pipe:
        assert torch.isfinite(torch.tensor(pipe.forward_backward(
            wrapped.inputs(ids, mask), labels)))


def test_a_full_model_with_nf4_weights_is_not_saved_as_nan(tmp_path):
    """Blocks frozen and quantized, the rest fully fine-tuned: ``wrapped.save_pretrained``
    used to write the 14 NF4 weights as their NaN placeholders, silently. It refuses,
    writing nothing, and names ``dequantize_frozen``, after which the files hold the
    dequantized weights and the trained ones."""
    torch.manual_seed(0)
    model = tiny("llama")
    for block in model.model.layers[:2]:
        block.requires_grad_(False)
    wrapped = rotapipe.adapters.wrap_hf(model, loss_chunk_tokens=5, quantize="nf4")
    ids, mask, labels = batch()
    cfg = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated")
    with wrapped.pipe(cfg, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2)) as pipe:
        pipe.train_step(wrapped.inputs(ids, mask), labels)
        with pytest.raises(rotapipe.adapters.AdapterError, match=re.escape(
                "save_pretrained would write the 14 weights kept as NF4 (quantize='nf4'; "
                "model.layers.0.self_attn.q_proj.weight, ...) as NaN") +
                ".*dequantize_frozen"):
            wrapped.save_pretrained(tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    want = {n: quantized(p).dequantize() for n, p in model.named_parameters()
            if quantized(p) is not None}
    dequantize_frozen(wrapped.layers)
    wrapped.save_pretrained(tmp_path / "model")
    saved = transformers_model(tmp_path / "model")
    for name, p in model.named_parameters():
        torch.testing.assert_close(dict(saved.named_parameters())[name], p, rtol=0, atol=0,
                                   msg=name)
        if name in want:
            assert torch.equal(p, want[name]), name


def test_quantizing_a_model_on_the_meta_device_names_the_weight():
    """It used to say "cannot quantize weight on the meta device", for every weight."""
    with torch.device("meta"):
        model = lora(tiny("llama"))
    with pytest.raises(rotapipe.ConfigError, match=re.escape(
            "cannot quantize self_attn.q_proj.base_layer.weight (LlamaDecoderLayer) on the "
            "meta device: load the weights first")):
        rotapipe.adapters.wrap_hf(model, quantize="nf4")
