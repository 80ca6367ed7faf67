"""The order of the training records: each record once per epoch, shuffled by
``(seed, epoch)``, read with bounded memory, with a small cursor for an exact resume.

The sources are cut into *spans* of consecutive records that are cheap to read in a
row: :data:`SPAN` lines of a JSONL file (found by their byte offset, from one pass over
the file's lines), :data:`SPAN` items of a JSON list or rows of a saved or hub dataset,
one row group of a Parquet file, one whole text file (a text file is one document: its
chunks stay in order). Each epoch permutes the spans (``random.Random(f"{seed}:{epoch}")``)
and keeps ``window`` of them open at a time (:data:`WINDOW`, or the batch's rows when
more); the draws visit every open span once per round, in an order of ``(seed, epoch,
round)``, and an exhausted span is replaced by the next one of the permutation. So the
records of a batch come from as many random places of the corpus as it has rows; the
memory is the span index (about 100 bytes per :data:`SPAN` records) and the open
spans' readers, never the records.

An earlier order gave each batch row a hash-chosen share of the records and read each
share front to back: the seed did not change the order of one file, every epoch
repeated it (a sorted JSONL trained sorted), and the shares were uneven, so an epoch
repeated some records and missed others.
"""

from __future__ import annotations

import array
import dataclasses
import pathlib
import random
from collections.abc import Iterator

from ..errors import ConfigError
from .records import HubSplit, TextFields, iter_records
from .tokens import Tokens

__all__ = ["SPAN", "WINDOW", "Span", "RecordOrder", "spans_of"]

