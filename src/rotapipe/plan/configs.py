"""Hugging Face model families as the cost model reads them: how each family builds its
decoder blocks (which projections, biases, norms and MLP matrices, dense or MoE), so
that a block's parameters are counted from the config alone, exactly for the families
in :data:`FAMILIES`. Loading and checking a ``config.json`` is :mod:`.configfile`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .configfile import (_EXPERTS, KNOWN_MODELS, _get, check_architecture, load_config,
                         text_settings)

__all__ = ["KNOWN_MODELS", "FAMILIES", "load_config", "text_settings", "tied_head",
           "check_architecture", "block_linears", "PEFT_FOLDED_EXPERTS",
           "folded_expert_stacks"]


def tied_head(config) -> bool:
    """Whether the model's LM head holds the embedding's weight: the config's
    ``tie_word_embeddings``, else its family's default (:data:`_TIED_BY_DEFAULT`)."""
    cfg = text_settings(load_config(config))
    tied = cfg.get("tie_word_embeddings")
    return cfg.get("model_type") in _TIED_BY_DEFAULT if tied is None else bool(tied)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
            "phi3", "granite", "olmo", "olmo2", "cohere", "cohere2", "gpt_neox", "phi",
            "stablelm", "starcoder2", "glm4", "mpt", "falcon", "gpt_neox_japanese",
            "codegen", "smollm3", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3",
            "mixtral", "llama4_text", "glm4_moe", "ernie4_5", "ernie4_5_moe", "olmo3",
            "olmoe", "flex_olmo", "phimoe", "exaone", "exaone4", "seed_oss", "minimax_m2",
            "arcee", "apertus", "granitemoe", "granitemoeshared", "helium", "internlm3",
            "ministral3", "minicpm3", "vaultgemma", "cwm", "solar_open", "youtu",
            "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "hyperclovax")
"""``model_type`` values whose blocks :func:`~rotapipe.plan.model_work` counts as their family builds
them (``transformers`` 5.24; ``tests/test_sim_costs.py`` builds each family's default
config on the meta device and compares every block); another ``model_type`` is
counted as a Llama-style block (pre-norms, gated MLP, ``attention_bias`` on all four
projections), and ``rotapipe plan`` says so."""

_PLAIN_MLP = frozenset({"gpt_neox", "gpt_neox_japanese", "phi", "starcoder2", "mpt",
                        "falcon", "codegen", "arcee", "apertus"})
"""Families whose MLP is two matrices (up, activation, down), not gated."""

_TIED_BY_DEFAULT = frozenset({"gemma", "gemma2", "gemma3_text", "starcoder2", "mpt",
                              "falcon", "gpt_neox_japanese", "cohere", "cohere2",
                              "smollm3", "ernie4_5", "ernie4_5_moe", "vaultgemma", "youtu",
                              "minicpm3"})
"""Families whose LM head is tied to the embedding when ``config.json`` does not say
(their ``transformers`` config default; every other family is untied)."""


@dataclass(frozen=True)
class _Attention:
    params: int
    """Weights and biases a token is multiplied by (2 FLOPs each)."""
    extra: int
    """Parameters without FLOPs here: QK-norms, latent norms, attention sinks."""
    qk_width: int
    """Query width a token's scores are computed over (heads x query head size)."""
    v_width: int
    """Value width a token's output sums (heads x value head size)."""
    saved: int
    """Elements per token autograd keeps for the attention's backward."""
    linear_core: float = 0.0
    """Forward FLOPs per token of a linear-attention core (independent of the sequence
    length; 0 for softmax attention, whose core :func:`~rotapipe.plan.model_work`
    prices from ``qk_width`` and ``v_width``)."""


_GATED_DELTA = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"})
"""Hybrid families: Gated DeltaNet linear attention in the ``linear_attention`` layers,
softmax attention with an output gate (``q_proj`` twice as wide) in the others."""
DELTA_CHUNK = 64
"""Tokens per chunk of the chunked gated delta rule (fla's kernels and transformers'
torch fallback)."""


