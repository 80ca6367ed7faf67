"""Training data: documents from files, tokenized, packed into fixed-length sequences.

A *record* is one JSONL line, or a chunk of about 32 KiB of lines of a text file. Each
record becomes token ids plus labels (unshifted, ``-100`` where a token does not count:
the prompt of a prompt/response pair) followed by the end-of-text token, and the
records of a split are concatenated and cut into ``seq``-token sequences (packing).

Nothing is loaded whole: files are read lazily, one record at a time, so a corpus
larger than RAM works. The order is deterministic: each epoch visits the files in a
permutation drawn from ``(seed, epoch)`` and each file's records in order. A record is
held out for evaluation by a hash of ``(file, record index)``, independent of the
seed. :class:`PackedStream` has a small cursor (epoch, file position, record index,
the partial sequence carried over) that a checkpoint saves and restores exactly.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import random
import sysconfig
from collections.abc import Iterator, Sequence

import torch

from ..errors import ConfigError, InputError

__all__ = ["PackedStream", "TextFields", "TrainBatches", "check_text", "eval_batch",
           "source_files", "stdlib_files", "train_tokenizer"]

IGNORE = -100
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".text")
CHUNK_CHARS = 32 * 1024
EOS = "<|endoftext|>"


class TextFields:
    """Which JSONL fields hold a document (``text``) or a prompt/response pair."""

    def __init__(self, text: str = "text", prompt: str = "prompt", response: str = "response"):
        self.text, self.prompt, self.response = text, prompt, response


# -- files and records -------------------------------------------------------------------
def stdlib_files() -> list[pathlib.Path]:
    """The running interpreter's standard library ``.py`` files (no site-packages)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def source_files(spec: str) -> list[pathlib.Path]:
    """Resolve ``data``: comma-separated files and directories, or ``stdlib``."""
    if spec == "stdlib":
        files = stdlib_files()
        if not files:
            raise ConfigError("data='stdlib': no .py files found under "
                              f"{sysconfig.get_paths()['stdlib']}: pass data files")
        return files
    files: list[pathlib.Path] = []
    for part in filter(None, (s.strip() for s in spec.split(","))):
        p = pathlib.Path(part)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file()
                           and (f.suffix in TEXT_SUFFIXES or f.suffix == ".jsonl"))
            if not found:
                raise ConfigError(f"data directory {part!r} holds no .txt/.md/.py/.rst/"
                                  ".jsonl files: point data at the files")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise ConfigError(f"data file {part!r} does not exist: check the path "
                              "(data is a comma-separated list of files or directories)")
    if not files:
        raise ConfigError("data is empty: pass files or directories (or 'stdlib')")
    for f in files:
        check_text(f)
    if all(f.stat().st_size == 0 for f in files):
        raise ConfigError(f"data files {', '.join(map(str, files[:3]))} are empty: pass "
                          "files that hold text")
    return files


# Bytes that do not occur in text (C0 controls other than tab, newlines, form feed,
# vertical tab and escape). Random or compressed bytes hold about 11% of them.
_CONTROL = bytes(c for c in range(32) if c not in (9, 10, 11, 12, 13, 27))
SNIFF_BYTES = 8192


def check_text(path: pathlib.Path) -> None:
    """Refuse a file that is not text: a NUL byte, or more than 1% of control bytes, in
    its first :data:`SNIFF_BYTES` bytes (text in another 8-bit encoding passes, with
    replacement characters for the bytes that are not UTF-8)."""
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError as exc:
        raise ConfigError(f"data file {str(path)!r} cannot be read ({exc.strerror})") \
            from None
    control = len(head) - len(head.translate(None, _CONTROL))
    if b"\0" in head or control > len(head) // 100:
        at = next(i for i, c in enumerate(head) if c in _CONTROL)
        raise InputError(f"data file {str(path)!r} is not text ({control} control bytes "
                         f"in its first {len(head)} bytes, the first at offset {at}): pass "
                         "UTF-8 text (.txt .md .py .rst) or JSONL files")


