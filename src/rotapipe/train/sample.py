"""Samples: what the trained model writes after the prompts the user gives, at the end
of a run (and every ``sample_interval`` steps), printed and kept in
``out_dir/samples.jsonl``."""

from __future__ import annotations

import pathlib
from contextlib import contextmanager

import torch

from ..errors import ConfigError
from .config import TrainConfig
from .tokens import Tokens

__all__ = ["check_prompts", "generate_sample", "sample_prompts"]


def sample_prompts(cfg: TrainConfig) -> list[str]:
    """``sample_prompt``, then the lines of ``sample_file`` (blank lines skipped);
    read before any work, so a missing file fails first."""
    prompts = [cfg.sample_prompt] if cfg.sample_prompt else []
    if cfg.sample_file is not None:
        path = pathlib.Path(cfg.sample_file)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(f"sample_file {cfg.sample_file!r} cannot be read ({why}): "
                              "pass a text file with one prompt per line") from None
        prompts += [line for line in text.splitlines() if line.strip()]
        if len(prompts) == (1 if cfg.sample_prompt else 0):
            raise ConfigError(f"sample_file {cfg.sample_file!r} holds no prompt: write one "
                              "prompt per line")
    return prompts


@torch.no_grad()
def generate_sample(wrapped, tokenizer, cfg: TrainConfig, prompt: str | None = None) -> str:
    """Decode ``prompt`` (default ``cfg.sample_prompt``) with the Hugging Face model
    itself on the CPU (its parameters are the trained fp32 masters; a QLoRA base is
    dequantized module by module): greedy, or sampled with ``temperature`` and
    ``top_p`` (seeded by ``seed``); stops at the end-of-text token (and the model's own
    end tokens); special tokens are not shown. Nothing else of the model's
    ``generation_config`` applies (a repetition penalty, beams): greedy is the plain
    argmax decode. A tokenizer with a chat template gets the prompt as the user's
    message, with the assistant header after it, and the reply alone is returned.
    Every module gets its own train/eval flag back."""
    text = cfg.sample_prompt if prompt is None else prompt
    model = wrapped.model
    # The pipeline's layers are this model's modules: each gets its own flag back.
    modes = [(m, m.training) for m in model.modules()]
    # The model's own generation defaults (a checkpoint's generation_config.json:
    # repetition_penalty, no_repeat_ngram_size, num_beams, ...) would turn "greedy"
    # into another decode; the sample is what cfg says and nothing else. generate()
    # fills every setting left unset from them, so they are blanked for the call,
    # except how the model runs (its cache: xLSTM's forward fails with one).
    from transformers import GenerationConfig
    ends = getattr(wrapped.generation_config, "eos_token_id", None)
    own = [(m, m.generation_config) for m in model.modules()
           if isinstance(vars(m).get("generation_config"), GenerationConfig)]
    model.eval()
    try:
        for m, config in own:
            m.generation_config = GenerationConfig(**{k: getattr(config, k, None)
                                                      for k in _HOW})
        with _dequantized(model):
            return _generate(model, wrapped, tokenizer, cfg, text, ends)
    finally:
        for m, config in own:
            m.generation_config = config
        for m, training in modes:
            m.training = training


_HOW = ("use_cache", "cache_implementation", "cache_config")
"""Settings of a model's ``generation_config`` that a sample keeps: how the model runs,
not which tokens the decode picks."""


@contextmanager
def _dequantized(model):
    """QLoRA: outside the pipeline the frozen NF4 weights hold a NaN placeholder
    (``rotapipe.model.quant``), so a forward of the model itself gives NaN logits and
    the decode garbage. Each module holding such weights gets them dequantized for the
    length of its own forward only (the whole base is never dequantized at once), and
    its placeholders back after it (the same tensors: the pipeline sees no change)."""
    from ..model.quant import quantized
    holders: dict[torch.Tensor, torch.Tensor] = {}
    handles = []
    for mod in model.modules():
        weights = [(p, q) for p in mod._parameters.values() if p is not None
                   for q in [quantized(p)] if q is not None]
        if not weights:
            continue
        holders.update((p, p.data) for p, _ in weights)

        def unpack(module, args, weights=weights):
            for p, q in weights:
                p.data = q.dequantize()

        def pack(module, args, out, weights=weights):
            for p, _ in weights:
                p.data = holders[p]
        handles += [mod.register_forward_pre_hook(unpack), mod.register_forward_hook(pack)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for p, placeholder in holders.items():      # a forward that raised half-way
            p.data = placeholder


def check_prompts(prompts: list[str], tokenizer, model_config) -> None:
    """Refuse, before any work, a sample prompt that leaves the model no room for a new
    token (the end of the run would fail on it)."""
    limit = getattr(model_config, "max_position_embeddings", None) or 1 << 30
    for text in prompts:
        _room(text, len(_prompt_ids(tokenizer, text)), limit)


def _prompt_ids(tokenizer, text: str) -> list[int]:
    """The prompt's token ids: a chat template's rendering of it as the user's message
    with the assistant header, else BOS and the text."""
    tokens = Tokens(tokenizer)
    if getattr(tokenizer, "chat_template", None):
        return tokens.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True))
    return ([] if tokens.bos is None else [tokens.bos]) + tokens.encode(text)


def _room(text: str, length: int, limit: int) -> int:
    """New tokens the model's context has room for after a prompt of ``length``."""
    if length >= limit:
        short = text if len(text) <= 60 else text[:57] + "..."
        raise ConfigError(f"the sample prompt {short!r} is {length} tokens, and the "
                          f"model's context holds {limit} (max_position_embeddings): no "
                          "room for a new token. Shorten the prompt")
    return limit - length


def _generate(model, wrapped, tokenizer, cfg: TrainConfig, text: str, ends) -> str:
    ids = torch.tensor([_prompt_ids(tokenizer, text)])
    limit = getattr(wrapped.config, "max_position_embeddings", None) or 1 << 30
    new = min(cfg.sample_tokens, _room(text, ids.shape[1], limit))
    stop = {tokenizer.eos_token_id}       # and the model's own end tokens (``ends``)
    stop |= set(ends if isinstance(ends, (list, tuple)) else [ends] if ends is not None
                else [])
    dtypes = {p.dtype for p in model.parameters()}
    low = next((d for d in dtypes if d != torch.float32), None)
    sampling = {"do_sample": False} if not cfg.temperature else \
        {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0}
    with torch.random.fork_rng(devices=[]), \
            torch.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None):
        torch.manual_seed(cfg.seed)
        out = ids if new < 1 else model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
            pad_token_id=tokenizer.eos_token_id, eos_token_id=sorted(stop), **sampling)
    # A chat: the reply alone (the prompt is the template's, with its headers).
    start = ids.shape[1] if getattr(tokenizer, "chat_template", None) else 0
    return tokenizer.decode(out[0, start:], skip_special_tokens=True)
