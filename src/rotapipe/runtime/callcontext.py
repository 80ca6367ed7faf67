"""The data one call's actions share: its :class:`CallContext` (built by the pipeline per
call) and its :class:`CallState` while its actions run (context, stores, routes,
compute copies). The action bodies that read them are ``kernels.py``'s."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import RecomputeGrain
from ..schedule.routes import Routes
from .callgrads import CallGrads
from .store import Store

__all__ = ["CallContext", "CallState"]


@dataclass
class CallContext:
    """Everything one call's actions share (built by the pipeline per call)."""

    call: int                  # call counter, part of the random stream
    seed: int
    microbatches: int
    weights: list[float]       # loss weight of each microbatch (its share of the batch)
    loss_scale: float
    training: bool
    grain: RecomputeGrain
    has_side: bool
    autocast: list             # [(device_type, dtype)] captured from the caller
    grads: CallGrads | None
    tail_context: object = None   # fn(tail inputs, labels) -> context for loss_fn
    tail_value: object = None     # its result, computed once per call by the tail
    handoff: Callable[[str], None] | None = None   # data parallel: after each O action
    rows_first: Callable[[str], None] | None = None   # an OR action (its O's key)
    mb_offset: int = 0         # data parallel: rank * microbatches, for random streams
    extra_weight: float = 1.0  # data parallel: this rank's share of the global units
    grad_gate: Callable[[str], None] | None = None   # data parallel: backpressure, before
    # a stage's backward (allreduce.InFlight.enter: waits while hand-offs queue up)


@dataclass
class CallState:
    """One call's data while its actions run: its context, host store, device stores,
    data routes, and the compute copies its weight uploads read."""

    ctx: CallContext
    host_store: Store
    stores: list[Store]
    routes: Routes
    compute: list[torch.Tensor]
