"""Pytree helpers: splitting a batch into microbatches and joining outputs back."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..errors import InputError


def batch_size(tree, what: str) -> int:
    """The common dim-0 size of every tensor leaf of ``tree``."""
    leaves, _ = tree_flatten(tree)
    sizes = {}
    for i, t in enumerate(leaves):
        if isinstance(t, torch.Tensor):
            if t.device.type != "cpu":
                raise InputError(f"{what} leaf {i} is on {t.device}: pass CPU tensors; "
                                 "rotapipe moves each microbatch to its worker itself")
            if t.layout is not torch.strided:
                raise InputError(f"{what} leaf {i} is a {t.layout} tensor: pass dense "
                                 "tensors (.to_dense()); a batch is split into "
                                 "microbatches along dim 0")
            if t.dim() == 0:
                raise InputError(f"{what} leaf {i} is a 0-dim tensor: every tensor needs "
                                 "a batch dimension 0")
            sizes[i] = t.shape[0]
    if not sizes:
        arrays = [f"{type(t).__module__.split('.')[0]}.{type(t).__name__}" for t in leaves
                  if hasattr(t, "__array__")]
        hint = f" (it holds a {arrays[0]}: convert it with torch.as_tensor)" if arrays \
            else ""
        raise InputError(f"{what} holds no tensor{hint}: pass a tensor or a "
                         "tuple/list/dict of tensors with the batch in dimension 0")
    if len(set(sizes.values())) > 1:
        detail = ", ".join(f"leaf {i}: {n}" for i, n in sizes.items())
        raise InputError(f"{what} tensors disagree on the batch size ({detail}): give "
                         "every tensor the same dimension 0")
    n = next(iter(sizes.values()))
    if n == 0:
        raise InputError(f"{what} hold an empty batch (dimension 0 has size 0): pass at "
                         "least one sample")
    return n


def split(tree, parts: int) -> list:
    """Split every tensor leaf along dim 0 into ``parts`` near-equal microbatches."""
    leaves, spec = tree_flatten(tree)
    chunks = [torch.tensor_split(t, parts) if isinstance(t, torch.Tensor) else [t] * parts
              for t in leaves]
    return [tree_unflatten([c[m] for c in chunks], spec) for m in range(parts)]


def concat(trees: list, sizes: list[int] | None = None):
    """Join per-microbatch outputs along dim 0 (inverse of :func:`split`; ``sizes``: the
    microbatches' batch sizes). A leaf is joined when its dim 0 is the same whole
    multiple of every microbatch's size (rows per sample: 1, or tokens flattened into
    rows). One that is not (0-dim in some microbatch, e.g. a mean; a per-feature
    statistic over microbatches of different sizes; the sequence of a sequence-first
    output) or whose other dimensions differ between microbatches comes back as the
    list of its per-microbatch values: joining it would make a tensor of no meaning.
    With microbatches of one size a statistic whose length is a multiple of it cannot
    be told from rows and is joined."""
    flat = [tree_flatten(t) for t in trees]
    spec = flat[0][1]
    cols = zip(*(leaves for leaves, _ in flat))

    def join(c):
        if not isinstance(c[0], torch.Tensor):
            return c[0]
        if all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in c) and \
                len({tuple(t.shape[1:]) for t in c}) == 1 and \
                (sizes is None or _per_sample(c, sizes)):
            return torch.cat(c)
        return list(c)
    return tree_unflatten([join(c) for c in cols], spec)


def _per_sample(leaves, sizes: list[int]) -> bool:
    """Every leaf's dim 0 is one whole multiple (the same for all) of its microbatch's
    size."""
    ratios = {t.shape[0] / n if n else None for t, n in zip(leaves, sizes)}
    if len(ratios) != 1:
        return False
    (k,) = ratios
    return k is not None and k >= 1 and k == int(k)


def cast_floating(tree, dtype: torch.dtype):
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor)
                    and t.is_floating_point() and t.dtype != dtype else t, tree)


def map_tensors(fn, tree):
    return tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, tree)
