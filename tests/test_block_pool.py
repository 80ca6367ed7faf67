"""The emulated backend's block pool: copies reuse memory, never memory still in use."""

from __future__ import annotations

import torch

from rotapipe.runtime.pool import BlockPool

BIG = (256, 256)   # 256 KiB of fp32: pooled


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_block_is_reused_only_once_nothing_uses_it():
    pool = BlockPool()
    a = pool.empty(BIG, torch.float32)
    held = a[3:5]                                   # a view keeps the block busy
    p = _ptr(a)
    del a
    b = pool.empty(BIG, torch.float32)
    assert _ptr(b) != p
    del held
    c = pool.empty(BIG, torch.float32)              # a's block is free again
    assert _ptr(c) == p and c.shape == BIG and c.is_contiguous()


def test_autograd_saved_tensors_keep_a_block_busy():
    pool = BlockPool()
    w = torch.nn.Parameter(pool.empty(BIG, torch.float32).normal_())
    p = _ptr(w)
    loss = (w * w).sum()                            # MulBackward saves w
    del w
    assert _ptr(pool.empty(BIG, torch.float32)) != p
    loss.backward()                                 # frees the graph
    del loss
    assert _ptr(pool.empty(BIG, torch.float32)) == p


def test_blocks_are_matched_by_bytes_and_small_tensors_bypass_the_pool():
    pool = BlockPool()
    a = pool.empty(BIG, torch.float32)
    p = _ptr(a)
    del a
    b = pool.empty((256 * 256 * 2,), torch.bfloat16)   # same bytes, other dtype/shape
    assert _ptr(b) == p and b.dtype == torch.bfloat16
    small = pool.empty((4, 4), torch.float32)
    assert small.shape == (4, 4) and not pool._blocks.get(64)