def _is_linear(cfg: Mapping, kind: str, layer: int) -> bool:
    """Whether block ``layer`` of a hybrid family is a Gated DeltaNet layer."""
    types = cfg.get("layer_types") or ()
    return kind in _GATED_DELTA and layer < len(types) and types[layer] == "linear_attention"


def _attention_linears(cfg: Mapping, kind: str, h: int, nh: int,
                       layer: int) -> list[tuple[str, int, int]]:
    """Block ``layer``'s attention matrices as ``(role, fan_in, fan_out)``
    (:func:`block_linears`); :func:`_attention` counts their weights."""
    if _is_linear(cfg, kind, layer):
        nk, nv = _get(cfg, "linear_num_key_heads"), _get(cfg, "linear_num_value_heads")
        key = nk * _get(cfg, "linear_key_head_dim")
        value = nv * _get(cfg, "linear_value_head_dim")
        # Qwen3-Next fuses q, k, v, z and b, a; Qwen3.5 keeps qkv, z, b and a apart.
        ins = [("qkv", h, 2 * key + 2 * value), ("qkv", h, 2 * nv)] if kind == "qwen3_next" \
            else [("qkv", h, 2 * key + value), ("qkv", h, value), ("qkv", h, nv),
                  ("qkv", h, nv)]
        return ins + [("o", value, h)]
    if cfg.get("kv_lora_rank"):
        rope, nope, v_hd, kvl, ql = _latent(cfg)
        qk = nh * (rope + nope)
        q = [("q", h, ql), ("q", ql, qk)] if ql else [("q", h, qk)]
        return q + [("kv", h, kvl + rope), ("kv", kvl, nh * (nope + v_hd)),
                    ("o", nh * v_hd, h)]
    hd = cfg.get("head_dim") or h // nh
    q, kv = nh * hd, _kv_heads(cfg, kind, nh) * hd
    gated = 2 if kind in _GATED_DELTA else 1         # the output gate rides on q
    qkv = [("qkv", h, q + 2 * kv)] if kind in _FUSED_QKV else \
        [("q", h, gated * q), ("k", h, kv), ("v", h, kv)]
    return qkv + [("o", q, h)]


def _weights(linears: list[tuple[str, int, int]]) -> int:
    return sum(a * b for _, a, b in linears)


def _linear_attention(cfg: Mapping, h: int, weights: int) -> _Attention:
    """A Gated DeltaNet layer: queries, keys, values, the output gate ``z`` and the
    per-head ``b``/``a`` projections from the hidden state, a causal depthwise
    convolution over q, k, v, per-head decay (``A_log``, ``dt_bias``), a gated norm of
    the head size, and the output projection. Its core per token and value head: the
    state update and read (about 3 multiply-adds per state element, dk x dv) and the
    chunk-local attention of the chunked form (dk + dv per position of the chunk): an
    estimate, the parameters are exact."""
    nk, nv = _get(cfg, "linear_num_key_heads"), _get(cfg, "linear_num_value_heads")
    dk, dv = _get(cfg, "linear_key_head_dim"), _get(cfg, "linear_value_head_dim")
    kernel = cfg.get("linear_conv_kernel_dim") or 4
    key, value = nk * dk, nv * dv
    conv = 2 * key + value
    core = nv * (2 * 3 * dk * dv + 2 * DELTA_CHUNK * (dk + dv)) + 2 * conv * kernel
    return _Attention(weights, conv * kernel + 2 * nv + dv, 0, 0,
                      4 * h + 2 * (2 * key + 2 * value) + conv, core)


