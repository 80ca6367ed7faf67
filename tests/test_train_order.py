"""The order of the training records (``rotapipe.train.order``): each record once per
epoch, shuffled by ``(seed, epoch)`` (a single sorted file too), reproducible, and a
cursor that resumes mid-epoch exactly; checkpoints of the earlier per-row order are
refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from rotapipe.errors import ConfigError
from rotapipe.train.data import TextFields, TrainBatches, is_heldout, train_tokenizer
from train_util import text_jsonl

FIELDS = TextFields()


class _Ids:
    """Stands in for :class:`~rotapipe.train.tokens.Tokens`: a record's document is its
    ``id`` (a text chunk: its first word), so the order is visible."""

    def documents(self, rec, fields, where):
        key = rec["id"] if isinstance(rec, dict) else rec.split()[0]
        return [([key], [key])]


def _sorted_jsonl(path, n, start=0):
    with open(path, "w") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"id": i}) + "\n")
            if i % 50 == 7:
                f.write("\n")                            # blank lines are not records
    return path


def _draw(order, n):
    return [order.next_documents()[0][0][0] for _ in range(n)]


def _epochs(order, n):
    """The records of the first ``n`` epochs, one list each."""
    out = [[]]
    while True:
        key = order.next_documents()[0][0][0]
        if order.epoch == n:
            return out
        if order.epoch == len(out):
            out.append([])
        out[-1].append(key)


def test_one_sorted_file_is_shuffled_by_seed_and_epoch_each_record_once(tmp_path):
    """One sorted JSONL: seeds 0 and 1 gave the same batches and every epoch read the
    file front to back (sorted training); each batch row read a hash-chosen share, so
    an epoch repeated some records and missed others (about +-1/sqrt(records/batch)).
    Now an epoch is every training record once, in an order of (seed, epoch)."""
    p = _sorted_jsonl(tmp_path / "sorted.jsonl", 1000)
    lines = p.read_text().split("\n")
    held = {json.loads(x)["id"] for k, x in enumerate(lines) if x and is_heldout(p, k, 0.1)}
    train = sorted(set(range(1000)) - held)

    from rotapipe.train.order import RecordOrder

    def order(seed):
        return RecordOrder([p], _Ids(), fields=FIELDS, seed=seed,
                           keep=lambda path, i: not is_heldout(path, i, 0.1))
    e0, e1 = _epochs(order(0), 2)
    assert sorted(e0) == train and sorted(e1) == train           # each once per epoch
    assert e0 != e1 and e0 != train
    ascending = sum(x < y for x, y in zip(e0, e0[1:])) / len(e0)
    assert 0.35 < ascending < 0.65                   # not the file's order
    assert _epochs(order(0), 1)[0] == e0                 # reproducible
    assert _epochs(order(1), 1)[0] != e0                 # the seed sets the order
    # consecutive records come from many places of the file: the first 16 (a round of
    # the window) from 16 spans of 64 lines, not about 10 (slots drawn with replacement)
    line = {json.loads(x)["id"]: k for k, x in enumerate(lines) if x}
    every = RecordOrder([p], _Ids(), fields=FIELDS, seed=0, keep=lambda path, i: True)
    assert len({line[i] // 64 for i in _draw(every, 16)}) == 16


def test_sources_of_every_kind_mid_epoch_resume(tmp_path):
    """JSONL, a JSON list, Parquet, a text file (its chunks in order): one epoch is
    every record once; a cursor saved mid-epoch resumes the same sequence."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    a = _sorted_jsonl(tmp_path / "a.jsonl", 300)
    b = tmp_path / "b.json"
    b.write_text(json.dumps([{"id": 1000 + i} for i in range(150)]))
    c = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": list(range(2000, 2400))}), c, row_group_size=100)
    d = tmp_path / "d.txt"
    # 10 lines of 32,000 characters: 5 chunks of 2 lines (records.CHUNK_CHARS)
    d.write_text("".join(f"{3000 + i} {'x' * 31990}\n" for i in range(10)))
    files = [a, b, c, d]

    from rotapipe.train.order import RecordOrder

    def order():
        return RecordOrder(files, _Ids(), fields=FIELDS, seed=3, keep=lambda p, i: True)
    (epoch,) = _epochs(order(), 1)
    want = list(range(300)) + list(range(1000, 1150)) + list(range(2000, 2400))
    assert sorted(x for x in epoch if not isinstance(x, str)) == want
    chunks = [x for x in epoch if isinstance(x, str)]
    assert chunks == [str(3000 + i) for i in range(0, 10, 2)]          # a text file in order
    o = order()
    _draw(o, 333)
    state = json.loads(json.dumps(o.state_dict()))             # as a checkpoint keeps it
    rest = _draw(o, 700)
    again = order()
    again.load_state_dict(state)
    assert _draw(again, 700) == rest


def test_batches_resume_mid_epoch_and_old_cursors_are_refused(tmp_path):
    """The batches (rows packed from the shared order) resume exactly from a cursor;
    a cursor of the per-row order (a checkpoint of an earlier rotapipe) is refused,
    naming why and the fix, not resumed at another place of the data."""
    p = text_jsonl(tmp_path / "d.jsonl", 200)
    tok = train_tokenizer([p], 300, 50_000, FIELDS, 0.1)

    def batches(seed=0):
        return TrainBatches([p], tok, batch=4, seq=16, seed=seed, holdout=0.1,
                            fields=FIELDS, packing="documents")
    a = batches()
    for _ in range(9):
        a.next()
    state = a.state_dict()
    want = [a.next() for _ in range(40)]
    b = batches()
    b.load_state_dict(state)
    for w in want:
        got = b.next()
        assert all(torch.equal(x, y) for x, y in zip(got, w) if x is not None)
    assert not torch.equal(batches(0).next().ids, batches(1).next().ids)
    old = {"lanes": [{"epoch": 0, "file_pos": 0, "record": 5, "carry_ids": [],
                      "carry_labels": []}] * 4}
    with pytest.raises(ConfigError, match="per-row data order of an earlier rotapipe.*"
                                          "start a new --out-dir"):
        batches().load_state_dict(old)


def test_an_epoch_of_padded_batches_holds_each_training_record_once(tmp_path):
    """``packing="pad"``: a row is one record. Until the stream's epoch turns, the rows
    hold every training record exactly once (each row packed its own hash-chosen share:
    the fast rows went on into their next epoch, repeating records, before the slowest
    finished its share)."""
    from collections import Counter
    from rotapipe.train.data import Tokens, iter_records
    p = text_jsonl(tmp_path / "d.jsonl", 90)
    tok = train_tokenizer([p], 300, 50_000, FIELDS, 0.1)
    tokens = Tokens(tok)
    want = Counter(tuple(tokens.documents(rec, FIELDS, "")[0][0][:128])
                   for i, rec in iter_records(p) if not is_heldout(p, i, 0.1))
    b = TrainBatches([p], tok, batch=4, seq=128, seed=5, holdout=0.1, fields=FIELDS,
                     packing="pad")
    got = Counter()
    while b.epoch == 0:
        batch = b.next()
        for ids, mask in zip(batch.ids, batch.attention_mask):
            got[tuple(ids[mask.bool()].tolist())] += 1
    extra = got - want                       # the last batch may start the next epoch
    assert got - extra == want and sum(extra.values()) <= 4
