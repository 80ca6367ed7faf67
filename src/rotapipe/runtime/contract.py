"""What a model's layers and loss function must keep to, checked on the worker while
they run (the action bodies, ``kernels.py``, call these): a layer changes no parameter in
place, keeps the batch in dim 0 of its output, and the loss uses no trainable parameter
of the model directly. Each check raises :class:`~rotapipe.errors.InputError` naming the
layer, the parameter and the fix."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from ..errors import InputError
from ..model import LayerSet
from ..schedule import Action

__all__ = ["check_loss_graph", "check_rows", "check_unchanged"]


def check_unchanged(ls: LayerSet, a: Action, params: dict, versions: dict) -> None:
    """Refuse a layer that changed a parameter in place (its version counter moved):
    the change went to this worker's copy of the weights and would be lost."""
    changed = [pid for pid, v in versions.items() if params[pid]._version != v]
    if changed:
        names = [ls.param_names[pid] for pid in changed]
        layer = int(names[0].split(".", 1)[0])
        raise InputError(
            f"layer {layer} ({type(ls.layers[layer]).__name__}) changed "
            f"its parameter(s) {', '.join(names)} in place while running: workers run "
            "each layer on an uploaded copy of its weights, so the change would be "
            "lost. Change parameters only through the optimizer, or keep such state "
            "in a buffer (buffer updates made in forward are kept)")


def check_rows(ls: LayerSet, l: int, out, rows: int) -> None:
    """The batch contract, the same in training and evaluation: the first tensor a
    layer returns (its activation) keeps the microbatch's samples in dim 0 (the
    batch is split into microbatches along it and evaluation joins the outputs
    along it). Further tensors of the output may be shaped freely (per-token
    records of an adapter, e.g. ``[batch * seq]`` routing indices)."""
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    t = tensors[0] if tensors else None
    if t is not None and (t.dim() == 0 or t.shape[0] != rows):
        got = "a 0-dim tensor" if t.dim() == 0 else f"{t.shape[0]} rows in dim 0"
        where, fix = "", "Do batch-changing work in loss_fn, or reshape back before " \
            "returning"
        if len(tensors) > 1:
            # e.g. {"aux": mean, "hidden": h}: the activation is there, but not first.
            where = f" as the first of the {len(tensors)} tensors of its output"
            fix = "The first tensor is taken as the activation: return the activation " \
                "first (e.g. (hidden, aux), or the hidden states' key first in a dict), " \
                "or reshape it back before returning"
        raise InputError(
            f"layer {l} ({type(ls.layers[l]).__name__}) returned {got} (shape "
            f"{tuple(t.shape)}){where} for a microbatch of {rows} samples: every layer "
            "must keep the batch in dim 0 of its output (rotapipe splits the batch into "
            f"microbatches along it). {fix}")


def check_loss_graph(ls: LayerSet, masters: dict[int, int], contribution: torch.Tensor,
                     out) -> None:
    """Refuse a loss that uses a trainable parameter of the model itself (an L2
    term on a weight, a temperature kept in the model): workers compute with
    copies of the weights, so autograd would write that term's gradient into the
    master's ``.grad`` from this worker thread, outside the call's gradients (the
    merge then drops it). Runs before any backward: nothing is written.

    Walks the loss's own part of the graph, from its root down to the nodes that
    produced the layers' outputs (the layers compute with this worker's copies):
    a few nodes per microbatch, whatever the size of the tail."""
    layers = {t.grad_fn for t in tree_flatten(out)[0]
              if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    seen, todo, found = set(layers), [contribution.grad_fn], []
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)        # an AccumulateGrad node's leaf
        if var is not None:
            pid = masters.get(id(var))
            if pid is not None and ls.params[pid] is var:
                found.append(pid)
            continue
        todo.extend(f for f, _ in fn.next_functions)
    if found:
        found.sort()
        names = [ls.param_names[pid] for pid in found]
        layer = int(names[0].split(".", 1)[0])
        more = f" (and {len(names) - 1} more: {', '.join(names[1:])})" \
            if len(names) > 1 else ""
        raise InputError(
            f"the loss function uses the model's parameter {names[0]} (layer {layer}, "
            f"{type(ls.layers[layer]).__name__}){more} directly: workers compute "
            "with copies of the weights, so the gradient of that term would be lost. "
            "Compute the term inside the forward of the layer holding the parameter "
            "(a layer may return (output, term) and pass the term on; loss_fn adds "
            "the term the last layer returns), or, for an L2 penalty, use the "
            "optimizer's weight_decay (in a parameter group of its own)")


def zero_contribution(out, loss: torch.Tensor) -> torch.Tensor:
    """An fp32 zero joined to the graph of the stage's output, whose backward gives the
    layers exact zero gradients without running the loss's own backward (NaN on a
    mean over nothing); ``loss * 0`` when the output holds nothing to join."""
    parts = [t.sum() * 0.0 for t in tree_flatten(out)[0]
             if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    return torch.stack(parts).sum().float() if parts else loss * 0.0
