"""Tiny random Hugging Face models (built from config classes, no downloads) and the
comparisons the adapter tests share.

Every family gets 3 decoder layers of hidden size 32, fp32, dropout 0 and an explicit
attention implementation (the same object is the reference and, deep-copied, the
wrapped model). :data:`FAMILIES` builds one per family, with the family's distinctive
features switched on; :data:`FEATURES` says which families carry which feature and how
to see it on the model (``test_hf_families.py`` checks both).
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


def _rope(partial: float) -> dict:
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}


def _config(name: str, **kw):
    return getattr(transformers, name)(**{**COMMON, "attn_implementation": "eager", **kw})


def _model(cls: str, config: str, **kw):
    return lambda: getattr(transformers, cls)(_config(config, **kw))


MOE = dict(output_router_logits=True, router_aux_loss_coef=0.5, num_experts_per_tok=2)
_LAYERS3 = ["sliding_attention", "sliding_attention", "full_attention"]

FAMILIES = {
    "qwen3": lambda: _qwen3(),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **COMMON, tie_word_embeddings=False, attn_implementation="sdpa")),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, attn_implementation="sdpa")),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        **COMMON, sliding_window=4, attn_implementation="eager")),
    "gemma": _model("GemmaForCausalLM", "GemmaConfig", head_dim=8),
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
    # HyperCLOVA X: Granite's multipliers, but its forward multiplies the logits by
    # logits_scaling where Granite's divides (a family hook: families.py).
    "hyperclovax": _model("HyperCLOVAXForCausalLM", "HyperCLOVAXConfig", head_dim=8,
                          embedding_multiplier=2.0, logits_scaling=0.5,
                          residual_multiplier=0.5, attention_multiplier=0.2),
    # xLSTM: mLSTM blocks, logits soft-capped by output_logit_soft_cap (families.py).
    # use_cache=False: with a cache its own forward fails ("matC_old has wrong shape").
    "xlstm": _model("xLSTMForCausalLM", "xLSTMConfig", head_dim=8, use_cache=False,
                    output_logit_soft_cap=3.0),
    "olmo": _model("OlmoForCausalLM", "OlmoConfig", clip_qkv=2.0),
    "olmo2": _model("Olmo2ForCausalLM", "Olmo2Config"),
    "cohere": _model("CohereForCausalLM", "CohereConfig", logit_scale=0.0625,
                     use_qk_norm=True),
    "cohere2": _model("Cohere2ForCausalLM", "Cohere2Config", logit_scale=0.125,
                      sliding_window=4,
                      layer_types=["sliding_attention", "sliding_attention",
                                   "full_attention"]),
    "gpt_neox": _model("GPTNeoXForCausalLM", "GPTNeoXConfig", use_parallel_residual=True,
                       attention_bias=True, rope_parameters=_rope(0.25)),
    "phi": _model("PhiForCausalLM", "PhiConfig", qk_layernorm=True,
                  rope_parameters=_rope(0.5)),
    "stablelm": _model("StableLmForCausalLM", "StableLmConfig", use_qkv_bias=True,
                       use_parallel_residual=True, qk_layernorm=True,
                       rope_parameters=_rope(0.25)),
    "starcoder2": _model("Starcoder2ForCausalLM", "Starcoder2Config", use_bias=True,
                         sliding_window=4),
    "glm4": _model("Glm4ForCausalLM", "Glm4Config", head_dim=8, attention_bias=True,
                   rope_parameters=_rope(0.5)),
    "mpt": _model("MptForCausalLM", "MptConfig", d_model=32, n_heads=4, n_layers=3,
                  expansion_ratio=2, max_seq_len=64, no_bias=False,
                  attn_config={"alibi": True, "alibi_bias_max": 8},
                  # in MPT's config, not applied by its forward (families.UNUSED)
                  logit_scale=0.5),
    "falcon": _model("FalconForCausalLM", "FalconConfig", alibi=True, parallel_attn=True,
                     bias=True, new_decoder_architecture=False, multi_query=False),
    "gpt_neox_japanese": lambda: transformers.GPTNeoXJapaneseForCausalLM(
        transformers.GPTNeoXJapaneseConfig(
            **{k: v for k, v in COMMON.items() if k != "intermediate_size"},
            intermediate_multiple_size=2, attention_dropout=0.0, hidden_dropout=0.0,
            attn_implementation="eager")),
    "codegen": lambda: transformers.CodeGenForCausalLM(transformers.CodeGenConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, rotary_dim=4, n_positions=64,
        n_inner=48, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, attn_implementation="eager")),
    "smollm3": _model("SmolLM3ForCausalLM", "SmolLM3Config", no_rope_layers=[1, 0, 1]),
    # Gemma 4 without per-layer inputs (those are refused: REFUSED["gemma4_per_layer"]).
    "gemma4": _model("Gemma4ForCausalLM", "Gemma4TextConfig", head_dim=8, sliding_window=4,
                     final_logit_softcapping=3.0, hidden_size_per_layer_input=0,
                     attention_k_eq_v=True, layer_types=_LAYERS3),
    # Falcon-H1: Mamba-2 mixer and attention side by side in every block, its embedding
    # multiplier applied where the forward looks the tokens up, lm_head_multiplier.
    "falcon_h1": _model("FalconH1ForCausalLM", "FalconH1Config", head_dim=8,
                        mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8,
                        mamba_chunk_size=4, mamba_d_ssm=32, embedding_multiplier=2.0,
                        lm_head_multiplier=0.5, mlp_multipliers=[0.5, 2.0]),
    # Qwen3-Next: gated DeltaNet (linear attention) layers between full-attention ones.
    "qwen3_next": _model("Qwen3NextForCausalLM", "Qwen3NextConfig", head_dim=8,
                         linear_key_head_dim=8, linear_value_head_dim=8,
                         linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
                         moe_intermediate_size=16, shared_expert_intermediate_size=16,
                         layer_types=["linear_attention", "full_attention",
                                      "linear_attention"], **MOE),
    "qwen3moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, mlp_only_layers=[1], output_router_logits=True,
        router_aux_loss_coef=0.5, attn_implementation="eager")),
    "qwen2moe": _model("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_experts=4,
                       moe_intermediate_size=16, shared_expert_intermediate_size=24,
                       qkv_bias=True, **MOE),
    "gpt_oss": _model("GptOssForCausalLM", "GptOssConfig", head_dim=8, num_local_experts=4,
                      sliding_window=4, attention_bias=True,
                      layer_types=["sliding_attention", "full_attention",
                                   "sliding_attention"], **MOE),
    "deepseek_v3": _model("DeepseekV3ForCausalLM", "DeepseekV3Config", n_routed_experts=4,
                          n_shared_experts=1, moe_intermediate_size=16,
                          first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                          qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                          n_group=1, topk_group=1, num_key_value_heads=4, **MOE),
    # JetMoE: experts in attention and MLP, its coefficient named ``aux_loss_coef`` (the
    # model reads that one; a stray ``router_aux_loss_coef`` in its config must not win).
    "jetmoe": _model("JetMoeForCausalLM", "JetMoeConfig", kv_channels=8,
                     num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                     aux_loss_coef=0.5, router_aux_loss_coef=0.125),
}


def _any_param(model, pred) -> bool:
    return any(pred(name) for name, _ in model.named_parameters())


def _block0(model, wrapped):
    return wrapped.layers[1].block


FEATURES = {
    # feature: (families, predicate(model, wrapped) that holds when the feature is on)
    "parameter-free final norm": (("olmo",), lambda m, w: w.parts["norm"] and not list(
        m.get_submodule(w.parts["norm"]).parameters())),
    "logit scaling in forward": (("granite", "cohere", "cohere2", "falcon_h1",
                                  "hyperclovax"),
                                 lambda m, w: {"divide", "multiply"} & set(
                                     w.layers[-1].transforms)),
    "final-logit soft-capping": (("gemma2", "gemma3", "gemma4", "xlstm"),
                                 lambda m, w: "softcap" in w.layers[-1].transforms),
    "attention soft-capping": (("gemma2",),
                               lambda m, w: m.config.attn_logit_softcapping is not None),
    "embedding scaling": (("gemma", "granite", "falcon_h1", "hyperclovax"),
                          lambda m, w: w.layers[0].multiplier or
                          "Scaled" in type(m.get_input_embeddings()).__name__),
    "sliding windows": (("mistral", "gemma2", "gemma3", "cohere2", "starcoder2",
                         "gpt_oss", "gemma4"), lambda m, w: m.config.sliding_window),
    "attention sinks": (("gpt_oss",), lambda m, w: _any_param(
        m, lambda n: n.endswith("sinks"))),
    "MoE": (("qwen3moe", "qwen2moe", "gpt_oss", "deepseek_v3", "jetmoe",
             "qwen3_next"),
            lambda m, w: w.parts["routers"]),
    "MoE with shared experts": (("qwen2moe", "deepseek_v3"), lambda m, w: _any_param(
        m, lambda n: "shared_expert" in n)),
    "parallel attention + MLP": (("gpt_neox", "stablelm", "falcon"), lambda m, w: getattr(
        m.config, "use_parallel_residual", None) or getattr(m.config, "parallel_attn",
                                                            None)),
    "ALiBi": (("mpt", "falcon"), lambda m, w: getattr(m.config, "alibi", None) or getattr(
        getattr(m.config, "attn_config", None), "alibi", None)),
    "post-norm": (("olmo2",), lambda m, w: not hasattr(_block0(m, w), "input_layernorm")
                  and hasattr(_block0(m, w), "post_feedforward_layernorm")),
    "partial rotary": (("gpt_neox", "phi", "stablelm", "glm4"), lambda m, w: (
        m.config.rope_parameters or {}).get("partial_rotary_factor", 1.0) < 1.0),
    "QK-norm": (("qwen3", "olmo2", "cohere", "phi", "stablelm"), lambda m, w: _any_param(
        m, lambda n: "q_norm" in n or "q_layernorm" in n)),
    "biases": (("qwen2", "gpt_neox", "starcoder2", "glm4", "gpt_oss", "falcon",
                "stablelm"), lambda m, w: _any_param(
        m, lambda n: n.endswith(".bias") and "norm" not in n)),
    # CodeGen's blocks return a tensor since transformers 5.24 (tuples before).
    "blocks returning tuples": (("gpt_neox_japanese",), lambda m, w: isinstance(
        w.side_inputs.stubs[0].state.returns.get(type(_block0(m, w))), int)),
    "multi-head latent attention": (("deepseek_v3",), lambda m, w: m.config.kv_lora_rank),
    "layers without rotary (NoPE)": (("smollm3",), lambda m, w: 0 in
                                     m.config.no_rope_layers),
    "state-space or linear-attention mixers": (("falcon_h1", "qwen3_next"),
                                               lambda m, w: any(
        "mamba" in n or "linear_attn" in n for n, _ in m.named_modules())),
    "tied embeddings": (("qwen3", "gemma"), lambda m, w: m.get_input_embeddings().weight
                        is m.get_output_embeddings().weight),
}


REFUSED = {
    # family: (builder, what the refusal says): refused at wrap time, with the reason.
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=64)),
        "GPT2Model.forward changes the input embeddings"),
    "opt": (lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        ffn_dim=48, max_position_embeddings=64, word_embed_proj_dim=32)),
        "OPTDecoder.forward changes the input embeddings"),
    "bloom": (lambda: transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=3, n_head=4)),
        "BloomModel.forward changes the input embeddings"),
    "recurrent_gemma": (lambda: transformers.RecurrentGemmaForCausalLM(
        transformers.RecurrentGemmaConfig(**COMMON, head_dim=8)),
        "RecurrentGemmaModel.forward changes the input embeddings"),
    # Every layer also gets a copy of the input embeddings (original_hidden_states).
    "zamba": (lambda: transformers.ZambaForCausalLM(transformers.ZambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        pad_token_id=0, attn_layer_period=3, attn_layer_offset=2, mamba_d_state=8,
        mamba_dt_rank=4, n_mamba_heads=2, attention_head_dim=8,
        attn_implementation="eager")),
        "ZambaModel.forward passes decoder layer 0 an argument computed from the input "
        "embeddings"),
    "zamba2": (lambda: transformers.Zamba2ForCausalLM(transformers.Zamba2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        pad_token_id=0, mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8,
        mamba_ngroups=1, chunk_size=4, num_mem_blocks=1, hybrid_layer_ids=[1],
        layers_block_type=["mamba", "hybrid", "mamba"], attn_implementation="eager")),
        "Zamba2Model.forward passes decoder layer 0 an argument computed from the input "
        "embeddings"),
    # Gemma 4 with per-layer inputs (E2B, E4B): the forward derives an input for every
    # layer from the token ids (embed_tokens_per_layer), outside the blocks.
    "gemma4_per_layer": (lambda: transformers.Gemma4ForCausalLM(_config(
        "Gemma4TextConfig", head_dim=8, sliding_window=4, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB, layer_types=_LAYERS3)),
        "Gemma4TextModel.forward failed before its first decoder layer when given the "
        "embeddings instead of token ids .*embed_tokens_per_layer"),
    # The forward reads each layer's block_type to pick its mask.
    "nemotron_h": (lambda: transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
        **{**COMMON, "num_hidden_layers": 3}, hybrid_override_pattern="M*-",
        mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=4,
        head_dim=8)),
        "NemotronHModel.forward reads 'block_type' of its decoder layer objects"),
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
