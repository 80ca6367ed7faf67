"""Embedding tables moved by rows (``RoundPipe(lookups=...)``, docs/performance.md).

A stage that uses a table only through declared lookups uploads the call's distinct
rows and downloads only their gradients. The results must be plain PyTorch's, element
by element, in every optimizer mode, with tied and untied heads, and the bytes moved
must really be the rows.
"""

from __future__ import annotations

import copy

import pytest
import torch

import rotapipe
from rotapipe.errors import ConfigError, InputError, NonFiniteError
from rotapipe.runtime.chunks import ChunkedCopies
from rotapipe.runtime.callgrads import CallGrads, RowGrad

from models import VOCAB, emulated, lm_loss, tiny_transformer, token_batch
from test_exactness import OPTIMIZERS
from test_pipelined_calls import CLIP, assert_weights, reference

STEPS = 3
USED = 17          # the batches use token ids 0..16 of the 61


def batches(size: int = 8):
    out = []
    for s in range(STEPS):
        x, y = token_batch(size, 6, seed=s)
        out.append((x % USED, y % USED))
    return out


class Spy:
    """Bytes each table moved per upload, and the gradients the host received."""

    def __init__(self, monkeypatch):
        self.uploaded: dict[int, int] = {}
        self.row_grads = 0
        source, add = ChunkedCopies._source, CallGrads.add
        spy = self

        def _source(copies, p, lo, hi, rows):
            if p in rows:
                spy.uploaded[p] = spy.uploaded.get(p, 0) + hi - lo
            return source(copies, p, lo, hi, rows)

        def _add(grads, pid, g):
            spy.row_grads += isinstance(g, RowGrad)
            return add(grads, pid, g)
        monkeypatch.setattr(ChunkedCopies, "_source", _source)
        monkeypatch.setattr(CallGrads, "add", _add)


@pytest.mark.parametrize("mode", ["sync", "overlap", "stale"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("workers,microbatches", [(1, 1), (2, 4), (3, 3)],
                         ids=["w1-m1", "w2-m4", "w3-m3"])
def test_tables_move_by_rows_and_train_as_plain_pytorch(monkeypatch, mode, tied, workers,
                                                        microbatches):
    spy = Spy(monkeypatch)
    model = tiny_transformer(tied=tied, dropout=0.1)
    data = batches(max(8, microbatches))
    # AdamW with weight decay changes the rows no batch looks up too.
    want_losses, want = reference("stale" if mode == "stale" else "sync", model, data,
                                  microbatches, CLIP["off"])
    run = copy.deepcopy(model)
    config = emulated(workers, microbatches, optimizer_mode=mode)
    with rotapipe.RoundPipe(run, lm_loss, config=config, optimizer=OPTIMIZERS["adamw"],
                            lookups={run[0].emb: lambda x: x}) as pipe:
        losses = [pipe.train_step(x, y) for x, y in data]
        got = {k: v.clone() for k, v in pipe.state_dict().items()}
        table = pipe.layerset._pid_of[id(run[0].emb.weight)]
        row_bytes = run[0].emb.weight[0].numel() * 4
        uploads = sum(1 for s in pipe.plan.jobs() if 0 in s.layers)
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_weights(got, want, f"{mode} tied={tied}")
    # Every upload of the embedding's stage moved at most the USED rows, never the table.
    assert 0 < spy.uploaded[table] <= STEPS * uploads * USED * row_bytes
    assert spy.row_grads == STEPS          # one row gradient per call (its B0)


def test_a_tied_head_in_the_same_stage_moves_the_table_whole(monkeypatch):
    spy = Spy(monkeypatch)
    model = tiny_transformer(tied=True, widths=(24,))
    data = batches()
    want_losses, want = reference("sync", model, data, 2, None)
    run = copy.deepcopy(model)
    plan = rotapipe.plan.Plan.from_text("T[0:3] ")       # one stage: embedding + head
    with rotapipe.RoundPipe(run, lm_loss, config=emulated(1, 2), plan=plan,
                            optimizer=OPTIMIZERS["adamw"],
                            lookups={run[0].emb: lambda x: x}) as pipe:
        losses = [pipe.train_step(x, y) for x, y in data]
        got = {k: v.clone() for k, v in pipe.state_dict().items()}
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_weights(got, want)
    assert spy.uploaded == {} and spy.row_grads == 0


def test_bf16_compute_equals_the_full_table_path():
    """The rows' gradients merge into the same fp32 gradient bits as the full table's."""
    data = batches()
    results = []
    for lookups in (False, True):
        run = tiny_transformer()
        config = emulated(2, 4, precision=rotapipe.PrecisionConfig(
            compute_dtype=torch.bfloat16))
        with rotapipe.RoundPipe(run, lm_loss, config=config, optimizer=OPTIMIZERS["adamw"],
                                lookups={run[0].emb: lambda x: x} if lookups else None) as p:
            losses = [p.train_step(x, y) for x, y in data]
            results.append((losses, {k: v.clone() for k, v in p.state_dict().items()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    assert_weights(results[1][1], results[0][1])


def test_an_index_outside_the_table_is_refused_in_the_callers_thread():
    run = tiny_transformer()
    with rotapipe.RoundPipe(run, lm_loss, config=emulated(2, 2),
                            lookups={run[0].emb: lambda x: x}) as pipe:
        x, y = token_batch()
        x[1, 2] = VOCAB + 5
        with pytest.raises(InputError, match=f"index {VOCAB + 5} is outside the embedding "
                                             f"table's {VOCAB} rows"):
            pipe.forward_backward(x, y)
        with pytest.raises(InputError, match="integer indices"):
            pipe.lookups.call_rows([x.float()])


def test_a_lookup_that_names_the_wrong_rows_fails_loudly():
    """Rows the declared function did not name are NaN on the worker: a wrong
    ``lookups`` function gives a non-finite loss, never silently stale weights."""
    run = tiny_transformer()
    with rotapipe.RoundPipe(run, lm_loss, config=emulated(2, 2),
                            lookups={run[0].emb: lambda x: x[:, :1]}) as pipe:
        x, y = token_batch()
        with pytest.raises(NonFiniteError):
            pipe.forward_backward(x, y)


def test_bad_lookup_declarations_are_refused():
    run = tiny_transformer()
    for lookups, words in [({run[1]: lambda x: x}, "not an nn.Embedding"),
                           ({run[0].emb: 3}, r"fn\(inputs\)"),
                           ({torch.nn.Embedding(4, 4): lambda x: x}, "not a module of"),
                           ({torch.nn.Embedding(4, 4, max_norm=1.0): lambda x: x},
                            "max_norm")]:
        with pytest.raises(ConfigError, match=words):
            rotapipe.RoundPipe(run, lm_loss, config=emulated(1, 1), lookups=lookups)
