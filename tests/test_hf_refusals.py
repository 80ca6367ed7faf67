"""What a wrapped Hugging Face model refuses, each case one that used to train silently
wrong, fail on a worker, or fail with a message naming something internal: refused by
``wrap_hf`` or before the call starts, with the reason and the fix; and where the fix
is an option, that option trains like the model itself (loss and every gradient)."""

from __future__ import annotations

import pytest
import torch

import rotapipe
import rotapipe.adapters
from rotapipe.adapters import AdapterError, wrap_hf
from hf_models import (COMMON, assert_grads_equal, batch, clone, hf_backward, tiny,
                       transformers)


def _hand_built(wrapped, microbatches: int, **kw):
    return rotapipe.RoundPipe(
        layers=wrapped.layers, loss_fn=wrapped.loss_fn, side_inputs=wrapped.side_inputs,
        loss_weight=wrapped.loss_weight, config=rotapipe.PipeConfig(
            workers=2, microbatches=microbatches, backend="emulated"), **kw)


def test_moe_aux_loss_without_tail_context_is_refused():
    """A ``RoundPipe`` built by hand from a wrapped MoE model without ``tail_context``
    gave each microbatch a load-balancing loss over its own rows: loss 5.596444 where
    Hugging Face's is 5.594909, gradients up to 0.0127 off. Refused when the pipeline
    is built (any microbatch count), in the caller's thread, naming ``tail_context``;
    with it, the model's own loss and gradients."""
    model = tiny("qwen3moe")
    w = wrap_hf(clone(model), loss_chunk_tokens=5)
    for microbatches in (1, 2):
        with pytest.raises(rotapipe.ConfigError, match="tail_context=wrapped.loss_fn."
                           "batch_context"):
            _hand_built(w, microbatches)
    ref, m = clone(model), clone(model)
    want = hf_backward(ref, *batch())
    w = wrap_hf(m, loss_chunk_tokens=5)
    with _hand_built(w, 2, tail_context=w.loss_fn.batch_context) as pipe:
        got = pipe.forward_backward(w.inputs(*batch()[:2]), batch()[2])
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert_grads_equal(m, ref)


def _doge(**kw):
    torch.manual_seed(0)
    return transformers.DogeForCausalLM(transformers.DogeConfig(
        **{**COMMON, "num_attention_heads": 4, "num_key_value_heads": 2}, is_moe=True,
        num_experts=16, num_experts_per_tok=2, attn_implementation="eager", **kw))


def test_a_load_balancing_loss_of_another_formula_is_refused():
    """Doge's product-key experts have a ``load_balancing_loss_func`` of other
    arguments: the formula check failed with a raw ``ValueError: too many values to
    unpack``. Refused, naming ``moe_aux_loss=False``, which wraps."""
    if not hasattr(transformers, "DogeForCausalLM"):
        pytest.skip("this transformers has no Doge")
    with pytest.raises(AdapterError, match=r"not the Switch-Transformer formula .*"
                       r"moe_aux_loss=False"):
        wrap_hf(_doge(output_router_logits=True))
    assert wrap_hf(_doge(output_router_logits=True), moe_aux_loss=False).loss_fn.moe is None


def test_moe_aux_loss_on_a_model_without_routers_is_refused():
    """``moe_aux_loss=True`` on a dense model was ignored silently."""
    with pytest.raises(AdapterError, match="moe_aux_loss=True, but no MoE router"):
        wrap_hf(tiny("qwen3"), moe_aux_loss=True)


def test_a_4d_mask_with_the_aux_loss_is_refused_in_the_callers_thread():
    """The load-balancing loss counts tokens by a [batch, seq] mask: a 4-D mask failed
    on a worker with a shape error (Hugging Face's forward fails too). An InputError
    before the call, naming the shape; without the aux loss the 4-D mask is taken."""
    ids, mask, labels = batch()
    mask4 = torch.ones(ids.shape[0], 1, ids.shape[1], ids.shape[1])
    w = wrap_hf(tiny("qwen3moe"), loss_chunk_tokens=5)
    cfg = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated")
    with w.pipe(cfg) as pipe:
        with pytest.raises(rotapipe.InputError, match=r"attention_mask has shape "
                           r"\[8, 1, 7, 7\] and the MoE load-balancing loss is on") as e:
            pipe.forward_backward(w.inputs(ids, mask4), labels)
        assert not isinstance(e.value, rotapipe.WorkerError)
        assert pipe.forward_backward(w.inputs(ids, mask), labels) > 0     # still usable


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_non_integer_input_ids_name_input_ids(dtype):
    """Float (or bool) token ids were refused as "lookups gave torch.float32", an
    internal name. An InputError naming input_ids and the fix, in training and
    evaluation, also for a pipeline built without the embedding's lookups."""
    ids, mask, labels = batch()
    w = wrap_hf(tiny("qwen3"), loss_chunk_tokens=5)
    match = rf"input_ids are {dtype}: .* input_ids\.long\(\)"
    cfg = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated")
    with w.pipe(cfg) as pipe:
        with pytest.raises(rotapipe.InputError, match=match):
            pipe.forward_backward(w.inputs(ids.to(dtype), mask), labels)
        with pytest.raises(rotapipe.InputError, match=match):
            pipe(w.inputs(ids.to(dtype), mask))
    with _hand_built(w, 2) as pipe:
        with pytest.raises(rotapipe.InputError, match=match):
            pipe.forward_backward(w.inputs(ids.to(dtype), mask), labels)
