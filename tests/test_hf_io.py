"""Loading, saving and inspecting wrapped models: a full fine-tune round trip through
``save_pretrained`` / ``from_pretrained``, loading from a local directory, a 32B-class
config on the meta device, and the errors for models the adapter cannot take."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rotapipe
import rotapipe.adapters
from rotapipe.adapters import AdapterError, load_hf, wrap_hf
from hf_models import batch, tiny, transformers


def test_train_save_load_round_trip(tmp_path):
    """3 AdamW steps, save_pretrained, AutoModelForCausalLM.from_pretrained: the loaded
    model's logits equal the pipeline's (evaluation) and the wrapped model's own."""
    model = tiny("qwen3")   # tied embeddings
    before = model.lm_head.weight.detach().clone()
    wrapped = wrap_hf(model, loss_chunk_tokens=5)
    ids, mask, labels = batch()
    cfg = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated")
    with wrapped.pipe(cfg) as pipe:
        pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-2))
        losses = []
        for _ in range(3):
            losses.append(pipe.forward_backward(wrapped.inputs(ids, mask), labels))
            pipe.step()
        assert losses[-1] < losses[0]
        logits = pipe(wrapped.inputs(ids, mask))
    assert not torch.equal(model.lm_head.weight, before)
    assert model.lm_head.weight is model.model.embed_tokens.weight   # still tied
    wrapped.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager")
    with torch.no_grad():
        want = loaded(input_ids=ids, attention_mask=mask).logits
        own = model(input_ids=ids, attention_mask=mask).logits
    assert logits.shape == want.shape == (8, 7, 97)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(own, want, rtol=0, atol=0)


def test_load_from_local_directory(tmp_path):
    model = tiny("llama")
    model.save_pretrained(tmp_path)
    loaded = load_hf(tmp_path, dtype=torch.float32, attn_implementation="sdpa")
    want = model.state_dict()
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)
    assert len(wrap_hf(loaded).layers) == 3 + 2


def test_32b_config_on_meta_device():
    """Qwen3-32B's shape: 64 decoder layers -> 66 rotapipe layers (embedding, 64 blocks,
    norm + LM head), no weights allocated."""
    cfg = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600,
        num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(cfg)
    wrapped = wrap_hf(model, compute_dtype=torch.bfloat16)
    assert len(wrapped.layers) == 66
    sizes = wrapped.layer_params()
    assert sizes[0] == sizes[-1] - 5120 == 151936 * 5120      # head = norm + lm_head
    assert len(set(sizes[1:-1])) == 1
    assert 32.7e9 < sum(sizes) < 32.9e9


def test_no_decoder_list_names_where_it_looked():
    model = tiny("qwen3")
    model.model.layers = nn.Sequential(*model.model.layers)
    with pytest.raises(AdapterError, match=r"no decoder layer list found on "
                                           r"Qwen3ForCausalLM\.model.*layers_path="):
        wrap_hf(model)


def test_explicit_paths():
    model = tiny("qwen3")
    wrapped = wrap_hf(model, layers_path="model.layers", norm_path="model.norm")
    assert wrapped.parts["layers"] == "model.layers"
    with pytest.raises(AdapterError, match="names no submodule"):
        wrap_hf(model, layers_path="model.blocks")


def test_model_that_changes_embeddings_in_forward_is_refused():
    """GPT-2 adds learned position embeddings in its forward: not replayable by the
    generic layers, so wrapping says so instead of training a different model (and
    does not blame the final norm: the norm is found by running the forward)."""
    cfg = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4,
                                  n_positions=16, bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(cfg)
    for paths in ({}, dict(norm_path="transformer.ln_f")):
        with pytest.raises(AdapterError, match="GPT2Model.forward changes the input "
                                               "embeddings"):
            wrap_hf(model, **paths)


def test_side_inputs_in_the_wrong_dtype_are_caught():
    model = tiny("qwen3")
    wrapped = wrap_hf(model)            # side inputs in fp32 ...
    cfg = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated",
                              precision=rotapipe.PrecisionConfig("bf16"))
    ids, mask, labels = batch()
    with rotapipe.RoundPipe(**wrapped.pipe_kwargs(), config=cfg) as pipe:   # ... bf16 run
        with pytest.raises(rotapipe.WorkerError, match="wrapped.pipe"):
            pipe.forward_backward(wrapped.inputs(ids, mask), labels)


def test_bad_inputs():
    wrapped = wrap_hf(tiny("qwen3"))
    with pytest.raises(AdapterError, match="labels separately"):
        wrapped.side_inputs({"input_ids": torch.zeros(1, 2, dtype=torch.long),
                             "labels": torch.zeros(1, 2, dtype=torch.long)})


def test_bad_labels_are_named_and_change_nothing():
    """Labels are checked in the caller's thread (out of the vocabulary, not integer
    ids) or named by the loss (a shape other than the inputs'); nothing trains."""
    model = tiny("qwen3")
    wrapped = wrap_hf(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, mask, labels = batch()
    cases = [(labels.masked_fill(labels == labels[1, 1], 102), rotapipe.InputError,
              r"labels hold 102, outside the vocabulary \[0, 97\) and not ignore_index=-100"),
             (labels.float(), rotapipe.InputError, "labels are torch.float32: pass integer"),
             (labels[:, :-1], rotapipe.WorkerError,
              r"labels have shape \(4, 6\) but the inputs are \(4, 7\) tokens")]
    with wrapped.pipe(rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated",
                                          timeout_s=10)) as pipe:
        pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
        for bad, error, message in cases:
            with pytest.raises(error, match=message):
                pipe.train_step(wrapped.inputs(ids, mask), bad)
            assert pipe.calls == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_model_without_decoder_blocks_is_refused():
    from hf_models import COMMON
    cfg = transformers.Qwen3Config(**{**COMMON, "num_hidden_layers": 0, "head_dim": 8})
    with pytest.raises(AdapterError, match=r"has no decoder blocks \(num_hidden_layers=0\)"):
        wrap_hf(transformers.Qwen3ForCausalLM(cfg))


