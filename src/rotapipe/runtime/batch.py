"""A training batch as a call takes it: split along dim 0 into microbatches, floating
inputs cast to the compute dtype, and each microbatch's loss units (:func:`split_batch`),
with the errors that name the fix for a batch that cannot be split."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..errors import InputError
from . import trees

__all__ = ["split_batch"]


def split_batch(inputs, labels, microbatches: int, dtype: torch.dtype,
                loss_weight: Callable[[object], float] | None):
    """``(input microbatches, label microbatches, loss units)`` of a training batch:
    split along dim 0, floating inputs cast to the compute dtype; a microbatch's units
    are ``loss_weight(labels)`` (default: its sample count). Raises :class:`InputError`
    naming the fix for mismatched or too small batches."""
    n = trees.batch_size(inputs, "inputs")
    n_labels = trees.batch_size(labels, "labels")
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


def _units(value, microbatch: int) -> float:
    """A number ``loss_weight`` returned (a Python number or a one-element tensor)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and \
            not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
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