def _attention(cfg: Mapping, kind: str, h: int, nh: int, layer: int = 0) -> _Attention:
    """Block ``layer``'s attention, as its family builds it: the weights of its
    matrices (:func:`_attention_linears`), the biases and norms around them."""
    weights = _weights(_attention_linears(cfg, kind, h, nh, layer))
    if _is_linear(cfg, kind, layer):
        return _linear_attention(cfg, h, weights)
    if cfg.get("kv_lora_rank"):
        # Multi-head latent attention (DeepSeek-V2/V3): queries through a rank-q_lora
        # bottleneck (or one projection), keys and values from a normalised rank-kv_lora
        # latent plus one shared rotary key; attention_bias on q_a, kv_a and o.
        rope, nope, v_hd, kvl, ql = _latent(cfg)
        qk = nh * (rope + nope)
        bias = ((ql or 0) + kvl + rope + h) if cfg.get("attention_bias") else 0
        return _Attention(weights + bias, (ql or 0) + kvl, qk, nh * v_hd,
                          4 * h + 2 * qk + 2 * nh * v_hd + (ql or 0) + kvl)
    hd = cfg.get("head_dim") or h // nh
    q, kv = nh * hd, _kv_heads(cfg, kind, nh) * hd
    # Biases on q, k, v (qkv) or on all four projections (all).
    qkv, every = q + 2 * kv, q + 2 * kv + h
    bias = {
        "qwen2": qkv,
        "qwen2_moe": qkv if cfg.get("qkv_bias", True) else 0,
        "glm4": qkv if cfg.get("attention_bias") else 0,
        "stablelm": qkv if cfg.get("use_qkv_bias") else 0,
        "phi": every,
        "gpt_neox": every if cfg.get("attention_bias", True) else 0,
        "starcoder2": every if cfg.get("use_bias", True) else 0,
        "falcon": every if cfg.get("bias") else 0,
        "gpt_neox_japanese": 0, "codegen": 0, "mpt": 0,
        "seed_oss": (qkv if cfg.get("attention_bias") else 0) +
                    (h if cfg.get("attention_out_bias") else 0),
        "ernie4_5": every if cfg.get("use_bias") else 0,
        "ernie4_5_moe": every if cfg.get("use_bias") else 0,
    }.get(kind, every if cfg.get("attention_bias") else 0)
    # Per-head or whole-width norms on queries and keys.
    if kind.startswith("qwen3") or kind in ("gemma3_text", "exaone4", "apertus") or (
            kind == "glm4_moe" and cfg.get("use_qk_norm")):
        qk_norm = 2 * hd
    elif kind == "phi":
        qk_norm = 4 * hd if cfg.get("qk_layernorm") else 0       # LayerNorms with bias
    elif kind in ("olmo2", "olmo3", "olmoe", "flex_olmo", "minimax_m2", "cohere", "stablelm"):
        on = {"cohere": cfg.get("use_qk_norm"),
              "stablelm": cfg.get("qk_layernorm")}.get(kind, True)
        qk_norm = q + kv if on else 0
    else:
        qk_norm = 0
    sinks = nh if kind == "gpt_oss" else 0   # one attention-sink logit per head
    return _Attention(weights + bias, qk_norm + sinks, q, q,
                      4 * h + 2 * q + 2 * kv + (q + kv if qk_norm else 0))


def _latent(cfg: Mapping) -> tuple[int, int, int, int, int | None]:
    """Multi-head latent attention's sizes: rotary and non-rotary query/key head size,
    value head size, key-value rank, query rank (``None``: one query projection)."""
    return (_get(cfg, "qk_rope_head_dim"), _get(cfg, "qk_nope_head_dim"),
            _get(cfg, "v_head_dim"), cfg["kv_lora_rank"], cfg.get("q_lora_rank"))


def _kv_heads(cfg: Mapping, kind: str, nh: int) -> int:
    """Key and value heads: grouped-query where the family has it."""
    if kind in ("gpt_neox", "gpt_neox_japanese", "codegen", "mpt"):
        return nh                                   # no grouped-query attention
    if kind == "falcon":
        return (cfg.get("num_kv_heads") or nh) if cfg.get("new_decoder_architecture") \
            else 1 if cfg.get("multi_query", True) else nh
    return cfg.get("num_key_value_heads") or nh


_SHARED_GATE = frozenset({"qwen2_moe", "qwen3_next", "qwen3_5_moe_text"})
"""MoE families with a one-output gate on the shared expert."""
_FUSED_QKV = frozenset({"phi3", "gpt_neox", "gpt_neox_japanese", "falcon", "mpt", "codegen"})
"""Families whose query, key and value projections are one matrix."""
_FUSED_GATE_UP = frozenset({"phi3", "glm4"})
"""Families whose dense MLP's gate and up projections are one matrix."""