def iter_records(path: pathlib.Path, start: int = 0) -> Iterator[tuple[int, object]]:
    """``(record index, record)`` of one file from record ``start`` on: a parsed JSONL
    line (dict), or a text chunk (str)."""
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for i, raw in enumerate(f):
                if i < start or not raw.strip():
                    continue
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise InputError(f"{path}:{i + 1}: not UTF-8 text (byte {exc.start} of "
                                     "the line): a JSONL file holds one UTF-8 JSON object "
                                     "per line") from None
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(f"{path}:{i + 1}: not valid JSON ({exc.msg}): fix or "
                                     "remove the line") from None
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        i, chunk, size = 0, [], 0
        for line in f:
            chunk.append(line)
            size += len(line)
            if size >= CHUNK_CHARS:
                if i >= start:
                    yield i, "".join(chunk)
                i, chunk, size = i + 1, [], 0
        if chunk and i >= start:
            yield i, "".join(chunk)


def _hash(path: pathlib.Path, index: int, salt: str = "") -> int:
    key = f"{salt}{path.as_posix()}#{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def is_heldout(path: pathlib.Path, index: int, fraction: float) -> bool:
    """Whether record ``index`` of ``path`` belongs to the held-out split."""
    return _hash(path, index) / 2**64 < fraction


def lane_of(path: pathlib.Path, index: int, lanes: int) -> int:
    """The batch row (lane) a training record is packed into."""
    return _hash(path, index, "lane:") % lanes


def record_text(record, fields: TextFields, where: str) -> tuple[str, str | None]:
    """``(prompt or text, response or None)`` of a record."""
    if isinstance(record, str):
        return record, None
    if isinstance(record, dict):
        if fields.prompt in record and fields.response in record:
            return str(record[fields.prompt]), str(record[fields.response])
        if fields.text in record:
            return str(record[fields.text]), None
    raise InputError(f"{where}: a JSONL line needs a {fields.text!r} field or "
                     f"{fields.prompt!r} and {fields.response!r} fields: set text_field / "
                     "prompt_field / response_field")


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


def _encoder(tokenizer):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:       # fast path, and no "longer than max length" warnings
        return lambda text: backend.encode(text, add_special_tokens=False).ids
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


