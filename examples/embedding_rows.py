"""Embedding tables moved by rows: the same training, fewer bytes over the link.

A small GPT-like model with a 4,096-row vocabulary is trained on batches that use only
200 distinct tokens, once moving its token embedding whole and once by rows
(``RoundPipe(lookups=...)``). The losses are equal; the table's bytes per call are not.

    python examples/embedding_rows.py
"""

import torch

import rotapipe
from rotapipe.model.tiny import lm_loss, stride_batch, tiny_gpt
from rotapipe.runtime.chunks import ChunkedCopies

VOCAB, USED = 4096, 200
x, y = stride_batch(8, 16, vocab=USED)      # token ids 0..199 of the 4,096

moved = {"bytes": 0}
runs = {}
gathered = ChunkedCopies._source


def counting(copies, p, lo, hi, rows):
    # Bytes of every weight chunk that goes through the bounce buffers (the table's
    # rows always do; with pin="off" every weight does).
    moved["bytes"] += hi - lo
    return gathered(copies, p, lo, hi, rows)


ChunkedCopies._source = counting
try:
    for by_rows in (False, True):
        torch.manual_seed(0)
        model = tiny_gpt(VOCAB, 64, 4, seq=16)
        moved["bytes"] = 0
        config = rotapipe.PipeConfig(workers=2, microbatches=4, backend="emulated",
                                     pin="off")
        with rotapipe.RoundPipe(model, lm_loss, config=config,
                                lookups={model[0].tok: lambda ids: ids} if by_rows else None
                                ) as pipe:
            pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-3))
            losses = [pipe.train_step(x, y) for _ in range(3)]
        print(f"{'by rows' if by_rows else 'whole  '}  losses "
              f"{' '.join(f'{l:.6f}' for l in losses)}  weight bytes uploaded "
              f"{moved['bytes'] / 2**20:.1f} MiB")
        runs[by_rows] = losses, moved["bytes"]
finally:
    ChunkedCopies._source = gathered
# Moving the table by rows changes the bytes, never the numbers.
assert runs[True][0] == runs[False][0], runs
assert runs[True][1] < runs[False][1], runs
