"""Wrap-time checks: what the model's forward does outside its blocks is either
reproduced exactly or refused with the true reason.

Each of the first three tests is a tiny model of our own built on a mechanism that used
to train wrong with no error (a parameter-free final norm left out of the tail, a logit
scale the adapter did not know) or be refused with a wrong diagnosis (blocks that return
tuples, which the probe's bare-tensor stubs broke).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import rotapipe
from rotapipe.adapters import AdapterError, wrap_hf
from hf_models import (COMMON, REFUSED, assert_grads_equal, batch, clone, hf_backward,
                       pipe_backward, transformers)

from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.masking_utils import create_causal_mask


def _llama(seed=0, **kw):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, attn_implementation="eager", **kw))


def _equal_to_hf(model, runs=((2, 4), (3, 1))):
    ref = clone(model)
    want = hf_backward(ref, *batch())
    for workers, microbatches in runs:
        m = clone(model)
        got = pipe_backward(m, *batch(), workers, microbatches)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (workers, microbatches)
        assert_grads_equal(m, ref)


# -- 1. a final norm without parameters ------------------------------------------------
def test_parameter_free_final_norm_is_found_and_applied():
    """OLMo's final LayerNorm has no weight: a search among parameterised children
    missed it and the loss was computed on unnormalised hidden states."""
    model = _llama()
    model.model.norm = nn.LayerNorm(32, elementwise_affine=False)
    assert next(model.model.norm.parameters(), None) is None
    wrapped = wrap_hf(model)
    assert wrapped.parts["norm"] == "model.norm"
    assert wrapped.layers[-1].norm is model.model.norm
    _equal_to_hf(model)


def test_explicit_norm_path_that_is_wrong_is_refused():
    model = _llama()
    with pytest.raises(AdapterError, match=r"LlamaForCausalLM.forward's logits differ.*"
                                           r"final norm \(none\).*ran: model.norm"):
        wrap_hf(model, norm_path="")


# -- 2. logits scaled in the forward by a value the adapter does not know -------------
class _ScaledLlama(transformers.LlamaForCausalLM):
    """Multiplies its logits by ``config.output_scale`` in forward (as Cohere does with
    ``logit_scale``), under a name no family hook knows."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        logits = out.logits * self.config.output_scale
        loss = None if labels is None else self.loss_function(
            logits, labels, self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def _scaled():
    torch.manual_seed(0)
    return _ScaledLlama(transformers.LlamaConfig(**COMMON, attn_implementation="eager",
                                                 output_scale=0.25))


def test_unknown_logit_scale_is_refused_with_the_scale_it_found():
    with pytest.raises(AdapterError) as err:
        wrap_hf(_scaled())
    msg = str(err.value)
    for part in ("_ScaledLlama.forward's logits differ", "max abs error", "[2, 3, 97]",
                 "times 0.25", "logits_fn=", "families.py"):
        assert part in msg, (part, msg)


def test_unknown_logit_scale_given_as_logits_fn_trains_exactly():
    model = _scaled()
    wrapped = wrap_hf(model, logits_fn=lambda x: x * 0.25)
    assert wrapped.layers[-1].transforms["fn"] is not None
    ref = clone(model)
    want = hf_backward(ref, *batch())
    m = clone(model)
    cfg = rotapipe.PipeConfig(workers=2, microbatches=4, backend="emulated")
    with wrap_hf(m, logits_fn=lambda x: x * 0.25, loss_chunk_tokens=5).pipe(cfg) as pipe:
        got = pipe.forward_backward({"input_ids": batch()[0], "attention_mask": batch()[1]},
                                    batch()[2])
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)


def test_cohere_logit_scale_is_a_family_hook():
    torch.manual_seed(0)
    model = transformers.CohereForCausalLM(transformers.CohereConfig(
        **COMMON, logit_scale=0.0625, attn_implementation="eager"))
    assert wrap_hf(model).layers[-1].transforms == {"multiply": 0.0625}
    _equal_to_hf(model, runs=((2, 4),))


