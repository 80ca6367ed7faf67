"""Samples: what the trained model writes after the prompts the user gives, at the end
of a run (and every ``sample_interval`` steps), printed and kept in
``out_dir/samples.jsonl``."""

from __future__ import annotations

import pathlib

import torch

from ..errors import ConfigError
from .config import TrainConfig
from .tokens import Tokens

__all__ = ["generate_sample", "sample_prompts"]


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
    itself on the CPU (its
    parameters are the trained fp32 masters): greedy, or sampled with ``temperature`` and
    ``top_p`` (seeded by ``seed``); stops at the end-of-text token (and the model's own
    end tokens); special tokens are not shown. A tokenizer with a chat template gets the
    prompt as the user's message, with the assistant header after it, and the reply
    alone is returned."""
    text = cfg.sample_prompt if prompt is None else prompt
    model = wrapped.model
    training = model.training      # the pipeline's layers are this model's modules
    model.eval()
    try:
        return _generate(model, wrapped, tokenizer, cfg, text)
    finally:
        model.train(training)


def _generate(model, wrapped, tokenizer, cfg: TrainConfig, text: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             tokenize=False, add_generation_prompt=True)
        prompt = Tokens(tokenizer).encode(text)
    else:
        tokens = Tokens(tokenizer)
        prompt = ([] if tokens.bos is None else [tokens.bos]) + tokens.encode(text)
    ids = torch.tensor([prompt])
    limit = getattr(wrapped.config, "max_position_embeddings", None) or 1 << 30
    new = max(0, min(cfg.sample_tokens, limit - ids.shape[1]))
    stop = {tokenizer.eos_token_id}
    own = getattr(wrapped.generation_config, "eos_token_id", None)
    stop |= set(own if isinstance(own, (list, tuple)) else [own] if own is not None else [])
    dtypes = {p.dtype for p in model.parameters()}
    low = next((d for d in dtypes if d != torch.float32), None)
    sampling = {"do_sample": False} if not cfg.temperature else \
        {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": 0}
    with torch.random.fork_rng(devices=[]), \
            torch.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None):
        torch.manual_seed(cfg.seed)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             pad_token_id=tokenizer.eos_token_id,
                             eos_token_id=sorted(stop), **sampling)
    # A chat: the reply alone (the prompt is the template's, with its headers).
    start = ids.shape[1] if getattr(tokenizer, "chat_template", None) else 0
    return tokenizer.decode(out[0, start:], skip_special_tokens=True)
