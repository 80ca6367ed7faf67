"""Training data: records packed into fixed-length sequences, in a deterministic order.

Records and their tokens come from :mod:`rotapipe.train.records` (files, record forms,
chat templates, special tokens); its names are re-exported here. The documents of a
split are cut into ``seq``-token sequences by one of three :data:`PACKING` modes:
``documents`` (concatenated; position ids restart at every document, which makes the
model's own mask helpers keep attention inside each document, and a document's first
token is not a target), ``concat``
(concatenated, attending across documents) or ``pad`` (one document per sequence, cut
at ``seq``, padded, with an attention mask).

Nothing is loaded whole: files are read lazily, one record at a time, so a corpus
larger than RAM works. The training records come in the order of
:class:`~rotapipe.train.order.RecordOrder` (each once per epoch, shuffled by
``(seed, epoch)``), shared by the rows of the batch. A record is held out for evaluation
by a hash of ``(file name, record index)``, independent of the seed and of where the
corpus lies (moving or copying it keeps the split); the held-out split is read in file
order. The cursor (the order's position, each row's partial sequence) is small, and a
checkpoint saves and restores it exactly.
"""

from __future__ import annotations

import hashlib
import pathlib
import typing
from collections.abc import Iterator, Sequence

import torch

from ..errors import ConfigError
from .records import (CHUNK_CHARS, COMPLETION, IGNORE, RECORD_SUFFIXES,  # noqa: F401
                      TEXT_SUFFIXES, HubSplit, TextFields, check_text, hub_dataset,
                      is_dataset_dir, iter_records, record_parts, record_text,
                      source_files, stdlib_files)
from .order import WINDOW, RecordOrder
from .tokens import RendersDifferently, Tokens, chat_documents, chat_segments  # noqa: F401

__all__ = ["Batch", "PACKING", "PackedStream", "TextFields", "Tokens", "TrainBatches",
           "check_text", "count_split", "eval_batch", "eval_set", "iter_records",
           "source_files", "stdlib_files", "train_tokenizer"]

EOS = "<|endoftext|>"
PACKING = ("documents", "concat", "pad")
"""How records become sequences: packed with per-document attention, packed with
attention across documents, or one padded record per sequence."""


class Batch(typing.NamedTuple):
    """One batch: ``ids`` and ``labels`` ``[rows, seq]`` int64 (labels ``-100`` where a
    token does not count); ``position_ids`` (``documents`` packing: restarting at each
    document) or ``attention_mask`` (``pad``, and padded held-out rows), else None."""

    ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None

    def inputs(self) -> dict:
        """The pipeline inputs of a wrapped Hugging Face model (no ``None`` entries)."""
        d = {"input_ids": self.ids, "attention_mask": self.attention_mask,
             "position_ids": self.position_ids}
        return {k: v for k, v in d.items() if v is not None}

    def rows(self, start: int, stop: int) -> Batch:
        return Batch(*(None if t is None else t[start:stop] for t in self))


def _hash(path: pathlib.Path, index: int, salt: str = "") -> int:
    # The file's name, not its path: the split and the lanes must not change when the
    # corpus is moved, copied to another machine or read from another checkout.
    key = f"{salt}{path.name}#{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def is_heldout(path: pathlib.Path, index: int, fraction: float) -> bool:
    """Whether record ``index`` of ``path`` belongs to the held-out split."""
    return _hash(path, index) / 2**64 < fraction


def lane_of(path: pathlib.Path, index: int, lanes: int) -> int:
    """The held-out lane (:func:`eval_set`) a record belongs to."""
    return _hash(path, index, "lane:") % lanes


