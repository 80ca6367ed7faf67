"""Tensors at a stage's edges, for the kernels (:mod:`rotapipe.runtime.kernels`): the
input a stage's layers get under autograd (a non-leaf they may change in place, its
gradient read from a leaf), copies of what a later layer may change, the loss as a
checked scalar, and the bytes autograd saves (the activation working set)."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..errors import InputError
from .backend import Device
from .trees import map_tensors

__all__ = ["SavedBytes", "WorkingSet", "loss_scalar", "batch_rows", "detach_tree",
           "StageInput", "stage_leaves", "copy_tree", "input_grads", "backward_tree"]


class SavedBytes:
    """Counts the bytes autograd saves for backward (the activation working set),
    each storage once, weights excluded (they are accounted as weights)."""

    def __init__(self, params: dict):
        self._skip = {p.untyped_storage().data_ptr() for p in params.values()}
        self._seen: set[int] = set()
        self.bytes = 0

    def _pack(self, t):
        for part in _strided_parts(t):
            st = part.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in self._skip and ptr not in self._seen:
                self._seen.add(ptr)
                self.bytes += st.nbytes()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def _strided_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The dense tensors holding ``t``'s bytes: itself, or a sparse tensor's indices
    and values (a sparse tensor has no storage of its own: PEFT's SHiRA saves one)."""
    if t.layout is torch.strided:
        return (t,)
    if t.layout is torch.sparse_coo:
        return (t._indices(), t._values())
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices(), t.values())
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return (t.ccol_indices(), t.row_indices(), t.values())
    return ()       # another layout (mkldnn, ...): not counted


class WorkingSet(SavedBytes):
    """Like :class:`SavedBytes` for work whose graph dies inside the action: the bytes
    are charged to the device (a budget check, and the peak) and released at exit."""

    def __init__(self, device: Device, params: dict, what: str):
        super().__init__(params)
        self._device, self._what = device, what

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if exc[0] is None and self.bytes:
            self._device.allocate(self.bytes, self._what)
            self._device.free(self.bytes)


def loss_scalar(loss) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InputError(f"the loss function returned {shape}, not a scalar tensor: reduce "
                         "it (e.g. .mean()) inside loss_fn")
    if loss.is_complex():
        raise InputError(f"the loss function returned a {loss.dtype} tensor: a loss to "
                         "minimise is real (backward() refuses a complex one); return its "
                         "real part or abs() from loss_fn")
    return loss.reshape(())


def batch_rows(tree) -> int:
    """The batch size of a layer input: dim 0 of its first tensor leaf (-1: none)."""
    for t in tree_flatten(tree)[0]:
        if isinstance(t, torch.Tensor):
            return t.shape[0] if t.dim() > 0 else -1
    return -1


def detach_tree(tree):
    return map_tensors(lambda t: t.detach(), tree)


class StageInput(torch.autograd.Function):
    """The input a stage's (at layer grain, a layer's) layers get under autograd:
    ``x`` itself (no copy), not a leaf, whose gradient goes to ``anchor`` unchanged."""

    @staticmethod
    def forward(ctx, anchor, x):
        return x.detach()          # the same storage; not a view: in-place is allowed

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def stage_leaves(tree):
    """``(leaves, inputs)`` for a stage's (at layer grain, a layer's) input ``tree``.

    ``leaves``: for each floating tensor ``x``, a leaf that requires grad, whose
    ``.grad`` is the gradient w.r.t. ``x`` (:func:`input_grads`): one element
    broadcast to ``x``'s shape. ``inputs``, what the layers get: ``x`` itself through
    :class:`StageInput`, not a leaf, so that a layer may change its input in place as
    in plain PyTorch (``nn.ReLU(inplace=True)``, ``x.add_()``: autograd refuses that on
    a leaf that requires grad). No copy and no arithmetic: the values are ``x``'s, and
    ``x`` must be this action's alone (what else reads a stage input gets a copy:
    :meth:`~rotapipe.runtime.kernels.ActionRunner._take_input`, :meth:`~rotapipe.runtime.kernels.ActionRunner._hand_on`, ``keep`` in
    :meth:`~rotapipe.runtime.kernels.ActionRunner._layers`)."""
    xs, spec = tree_flatten(tree)
    leaves, inputs = [], []
    for x in xs:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            leaf = x.new_zeros(()).expand(x.shape).requires_grad_()
            leaves.append(leaf)
            inputs.append(StageInput.apply(leaf, x))
        else:
            leaves.append(x)
            inputs.append(x)
    return tree_unflatten(leaves, spec), tree_unflatten(inputs, spec)


def copy_tree(tree):
    """A copy of every tensor of ``tree`` that a layer is about to receive while
    something else holds it too: a layer may change its input in place."""
    return map_tensors(lambda t: t.detach().clone(), tree)


def input_grads(tree):
    return tree_map(lambda t: t.grad if isinstance(t, torch.Tensor) and t.requires_grad
                    else None, tree)


def backward_tree(out, grad) -> None:
    """Backpropagate ``grad`` (same tree as ``out``, ``None`` where no gradient)."""
    outs, _ = tree_flatten(out)
    grads, _ = tree_flatten(grad)
    pairs = [(o, g) for o, g in zip(outs, grads)
             if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
