"""Family hooks: config values a model's forward applies outside its decoder blocks.

In ``transformers`` 5.x most per-family differences live inside the blocks or in the
mask and rotary helpers, which the adapter reuses as they are. A few live in the
model's own forward, before the first block or after the last one, where the adapter's
embedding and head layers must repeat them. Each is read from the config by name:

| config attribute | families | the forward does |
|---|---|---|
| ``embedding_multiplier`` | Granite (and its MoE variants) | ``embeds * m`` |
| ``final_logit_softcapping`` | Gemma 2/3/4, VaultGemma, Nanochat | ``tanh(x / c) * c`` |
| ``logits_scaling`` | Granite (and its MoE variants) | ``x / d`` |
| ``logit_scale`` | Cohere, Cohere 2 | ``x * m`` |
| ``lm_head_multiplier`` | Falcon-H1 | ``x * m`` |

A family whose forward does something else there is caught at wrap time (the checks in
:mod:`.checks` compare with the model's own forward) and refused with what differs. To
support it, add its attribute here, or pass ``wrap_hf(model, logits_fn=...)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["embedding_multiplier", "logit_transforms", "LOGIT_TRANSFORMS"]

LOGIT_TRANSFORMS = {
    "final_logit_softcapping": "softcap",
    "logits_scaling": "divide",
    "logit_scale": "multiply",
    "lm_head_multiplier": "multiply",
}
"""Config attribute -> :class:`~rotapipe.adapters.LMHead` argument."""


def embedding_multiplier(config) -> float | None:
    """What the forward multiplies the input embeddings by (Granite), or ``None``."""
    return getattr(config, "embedding_multiplier", None)


def logit_transforms(config, fn: Callable[[torch.Tensor], torch.Tensor] | None = None
                     ) -> dict:
    """Keyword arguments of :class:`~rotapipe.adapters.LMHead` for ``config`` (the
    ``None`` ones left out), plus the user's ``fn``."""
    out = {}
    for attr, arg in LOGIT_TRANSFORMS.items():
        v = getattr(config, attr, None)
        if v is not None:
            # Two attributes of one kind (no family has both) would both apply.
            out[arg] = v if arg not in out else out[arg] * v
    if fn is not None:
        out["fn"] = fn
    return out