# -- 3. blocks that return tuples ------------------------------------------------------
class _TupleBlock(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
    def forward(self, *args, **kwargs):
        return (super().forward(*args, **kwargs),)


def _prologue(model, input_ids, attention_mask, position_ids, inputs_embeds):
    """What a Llama-style model computes before its blocks: the embeddings, the causal
    mask, the rotary tables and the position ids."""
    h = model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    if position_ids is None:
        position_ids = torch.arange(h.shape[1], device=h.device)[None]
    mask = create_causal_mask(config=model.config, inputs_embeds=h,
                              attention_mask=attention_mask, past_key_values=None,
                              position_ids=position_ids)
    return h, mask, model.rotary_emb(h, position_ids), position_ids


class _TupleModel(transformers.LlamaModel):
    """An older-style forward: each block returns a tuple, the model keeps
    ``outputs[0]`` (a bare-tensor stub made that the first row of the batch)."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        h, mask, rotary, position_ids = _prologue(self, input_ids, attention_mask,
                                                  position_ids, inputs_embeds)
        for block in self.layers:
            outputs = block(h, attention_mask=mask, position_embeddings=rotary,
                            position_ids=position_ids)
            h = outputs[0]
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h))


def _tuple_llama():
    model = _llama()
    model.model.__class__ = _TupleModel
    for block in model.model.layers:
        block.__class__ = _TupleBlock
    return model


def test_blocks_returning_tuples_are_probed_as_they_are():
    model = _tuple_llama()
    ids, mask, _ = batch()
    assert isinstance(model.model.layers[0](
        torch.zeros(1, 2, 32), attention_mask=None,
        position_embeddings=(torch.ones(1, 2, 8), torch.zeros(1, 2, 8))), tuple)
    wrapped = wrap_hf(model)
    assert [s.state.returns for s in wrapped.side_inputs.stubs][0] == {_TupleBlock: 1}
    _equal_to_hf(model)


def test_a_block_that_fails_on_its_arguments_is_refused_with_its_error():
    model = _llama()

    def broken(*args, **kwargs):
        raise RuntimeError("needs a cache")
    model.model.layers[0].forward = broken
    with pytest.raises(AdapterError, match=r"LlamaModel.forward: a decoder layer failed "
                                           r"on the arguments.*needs a cache"):
        wrap_hf(model)


class _IdsBlock(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
    """Reads the token ids the model hands it (as DeepSeek-V4's hash routing does):
    ``strict`` fails without them, else it uses them when given."""

    strict = False

    def forward(self, hidden_states, *args, input_ids=None, **kwargs):
        if input_ids is not None or self.strict:
            hidden_states = hidden_states + 0.01 * input_ids[..., None].to(
                hidden_states.dtype)
        return super().forward(hidden_states, *args, **kwargs)


class _IdsModel(transformers.LlamaModel):
    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        h, mask, rotary, position_ids = _prologue(self, input_ids, attention_mask, None,
                                                  inputs_embeds)
        for block in self.layers:
            h = block(h, attention_mask=mask, position_embeddings=rotary,
                      position_ids=position_ids, input_ids=input_ids)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h))


@pytest.mark.parametrize("strict", [False, True])
def test_a_forward_that_hands_the_blocks_token_ids_is_refused(strict):
    """The side inputs come from a probe of the forward run on embeddings, so blocks
    handed ``input_ids`` got ``None`` in the pipeline: a block that uses them when given
    wrapped and trained another function (silently); one that needs them (DeepSeek-V4)
    was refused as "a decoder layer failed on the arguments the model gives it"."""
    model = _llama()
    model.model.__class__ = _IdsModel
    for block in model.model.layers:
        block.__class__ = _IdsBlock
        block.strict = strict
    ids, mask, labels = batch()
    assert model(input_ids=ids, attention_mask=mask, labels=labels).loss > 0
    with pytest.raises(AdapterError, match=r"_IdsModel.forward hands its decoder layers "
                       r"the token ids .* input_ids=None"):
        wrap_hf(model)


def test_embeddings_narrower_than_the_blocks_are_refused_as_such():
    """OPT-350m's embeddings are narrower than its blocks (``project_in`` widens them
    before the first block): it was refused as a forward that "failed before its first
    decoder layer when given the embeddings instead of token ids"."""
    model = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=97, hidden_size=32, word_embed_proj_dim=16, num_hidden_layers=2,
        ffn_dim=48, num_attention_heads=4, max_position_embeddings=64))
    with pytest.raises(AdapterError, match=r"OPTForCausalLM's input embeddings are 16 "
                       r"wide but its decoder blocks take hidden_size=32"):
        wrap_hf(model)


