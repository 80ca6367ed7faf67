"""Activation bytes of one microbatch, layer by layer, measured without computing: the
layers run on fake tensors (shapes and dtypes, no storage and no arithmetic), so the
runtime's plan can leave room for activations once a call's microbatches are known.

What is measured is what the runtime's device memory holds for a microbatch
(``rotapipe.runtime.kernels``): the model input, each layer's output, the bytes
autograd saves for each layer's backward (weights excluded: they are counted as
weights; for the last layer also what the loss saves), and per call what a worker
keeps beside its stages: the side inputs of every microbatch (uploaded once per
microbatch per worker and kept for the call) and the labels of the tail's inputs in
flight, and the outputs of its previous stage still downloading. The planner's memory
bound (:mod:`rotapipe.plan.partitioner`) reads them through :func:`with_activations`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch.utils._pytree import tree_leaves, tree_map

from ..model.layers import LayerSet, call_layer
from ..plan import ModelCosts
from ..plan.partition import INPUT_DEPTH

__all__ = ["Activations", "measure_activations", "with_activations"]


@dataclass(frozen=True)
class Activations:
    """Device bytes of one microbatch (see the module docstring)."""

    input_bytes: int
    output_bytes: tuple[int, ...]
    saved_bytes: tuple[int, ...]
    reserve: int
    """Bytes a worker holds beside the working set of the stage it runs: the side
    inputs of every microbatch (kept for the call), the labels of ``INPUT_DEPTH``
    tail inputs, and ``INPUT_DEPTH`` outputs of its previous stage whose download may
    still be under way (seen on a LoRA Qwen3 when the emulated workers' threads were
    slow: two 8 KiB activations over the bound)."""
    side_bytes: int = 0
    """The side inputs of one microbatch."""

    def merge(self, other: Activations) -> Activations:
        """The larger of two measurements, entry by entry (a plan for both shapes)."""
        return Activations(max(self.input_bytes, other.input_bytes),
                           tuple(map(max, self.output_bytes, other.output_bytes)),
                           tuple(map(max, self.saved_bytes, other.saved_bytes)),
                           max(self.reserve, other.reserve),
                           max(self.side_bytes, other.side_bytes))


def _bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree)
               if isinstance(t, torch.Tensor))


class _Saved:
    """Bytes autograd saves, each storage once, the weights' excluded (as the runtime's
    meter counts them)."""

    def __init__(self, weights):
        self._seen = {t.untyped_storage()._cdata for t in weights}
        self.bytes = 0

    def _pack(self, t):
        if t.layout is torch.strided:
            st = t.untyped_storage()
            if st._cdata not in self._seen:
                self._seen.add(st._cdata)
                self.bytes += st.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


def measure_activations(layerset: LayerSet, inputs, labels, dtype: torch.dtype,
                        microbatches: int, side: Callable | None = None,
                        loss_fn: Callable | None = None, training: bool = True) -> Activations:
    """Run one microbatch (``inputs``, ``labels``: the largest of the call's, floating
    inputs already in the compute dtype) through every layer on fake tensors, weights
    in ``dtype``, each layer under autograd as a backward or the fused tail runs it;
    ``side(inputs)`` gives its side inputs, ``loss_fn(output, labels)`` the loss (both
    optional). An evaluation (``training=False``) runs without autograd, as the
    runtime's evaluation calls do: nothing is saved for a backward. Raises whatever a layer raises on fake tensors (an operation whose
    output shape depends on the data, for example): the caller decides what then."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    shells = layerset.make_shells()
    layerset.set_training(shells)
    side_value = side(inputs) if side is not None else None
    # An operation fake tensors cannot run is logged by torch as an error with its
    # traceback: the caller reports it in one line.
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    with _disabled(quiet), FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = lambda tree: tree_map(      # noqa: E731
            lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, tree)
        # Each tensor in the dtype the workers hold it in (kept fp32 ones in fp32).
        params = {i: torch.empty(p.shape, dtype=layerset.compute_dtype(i, dtype)
                                 if p.is_floating_point() else p.dtype)
                  .requires_grad_(p.requires_grad) for i, p in enumerate(layerset.params)}
        buffers = {}
        for i in range(len(layerset.buffers)):
            b = layerset.buffer_value(i)
            buffers[i] = fake(b.to(layerset.buffer_dtype(i, dtype)) if b.is_floating_point()
                              else b)
        x, y, side_fake = fake(inputs), fake(labels), fake(side_value)
        outputs, saved = [], []
        for i, shell in enumerate(shells):
            counter = _Saved([params[p] for p in layerset.layer_params[i]])
            x = tree_map(lambda t: t.detach().requires_grad_() if isinstance(t, torch.Tensor)
                         and t.is_floating_point() else t, x)
            shell.bind(params, buffers)
            try:
                with torch.set_grad_enabled(training), counter.hooks():
                    x = call_layer(shell.module, x, side_fake)
                    if loss_fn is not None and labels is not None and i == len(shells) - 1:
                        loss_fn(x, y)
            finally:
                shell.unbind()
            outputs.append(_bytes(x))
            saved.append(counter.bytes)
    side_bytes = _bytes(side_value)
    reserve = microbatches * side_bytes + INPUT_DEPTH * (_bytes(labels) + max(outputs))
    return Activations(_bytes(inputs), tuple(outputs), tuple(saved), reserve, side_bytes)


@contextmanager
def _disabled(logger: logging.Logger):
    was, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = was


def with_activations(costs: ModelCosts, acts: Activations) -> ModelCosts:
    """``costs`` with the measured bytes of one microbatch (times unchanged)."""
    layers = tuple(replace(l, output_bytes=o, saved_bytes=s)
                   for l, o, s in zip(costs.layers, acts.output_bytes, acts.saved_bytes))
    return replace(costs, layers=layers, input_bytes=acts.input_bytes)