def block_linears(config, i: int) -> list[tuple[str, int, int]]:
    """The weight matrices of decoder block ``i`` as ``(role, fan_in, fan_out)``, the
    ones PEFT's ``target_modules="all-linear"`` adapts other than the routed experts
    and their router: attention (``q``, ``k``, ``v``, ``o``; ``qkv`` where the family
    fuses them; DeepSeek's latent projections as ``q`` and ``kv``), the dense MLP or
    the MoE block's shared experts (``gate``, ``up``, ``down``; ``gate_up`` fused),
    and Qwen2-MoE's shared-expert gate (``gate``)."""
    cfg = text_settings(load_config(config))
    h, nh = _get(cfg, "hidden_size"), _get(cfg, "num_attention_heads")
    kind = str(cfg.get("model_type", ""))
    out = _attention_linears(cfg, kind, h, nh, i)
    experts = _experts(cfg)
    if experts and _is_moe(cfg, kind, i):
        inter = cfg.get("moe_intermediate_size") or _get(cfg, "intermediate_size")
        shared = _shared_width(cfg, kind, inter)
        if shared:
            out += [("gate", h, shared), ("up", h, shared), ("down", shared, h)]
        if shared and kind in _SHARED_GATE:
            out.append(("gate", h, 1))
        return out
    inter = _dense_width(cfg, kind, h)
    if kind in _PLAIN_MLP:
        return out + [("up", h, inter), ("down", inter, h)]
    gate_up = [("gate_up", h, 2 * inter)] if kind in _FUSED_GATE_UP else \
        [("gate", h, inter), ("up", h, inter)]
    return out + gate_up + [("down", inter, h)]


def _shared_width(cfg: Mapping, kind: str, inter: int) -> int:
    """An MoE block's shared-expert width: one MLP of its own width (Qwen2-MoE,
    GraniteMoE-shared, Llama 4's expert-wide one) or a count of expert-wide ones
    (DeepSeek, GLM-4.5, ERNIE 4.5); 0 without."""
    return cfg.get("shared_expert_intermediate_size") or \
        cfg.get("shared_intermediate_size") or (inter if kind == "llama4_text" else 0) or \
        (cfg.get("n_shared_experts") or cfg.get("moe_num_shared_experts") or 0) * inter


def _dense_width(cfg: Mapping, kind: str, h: int) -> int:
    """A dense block's MLP width, by family."""
    if kind == "falcon":
        return cfg.get("ffn_hidden_size") or 4 * h
    if kind == "mpt":
        return 4 * h                       # transformers' MPT ignores expansion_ratio
    if kind == "gpt_neox_japanese":
        return h * (cfg.get("intermediate_multiple_size") or 4)
    if kind == "codegen":
        return cfg.get("n_inner") or 4 * h
    if kind == "llama4_text":
        return cfg.get("intermediate_size_mlp") or _get(cfg, "intermediate_size")
    return _get(cfg, "intermediate_size")


def _dense_mlp(cfg: Mapping, kind: str, h: int) -> tuple[int, int]:
    """A dense block's MLP: its parameters (all multiplied per token) and the elements
    per token it saves for the backward."""
    inter = _dense_width(cfg, kind, h)
    if kind in _PLAIN_MLP:
        bias = {"gpt_neox": True, "phi": True, "codegen": True,
                "starcoder2": cfg.get("use_bias", True), "falcon": cfg.get("bias")
                }.get(kind, False)
        # Apertus: xIELU's two learned slopes.
        act = 2 if kind == "apertus" else 0
        return 2 * h * inter + (inter + h if bias else 0) + act, 2 * inter
    bias = 2 * inter + h if cfg.get("mlp_bias") or (
        kind.startswith("ernie4_5") and cfg.get("use_bias")) else 0
    return 3 * h * inter + bias, 4 * inter


