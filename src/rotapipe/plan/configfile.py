"""A model's ``config.json`` as the cost model reads it: loading one (a shipped name, a
path or folder, a dict, a ``transformers`` config), merging a multimodal model's
``text_config``, and checking every field the cost model reads, naming the file, the
field and what is expected (:func:`check_architecture`)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping

from ..errors import ConfigError

__all__ = ["KNOWN_MODELS", "load_config", "text_settings", "check_architecture"]

_CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "data" / "configs"
KNOWN_MODELS = ("qwen3-1.7b", "llama-3.1-8b", "qwen3-32b", "qwen3-235b-a22b", "gpt-oss-20b")
"""Model configs shipped with rotapipe (``data/configs/NAME.json``)."""


def load_config(model: str | pathlib.Path | Mapping | object) -> dict:
    """A model config as a dict: a known name (:data:`KNOWN_MODELS`), a path to a
    ``config.json`` (or to a folder holding one), a dict, or a ``transformers``
    config object."""
    if isinstance(model, Mapping):
        check_architecture(model)
        return dict(model)
    if hasattr(model, "to_dict"):
        cfg = model.to_dict()
        check_architecture(cfg)
        return cfg
    name = str(model)
    path = pathlib.Path(name)
    if name.lower() in KNOWN_MODELS:
        path = _CONFIGS / f"{name.lower()}.json"
    elif path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no model config at {name!r}: give a config.json path or one "
                          f"of {', '.join(KNOWN_MODELS)}")
    try:
        cfg = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a JSON text file") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} holds a JSON {type(cfg).__name__}, not an object: a "
                          "model config.json is an object of settings (hidden_size, ...)")
    check_architecture(cfg, str(path))
    merged = text_settings(cfg)
    missing = [k for k in _REQUIRED if merged.get(k) is None]
    if missing:
        raise ConfigError(f"{path}: no {', '.join(map(repr, missing))} (model_type="
                          f"{cfg.get('model_type')!r}): rotapipe needs "
                          f"{'it' if len(missing) == 1 else 'them'} to count FLOPs; give "
                          "the config.json of a Hugging Face decoder model")
    return cfg


_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "vocab_size", "intermediate_size", "moe_intermediate_size",
          "num_experts_per_tok", "shared_expert_intermediate_size", "ffn_hidden_size",
          "n_inner", "num_kv_heads", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
          "qk_nope_head_dim", "v_head_dim", "intermediate_multiple_size")


_ALIASES = {"hidden_size": ("d_model", "n_embd"), "num_hidden_layers": ("n_layers", "n_layer"),
            "num_attention_heads": ("n_heads", "n_head"),
            "max_position_embeddings": ("n_positions", "max_seq_len")}
"""Older families' names for the sizes the cost model reads (MPT, CodeGen)."""


def text_settings(cfg: Mapping) -> dict:
    """A config's settings with its ``text_config`` (a multimodal model's language
    model) merged over the top level, and the sizes older families name differently
    (:data:`_ALIASES`) under their usual names."""
    text = cfg.get("text_config")
    merged = {**cfg, **text} if isinstance(text, Mapping) else dict(cfg)
    for key, names in _ALIASES.items():
        if merged.get(key) is None:
            merged[key] = next((merged[n] for n in names if merged.get(n) is not None), None)
    return merged


_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
"""Sizes every family's cost is counted from (a config file without one is refused
naming the file; the family-specific ones are reported where they are needed)."""
_LARGEST = {"num_hidden_layers": 1024, "vocab_size": 2**22}
"""The largest value of a size in :data:`_SIZES`, else ``2**20``: far beyond any real
model (a width of a million, 1,024 blocks as ``rotapipe train``'s ``layers``), so that
``hidden_size: 1e12`` fails naming the field, not as a verdict in exabytes."""
_COUNTS = {"max_position_embeddings": 1, "sliding_window": 0, "intermediate_size_mlp": 1,
           "linear_num_key_heads": 1, "linear_num_value_heads": 1,
           "linear_key_head_dim": 1, "linear_value_head_dim": 1,
           "linear_conv_kernel_dim": 1, "experts_per_token": 1, "moe_k": 1,
           "num_ln_in_parallel_attn": 1, "moe_layer_interval": 1,
           "interleave_moe_layer_step": 1, "first_k_dense_replace": 0,
           "moe_layer_start_index": 0, "moe_layer_end_index": -1, "n_shared_experts": 0,
           "moe_num_shared_experts": 0, "shared_intermediate_size": 0}