# -- tokenizer -----------------------------------------------------------------------------
def train_tokenizer(files: Sequence[pathlib.Path], vocab: int, max_bytes: int,
                    fields: TextFields, holdout: float):
    """A byte-level BPE (``tokenizers``) trained on up to ``max_bytes`` of the training
    split, as a ``transformers`` fast tokenizer with ``<|endoftext|>`` as end-of-text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def texts():
        seen = 0
        for path in files:
            for i, rec in iter_records(path):
                if is_heldout(path, i, holdout):
                    continue
                a, b = record_text(rec, fields, f"{path}:{i + 1}")
                text = a if b is None else a + b
                yield text
                seen += len(text)
                if seen >= max_bytes:
                    return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   model_max_length=1 << 30)


# -- packing -------------------------------------------------------------------------------
class PackedStream:
    """Fixed-length sequences of one split, in a deterministic order.

    ``heldout=False`` cycles over the training records epoch after epoch, drawing them
    from ``order`` (a :class:`~rotapipe.train.order.RecordOrder`, shared by the rows of
    a batch; by default its own); ``heldout=True`` makes one pass over the held-out
    records of lane ``lane`` of ``lanes`` in file order, its last, short sequence padded
    (labels ``-100``). ``packing`` is one of :data:`PACKING`.
    """

    def __init__(self, files: Sequence[pathlib.Path], tokenizer, *, seq: int, seed: int,
                 holdout: float, fields: TextFields, heldout: bool = False,
                 lane: int = 0, lanes: int = 1, packing: str = "concat",
                 order: RecordOrder | None = None):
        if packing not in PACKING:
            raise ConfigError(f"packing={packing!r}: use one of {', '.join(PACKING)}")
        self.files, self.seq, self.seed = list(files), seq, seed
        self.lane, self.lanes, self.packing = lane, lanes, packing
        self.holdout, self.fields, self.heldout = holdout, fields, heldout
        self.tokens = Tokens(tokenizer)
        self.eos = self.tokens.eos
        self.epoch, self.file_pos, self.record = 0, 0, 0
        self.carry_ids: list[int] = []
        self.carry_labels: list[int] = []
        self.carry_pos: list[int] = []
        self.pending: list[tuple[list[int], list[int]]] = []   # pad: documents not yet out
        # [epoch, tokens (pad: documents)] of the records in the carry (or pending), oldest
        # first: the epoch a row's next token comes from (:meth:`next_epoch`)
        self.held: list[list[int]] = []
        self._records: Iterator | None = None
        self.skipped = 0
        """Training sequences skipped because no label of theirs counts (:meth:`next_row`)."""
        if not heldout and order is None:
            order = RecordOrder(self.files, self.tokens, fields=fields, seed=seed,
                                keep=lambda path, i: not is_heldout(path, i, holdout))
        self.order = order

    # -- cursor ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the stream is: the next record to read and the partial sequence."""
        return {"epoch": self.epoch, "file_pos": self.file_pos, "record": self.record,
                "carry_ids": list(self.carry_ids), "carry_labels": list(self.carry_labels),
                "carry_pos": list(self.carry_pos),
                "pending": [[list(a), list(b)] for a, b in self.pending],
                "held": [list(h) for h in self.held]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.file_pos = int(state["epoch"]), int(state["file_pos"])
        self.record = int(state["record"])
        self.carry_ids = list(state["carry_ids"])
        self.carry_labels = list(state["carry_labels"])
        self.carry_pos = list(state.get("carry_pos", range(len(self.carry_ids))))
        self.pending = [(list(a), list(b)) for a, b in state.get("pending", [])]
        self.held = [[int(e), int(n)] for e, n in state.get("held", [])]
        self._records = None

    # -- reading -------------------------------------------------------------------------
    def _next_record(self) -> list[tuple[list[int], list[int]]] | None:
        """The next record of the split as its documents' ``(ids, labels)``, or None at
        the end of a held-out pass. Advances the cursor."""
        if self.order is not None:
            docs = self.order.next_documents()
            self.epoch = self.order.epoch
            return docs
        while self.file_pos < len(self.files):          # held out: one pass, in order
            path = self.files[self.file_pos]
            if self._records is None:
                self._records = iter_records(path, self.record)
            for i, rec in self._records:
                self.record = i + 1
                if not is_heldout(path, i, self.holdout) or (
                        self.lanes > 1 and lane_of(path, i, self.lanes) != self.lane):
                    continue
                docs = self.tokens.documents(rec, self.fields, f"{path}:{i + 1}")
                if docs:                            # an empty record has none: skipped
                    return docs
            self.file_pos, self.record, self._records = self.file_pos + 1, 0, None
        return None

    def next_epoch(self) -> int:
        """The epoch of the record this row's next token comes from: every token of the
        epochs before it has been in a row already."""
        if self.held:
            return self.held[0][0]
        return self.order.epoch if self.order is not None else self.epoch

    def _hold(self, n: int) -> None:
        """``n`` tokens (pad: documents) of a record of epoch :attr:`epoch` join the carry."""
        if self.held and self.held[-1][0] == self.epoch:
            self.held[-1][1] += n
        elif n:
            self.held.append([self.epoch, n])

    def _release(self, n: int) -> None:
        """``n`` tokens (pad: documents) of the carry went into a row."""
        while n and self.held:
            k = min(n, self.held[0][1])
            self.held[0][1] -= k
            n -= k
            if not self.held[0][1]:
                self.held.pop(0)

    def next_row(self) -> tuple[list[int], list[int], list[int] | None, list[int] | None] | None:
        """``(ids, labels, position ids or None, attention mask or None)`` of the next
        ``seq``-token sequence; None when a held-out pass ends.

        Training skips a sequence none of whose next-token labels counts (a prompt
        longer than ``seq``, cut before its completion): it adds nothing to the loss,
        and a batch of only such sequences would have nothing to average over (the
        step would fail mid-run). :attr:`skipped` counts them. A whole epoch of them
        is a :class:`ConfigError`."""
        start = None
        while True:
            row = self._row()
            if row is None or self.heldout or any(x != IGNORE for x in row[1][1:]):
                return row
            self.skipped += 1
            start = self.epoch if start is None else start
            if self.epoch > start + 1:
                raise ConfigError(
                    f"no sequence of the training split has a label to learn within seq="
                    f"{self.seq} tokens (every completion starts after them, or every "
                    "label is ignored): raise --seq, shorten the prompts, or check the "
                    "data's completion fields")

    def _row(self) -> tuple[list[int], list[int], list[int] | None, list[int] | None] | None:
        pad = self.tokens.pad
        if self.packing == "pad":                   # one document, cut at seq, padded
            if not self.pending:
                got = self._next_record()
                if got is None:
                    return None
                self.pending = got
                self._hold(len(got))
            doc = self.pending.pop(0)
            self._release(1)
            ids, labels = doc[0][:self.seq], doc[1][:self.seq]
            n = self.seq - len(ids)
            return ids + [pad] * n, labels + [IGNORE] * n, None, [1] * len(ids) + [0] * n
        while len(self.carry_ids) < self.seq:
            got = self._next_record()
            if got is None:
                if self.heldout and self.carry_ids:       # the short last sequence
                    break
                return None
            self._hold(sum(len(ids) for ids, _ in got))
            for ids, labels in got:
                self.carry_ids += ids
                # documents: a document's first token is not a target. It would be
                # predicted from the end of the document before it, which it does not
                # attend to (transformers' DataCollatorWithFlattening masks it too): the
                # loss is then the documents' own, as each alone (or padded) gives it.
                self.carry_labels += [IGNORE] + labels[1:] \
                    if self.packing == "documents" and labels else labels
                self.carry_pos += range(len(ids))
        n = min(self.seq, len(self.carry_ids))
        self._release(n)
        fill = self.seq - n
        ids = self.carry_ids[:n] + [pad] * fill
        labels = self.carry_labels[:n] + [IGNORE] * fill
        pos = self.carry_pos[:n] + list(range(fill))    # padding: a document of its own
        rest = self.carry_pos[n:]
        if rest and rest[0] != 0:
            # A document continues into the next sequence: its positions restart there.
            k = rest.index(0) if 0 in rest else len(rest)
            rest = list(range(k)) + rest[k:]
        self.carry_ids, self.carry_labels, self.carry_pos = \
            self.carry_ids[n:], self.carry_labels[n:], rest
        return ids, labels, pos if self.packing == "documents" else None, None

    def next_sequence(self) -> tuple[list[int], list[int]] | None:
        """``(ids, labels)`` of the next sequence (None when a held-out pass ends)."""
        row = self.next_row()
        return None if row is None else row[:2]


def _stack(rows) -> Batch:
    def column(k):
        if any(r[k] is None for r in rows):
            return None
        return torch.tensor([r[k] for r in rows], dtype=torch.long)
    return Batch(column(0), column(1), column(2), column(3))


class TrainBatches:
    """Training batches: row ``r`` of every batch is the next sequence of lane ``r``, a
    :class:`PackedStream` that packs the records it draws from one shared
    :class:`~rotapipe.train.order.RecordOrder`: an epoch reads every training record
    once, the rows of a batch hold records from many places of the corpus."""

    def __init__(self, files, tokenizer, *, batch: int, seed: int, holdout: float,
                 fields: TextFields, **kwargs):
        # a span open per row at least: the records a batch draws come from as many
        # places of the corpus as it has rows
        self.order = RecordOrder(files, Tokens(tokenizer), fields=fields, seed=seed,
                                 keep=lambda path, i: not is_heldout(path, i, holdout),
                                 window=max(WINDOW, batch))
        self.lanes = [PackedStream(files, tokenizer, seed=seed, holdout=holdout,
                                   fields=fields, order=self.order, **kwargs)
                      for _ in range(batch)]

    @property
    def epoch(self) -> int:
        """Completed passes over the training split: every token of those epochs has been
        in a batch (a row's carry may still hold the end of a record read before the
        order turned to the next epoch)."""
        return min(s.next_epoch() for s in self.lanes)

    def next(self) -> Batch:
        """The next :class:`Batch` (``[batch, seq]`` tensors; rows with no label to
        learn skipped, :meth:`PackedStream.next_row`)."""
        return _stack([s.next_row() for s in self.lanes])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, labels)``, each ``[batch, seq]`` int64; labels ``-100`` where a token
        does not count (prompts)."""
        b = self.next()
        return b.ids, b.labels

    def state_dict(self) -> dict:
        return {"order": self.order.state_dict(), "lanes": [s.state_dict() for s in self.lanes]}

    def load_state_dict(self, state: dict) -> None:
        if "order" not in state:
            raise ConfigError(
                "the checkpoint's data cursor is from the per-row data order of an earlier "
                "rotapipe (each row of the batch read its own share of the records front "
                "to back), which this version no longer has, so the run cannot continue "
                "exactly where it stopped: start a new --out-dir (--model with the "
                "exported weights, or --resume-from-adapter, continues the training)")
        if len(state["lanes"]) != len(self.lanes):
            raise ConfigError(f"the data cursor has {len(state['lanes'])} lanes, this run "
                              f"{len(self.lanes)}: resume with the same batch")
        self.order.load_state_dict(state["order"])
        for s, st in zip(self.lanes, state["lanes"]):
            s.load_state_dict(st)
            s.epoch = self.order.epoch


def eval_set(files, tokenizer, n: int, *, seq: int, holdout: float, fields: TextFields,
             seed: int = 0, per_lane: int = 4, packing: str = "concat",
             what: str = "") -> Batch:
    """Up to ``n`` held-out sequences, the same for every seed and every call: the first
    ``per_lane`` sequences of each of ``n / per_lane`` held-out lanes, so they sample the
    whole corpus rather than its first files (and not only the starts of records). A
    split smaller than a sequence gives one padded sequence. ``holdout=1``: every record
    of ``files`` (a separate evaluation set)."""
    rows = []
    lanes = max(1, -(-n // per_lane))
    for lane in range(lanes):
        s = PackedStream(files, tokenizer, seq=seq, seed=seed, holdout=holdout,
                         fields=fields, heldout=True, lane=lane, lanes=lanes, packing=packing)
        for _ in range(per_lane):
            r = s.next_row() if len(rows) < n else None
            if r is None:
                break
            rows.append(r)
    if not rows:
        raise ConfigError(f"the {what or f'held-out split (holdout={holdout})'} holds no "
                          "tokens that count: raise holdout, add data, or pass eval_data")
    return _stack(rows)


def eval_batch(files, tokenizer, n: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, labels)`` of :func:`eval_set`."""
    b = eval_set(files, tokenizer, n, **kwargs)
    return b.ids, b.labels


def count_split(files, tokenizer, *, holdout: float, fields: TextFields) -> tuple[int, int]:
    """``(documents, tokens)`` of the training split (one tokenizing pass): what sets
    the schedule length when ``epochs`` does. A document is a record, or one assistant
    turn of a chat expanded by :func:`chat_documents`."""
    tokens = Tokens(tokenizer)
    records = total = 0
    for path in files:
        for i, rec in iter_records(path):
            if not is_heldout(path, i, holdout):
                docs = tokens.documents(rec, fields, f"{path}:{i + 1}")
                records += len(docs)
                total += sum(len(d[0]) for d in docs)
    return records, total
