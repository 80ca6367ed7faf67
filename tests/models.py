"""Small models for the tests, and the plain-PyTorch reference trainer.

The reference reproduces rotapipe's random streams: before running layer ``l`` on
microbatch ``m`` of call ``c`` it seeds the CPU generator with
``rotapipe.layer_seed(seed, c, m, l)``, and it weights each microbatch's loss by its
share of the batch, exactly as ``RoundPipe.forward_backward`` documents.
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

import rotapipe
from rotapipe.model import tiny

VOCAB = 61


class Embed(nn.Module):
    """Token embedding (layer 0); may share its weight with the head."""

    def __init__(self, emb: nn.Embedding):
        super().__init__()
        self.emb = emb

    def forward(self, ids):
        return self.emb(ids)


def Block(dim: int, hidden: int, heads: int = 2, dropout: float = 0.0) -> nn.Module:
    """Pre-norm transformer block with an MLP of width ``hidden`` (uneven per layer)."""
    return tiny.Block(dim, heads, dropout=dropout, hidden=hidden)


class Sleepy(nn.Module):
    """A linear layer that sleeps ``seconds`` in forward while ``seconds`` is set (a
    stuck kernel; set it to 0 on the workers' shells to end the stall, also one under
    way: an abandoned stuck thread would otherwise sleep on past the test)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seconds = seconds

    def forward(self, x):
        end = time.monotonic() + (self.seconds or 0)
        while self.seconds and time.monotonic() < end:
            time.sleep(0.02)
        return self.lin(x)


class RunningNorm(nn.Module):
    """A layer with buffers its forward updates (BatchNorm over features)."""

    def __init__(self, dim: int):
        super().__init__()
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x):
        return x + self.bn(x.transpose(1, 2)).transpose(1, 2)


class Residual(nn.Module):
    """``x + W2 tanh(W1 x)``: (batch, dim) -> (batch, dim), the memory tests' layer."""

    def __init__(self, dim: int = 64, hidden: int = 256):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Head(nn.Module):
    """Final norm + output projection; ``tied`` reuses the embedding weight."""

    def __init__(self, dim: int, emb: nn.Embedding | None = None):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.tied = emb
        self.out = None if emb is not None else nn.Linear(dim, VOCAB, bias=False)

    def forward(self, x):
        x = self.norm(x)
        return x @ self.tied.weight.t() if self.tied is not None else self.out(x)


def tiny_transformer(*, dim: int = 16, widths=(24, 40, 8, 32), dropout: float = 0.0,
                     tied: bool = False, buffers: bool = False, seed: int = 0) -> nn.Sequential:
    """Embedding, blocks of uneven MLP widths, optional BatchNorm layer, head."""
    torch.manual_seed(seed)
    emb = nn.Embedding(VOCAB, dim)
    layers: list[nn.Module] = [Embed(emb)]
    for i, w in enumerate(widths):
        layers.append(Block(dim, w, dropout=dropout))
        if buffers and i == 1:
            layers.append(RunningNorm(dim))
    layers.append(Head(dim, emb if tied else None))
    return nn.Sequential(*layers)


def lm_loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def token_batch(n: int = 8, t: int = 6, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, t), generator=g)
    return x, torch.roll(x, -1, dims=1)


def reference_forward_backward(model: nn.Sequential, inputs, labels, microbatches: int,
                               call: int, loss_fn=lm_loss, seed: int = 0) -> float:
    """Plain PyTorch: what ``RoundPipe.forward_backward`` promises to compute."""
    n = inputs.shape[0]
    total = 0.0
    for m, (x, y) in enumerate(zip(inputs.tensor_split(microbatches),
                                   labels.tensor_split(microbatches))):
        h = x
        for l, layer in enumerate(model):
            torch.manual_seed(rotapipe.layer_seed(seed, call, m, l))
            h = layer(h)
        loss = loss_fn(h, y)
        (loss * (x.shape[0] / n)).backward()
        total += loss.item() * x.shape[0] / n
    return total


def emulated(workers: int, microbatches: int, **kw) -> rotapipe.PipeConfig:
    """Emulated workers. ``ROTAPIPE_TEST_PIN`` (copy / register / off) and
    ``ROTAPIPE_TEST_CHUNK_MB`` run a suite with another host memory mode or weight
    chunk size (docs/host_memory.md)."""
    if os.environ.get("ROTAPIPE_TEST_PIN"):
        kw.setdefault("pin", os.environ["ROTAPIPE_TEST_PIN"])
    if os.environ.get("ROTAPIPE_TEST_CHUNK_MB"):
        kw.setdefault("copy_chunk_mb", float(os.environ["ROTAPIPE_TEST_CHUNK_MB"]))
    return rotapipe.PipeConfig(workers=workers, microbatches=microbatches,
                               backend="emulated", **kw)
