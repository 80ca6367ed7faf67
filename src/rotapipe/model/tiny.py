"""A tiny GPT-like model as layers, and a learnable synthetic token task, for demos.

``tiny_gpt`` returns ``nn.Sequential(Embed, Block, ..., Block, Head)``: the shape
rotapipe wants (layer 0 takes token ids, every later layer the previous layer's
output, the last layer gives logits). ``stride_batch`` draws sequences whose next
token is a deterministic function of the previous two, so a model that attends to
the context can drive the loss towards zero. Real data and Hugging Face models are
the business of ``rotapipe train`` (issue 7) and the adapters; this is for the
README, the examples and the CLI's smoke run.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError

__all__ = ["Embed", "Block", "Head", "tiny_gpt", "stride_batch", "lm_loss"]


class Embed(nn.Module):
    """Token + learned position embedding: ids ``[b, t]`` -> hidden ``[b, t, dim]``."""

    def __init__(self, vocab: int, dim: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)

    def forward(self, ids):
        t = ids.shape[1]
        return self.tok(ids) + self.pos(torch.arange(t, device=ids.device))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP of width
    ``hidden`` (default ``4 * dim``)."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, hidden: int | None = None):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        hidden = hidden or 4 * dim
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        # qkv: [b, t, 3*d] -> q, k, v each [b, heads, t, d/heads]
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm2(x)))))


class Head(nn.Module):
    """Final norm + output projection: hidden ``[b, t, dim]`` -> logits ``[b, t, vocab]``."""

    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        return self.out(self.norm(x))


def tiny_gpt(vocab: int = 64, dim: int = 64, layers: int = 4, heads: int = 4,
             seq: int = 32, dropout: float = 0.0) -> nn.Sequential:
    """``nn.Sequential(Embed, layers x Block, Head)``: ``layers + 2`` rotapipe layers.

    Initialised from torch's global generator (seed it first for a repeatable run)."""
    if dim % heads:
        raise ConfigError(f"dim={dim} is not a multiple of heads={heads}: pick dim as a "
                         "multiple of heads")
    return nn.Sequential(Embed(vocab, dim, seq),
                         *(Block(dim, heads, dropout) for _ in range(layers)),
                         Head(dim, vocab))


def stride_batch(batch: int, seq: int, vocab: int = 64, max_stride: int = 4,
                 generator: torch.Generator | None = None):
    """Inputs and next-token labels, both ``[batch, seq]`` int64.

    Each sequence starts at a random token and climbs by a random stride in
    ``1..max_stride`` modulo ``vocab``: token ``t+1 = token t + (token t - token t-1)``.
    From the third token on, the next token is a function of the previous two, so
    the loss can fall from ``ln(vocab)`` to near zero (only the first step of each
    sequence stays a guess among ``max_stride`` strides).
    """
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, max_stride + 1, (batch, 1), generator=generator)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab   # [batch, seq + 1]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(logits, labels):
    """Mean next-token cross entropy over every position of the microbatch."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       labels.reshape(-1))