"""Other ints the cost model reads, with their least value (``sliding_window: 0`` is
no window, as ``transformers`` reads it; ``moe_layer_end_index: -1`` the last block)."""
_FLAGS = ("tie_word_embeddings", "attention_bias", "attention_out_bias", "mlp_bias",
          "use_bias", "use_qkv_bias", "qkv_bias", "use_qk_norm", "qk_layernorm",
          "new_decoder_architecture", "multi_query", "parallel_attn", "bias",
          "use_parallel_residual", "lm_head_bias")
"""Booleans the cost model reads: ``"no"`` or ``0`` is refused (``bool("no")`` is true,
and ``transformers`` refuses it too)."""
_LISTS = {"layer_types": str, "mlp_only_layers": int, "moe_layers": int}
"""Lists the cost model reads, and the type of their items."""


def check_architecture(cfg: Mapping, where: str = "model config") -> None:
    """Fail with :class:`ConfigError` naming ``where``, the field, its value and what is
    expected when a setting the cost model reads has the wrong type or range: a size
    that is not a positive int (``num_attention_heads: 0``, ``"4k"``, ``2048.0``) or
    beyond any real model, a flag that is not a JSON boolean, a list of the wrong items;
    or when the heads do not group (absent sizes are reported where they are needed)."""
    if cfg.get("text_config") is not None and not isinstance(cfg["text_config"], Mapping):
        raise ConfigError(f"{where}: text_config={cfg['text_config']!r}: use an object of "
                          "the language model's settings")
    merged = text_settings(cfg)
    for key in _SIZES:
        _check_int(merged, key, where, 1, _LARGEST.get(key, 2**20))
    for key, least in _COUNTS.items():
        _check_int(merged, key, where, least)
    for key in _FLAGS:
        v = merged.get(key)
        if v is not None and not isinstance(v, bool):
            raise ConfigError(f"{where}: {key}={v!r}: use true or false (a JSON boolean; "
                              f"got {type(v).__name__})")
    for key, item in _LISTS.items():
        v = merged.get(key)
        if v is not None and not (isinstance(v, (list, tuple)) and all(
                isinstance(x, item) and not isinstance(x, bool) for x in v)):
            raise ConfigError(f"{where}: {key}={v!r}: use a list of "
                              f"{'strings' if item is str else 'ints'}")
    kind = merged.get("model_type")
    if kind is not None and not isinstance(kind, str):
        raise ConfigError(f"{where}: model_type={kind!r}: use the family's name as a "
                          "string (e.g. \"qwen3\")")
    heads, kv = merged.get("num_attention_heads"), merged.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ConfigError(f"{where}: num_attention_heads={heads} is not a multiple of "
                          f"num_key_value_heads={kv}")
    _check_moe(merged, where)


def _check_int(cfg: Mapping, key: str, where: str, least: int,
               largest: int | None = None) -> None:
    """``cfg[key]`` is absent, ``null`` or an int in ``[least, largest]``."""
    v = cfg.get(key)
    wrong = isinstance(v, bool) or not isinstance(v, int)
    if v is not None and (wrong or v < least or (largest is not None and v > largest)):
        what = "a positive int" if least == 1 else f"an int >= {least}"
        if not wrong and v >= least:                 # above largest
            what = f"an int in [{least}, {largest:,}] (no real model is near it: a typo?)"
        raise ConfigError(f"{where}: {key}={v!r}: use {what}"
                          + (f" (got {type(v).__name__})" if wrong else ""))


def _check_moe(cfg: Mapping, where: str) -> None:
    """The MoE sizes agree where the model itself would fail: no more experts per token
    than experts (``topk`` refuses it), a sparse step of at least 1 (``% 0``). A count
    of 0 experts is a dense model (Qwen3-MoE builds dense blocks then)."""
    key = next((k for k in _EXPERTS if cfg.get(k) is not None), "num_experts")
    experts = cfg.get(key)
    top_k = cfg.get("num_experts_per_tok", cfg.get("experts_per_token"))
    if experts is not None and (isinstance(experts, bool) or not isinstance(experts, int)
                                or experts < 0):
        raise ConfigError(f"{where}: {key}={experts!r}: use an int >= 0 (0: dense)")
    if experts and isinstance(top_k, int) and top_k > experts:
        raise ConfigError(f"{where}: num_experts_per_tok={top_k} is more than {key}="
                          f"{experts}: a token is routed to at most every expert")
    for name in ("decoder_sparse_step", "moe_layer_freq"):
        step = cfg.get(name)
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)
                                 or step < 1):
            raise ConfigError(f"{where}: {name}={step!r}: use an int >= 1 (every that many "
                              "layers is MoE)")


def _get(cfg: Mapping, key: str, default=None):
    value = cfg.get(key, default)
    if value is None:
        raise ConfigError(f"model config (model_type={cfg.get('model_type')!r}) has no "
                          f"{key!r}: rotapipe needs it to count FLOPs")
    return value


_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Config keys of the routed expert count, by family."""