def _norms(cfg: Mapping, kind: str, h: int) -> tuple[int, int]:
    """Norm parameters of one block and of the final norm (in the head)."""
    ln = 2 * h                                     # a LayerNorm with a bias
    if kind == "olmo":
        return 0, 0                                # parameter-free LayerNorms
    if kind in ("gemma2", "gemma3_text", "glm4"):
        return 4 * h, h                            # pre- and post-norms, both sublayers
    if kind == "hyperclovax":                      # peri-layer norms (use_post_norm)
        return (4 * h if cfg.get("use_post_norm", True) else 2 * h), h
    if kind in ("cohere", "cohere2"):
        return h, h                                # one norm, parallel sublayers
    if kind in ("gpt_neox", "gpt_neox_japanese", "starcoder2"):
        return 2 * ln, ln
    if kind in ("phi", "codegen"):
        return ln, ln
    if kind == "phimoe":
        return 2 * ln, ln
    if kind == "stablelm":
        return (ln if cfg.get("use_parallel_residual") else 2 * ln), ln
    if kind == "falcon":
        lns = cfg.get("num_ln_in_parallel_attn") or \
            (2 if cfg.get("new_decoder_architecture") else 1)
        return (ln if cfg.get("parallel_attn", True) and lns != 2 else 2 * ln), ln
    return 2 * h, h                                # RMSNorms (MPT: LayerNorms, no bias)


def _is_moe(cfg: Mapping, kind: str, i: int) -> bool:
    """Whether block ``i`` of a model with experts routes to them: the family's own
    rule (Llama 4's ``moe_layers``, ERNIE 4.5's index range), else dense first blocks
    (``first_k_dense_replace``, every ``moe_layer_freq``-th after them: DeepSeek,
    GLM-4.5) and Qwen's dense list and sparse step."""
    if kind == "llama4_text":
        listed = cfg.get("moe_layers")
        return i in listed if listed is not None else \
            (i + 1) % (cfg.get("interleave_moe_layer_step") or 1) == 0
    if kind == "ernie4_5_moe":
        end = cfg.get("moe_layer_end_index", -1)
        end = _get(cfg, "num_hidden_layers") - 1 if end == -1 else end
        return (i + 1) % (cfg.get("moe_layer_interval") or 1) == 0 and \
            (cfg.get("moe_layer_start_index") or 0) <= i <= end
    return i >= (cfg.get("first_k_dense_replace") or 0) and \
        i % (cfg.get("moe_layer_freq") or 1) == 0 and \
        i not in set(cfg.get("mlp_only_layers") or ()) and \
        (i + 1) % (cfg.get("decoder_sparse_step") or 1) == 0




def _experts(cfg: Mapping) -> int:
    """Routed experts per MoE block (0: a dense model)."""
    return next((cfg[k] for k in _EXPERTS if cfg.get(k)), 0)


PEFT_FOLDED_EXPERTS = frozenset({
    "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "ernie4_5_moe", "olmoe",
    "flex_olmo", "minimax_m2", "solar_open", "qwen3_next"})
"""MoE families whose fused routed-expert stacks (``experts.gate_up_proj`` and
``experts.down_proj``, one ``experts x out x in`` parameter each) PEFT's
``target_modules="all-linear"`` adapts (PEFT 0.21 on transformers 5.24: its
conversion of transformers-4 expert names targets the stacks' parameters, and it
folds ``B·A`` into each whole stack on every forward). It leaves the experts of
Qwen2-MoE, GPT-OSS, Llama 4, PhiMoE, Granite-MoE and Qwen3.5-MoE alone.
``tests/test_sim_costs.py`` checks the set against PEFT on every MoE family of
:data:`FAMILIES`. :func:`lora_params` prices the experts frozen either way."""


def folded_expert_stacks(config) -> int:
    """Fused expert stacks ``rotapipe train --lora``'s default targets (PEFT
    ``all-linear``) adapt in ``config``'s model: two per routed-expert block of a
    family in :data:`PEFT_FOLDED_EXPERTS`, else 0."""
    cfg = text_settings(load_config(config))
    kind = str(cfg.get("model_type", ""))
    if kind not in PEFT_FOLDED_EXPERTS or not _experts(cfg):
        return 0
    return 2 * sum(_is_moe(cfg, kind, i) for i in range(_get(cfg, "num_hidden_layers")))
