"""Hugging Face adapters: a ``transformers`` causal LM (or a PEFT model around one) as
rotapipe layers, with side inputs, a chunked LM-head loss, MoE routing replay and the
load-balancing loss. See docs/huggingface.md.

Importing this package does not import ``transformers``; :func:`load_hf` and PEFT
models need it (``pip install rotapipe[hf]``).
"""

from .hf import AdapterError, HFModel, hf_pipe, load_hf, wrap_hf
from .loss import (CausalLMLoss, LMHead, TokenCount, chunked_cross_entropy, lm_loss,
                   shift_labels)

__all__ = ["AdapterError", "CausalLMLoss", "HFModel", "LMHead", "TokenCount",
           "chunked_cross_entropy", "hf_pipe", "lm_loss", "load_hf", "shift_labels",
           "wrap_hf"]
