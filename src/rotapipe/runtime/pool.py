"""Pools of reusable host storages for device copies.

Fresh host memory is page-faulted in on first touch (and pinned memory is slow to
allocate: TRAPS.md), costing more than the copy itself; the CUDA caching allocator
solves this on the device, these pools on the host (and, for emulated devices, on the
"device" too).
"""

from __future__ import annotations

import math
import threading

import torch

# References to a storage (tensors, views, autograd's saved tensors); None: no pooling.
_use_count = getattr(torch._C, "_storage_Use_Count", None)


class BlockPool:
    """Reusable host storages for copies, keyed by byte size (pinned with ``pin``, or
    allocated by ``pinning``, a :class:`~rotapipe.runtime.pinning.HostPinning`, whose
    page-locked buffers are accounted, also on emulated workers).

    A block is handed out again only when no tensor uses its storage any more (its use
    count is the pool's own reference), so reuse can never alias live data, whoever
    holds it (a stage's weights, an autograd graph, ``param.grad``). Small tensors come
    from the ordinary allocator: malloc reuses them without page faults.

    Blocks match by exact size, so shapes that change from call to call (a new padded
    sequence length per batch) would keep adding blocks for good: before a new block is
    allocated, idle blocks of the sizes requested longest ago are dropped until the pool
    holds at most ``SLACK`` times the most bytes it ever had in use at once.
    """

    MIN_BYTES = 1 << 16
    SLACK = 2

    def __init__(self, pin: bool = False, pinning=None):
        self.pin = pin
        self.pinning = pinning
        self._blocks: dict[int, list[torch.UntypedStorage]] = {}
        self._asked: dict[int, int] = {}    # bytes -> when last requested (a counter)
        self._clock = 0
        self._peak = 0                      # the most bytes in use at once
        self._lock = threading.Lock()

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` with undefined contents."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < self.MIN_BYTES or _use_count is None:
            return self._alloc(shape, dtype)
        with self._lock:
            self._clock += 1
            self._asked[nbytes] = self._clock
            blocks = self._blocks.setdefault(nbytes, [])
            for i, block in enumerate(blocks):
                if _use_count(block._cdata) == 1:
                    blocks.append(blocks.pop(i))   # least recently taken first next time
                    break
            else:
                self._trim(nbytes)
                block = self._alloc((nbytes,), torch.uint8).untyped_storage()
                self._blocks.setdefault(nbytes, []).append(block)
            # Claimed under the lock: the tensor's reference makes the block busy.
            return torch.empty(0, dtype=dtype).set_(block, 0, shape)

    def _trim(self, nbytes: int) -> None:
        """Before allocating a block of ``nbytes`` (every block of that size is busy):
        drop idle blocks, of the sizes requested longest ago first, while the pool
        would hold more than ``SLACK`` times its peak bytes in use. Under the lock."""
        idle, held = [], 0
        for size, blocks in self._blocks.items():
            for block in blocks:
                held += size
                if _use_count(block._cdata) == 1:
                    idle.append((self._asked.get(size, 0), size, block))
        busy = held - sum(size for _, size, _ in idle) + nbytes
        self._peak = max(self._peak, busy)
        held += nbytes
        for _, size, block in sorted(idle, key=lambda i: i[0]):
            if held <= self.SLACK * self._peak:
                break
            self._blocks[size] = [b for b in self._blocks[size] if b is not block]
            if not self._blocks[size]:
                del self._blocks[size]
                self._asked.pop(size, None)
            held -= size

    @property
    def nbytes(self) -> int:
        """Bytes of the pooled blocks (in use or idle); small tensors are not pooled."""
        with self._lock:
            return sum(b.nbytes() for blocks in self._blocks.values() for b in blocks)

    def _alloc(self, shape, dtype: torch.dtype) -> torch.Tensor:
        if self.pinning is not None:
            return self.pinning.empty(shape, dtype)
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin)
