"""A training batch as a call takes it: split along dim 0 into microbatches, floating
inputs cast to the compute dtype, and each microbatch's loss units (:func:`split_batch`),
with the errors that name the fix for a batch that cannot be split."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping

import torch
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_map

from ..errors import InputError
from . import trees

__all__ = ["split_batch", "as_tree"]


def split_batch(inputs, labels, microbatches: int, dtype: torch.dtype,
                loss_weight: Callable[[object], float] | None):
    """``(input microbatches, label microbatches, loss units)`` of a training batch:
    split along dim 0, floating inputs cast to the compute dtype; a microbatch's units
    are ``loss_weight(labels)`` (default: its sample count). Raises :class:`InputError`
    naming the fix for mismatched or too small batches, and for tensors that require
    grad."""
    inputs, labels = as_tree(inputs), as_tree(labels)
    n = trees.batch_size(inputs, "inputs")
    n_labels = trees.batch_size(labels, "labels")
    _check_no_grad(inputs, "inputs")
    _check_no_grad(labels, "labels")
    if n != n_labels:
        raise InputError(f"inputs hold {n} samples but labels hold {n_labels}: pass "
                         "one label row per input row")
    if n < microbatches:
        raise InputError(f"the batch has {n} samples but config.microbatches={microbatches}"
                         f": pass at least {microbatches} samples or lower microbatches")
    mbs = trees.split(trees.cast_floating(inputs, dtype), microbatches)
    lbs = trees.split(labels, microbatches)
    if loss_weight is None:
        units = [float(trees.batch_size(x, "inputs")) for x in mbs]
    else:
        units = [_units(loss_weight(y), m) for m, y in enumerate(lbs)]
    return mbs, lbs, units


def as_tree(batch):
    """``batch`` with every mapping PyTorch's pytree does not open (a ``transformers``
    ``BatchEncoding``, a ``UserDict``, a dict subclass) made a dict, at any depth: else
    such a mapping is one opaque leaf, its tensors neither found nor split (and given
    whole to every microbatch)."""
    return tree_map(lambda x: as_tree(dict(x)) if _opaque(x) else x, batch,
                    is_leaf=_opaque)


def _opaque(x) -> bool:
    return isinstance(x, Mapping) and type(x) not in SUPPORTED_NODES


def _check_no_grad(tree, what: str) -> None:
    """Refuse a batch tensor that requires grad: each microbatch enters the pipeline
    as a constant (workers compute on copies), so no gradient would reach its
    ``.grad`` or the graph that made it, where plain PyTorch's backward would."""
    for i, t in enumerate(tree_flatten(tree)[0]):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            fix = "make the module that computes it layer 0 of the pipeline, or pass " \
                "it .detach()ed" if what == "inputs" else "compute it under " \
                "torch.no_grad() (a teacher's outputs, say) or pass it .detach()ed"
            raise InputError(f"{what} leaf {i} requires grad: rotapipe does not "
                             f"backpropagate into the {what}, so its gradient would be "
                             f"lost; {fix}")


def _units(value, microbatch: int) -> float:
    """A number ``loss_weight`` returned (a Python or NumPy number, or a one-element
    tensor)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and \
            not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputError(f"loss_weight returned {_shown(value)} for microbatch "
                         f"{microbatch}: return the number of items the loss averages "
                         "over (an int, a float or a one-element tensor)")
    if not math.isfinite(value):
        raise InputError(f"loss_weight returned {value} for microbatch {microbatch}: "
                         "return a finite number of items")
    return float(value)


def _shown(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{value!r}" if isinstance(value, (str, bool)) else f"a {type(value).__name__}"
