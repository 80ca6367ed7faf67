"""The rotapipe layers of a Hugging Face decoder: embedding, one per block, and the head.

Each wraps the user's own modules (no copy: the parameters stay the model's, so the
model's ``state_dict`` and ``save_pretrained`` see the trained weights) and is called by
the pipeline as ``layer(x, **side)`` with the side inputs of :mod:`.side`.

Activations between layers are the hidden states ``[B, T, H]``; for MoE models with the
auxiliary loss on, the pair ``(hidden, (tokens, probs, rows))`` (see :mod:`.moe`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .errors import AdapterError
from .loss import LMHead
from .moe import MoESpec, RouterTap, aux_add, aux_zero
from .side import unpack_inputs

__all__ = ["EmbedLayer", "DecoderLayer", "HeadLayer", "HeadOutput"]


class HeadOutput(NamedTuple):
    """What the head layer hands the loss in training: the normalised hidden states,
    the (bound) LM head to apply chunk by chunk, and the MoE loss sums (or ``None``)."""

    hidden: torch.Tensor
    head: LMHead
    moe: tuple | None


class EmbedLayer(nn.Module):
    """Layer 0: token embeddings (Gemma's sqrt(hidden) scaling lives in its embedding
    module in transformers 5.x), times ``multiplier`` where the model's forward scales
    them (Granite's ``embedding_multiplier``), then ``dropout`` where the forward drops
    them out (Phi's ``embed_dropout``, GPT-NeoX's ``emb_dropout``, CodeGen's and GPT-J's
    ``drop``: the model's own modules; Starcoder2's ``F.dropout`` of
    ``embedding_dropout``: an ``nn.Dropout``). It draws from the layer's random stream
    (:func:`rotapipe.layer_seed`) and is on when the pipeline is in train mode."""

    def __init__(self, embed: nn.Module, multiplier: float | None = None,
                 moe: MoESpec | None = None, dropout: nn.Module | None = None):
        super().__init__()
        self.embed = embed
        self.multiplier = multiplier
        self.moe = moe
        self.dropout = dropout

    def forward(self, inputs, **side):
        ids, _, _ = unpack_inputs(inputs)
        h = self.embed(ids)
        if self.multiplier is not None:
            h = h * self.multiplier
        if self.dropout is not None:
            h = self.dropout(h)
        if self.moe is not None:
            return h, aux_zero(self.moe.num_experts, h.device)
        return h


class DecoderLayer(nn.Module):
    """Decoder block ``index`` called with the arguments the model's forward gives it."""

    def __init__(self, block: nn.Module, index: int, routers: tuple = (),
                 moe: MoESpec | None = None):
        super().__init__()
        self.block = block
        self.index = index
        self.routers = routers
        self.moe = moe

    def forward(self, x, *, hf_tensors, hf_layout, hf_routing=None, hf_moe_mask=None):
        args, kwargs = hf_layout.arguments(self.index, hf_tensors)
        h, acc = x if self.moe is not None else (x, None)
        _check_dtypes(h, hf_tensors)
        if not self.routers:
            out = _hidden(self.block(h, *args, **kwargs))
            return out if acc is None else (out, acc)
        with RouterTap(self.block, self.routers, hf_routing, self.index) as tap:
            out = _hidden(self.block(h, *args, **kwargs))
        if acc is None:
            return out
        for logits in tap.logits:
            acc = aux_add(acc, logits, hf_moe_mask, self.moe)
        return out, acc

    def extra_repr(self) -> str:
        return f"index={self.index}" + (f", routers={[p for p, _ in self.routers]}"
                                        if self.routers else "")


class HeadLayer(nn.Module):
    """The tail: final norm, then in training a :class:`HeadOutput` for the chunked loss
    (the full logits never exist); without autograd (evaluation) the logits.

    ``transforms`` are the keyword arguments of :class:`~rotapipe.adapters.LMHead`
    (``softcap``, ``divide``, ``multiply``, ``fn``): what the model's forward does to
    the logits."""

    def __init__(self, norm: nn.Module | None, lm_head: nn.Module,
                 transforms: dict | None = None, moe: MoESpec | None = None):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.transforms = {k: v for k, v in (transforms or {}).items() if v is not None}
        self.moe = moe

    def forward(self, x, **side):
        h, acc = x if self.moe is not None else (x, None)
        if self.norm is not None:
            h = self.norm(h)
        head = LMHead(self.lm_head, **self.transforms)
        if torch.is_grad_enabled():
            return HeadOutput(h, head, acc)
        return head(h)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.transforms.items())


def _hidden(out):
    """transformers 5.x blocks return the hidden states; older ones a tuple."""
    return out[0] if isinstance(out, (tuple, list)) else out


def _check_dtypes(h: torch.Tensor, tensors) -> None:
    for t in tensors:
        if t.is_floating_point() and t.dtype != h.dtype:
            raise AdapterError(
                f"side inputs (masks, rotary tables) were built in {t.dtype} but the "
                f"layers compute in {h.dtype}: build the pipeline with "
                "rotapipe.adapters.hf_pipe(model, config) or wrapped.pipe(config), or "
                f"wrap_hf(model, compute_dtype={h.dtype})")