SPAN = 64
"""Records per span of a JSONL file, a JSON list or a dataset."""
WINDOW = 16
"""Spans open at a time: the places of the corpus that consecutive records come from."""
VERSION = 2
"""The cursor's format (:meth:`RecordOrder.state_dict`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """Records ``start`` to ``stop - 1`` of source ``file`` (an index into the files;
    ``stop`` None: to the end), from byte ``offset`` (JSONL) or row group ``group``."""

    file: int
    start: int
    stop: int | None
    offset: int | None = None
    group: int | None = None


def spans_of(files) -> list[Span]:
    """The spans of ``files`` (one pass over each JSONL file's lines; Parquet's row
    groups from its metadata)."""
    out: list[Span] = []
    for k, path in enumerate(files):
        if isinstance(path, HubSplit) or path.is_dir():
            n = len(path) if isinstance(path, HubSplit) else _dataset_rows(path)
            out += [Span(k, s, min(n, s + SPAN)) for s in range(0, n, SPAN)]
        elif path.suffix == ".parquet":
            import pyarrow.parquet as pq
            meta, s = pq.ParquetFile(path).metadata, 0
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                out += [Span(k, s, s + n, group=g)] if n else []
                s += n
        elif path.suffix == ".jsonl" or path.suffix == ".json" and _json_lines(path):
            n, offsets = _line_offsets(path)
            out += [Span(k, s, min(n, s + SPAN), offset=offsets[s // SPAN])
                    for s in range(0, n, SPAN)]
        elif path.suffix == ".json":                      # a JSON list, read whole
            n = sum(1 for _ in iter_records(path))
            out += [Span(k, s, min(n, s + SPAN)) for s in range(0, n, SPAN)]
        else:
            out.append(Span(k, 0, None))                  # a text file, in order
    return out


def _dataset_rows(path: pathlib.Path) -> int:
    """Rows of a saved dataset (its ``train`` split, as :func:`iter_records` reads it)."""
    import datasets
    data = datasets.load_from_disk(str(path))
    return len(data["train"] if isinstance(data, datasets.DatasetDict) else data)


def _json_lines(path: pathlib.Path) -> bool:
    """A ``.json`` file holding JSON Lines (not one JSON list)."""
    from .records import _json_list
    return _json_list(path) is None


def _line_offsets(path: pathlib.Path) -> tuple[int, array.array]:
    """``(lines, byte offset of every SPAN-th line)`` of a file: one pass, and 8 bytes
    per :data:`SPAN` lines kept."""
    offsets, n, at = array.array("q"), 0, 0
    with open(path, "rb") as f:
        for line in f:
            if n % SPAN == 0:
                offsets.append(at)
            at += len(line)
            n += 1
    return n, offsets


class RecordOrder:
    """The training records of ``files`` (held-out and empty ones skipped) as documents
    (:class:`~rotapipe.train.tokens.Tokens`), each record once per epoch, in an order
    drawn from ``(seed, epoch)``; shared by every row of the batch."""

    def __init__(self, files, tokens: Tokens, *, fields: TextFields, seed: int,
                 keep, window: int = WINDOW, spans: list[Span] | None = None):
        self.files, self.tokens, self.fields, self.seed = list(files), tokens, fields, seed
        self.keep = keep                  # (path, record index) -> a training record?
        self.spans = spans_of(self.files) if spans is None else spans
        self.window = window
        self.epoch, self.draws, self.next_span = 0, 0, 0
        # per slot: [span id, next record index], or None (no span left to open)
        self.open: list[list[int] | None] = []
        self._readers: list[Iterator | None] = []
        self._perm: tuple[int, list[int]] | None = None

    # -- cursor --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"version": VERSION, "epoch": self.epoch, "draws": self.draws,
                "next_span": self.next_span,
                "open": [None if s is None else list(s) for s in self.open]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.draws = int(state["epoch"]), int(state["draws"])
        self.next_span = int(state["next_span"])
        self.open = [None if s is None else [int(s[0]), int(s[1])] for s in state["open"]]
        self._readers = [None] * len(self.open)

    # -- reading -------------------------------------------------------------------------
    def permutation(self, epoch: int) -> list[int]:
        """The span order of ``epoch``."""
        if self._perm is None or self._perm[0] != epoch:
            order = list(range(len(self.spans)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._perm = (epoch, order)
        return self._perm[1]

    def _reader(self, slot: int) -> Iterator:
        if self._readers[slot] is None:
            sid, at = self.open[slot]
            span = self.spans[sid]
            self._readers[slot] = iter_records(self.files[span.file], at, stop=span.stop,
                                               offset=span.offset, first=span.start,
                                               group=span.group)
        return self._readers[slot]

    def _open(self, slot: int) -> None:
        """Slot ``slot`` gets the next span of the permutation (or None: none is left)."""
        perm = self.permutation(self.epoch)
        if self.next_span < len(perm):
            sid = perm[self.next_span]
            self.open[slot] = [sid, self.spans[sid].start]
            self.next_span += 1
        else:
            self.open[slot] = None
        self._readers[slot] = None

    def _slot(self) -> int:
        """The slot of draw :attr:`draws`: every slot once per round of ``window``
        draws, in an order of ``(seed, epoch, round)`` (not with replacement: 16 draws
        then came from about 10 spans, and a batch held fewer places of the corpus)."""
        r, k = divmod(self.draws, self.window)
        slots = list(range(self.window))
        random.Random(f"{self.seed}:{self.epoch}:{r}").shuffle(slots)
        return slots[k]

    def next_documents(self) -> list[tuple[list[int], list[int]]]:
        """The next training record's documents (an empty record is skipped); the
        epoch advances when every span of it was read."""
        empty_epochs = 0
        while True:
            if not self.open:                         # a new epoch: fill the window
                self.open, self._readers = [None] * self.window, [None] * self.window
                for slot in range(self.window):
                    self._open(slot)
            if all(s is None for s in self.open):     # the epoch is done
                self.epoch, self.next_span, self.draws, self.open = self.epoch + 1, 0, 0, []
                empty_epochs += 1
                if empty_epochs > 1:
                    raise ConfigError("the training split holds no record to train on "
                                      "(every record is held out or empty): add data, or "
                                      "lower --holdout")
                continue
            slot = self._slot()
            self.draws += 1
            if self.open[slot] is None:
                continue
            got = next(self._reader(slot), None)
            if got is None:                            # the span is read: the next one
                self._open(slot)
                continue
            i, rec = got
            self.open[slot][1] = i + 1
            path = self.files[self.spans[self.open[slot][0]].file]
            if not self.keep(path, i):
                continue
            docs = self.tokens.documents(rec, self.fields, f"{path}:{i + 1}")
            if docs:
                empty_epochs = 0
                return docs
