"""Tiny random Hugging Face models (built from config classes, no downloads) and the
comparisons the adapter tests share.

Every family gets 3 decoder layers of hidden size 32, fp32, dropout 0 and an explicit
attention implementation (the same object is the reference and, deep-copied, the
wrapped model). Family-specific features are switched on where the family has them:
tied embeddings (Qwen3, Gemma), sliding windows (Mistral, Gemma 2/3, Phi-3 off),
attention and final-logit soft-capping (Gemma 2/3), Granite's multipliers, and MoE
(Qwen3-MoE with a dense layer among the sparse ones and the auxiliary loss on).
"""

from __future__ import annotations

import copy

import pytest
import torch

import rotapipe
import rotapipe.adapters

transformers = pytest.importorskip("transformers")

VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
RTOL, ATOL = 1e-5, 1e-6


def _qwen3(attn="eager", **kw):
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **COMMON, head_dim=8, tie_word_embeddings=True, attn_implementation=attn, **kw))


FAMILIES = {
    "qwen3": lambda: _qwen3(),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **COMMON, tie_word_embeddings=False, attn_implementation="sdpa")),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, attn_implementation="sdpa")),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        **COMMON, sliding_window=4, attn_implementation="eager")),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **COMMON, head_dim=8, sliding_window=4, final_logit_softcapping=3.0,
        attn_logit_softcapping=5.0, attn_implementation="eager")),
    "gemma3": lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **COMMON, head_dim=8, sliding_window=4, final_logit_softcapping=3.0,
        attn_implementation="eager")),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **COMMON, attn_implementation="eager")),
    "granite": lambda: transformers.GraniteForCausalLM(transformers.GraniteConfig(
        **COMMON, embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5,
        attention_multiplier=0.2, attn_implementation="eager")),
    "qwen3moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, mlp_only_layers=[1], output_router_logits=True,
        router_aux_loss_coef=0.5, attn_implementation="eager")),
}


def tiny(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return FAMILIES[family]()


def batch(n: int = 8, t: int = 7, seed: int = 1):
    """Token ids, an attention mask with left and right padding, and labels (-100 on
    padding), as a data collator would build them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, t), generator=g)
    mask = torch.ones(n, t, dtype=torch.long)
    mask[0, :3] = 0          # left padding
    mask[n // 2, t - 2:] = 0  # right padding
    ids[mask == 0] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def hf_backward(model, ids, mask, labels) -> float:
    """The model's own loss and backward (the reference)."""
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.loss.item()


def pipe_backward(model, ids, mask, labels, workers: int, microbatches: int,
                  **config) -> float:
    """One ``forward_backward`` of the wrapped model on emulated workers."""
    chunk = config.pop("loss_chunk_tokens", 5)
    wrapped = rotapipe.adapters.wrap_hf(model, loss_chunk_tokens=chunk)
    cfg = rotapipe.PipeConfig(workers=workers, microbatches=microbatches,
                              backend="emulated", **config)
    with wrapped.pipe(cfg) as pipe:
        return pipe.forward_backward(wrapped.inputs(ids, mask), labels)


def assert_grads_equal(got, want, rtol=RTOL, atol=ATOL) -> None:
    """Every parameter's gradient, element by element, by name."""
    g, w = dict(got.named_parameters()), dict(want.named_parameters())
    assert g.keys() == w.keys()
    for name, p in w.items():
        q = g[name]
        if p.grad is None:
            assert q.grad is None or not q.grad.any(), name
            continue
        assert q.grad is not None, f"{name}: no gradient"
        torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=atol, msg=name)


def clone(model):
    return copy.deepcopy(model)
