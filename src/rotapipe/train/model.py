"""The model and tokenizer a run trains: a local Hugging Face model (optionally with a
LoRA adapter), or a Qwen3-architecture model from scratch with a BPE trained on the data.
"""

from __future__ import annotations

import pathlib

import torch
from torch import nn

from ..errors import ConfigError
from .config import TrainConfig
from .data import TextFields, train_tokenizer
from .hub import is_hub_id, snapshot

__all__ = ["build_tokenizer", "build_model", "fingerprint", "check_sequence_length",
           "resolve_model", "adapter_dir"]


def _model_dir(cfg: TrainConfig) -> pathlib.Path:
    return resolve_model(cfg.model)


def resolve_model(name: str) -> pathlib.Path:
    """The local directory of ``model``: the directory itself, or for a hub id
    (``org/name``) its snapshot in the Hugging Face cache (``HF_HUB_CACHE`` /
    ``HF_HOME``), downloaded first unless ``HF_HUB_OFFLINE=1``."""
    p = pathlib.Path(name)
    if not p.is_dir():
        if not is_hub_id(name):
            raise ConfigError(f"model directory {name!r} does not exist: check the path, "
                              "pass a hub id (org/name), or leave model unset to train from "
                              "scratch")
        p = snapshot(name, "model", patterns=_HUB_FILES)
    if not (p / "config.json").is_file():
        raise ConfigError(f"model directory {name!r} has no config.json: pass the "
                          "directory save_pretrained wrote")
    return p


_HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
"""What a fine-tuning run needs from a hub repository (not .bin/.pth/.gguf copies)."""


def adapter_dir(cfg: TrainConfig) -> pathlib.Path | None:
    """``resume_from_adapter`` checked: a PEFT adapter directory."""
    if cfg.resume_from_adapter is None:
        return None
    p = pathlib.Path(cfg.resume_from_adapter)
    if not (p / "adapter_config.json").is_file():
        raise ConfigError(f"resume_from_adapter {cfg.resume_from_adapter!r} "
                          f"{'has no adapter_config.json' if p.is_dir() else 'is not a directory'}"
                          ": pass the directory a LoRA run exported (its final/)")
    return p


def check_sequence_length(cfg: TrainConfig) -> None:
    """A fine-tuned model's ``max_position_embeddings`` must cover ``seq`` (checked from
    config.json, before any weight is loaded)."""
    if cfg.model is None:
        return
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(_model_dir(cfg))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError...
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise ConfigError(f"model directory {cfg.model!r}: config.json cannot be read "
                          f"({type(exc).__name__}: {first})") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if limit is not None and cfg.seq > limit:
        raise ConfigError(f"seq={cfg.seq} is longer than the model supports "
                          f"(max_position_embeddings={limit} in {cfg.model}/config.json): "
                          f"use --seq {limit} or less")


def build_tokenizer(cfg: TrainConfig, files, saved: pathlib.Path | None = None):
    """The model's tokenizer; from scratch, the one saved in ``saved`` (a checkpoint's)
    or a byte-level BPE trained on the training split."""
    from transformers import AutoTokenizer

    if saved is not None and saved.is_dir():
        return AutoTokenizer.from_pretrained(str(saved))
    if cfg.model is not None:
        return AutoTokenizer.from_pretrained(str(_model_dir(cfg)))
    fields = TextFields(cfg.text_field, cfg.prompt_field, cfg.response_field)
    return train_tokenizer(files, cfg.vocab, cfg.tokenizer_bytes, fields, cfg.holdout)


def build_model(cfg: TrainConfig, tokenizer) -> nn.Module:
    """The causal LM on the CPU, fp32, initialised from ``cfg.seed`` when from scratch;
    a PEFT model around it with ``cfg.lora`` or ``cfg.qlora``."""
    import transformers

    if cfg.model is not None:
        from ..adapters import load_hf
        # LoRA: the frozen base is loaded in the compute dtype (it is kept in it anyway),
        # so host RAM never holds an fp32 copy of it; trainable weights are fp32.
        from ..config import resolve_dtype
        dtype = resolve_dtype(cfg.dtype) if cfg.lora or cfg.resume_from_adapter else \
            torch.float32
        model = load_hf(str(_model_dir(cfg)), dtype=dtype)
    else:
        torch.manual_seed(cfg.seed)
        config = transformers.Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=cfg.dim,
            intermediate_size=cfg.ffn or 3 * cfg.dim, num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads or cfg.heads,
            head_dim=cfg.dim // cfg.heads, max_position_embeddings=cfg.seq,
            tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
            attn_implementation="sdpa")
        model = transformers.Qwen3ForCausalLM(config)
    adapter = adapter_dir(cfg)
    if adapter is not None:
        import peft
        model = peft.PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    elif cfg.lora or cfg.qlora:
        import peft
        targets = cfg.lora_targets if cfg.lora_targets == "all-linear" else \
            [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
        torch.manual_seed(cfg.seed + 1)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets,
            lora_dropout=0.0, task_type="CAUSAL_LM"))
    return model


def fingerprint(model: nn.Module) -> dict:
    """What must match for a checkpoint to load: the architecture, its main sizes and
    every trainable parameter's name and shape."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    c = base.config
    return {"architecture": type(base).__name__, "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "params": {n: list(p.shape) for n, p in model.named_parameters()
                       if p.requires_grad}}
