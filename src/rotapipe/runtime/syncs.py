"""Host syncs: the operations that make the host wait for a CUDA device, counted on any
backend (the emulated CPU workers included).

On CUDA a kernel launch returns at once; an operation whose *result on the host*
depends on device data (a Python scalar, a data-dependent output shape) blocks the
host thread until the device has caught up, which stalls the worker's queue of
launches. :class:`HostSyncCounter` is a ``TorchDispatchMode`` that counts those
operations as they are dispatched, so a CPU test can state how many a layer's forward
or recompute would cost on a GPU. Modes are thread-local: enter the counter in the
thread that runs the work (a worker thread, for the emulated backend).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncCounter", "SYNC_OPS"]

_aten = torch.ops.aten

SYNC_OPS = frozenset({
    _aten._local_scalar_dense.default,     # .item(), bool(t), int(t), `if t:`
    _aten.nonzero.default,                  # output shape from the data
    _aten.nonzero_numpy.default,            # torch.where(cond) with one argument
    _aten.masked_select.default,
    _aten.unique_consecutive.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.repeat_interleave.Tensor,         # repeats as a tensor, no output_size
    _aten.equal.default,                    # a Python bool
    _aten.is_nonzero.default,
})
"""Operations that return data-dependent host values or shapes."""


def _bool_index(func, args) -> bool:
    # x[mask]: a boolean index becomes a nonzero() inside the kernel.
    if func not in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (args[1] if len(args) > 1 else ()) if i is not None)


class HostSyncCounter(TorchDispatchMode):
    """Count host syncs by operation: ``with HostSyncCounter() as c: ...; c.total``."""

    def __init__(self):
        super().__init__()
        self.by_op: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNC_OPS or _bool_index(func, args):
            self.by_op[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))
