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
larger than RAM works. The order is deterministic: each epoch visits the files in a
permutation drawn from ``(seed, epoch)`` and each file's records in order. A record is
held out for evaluation by a hash of ``(file name, record index)``, independent of the
seed and of where the corpus lies (moving or copying it keeps the split). :class:`PackedStream` has a small cursor (epoch, file position, record index,
the partial sequence carried over) that a checkpoint saves and restores exactly.
"""

from __future__ import annotations

import hashlib
import pathlib
import random
import typing
from collections.abc import Iterator, Sequence

import torch

from ..errors import ConfigError
from .records import (CHUNK_CHARS, COMPLETION, IGNORE, RECORD_SUFFIXES,  # noqa: F401
                      TEXT_SUFFIXES, HubSplit, TextFields, check_text, hub_dataset,
                      is_dataset_dir, iter_records, record_parts, record_text,
                      source_files, stdlib_files)
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
    """The batch row (lane) a training record is packed into."""
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

    ``heldout=False`` cycles over the training records of lane ``lane`` of ``lanes``
    epoch after epoch (a new file permutation per epoch and lane); ``heldout=True``
    makes one pass over the held-out records in file order, its last, short sequence
    padded (labels ``-100``). ``packing`` is one of :data:`PACKING`.
    """

    def __init__(self, files: Sequence[pathlib.Path], tokenizer, *, seq: int, seed: int,
                 holdout: float, fields: TextFields, heldout: bool = False,
                 lane: int = 0, lanes: int = 1, packing: str = "concat"):
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
        self._records: Iterator | None = None
        self.skipped = 0
        """Training sequences skipped because no label of theirs counts (:meth:`next_row`)."""

    # -- cursor ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the stream is: the next record to read and the partial sequence."""
        return {"epoch": self.epoch, "file_pos": self.file_pos, "record": self.record,
                "carry_ids": list(self.carry_ids), "carry_labels": list(self.carry_labels),
                "carry_pos": list(self.carry_pos),
                "pending": [[list(a), list(b)] for a, b in self.pending]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.file_pos = int(state["epoch"]), int(state["file_pos"])
        self.record = int(state["record"])
        self.carry_ids = list(state["carry_ids"])
        self.carry_labels = list(state["carry_labels"])
        self.carry_pos = list(state.get("carry_pos", range(len(self.carry_ids))))
        self.pending = [(list(a), list(b)) for a, b in state.get("pending", [])]
        self._records = None

    def order(self, epoch: int) -> list[pathlib.Path]:
        """File order of ``epoch``."""
        if self.heldout:
            return self.files
        files = list(self.files)
        random.Random(f"{self.seed}:{epoch}:{self.lane}").shuffle(files)
        return files

    # -- reading -------------------------------------------------------------------------
    def _next_record(self) -> list[tuple[list[int], list[int]]] | None:
        """The next record of the split as its documents' ``(ids, labels)``, or None at
        the end of a held-out pass. Advances the cursor."""
        empty_epochs = 0
        while True:
            order = self.order(self.epoch)
            if self.file_pos >= len(order):
                if self.heldout:
                    return None
                self.epoch, self.file_pos, self.record, self._records = \
                    self.epoch + 1, 0, 0, None
                empty_epochs += 1
                if empty_epochs > 1:
                    raise ConfigError(
                        f"row {self.lane} of the batch gets no training record: each of "
                        f"the batch's {self.lanes} rows packs its own share of the records "
                        "(by a hash of file name and record index; empty records skipped), "
                        "and this share is empty: add data, lower --batch, or lower "
                        "--holdout")
                continue
            path = order[self.file_pos]
            if self._records is None:
                self._records = iter_records(path, self.record)
            for i, rec in self._records:
                self.record = i + 1
                if is_heldout(path, i, self.holdout) != self.heldout or (
                        self.lanes > 1 and lane_of(path, i, self.lanes) != self.lane):
                    continue
                docs = self.tokens.documents(rec, self.fields, f"{path}:{i + 1}")
                if docs:                            # an empty record has none: skipped
                    empty_epochs = 0
                    return docs
            self.file_pos, self.record, self._records = self.file_pos + 1, 0, None

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
            doc = self.pending.pop(0)
            ids, labels = doc[0][:self.seq], doc[1][:self.seq]
            n = self.seq - len(ids)
            return ids + [pad] * n, labels + [IGNORE] * n, None, [1] * len(ids) + [0] * n
        while len(self.carry_ids) < self.seq:
            got = self._next_record()
            if got is None:
                if self.heldout and self.carry_ids:       # the short last sequence
                    break
                return None
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
    """Training batches: row ``r`` of every batch comes from lane ``r``, a
    :class:`PackedStream` over its own hash-chosen share of the records with its own
    file order, so one batch mixes ``batch`` different places of the corpus (packing a
    single stream would fill a batch with consecutive pieces of one file)."""

    def __init__(self, files, tokenizer, *, batch: int, **kwargs):
        self.lanes = [PackedStream(files, tokenizer, lane=r, lanes=batch, **kwargs)
                      for r in range(batch)]

    @property
    def epoch(self) -> int:
        """Completed passes over the training split (the slowest lane's)."""
        return min(s.epoch for s in self.lanes)

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
        return {"lanes": [s.state_dict() for s in self.lanes]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["lanes"]) != len(self.lanes):
            raise ConfigError(f"the data cursor has {len(state['lanes'])} lanes, this run "
                              f"{len(self.lanes)}: resume with the same batch")
        for s, st in zip(self.lanes, state["lanes"]):
            s.load_state_dict(st)


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
