"""The sample at the end of a run: what the trained model writes after a prompt."""

from __future__ import annotations

import torch

from .config import TrainConfig
from .records import Tokens

__all__ = ["generate_sample"]


@torch.no_grad()
def generate_sample(wrapped, tokenizer, cfg: TrainConfig) -> str:
    """Decode ``cfg.sample_prompt`` with the Hugging Face model itself on the CPU (its
    parameters are the trained fp32 masters): greedy, or sampled with ``temperature`` and
    ``top_p`` (seeded by ``seed``); stops at the end-of-text token (and the model's own
    end tokens); special tokens are not shown. A tokenizer with a chat template gets the
    prompt as the user's message, with the assistant header after it, and the reply
    alone is returned."""
    model = wrapped.model
    model.eval()
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": cfg.sample_prompt}],
                                             tokenize=False, add_generation_prompt=True)
        prompt = Tokens(tokenizer).encode(text)
    else:
        tokens = Tokens(tokenizer)
        prompt = ([] if tokens.bos is None else [tokens.bos]) + tokens.encode(cfg.sample_prompt)
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
