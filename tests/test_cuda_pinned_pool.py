"""The pinned pool a CUDA worker downloads into (``CudaDevice``'s ``BlockPool``; the
emulated workers' host and device pools are the same class): shapes that change from
call to call must not grow it for good. Page-locked memory never given back starves
the host (TRAPS.md: pinned allocations are pooled, not freed)."""

from __future__ import annotations

import torch

import rotapipe
from rotapipe.runtime.pool import BlockPool
from models import VOCAB, lm_loss, tiny_transformer
from test_cuda_backend_logic import fake_cuda  # noqa: F401 - fixture

BIG = (256, 256)   # 256 KiB of fp32: pooled


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_shapes_that_change_every_call_do_not_grow_the_pool_for_good():
    """A new padded sequence length per batch: each call asks for blocks of new sizes.
    The pool drops idle blocks of the sizes asked for longest ago, holding at most twice
    the most it had in use at once (before: every size ever seen, 50 calls' worth
    here), and never a block in use."""
    pool = BlockPool()
    for seq in range(64, 64 + 50):
        held = [pool.empty((seq, 1024), torch.float32) for _ in range(3)]   # one call
        assert len({_ptr(t) for t in held}) == 3     # blocks in use are never shared
        for t in held:
            t.fill_(seq)
        assert all(bool((t == seq).all()) for t in held)
        del held, t
    assert pool.nbytes <= 2 * 3 * (64 + 49) * 1024 * 4
    # A size asked for every call (a weight gradient) keeps its block meanwhile.
    grad = pool.empty(BIG, torch.float32)
    p = _ptr(grad)
    del grad
    for seq in range(200, 220):
        held = [pool.empty((seq, 1024), torch.float32) for _ in range(3)]
        g = pool.empty(BIG, torch.float32)
        assert _ptr(g) == p
        del held, g


def test_a_cuda_workers_download_pool_stays_bounded_over_changing_lengths(
        fake_cuda):  # noqa: F811 - the imported fixture
    """Thirty calls, each with another sequence length between 64 and 122 tokens: the
    pinned download pools hold a bounded multiple of one call's: 3.8x the first call's
    (before: 44x after 30 calls, growing with every new length)."""
    devices = [fake_cuda(0), fake_cuda(1)]
    model = tiny_transformer(dim=64, widths=(64, 64))
    config = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated")
    try:
        with rotapipe.RoundPipe(model, lm_loss, config=config, devices=devices) as pipe:
            for k in range(30):
                x = torch.randint(0, VOCAB, (8, 64 + 2 * k),
                                  generator=torch.Generator().manual_seed(k))
                pipe.forward_backward(x, torch.roll(x, -1, 1))
                pipe.zero_grad()
                if k == 0:
                    first = sum(d._pinned.nbytes for d in devices)
        last = sum(d._pinned.nbytes for d in devices)
    finally:
        for d in devices:
            d.stop()
            d.close()
    assert 0 < first and last <= 4 * first, (first, last)