# -- 4. dropout outside the blocks that the layers would not apply ---------------------
class _DropoutModel(transformers.LlamaModel):
    """Applies dropout where rotapipe's layers would not: functionally between blocks
    (``config.between_dropout``), or with a module after the last one
    (``config.final_dropout``); ``None``: not at all."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device)[None]
        mask = create_causal_mask(config=self.config, inputs_embeds=h,
                                  attention_mask=attention_mask, past_key_values=None,
                                  position_ids=position_ids)
        rotary = self.rotary_emb(h, position_ids)
        for i, block in enumerate(self.layers):
            if i == 1 and self.config.between_dropout is not None:
                h = nn.functional.dropout(h, self.config.between_dropout, self.training)
            h = block(h, attention_mask=mask, position_embeddings=rotary,
                      position_ids=position_ids)
        if self.config.final_dropout is not None:
            h = self.final_drop(h)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(h))


def _dropping_llama(between=None, final=None):
    model = _llama(between_dropout=between, final_dropout=final)
    model.model.__class__ = _DropoutModel
    model.model.final_drop = nn.Dropout(final or 0.0)
    return model


@pytest.mark.parametrize("where, message", [
    (dict(between=0.1), r"_DropoutModel.forward applies dropout\(p=0.1\) to the hidden "
                        r"states after decoder layer 0, .*set that dropout probability "
                        r"to 0"),
    (dict(final=0.1), r"_DropoutModel.forward applies dropout \(module Dropout, "
                      r"p=0.1\) after its last decoder layer.*set that dropout "
                      r"probability to 0")])
def test_dropout_the_layers_would_not_apply_is_refused(where, message):
    """Found in eval mode too (the probe records every dropout it makes an identity):
    a model in eval mode would otherwise be taken and then train without it."""
    model = _dropping_llama(**where).eval()
    with pytest.raises(AdapterError, match=message):
        wrap_hf(model)


def test_dropout_of_probability_zero_is_no_dropout():
    """The fix the refusals give: probability 0 there, and the model trains exactly."""
    model = _dropping_llama(between=0.0, final=0.0).train()
    assert wrap_hf(model).layers[0].dropout is None
    _equal_to_hf(model, runs=((2, 2),))


# -- the checks themselves -------------------------------------------------------------
def test_checks_leave_the_random_stream_alone():
    model = _llama()
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    wrap_hf(model, verify="full")
    assert torch.equal(torch.rand(3), want)


class _ScaledEmbeddingsModel(transformers.LlamaModel):
    """Scales the embeddings only when it looks them up itself: the probe, which passes
    ``inputs_embeds``, cannot see it."""

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids) * 2.0
        return super().forward(inputs_embeds=inputs_embeds, **kwargs)


def test_full_verify_catches_what_the_probe_cannot_see():
    model = _llama()
    assert wrap_hf(model, verify="full").parts["norm"] == "model.norm"   # supported
    model.model.__class__ = _ScaledEmbeddingsModel
    wrap_hf(model)                           # the probe passes inputs_embeds: blind
    with pytest.raises(AdapterError, match=r"verify='full'.*differ from "
                                           r"LlamaForCausalLM.forward by up to"):
        wrap_hf(model, verify="full")


def _flags(model) -> dict[str, bool]:
    return {name: m.training for name, m in model.named_modules()}


def test_checks_run_with_dropout_off_and_give_each_module_its_flag_back():
    """A model in train mode with dropout on: the checks compare forwards that would
    draw different dropout masks (false alarms: "rotapipe would train this model
    wrong", "Training would use a wrong loss"), so they run it in eval mode and then
    give every module its own training flag back, also when a check refuses."""
    import peft
    model = _llama(attention_dropout=0.5).train()
    model.model.layers[1].eval()
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["q_proj", "lm_head"],
        init_lora_weights=False))
    model.train()
    model.base_model.model.model.layers[2].self_attn.eval()
    before = _flags(model)
    wrap_hf(model, verify="full")
    assert _flags(model) == before
    refused = _scaled().train()
    refused.model.layers[0].eval()
    before = _flags(refused)
    with pytest.raises(AdapterError, match="logits differ"):
        wrap_hf(refused, verify="full")
    assert _flags(refused) == before


def test_verify_value_is_checked():
    with pytest.raises(AdapterError, match="verify='all'.*'tail', 'full'"):
        wrap_hf(_llama(), verify="all")


def test_tail_check_is_fast():
    model = _llama()
    t0 = time.perf_counter()
    wrap_hf(model)
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("family", REFUSED)
def test_unsupported_families_are_refused_with_the_reason(family):
    build, reason = REFUSED[family]
    torch.manual_seed(0)
    with pytest.raises(AdapterError, match=reason):
        wrap_hf(build())


def test_train_verify_flag_runs_the_full_check(tmp_path, capsys, monkeypatch):
    """``rotapipe train --verify``: the whole model is checked before training."""
    from rotapipe.adapters import hf
    from rotapipe.cli import main
    from train_util import flags, text_jsonl

    errors = []

    def spy(wrapped, **kw):
        errors.append(verify(wrapped, **kw))
        return errors[-1]
    verify = hf.verify_full
    monkeypatch.setattr(hf, "verify_full", spy)
    data = text_jsonl(tmp_path / "d.jsonl", 60)
    rc = main(["train", "--verify", *flags(data=str(data), out_dir=str(tmp_path / "o"),
                                           steps=1, eval_interval=1, sample_tokens=0,
                                           export=False)])
    assert rc == 0, capsys.readouterr()
    assert len(errors) == 1 and errors[0] < 1e-5


def test_verify_example_runs(capsys, monkeypatch):
    import pathlib
    import runpy
    import sys
    script = pathlib.Path(__file__).parent.parent / "examples" / "verify_hf.py"
    monkeypatch.setattr(sys, "argv", [str(script), "--model-type", "olmo"])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert "3. every gradient equal" in out and "'norm': 'model.norm'" in out


# -- 5. a loss the forward computes another way ---------------------------------------
def _bamba(z_loss: float):
    torch.manual_seed(0)
    return transformers.BambaForCausalLM(transformers.BambaConfig(
        **COMMON, attn_implementation="eager", mamba_n_heads=8, mamba_d_head=8,
        mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=4, attn_layer_indices=[1],
        z_loss_coefficient=z_loss))


class _SmoothedLlama(transformers.LlamaForCausalLM):
    """Its forward's loss smooths the labels: the logits are Llama's, the loss not."""

    def forward(self, *args, labels=None, **kwargs):
        out = super().forward(*args, **kwargs)
        if labels is not None:
            logits = out.logits[:, :-1].flatten(0, 1).float()
            out.loss = nn.functional.cross_entropy(logits, labels[:, 1:].flatten(),
                                                   label_smoothing=0.1)
        return out


def test_a_loss_other_than_the_cross_entropy_is_refused():
    """Bamba's forward adds ``z_loss_coefficient * mean(logsumexp(logits)^2)`` to the
    loss; rotapipe trained the cross-entropy alone (loss 4.5698 where the model's is
    15.0595 at 0.5), silently. The tail check now compares the forward's loss with the
    cross-entropy of its logits and refuses, naming the coefficient; at 0 Bamba trains
    exactly. Any other loss (here label smoothing) is refused the same way."""
    with pytest.raises(AdapterError, match=r"BambaForCausalLM.forward's loss differs .*"
                                           r"z_loss_coefficient=0.5"):
        wrap_hf(_bamba(0.5))
    _equal_to_hf(_bamba(0.0), runs=((2, 2),))
    torch.manual_seed(0)
    smoothed = _SmoothedLlama(transformers.LlamaConfig(**COMMON,
                                                       attn_implementation="eager"))
    with pytest.raises(AdapterError, match=r"_SmoothedLlama.forward's loss differs"):
        wrap_hf(smoothed)
