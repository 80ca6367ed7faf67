"""Frozen weights kept as 4-bit NormalFloat (QLoRA's NF4): quantized once on the host,
uploaded packed, dequantized on the worker right before the stage runs.

The format and both kernels are bitsandbytes' (``quantize_4bit(quant_type="nf4",
compress_statistics=True)``: 64-element blocks, absmax scales double-quantized to 8
bits in blocks of 256, the QLoRA paper's layout). bitsandbytes was chosen over
torchao's ``NF4Tensor`` after measuring both on this CPU (docs/memory.md): the same
bytes (0.516 per parameter) and the same error, but bitsandbytes dequantizes a
2048 x 2048 weight in 0.5 ms where torchao's pure-PyTorch gather takes 122 ms, it has
CUDA kernels, and it is what PEFT and ``transformers`` QLoRA use, so adapters trained
here load into the usual QLoRA stack. It handles any shape (MoE experts' 3-D weights
included) by quantizing the flattened tensor.

One :class:`NF4Weight` packs the 4-bit codes, the 8-bit scales, their fp32 scales, the
offset and both code books into **one uint8 tensor**: the runtime treats it as any
other host tensor (page-locked, uploaded in chunks) and the transfer engine moves
exactly its bytes. The parameter in the user's module keeps its shape and dtype but
no storage (a one-element NaN broadcast to its shape, so using the module outside the
pipeline fails loudly instead of running on zeros); :func:`dequantize_frozen` puts
dequantized weights back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from ..plan.costs import NF4_BLOCK as BLOCK, nf4_bytes

__all__ = ["QUANTIZE", "NF4Weight", "quantize_frozen", "dequantize_frozen", "quantized",
           "check_frozen", "nf4_bytes"]

QUANTIZE = ("nf4",)
"""Quantized formats of frozen weights (``wrap_hf(quantize=...)``)."""


_ATTR = "_rotapipe_nf4"


def _bnb():
    try:
        import bitsandbytes.functional as F
    except ImportError:
        raise ConfigError("quantize='nf4' needs bitsandbytes (pip install bitsandbytes; "
                          "it runs on the CPU and on CUDA)") from None
    return F


@dataclass
class NF4Weight:
    """One frozen weight in NF4, all its bytes in :attr:`packed` (uint8, 1-D).

    ``parts`` says where each piece lies: ``name -> (offset, nbytes, dtype, shape)``."""

    packed: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    """dtype the weight dequantizes to (the dtype it was quantized from)."""
    parts: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]]
    blocksize: int
    scale_blocksize: int

    @classmethod
    def quantize(cls, w: torch.Tensor) -> NF4Weight:
        """Quantize ``w`` (any shape, floating) with bitsandbytes, on ``w``'s device."""
        F = _bnb()
        codes, qs = F.quantize_4bit(w.detach().contiguous(), blocksize=BLOCK,
                                    quant_type="nf4", compress_statistics=True)
        pieces = {"codes": codes.reshape(-1), "scales": qs.absmax,
                  "scale_scales": qs.state2.absmax, "offset": qs.offset.reshape(1),
                  "code": qs.code, "scale_code": qs.state2.code}
        parts, offset = {}, 0
        for name, t in pieces.items():
            offset = -(-offset // 8) * 8            # every piece 8-byte aligned
            nbytes = t.numel() * t.element_size()
            parts[name] = (offset, nbytes, t.dtype, tuple(t.shape))
            offset += nbytes
        packed = torch.empty(offset, dtype=torch.uint8, device=w.device)
        for name, t in pieces.items():
            o, n, _, _ = parts[name]
            packed[o:o + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        return cls(packed, w.shape, w.dtype, parts, qs.blocksize, qs.state2.blocksize)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def _piece(self, packed: torch.Tensor, name: str) -> torch.Tensor:
        o, n, dtype, shape = self.parts[name]
        return packed[o:o + n].view(dtype).reshape(shape)

    def dequantize(self, packed: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight, dequantized by bitsandbytes from ``packed`` (default:
        :attr:`packed`; a worker passes its uploaded copy, on its device), in ``dtype``
        (default: :attr:`dtype`)."""
        F = _bnb()
        p = self.packed if packed is None else packed
        state2 = F.QuantState(absmax=self._piece(p, "scale_scales"),
                              code=self._piece(p, "scale_code"),
                              blocksize=self.scale_blocksize, dtype=torch.float32)
        qs = F.QuantState(absmax=self._piece(p, "scales"), shape=self.shape,
                          code=self._piece(p, "code"), blocksize=self.blocksize,
                          quant_type="nf4", dtype=self.dtype,
                          offset=self._piece(p, "offset").reshape(()), state2=state2)
        w = F.dequantize_4bit(self._piece(p, "codes").reshape(-1, 1), qs)
        return w if dtype is None or w.dtype == dtype else w.to(dtype)


def quantized(p: torch.Tensor) -> NF4Weight | None:
    """The :class:`NF4Weight` a parameter was replaced by (``None``: not quantized)."""
    return getattr(p, _ATTR, None)


def quantize_frozen(modules: Iterable[nn.Module],
                    skip: Callable[[nn.Module, str], bool] | None = None) -> int:
    """Quantize every frozen floating parameter of ``modules`` with two or more
    dimensions (weight matrices, MoE experts' stacked weights) to NF4, in place:
    the parameter then holds no storage and carries its :class:`NF4Weight`
    (:func:`quantized`). ``skip(module, name)``: leave that parameter alone (MoE
    routers). Trainable parameters, PEFT adapters' weights (also frozen ones: an
    adapter not active), vectors (norms, biases) and parameters already quantized are
    left alone. Returns the packed bytes added."""
    modules = list(modules)
    adapters = _adapter_params(modules)
    total = 0
    for m in modules:
        for path, mod in m.named_modules():
            for name, p in mod._parameters.items():
                if p is None or p.requires_grad or p.dim() < 2 or \
                        not p.is_floating_point() or quantized(p) is not None or \
                        id(p) in adapters or (skip is not None and skip(mod, name)):
                    continue
                if p.device.type == "meta":
                    where = f"{path}.{name}" if path else name
                    raise ConfigError(f"cannot quantize {where} ({type(m).__name__}) on "
                                      "the meta device: load the weights first")
                q = NF4Weight.quantize(p.data)
                setattr(p, _ATTR, q)
                # Shape and dtype stay (shells, planner and PEFT read them); the bytes
                # go. NaN, not zeros: a forward outside the pipeline shows it at once.
                p.data = torch.full((), float("nan"), dtype=p.dtype).expand(q.shape)
                total += q.nbytes
    return total


def _adapter_params(modules: list[nn.Module]) -> set[int]:
    """Ids of the PEFT adapter weights in ``modules``, trainable or not: what each tuner
    layer lists in ``adapter_layer_names`` / ``other_param_names`` (``lora_A``,
    DoRA's magnitudes, ``modules_to_save`` copies, ...). QLoRA quantizes the base
    model's weights only: a frozen adapter used to be quantized with them (saved by
    PEFT all NaN, or computing with 4-bit copies of its weights)."""
    ids: set[int] = set()
    for m in modules:
        for mod in m.modules():
            for name in (*getattr(mod, "adapter_layer_names", ()),
                         *getattr(mod, "other_param_names", ())):
                obj = mod
                for part in name.split("."):      # TrainableTokens: a dotted name
                    obj = getattr(obj, part, None)
                if isinstance(obj, nn.Parameter):
                    ids.add(id(obj))
                elif isinstance(obj, nn.Module):
                    ids.update(id(p) for p in obj.parameters())
    return ids


def check_frozen(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Refuse a quantized parameter that trains (``requires_grad`` set after
    :func:`quantize_frozen`): its module holds the NaN placeholder, which a pipeline
    would make its fp32 master and train from (the first call used to fail as a
    non-finite loss, "check the data"). ``named``: ``(name, parameter)`` pairs."""
    for name, p in named:
        if p.requires_grad and quantized(p) is not None:
            raise ConfigError(
                f"{name} is kept as NF4 (wrap_hf(quantize='nf4')) and has "
                "requires_grad=True: its module holds no values, only the packed 4-bit "
                "bytes, so it cannot train. Freeze it (requires_grad_(False)), or to "
                "train it call rotapipe.model.quant.dequantize_frozen(wrapped.layers) "
                "and wrap the model again without quantize")


def dequantize_frozen(modules: Iterable[nn.Module]) -> int:
    """Undo :func:`quantize_frozen`: each quantized parameter gets its dequantized
    weight back as ordinary storage (the weights QLoRA trains against, not the
    original ones). Returns how many parameters it restored."""
    n = 0
    for m in modules:
        for p in m.parameters():
            q = quantized(p)
            if q is not None:
                p.data = q.dequantize()
                delattr(p, _ATTR)
                n += 1
    return n
