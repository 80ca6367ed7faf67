"""The model as an ordered list of layers, with its parameters and buffers indexed."""

from .layers import LayerSet, Lookups, call_layer
from .work import estimate_work, layer_work, set_work

__all__ = ["LayerSet", "Lookups", "call_layer", "estimate_work", "layer_work", "set_work"]
