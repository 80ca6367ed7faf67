"""Per-token arithmetic of the user's layers, for the runtime's planner: what a layer
says about itself (:func:`set_work`), else an estimate from its modules.

The estimate (:func:`estimate_work`), per token and forward pass:

- an ``nn.Embedding`` / ``nn.EmbeddingBag`` is a lookup: no FLOPs, it reads one row of
  ``embedding_dim`` elements and writes it (``memory_bytes``), priced by bandwidth;
- every other parameter is a weight a token is multiplied by (linear and convolution
  weights, norm scales, biases): 2 FLOPs (one multiply-add) per parameter;
- a weight shared with an earlier layer's embedding (a tied output head) is such a
  multiply there, not a lookup;
- every layer costs at least :data:`MIN_FLOPS` (one parameter's worth), so a
  parameter-free layer is cheap but not free;
- the backward costs twice the forward (input and weight gradients).

Attention scores and other parameter-free work are invisible to the estimate; the
Hugging Face adapter attaches each layer's arithmetic from its config instead
(:func:`rotapipe.plan.model_work`, attention included), and on CUDA the runtime
refines the plan from measured stage times (docs/planning.md, "The runtime's plan").
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..plan.costs import LayerWork

__all__ = ["WORK_ATTR", "MIN_FLOPS", "set_work", "layer_work", "estimate_work"]

WORK_ATTR = "rotapipe_work"
"""Attribute of a layer module holding its :class:`~rotapipe.plan.LayerWork`."""

MIN_FLOPS = 2.0
"""Forward FLOPs per token of a layer with nothing to count (one parameter's worth)."""

_LOOKUPS = (nn.Embedding, nn.EmbeddingBag)


def set_work(layer: nn.Module, work: LayerWork) -> None:
    """Tell the runtime's planner ``layer``'s per-token arithmetic (what the Hugging
    Face adapter does from the model's config). Kept through deep copies."""
    if not isinstance(work, LayerWork):
        raise TypeError(f"set_work needs a rotapipe.plan.LayerWork, got "
                        f"{type(work).__name__}: build one with rotapipe.plan.model_work "
                        "or LayerWork(name, forward_flops, backward_flops, params, "
                        "saved_bytes, output_bytes)")
    setattr(layer, WORK_ATTR, work)


def layer_work(layer: nn.Module) -> LayerWork | None:
    """The arithmetic set on ``layer`` with :func:`set_work`, or ``None``."""
    work = getattr(layer, WORK_ATTR, None)
    return work if isinstance(work, LayerWork) else None


def estimate_work(layers: Sequence[nn.Module], dtype_bytes: int = 2
                  ) -> tuple[LayerWork, ...]:
    """Each layer's :class:`LayerWork`: the one set on it, else the estimate of the
    module docstring, with embedding rows of ``dtype_bytes`` per element. Activation
    sizes are unknown without running the layers (0 here)."""
    looked_up: set[int] = set()   # embedding weights an earlier layer already looks up
    works = []
    for i, layer in enumerate(layers):
        own = layer_work(layer)
        if own is not None:
            works.append(own)
            looked_up.update(id(m.weight) for m in layer.modules() if isinstance(m, _LOOKUPS))
            continue
        flops, moved, params, seen = 0.0, 0.0, 0, set()
        for module in layer.modules():
            lookup = isinstance(module, _LOOKUPS) and id(module.weight) not in looked_up
            for p in module.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                params += p.numel()
                if lookup and p is module.weight:
                    moved += 2 * module.embedding_dim * dtype_bytes
                else:
                    flops += 2 * p.numel()
            if lookup:
                looked_up.add(id(module.weight))
        flops = max(flops, MIN_FLOPS) if moved == 0 else flops
        works.append(LayerWork(f"layer{i}", flops, 2 * flops, params, 0.0, 0.0,
                               memory_bytes=moved))
    return tuple(works)
