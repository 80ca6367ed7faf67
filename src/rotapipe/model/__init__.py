"""The model as an ordered list of layers, with its parameters and buffers indexed."""

from .layers import LayerSet, call_layer

__all__ = ["LayerSet", "call_layer"]