def test_finetune_example_runs():
    import pathlib
    import subprocess
    import sys
    script = pathlib.Path(__file__).parent.parent / "examples" / "finetune_hf.py"
    out = subprocess.run([sys.executable, str(script), "--steps", "3"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("reloaded model's logits vs the pipeline's") == 2


def _shape_cases():
    """``(name, inputs, labels, message)``: inputs or labels that are not ``[batch, seq]``
    (``labels=None``: an evaluation call). Batch: 8 sequences of 7 tokens."""
    ids, mask, labels = batch()
    pos = torch.arange(7).expand(8, 7)
    inputs = rotapipe.adapters.HFModel.inputs
    return [
        ("1-D input_ids", ids[0], None,
         r"input_ids have shape \[7\]: a wrapped Hugging Face model takes token ids "
         r"shaped \[batch, seq\]; for one sequence add the batch dimension"),
        ("3-D input_ids", ids[..., None], labels,
         r"input_ids have shape \[8, 7, 1\]: .* shaped \[batch, seq\]"),
        ("1-D labels", ids[0], labels[0],
         r"labels have shape \[4\] in a microbatch: pass labels shaped \[batch, seq\] like "
         r"input_ids .*labels\[None\]"),
        ("3-D labels", inputs(ids, mask), labels[..., None],
         r"labels have shape \[4, 7, 1\] in a microbatch: pass labels shaped \[batch, seq\]"),
        ("short mask", inputs(ids, mask[:, :5]), labels,
         r"attention_mask has shape \[8, 5\] but input_ids have \[8, 7\]: pass a "
         r"\[batch, seq\] mask shaped like input_ids"),
        ("3-D mask", inputs(ids, mask[..., None]), labels,
         r"attention_mask has shape \[8, 7, 1\] but input_ids have \[8, 7\]"),
        ("short position_ids", inputs(ids, position_ids=pos[:, :5]), labels,
         r"position_ids have shape \[8, 5\] but input_ids have \[8, 7\]: pass "
         r"\[batch, seq\] position ids shaped like input_ids"),
        ("3-D position_ids", inputs(ids, mask, pos[..., None]), None,
         r"position_ids have shape \[8, 7, 1\] but input_ids have \[8, 7\]"),
    ]


@pytest.mark.parametrize("case", _shape_cases(), ids=lambda c: c[0])
def test_input_shapes_are_checked_in_the_callers_thread(case):
    """input_ids, attention_mask, position_ids and labels that are not [batch, seq] (or
    do not match input_ids) raise InputError in the caller's thread, naming both shapes,
    before the call starts (not a ValueError from the side inputs, a WorkerError from
    inside a decoder block, or "are all labels ignored?"); nothing trains, and the
    pipeline still works."""
    _, inputs, labels, message = case
    model = tiny("qwen3")
    wrapped = wrap_hf(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, mask, good = batch()
    with wrapped.pipe(rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated",
                                          timeout_s=10)) as pipe:
        pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
        with pytest.raises(rotapipe.InputError, match=message) as caught:
            if labels is None:
                pipe(inputs)
            else:
                pipe.train_step(inputs, labels)
        assert not isinstance(caught.value, rotapipe.WorkerError)
        assert pipe.calls == 0
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k
        pipe.train_step(wrapped.inputs(ids, mask), good)
        assert pipe.calls == 1


def test_a_4d_attention_mask_is_still_taken():
    """A custom 4-D mask [batch, 1, seq, seq] (what transformers' mask helpers take as
    it is) passes the shape check: the loss is the model's own with that mask."""
    model = tiny("qwen3")
    wrapped = wrap_hf(model)
    ids, _, labels = batch()
    mask = torch.tril(torch.ones(7, 7, dtype=torch.bool)).expand(8, 1, 7, 7).clone()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, labels=labels,
                     use_cache=False).loss.item()
    with wrapped.pipe(rotapipe.PipeConfig(workers=2, microbatches=2,
                                          backend="emulated")) as pipe:
        got = pipe.forward_backward(wrapped.inputs(ids, mask), labels)
    assert got == pytest.approx(want, rel=1e-5)


def test_inputs_embeds_are_refused_by_name():
    """The pipeline's layer 0 is the embedding (it trains): inputs give token ids."""
    wrapped = wrap_hf(tiny("qwen3"))
    ids = torch.ones(1, 2, dtype=torch.long)
    embeds = torch.zeros(1, 2, 32)
    for inputs in ({"inputs_embeds": embeds}, {"input_ids": ids, "inputs_embeds": embeds}):
        with pytest.raises(AdapterError, match=r"inputs_embeds: .*pass input_ids"):
            wrapped.side_inputs(inputs)


def test_encoder_decoder_is_refused_as_such():
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=97, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4))
    for paths in ({}, dict(layers_path="decoder.block")):
        with pytest.raises(AdapterError, match=r"T5ForConditionalGeneration is an "
                                               r"encoder-decoder .*is_encoder_decoder=True"):
            wrap_hf(model, **paths)


def test_flex_attention_is_refused_at_wrap_time():
    """Flex attention's block masks are not tensors the pipeline uploads, and its
    backward does not run on the CPU: refused before anything runs."""
    from hf_models import COMMON
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, attn_implementation="flex_attention"))
    with pytest.raises(AdapterError, match=r"attn_implementation='flex_attention'.*"
                                           r"'eager' or 'sdpa'"):
        wrap_hf(model)