# -- packing -------------------------------------------------------------------------------
class PackedStream:
    """Fixed-length ``(ids, labels)`` sequences of one split, in a deterministic order.

    ``heldout=False`` cycles over the training records of lane ``lane`` of ``lanes``
    epoch after epoch (a new file permutation per epoch and lane); ``heldout=True``
    makes one pass over the held-out records in file order.
    """

    def __init__(self, files: Sequence[pathlib.Path], tokenizer, *, seq: int, seed: int,
                 holdout: float, fields: TextFields, heldout: bool = False,
                 lane: int = 0, lanes: int = 1):
        self.files, self.seq, self.seed = list(files), seq, seed
        self.lane, self.lanes = lane, lanes
        self.holdout, self.fields, self.heldout = holdout, fields, heldout
        self.encode = _encoder(tokenizer)
        self.eos = tokenizer.eos_token_id
        if self.eos is None:
            raise ConfigError("the tokenizer has no end-of-text token (eos_token): set one "
                              "in the model's tokenizer_config.json")
        self.epoch, self.file_pos, self.record = 0, 0, 0
        self.carry_ids: list[int] = []
        self.carry_labels: list[int] = []
        self._records: Iterator | None = None

    # -- cursor ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the stream is: the next record to read and the partial sequence."""
        return {"epoch": self.epoch, "file_pos": self.file_pos, "record": self.record,
                "carry_ids": list(self.carry_ids), "carry_labels": list(self.carry_labels)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.file_pos = int(state["epoch"]), int(state["file_pos"])
        self.record = int(state["record"])
        self.carry_ids = list(state["carry_ids"])
        self.carry_labels = list(state["carry_labels"])
        self._records = None

    def order(self, epoch: int) -> list[pathlib.Path]:
        """File order of ``epoch``."""
        if self.heldout:
            return self.files
        files = list(self.files)
        random.Random(f"{self.seed}:{epoch}:{self.lane}").shuffle(files)
        return files

    # -- reading -------------------------------------------------------------------------
    def _next_record(self) -> tuple[list[int], list[int]] | None:
        """The next record of the split as ``(ids, labels)``, or None at the end of a
        held-out pass. Advances the cursor."""
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
                    raise ConfigError(f"lane {self.lane} of the training split is empty "
                                      f"(each of the {self.lanes} batch rows packs its own "
                                      "share of the records): add data, lower batch or "
                                      "lower holdout")
                continue
            path = order[self.file_pos]
            if self._records is None:
                self._records = iter_records(path, self.record)
            for i, rec in self._records:
                self.record = i + 1
                if is_heldout(path, i, self.holdout) != self.heldout or (
                        self.lanes > 1 and lane_of(path, i, self.lanes) != self.lane):
                    continue
                empty_epochs = 0
                return self._tokenize(rec, f"{path}:{i + 1}")
            self.file_pos, self.record, self._records = self.file_pos + 1, 0, None

    def _tokenize(self, rec, where: str) -> tuple[list[int], list[int]]:
        a, b = record_text(rec, self.fields, where)
        if b is None:
            ids = self.encode(a) + [self.eos]
            return ids, ids
        p, r = self.encode(a), self.encode(b) + [self.eos]
        return p + r, [IGNORE] * len(p) + r

    def next_sequence(self) -> tuple[list[int], list[int]] | None:
        """One packed sequence of ``seq`` tokens (None when a held-out pass ends)."""
        while len(self.carry_ids) < self.seq:
            got = self._next_record()
            if got is None:
                return None
            self.carry_ids += got[0]
            self.carry_labels += got[1]
        ids, labels = self.carry_ids[:self.seq], self.carry_labels[:self.seq]
        self.carry_ids, self.carry_labels = self.carry_ids[self.seq:], \
            self.carry_labels[self.seq:]
        return ids, labels



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

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, labels)``, each ``[batch, seq]`` int64; labels ``-100`` where a token
        does not count (prompts)."""
        rows = [s.next_sequence() for s in self.lanes]
        return (torch.tensor([r[0] for r in rows], dtype=torch.long),
                torch.tensor([r[1] for r in rows], dtype=torch.long))

    def state_dict(self) -> dict:
        return {"lanes": [s.state_dict() for s in self.lanes]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["lanes"]) != len(self.lanes):
            raise ConfigError(f"the data cursor has {len(state['lanes'])} lanes, this run "
                              f"{len(self.lanes)}: resume with the same batch")
        for s, st in zip(self.lanes, state["lanes"]):
            s.load_state_dict(st)


def eval_batch(files, tokenizer, n: int, *, seq: int, holdout: float, fields: TextFields,
               seed: int = 0, per_lane: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``n`` held-out sequences, the same for every seed and every call: the first
    ``per_lane`` sequences of each of ``n / per_lane`` held-out lanes, so they sample the
    whole corpus rather than its first files (and not only the starts of records)."""
    rows = []
    lanes = max(1, -(-n // per_lane))
    for lane in range(lanes):
        s = PackedStream(files, tokenizer, seq=seq, seed=seed, holdout=holdout,
                         fields=fields, heldout=True, lane=lane, lanes=lanes)
        for _ in range(per_lane):
            r = s.next_sequence() if len(rows) < n else None
            if r is None:
                break
            rows.append(r)
    if not rows:
        raise ConfigError(f"the held-out split (holdout={holdout}) holds less than one "
                          f"sequence of {seq} tokens: raise holdout or add data")
    return (torch.tensor([r[0] for r in rows], dtype=torch.long),
            torch.tensor([r[1] for r in rows], dtype=torch.long))
