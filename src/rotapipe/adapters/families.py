"""Family hooks: config values a model's forward applies outside its decoder blocks.

In ``transformers`` 5.x most per-family differences live inside the blocks or in the
mask and rotary helpers, which the adapter reuses as they are. A few live in the
model's own forward, before the first block or after the last one, where the adapter's
embedding and head layers must repeat them. Each is read from the config by name:

| config attribute | families | the forward does |
|---|---|---|
| ``embedding_multiplier`` | Granite (and its MoE variants) | ``embeds * m`` |
| ``final_logit_softcapping`` | Gemma 2/3/4, VaultGemma, Nanochat | ``tanh(x / c) * c`` |
| ``output_logit_soft_cap`` | xLSTM | ``tanh(x / c) * c`` |
| ``logits_scaling`` | Granite (and its MoE variants) | ``x / d`` |
| ``logits_scaling`` | HyperCLOVA X (:data:`MULTIPLIED_LOGITS_SCALING`) | ``x * d`` |
| ``logit_scale`` | Cohere, Cohere 2 | ``x * m`` |
| ``lm_head_multiplier`` | Falcon-H1 | ``x * m`` |

MPT's configs carry a ``logit_scale`` its forward does not apply (:data:`UNUSED`).

A family whose forward does something else there is caught at wrap time (the checks in
:mod:`.checks` compare with the model's own forward) and refused with what differs. To
support it, add its attribute here, or pass ``wrap_hf(model, logits_fn=...)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["embedding_multiplier", "logit_transforms", "LOGIT_TRANSFORMS",
           "MULTIPLIED_LOGITS_SCALING", "UNUSED"]

LOGIT_TRANSFORMS = {
    "final_logit_softcapping": "softcap",
    "output_logit_soft_cap": "softcap",
    "logits_scaling": "divide",
    "logit_scale": "multiply",
    "lm_head_multiplier": "multiply",
}
"""Config attribute -> :class:`~rotapipe.adapters.LMHead` argument."""

MULTIPLIED_LOGITS_SCALING = frozenset({"hyperclovax"})
"""``config.model_type`` of the families whose forward multiplies the logits by
``logits_scaling`` (Granite's divides by it)."""

UNUSED = frozenset({("mpt", "logit_scale")})
"""``(model_type, attribute)``: a config attribute of :data:`LOGIT_TRANSFORMS` that the
family's forward does not apply (MPT's configs carry ``logit_scale``; its forward in
``transformers`` ignores it)."""


def embedding_multiplier(config) -> float | None:
    """What the forward multiplies the input embeddings by (Granite), or ``None``."""
    return getattr(config, "embedding_multiplier", None)


def logit_transforms(config, fn: Callable[[torch.Tensor], torch.Tensor] | None = None
                     ) -> dict:
    """Keyword arguments of :class:`~rotapipe.adapters.LMHead` for ``config`` (the
    ``None`` ones left out), plus the user's ``fn``."""
    out = {}
    kind = getattr(config, "model_type", None)
    for attr, arg in LOGIT_TRANSFORMS.items():
        if (kind, attr) in UNUSED:
            continue
        if attr == "logits_scaling" and kind in MULTIPLIED_LOGITS_SCALING:
            arg = "multiply"
        v = getattr(config, attr, None)
        if v is not None:
            # Two attributes of one kind (no family has both) would both apply.
            out[arg] = v if arg not in out else out[arg] * v
    if fn is not None:
        out["fn"] = fn
    return out
