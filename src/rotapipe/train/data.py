"""Training data: documents from files, tokenized, packed into fixed-length sequences.

A *record* is one JSONL line, one object of a JSON list, one row of a Parquet file or
of a saved Hugging Face dataset, or a chunk of about 32 KiB of lines of a text file. A
record is plain text, a prompt/response (or prompt/completion) pair, or a chat
(``messages``, rendered with the tokenizer's own chat template, the loss on the
assistant turns only). Each becomes token ids plus labels (unshifted, ``-100`` where a
token does not count), and the records of a split are cut into ``seq``-token sequences
by one of three :data:`PACKING` modes: ``documents`` (concatenated; position ids
restart at every document, which makes the model's own mask helpers keep attention
inside each document), ``concat`` (concatenated, attending across documents) or
``pad`` (one record per sequence, cut at ``seq``, padded, with an attention mask).

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
import re
import sysconfig
import typing
from collections.abc import Iterator, Sequence

import torch

from ..errors import ConfigError, InputError

__all__ = ["Batch", "PACKING", "PackedStream", "TextFields", "TrainBatches", "check_text",
           "count_split", "eval_batch", "eval_set", "source_files", "stdlib_files",
           "train_tokenizer"]

IGNORE = -100
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".text")
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
"""Files read as records (not as text): JSON lines, a JSON list, Parquet."""
CHUNK_CHARS = 32 * 1024
EOS = "<|endoftext|>"
PACKING = ("documents", "concat", "pad")
"""How records become sequences: packed with per-document attention, packed with
attention across documents, or one padded record per sequence."""
COMPLETION = "completion"
"""Accepted in place of ``response_field`` (TRL's prompt/completion records)."""


class TextFields:
    """Which record fields hold a document (``text``), a prompt/response pair or a chat
    (``messages``: a list of ``{"role", "content"}``)."""

    def __init__(self, text: str = "text", prompt: str = "prompt", response: str = "response",
                 messages: str = "messages"):
        self.text, self.prompt, self.response, self.messages = text, prompt, response, messages


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
        if p.is_dir() and is_dataset_dir(p):
            files.append(p)                  # a datasets.save_to_disk folder: one source
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file()
                           and (f.suffix in TEXT_SUFFIXES or f.suffix in RECORD_SUFFIXES))
            if not found:
                raise ConfigError(f"data directory {part!r} holds no .txt/.md/.py/.rst/"
                                  ".jsonl/.json/.parquet files: point data at the files")
            files += found
        elif p.is_file():
            files.append(p)
        elif _hub_dataset_spec(part):
            files += hub_dataset_files(part)
        else:
            raise ConfigError(f"data file {part!r} does not exist: check the path "
                              "(data is a comma-separated list of files or directories)")
    if not files:
        raise ConfigError("data is empty: pass files or directories (or 'stdlib')")
    for f in files:
        if f.is_file() and f.suffix != ".parquet":
            check_text(f)
    if all(f.is_file() and f.stat().st_size == 0 for f in files):
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


def _optional(module: str, what: str, package: str):
    """Import an optional dependency, or say which package to install."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"reading {what} needs the {package!r} package: pip install "
                          f"{package}") from None


def _json_list(path: pathlib.Path) -> list:
    """A ``.json`` data file: a list of records (read whole; use JSONL for big data)."""
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(values, list):
        raise InputError(f"{path} holds a JSON {type(values).__name__}: a .json data file "
                         "is a list of records (one object per record), or use JSONL")
    return values


def _hub_dataset_spec(part: str) -> bool:
    from .hub import is_hub_id
    return is_hub_id(part.split(":", 1)[0])


def hub_dataset_files(spec: str) -> list[pathlib.Path]:
    """``org/name[:split]``: the record files of that split (default ``train``) of a
    dataset repository in the Hugging Face cache (downloaded into it when not cached
    and not offline). A file belongs to a split when the split's name is a part of its
    path (``data/train-00000.parquet``, ``train/x.jsonl``, ``train.jsonl``); a
    repository without split names in its paths is one split."""
    from .hub import snapshot

    repo, _, split = spec.partition(":")
    root = snapshot(repo, "data", repo_type="dataset",
                    patterns=[f"*{x}" for x in RECORD_SUFFIXES] + ["*.md"])
    found = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in RECORD_SUFFIXES)
    words = lambda f: set(re.split(r"[-_./]", f.relative_to(root).as_posix().lower()))
    named = [f for f in found if words(f) & _SPLITS]
    chosen = [f for f in named if (split or "train") in words(f)] if named else \
        (found if not split else [])
    if not chosen:
        raise ConfigError(f"dataset {repo!r} in the Hugging Face cache has no "
                          f"{split or 'train'!r} split among its .jsonl/.json/.parquet files "
                          f"({', '.join(str(f.relative_to(root)) for f in found[:5]) or 'none'})"
                          ": name another split (org/name:test)")
    return chosen


_SPLITS = {"train", "test", "validation", "valid", "dev", "eval"}


def is_dataset_dir(path: pathlib.Path) -> bool:
    """A folder ``datasets.Dataset.save_to_disk`` wrote (``state.json`` + ``.arrow``)."""
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def iter_records(path: pathlib.Path, start: int = 0) -> Iterator[tuple[int, object]]:
    """``(record index, record)`` of one source from record ``start`` on: a parsed JSONL
    line, JSON list item, Parquet row or dataset row (dict), or a text chunk (str)."""
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
    if path.suffix == ".json":
        yield from enumerate(_json_list(path)[start:], start)
        return
    if path.suffix == ".parquet":
        pq = _optional("pyarrow.parquet", "Parquet data", "pyarrow")
        i = 0
        for table in pq.ParquetFile(path).iter_batches(batch_size=1024):
            rows = table.to_pylist()
            for j, row in enumerate(rows):
                if i + j >= start:
                    yield i + j, row
            i += len(rows)
        return
    if path.is_dir():
        ds = _optional("datasets", "a saved Hugging Face dataset", "datasets")
        data = ds.load_from_disk(str(path))
        if isinstance(data, ds.DatasetDict):
            if "train" not in data:
                raise InputError(f"dataset {path} has splits {sorted(data)} and no 'train': "
                                 "pass the folder of one split")
            data = data["train"]
        for i in range(start, len(data)):
            yield i, data[i]
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


def record_parts(record, fields: TextFields, where: str) -> tuple[str, object]:
    """What a record holds: ``("text", str)``, ``("pair", (prompt, response))`` or
    ``("chat", messages)``; an :class:`InputError` naming ``where`` otherwise."""
    if isinstance(record, str):
        return "text", record
    if isinstance(record, dict):
        if record.get(fields.messages) is not None:
            return "chat", _check_messages(record[fields.messages], where, fields.messages)
        if fields.prompt in record:
            for name in (fields.response, COMPLETION):
                if name in record:
                    return "pair", (str(record[fields.prompt]), str(record[name]))
        if fields.text in record:
            return "text", str(record[fields.text])
    raise InputError(f"{where}: a record needs a {fields.text!r} field, {fields.prompt!r} "
                     f"and {fields.response!r} (or {COMPLETION!r}) fields, or a "
                     f"{fields.messages!r} list: set text_field / prompt_field / "
                     "response_field / messages_field")


def _check_messages(messages, where: str, name: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: {name!r} is a {type(messages).__name__}: use a list of "
                         '{"role": ..., "content": ...} objects')
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content"), str):
            raise InputError(f"{where}: {name}[{k}] = {str(m)[:80]!r}: each message is an "
                             'object with a string "role" and a string "content"')
    if not any(m["role"] == "assistant" for m in messages):
        raise InputError(f"{where}: no 'assistant' message: the loss is on the assistant's "
                         "turns, so a chat needs at least one")
    return messages


def record_text(record, fields: TextFields, where: str) -> tuple[str, str | None]:
    """``(prompt or text, response or None)`` of a record (a chat: its messages' text,
    for training a tokenizer)."""
    kind, value = record_parts(record, fields, where)
    if kind == "chat":
        return "\n".join(m["content"] for m in value), None
    return (value, None) if kind == "text" else value


class RendersDifferently(InputError):
    """The chat template renders a turn differently once later turns follow."""


def chat_segments(tokenizer, messages: list[dict], where: str) -> list[tuple[str, bool]]:
    """The conversation rendered by the tokenizer's chat template, cut into
    ``(text, is the assistant's)`` pieces.

    The assistant's text of message ``i`` is what rendering ``messages[:i + 1]`` adds to
    rendering ``messages[:i]`` with the generation prompt (which renders the assistant
    header): so the header is not trained on, the turn's end marker is. A template that
    renders earlier turns differently once later ones follow (Qwen3 drops the thinking
    block of earlier turns) raises :class:`RendersDifferently`."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{where}: a chat record needs a tokenizer with a chat template, "
                          "and this one has none: use the model's instruct tokenizer, set "
                          "tokenizer.chat_template, or write prompt/response records")

    def render(msgs, generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        except Exception as exc:  # noqa: BLE001 - jinja raises its own types
            raise InputError(f"{where}: the chat template fails on this conversation "
                             f"({type(exc).__name__}: {exc})") from None

    full = render(messages, False)
    segments, done = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render(messages[:i], True) if i else ""
        upto = render(messages[:i + 1], False)
        if not (full.startswith(upto) and upto.startswith(head) and len(head) >= done):
            raise RendersDifferently(f"{where}: the chat template renders message {i} "
                                     "differently once later messages follow")
        segments += [(full[done:len(head)], False), (full[len(head):len(upto)], True)]
        done = len(upto)
    segments.append((full[done:], False))
    return [(t, c) for t, c in segments if t]


def chat_documents(tokenizer, messages: list[dict], where: str
                   ) -> list[list[tuple[str, bool]]]:
    """A chat as documents of :func:`chat_segments` pieces: one document, or, when the
    template renders earlier turns differently once later ones follow, one document
    per assistant turn (its history as the template renders it when that turn is
    generated, only that turn counted: what the model sees at inference)."""
    try:
        return [chat_segments(tokenizer, messages, where)]
    except RendersDifferently:
        pass
    docs = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                             add_generation_prompt=True) if i else ""
        upto = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not upto.startswith(head):
            raise InputError(f"{where}: the chat template's generation prompt for message "
                             f"{i} is not how it renders that message, so the assistant "
                             "tokens cannot be found: use a template whose "
                             "add_generation_prompt output starts the assistant turn")
        docs.append([(t, c) for t, c in ((head, False), (upto[len(head):], True)) if t])
    return docs


class Tokens:
    """A record as ``(ids, labels)``, with the tokenizer's own special tokens.

    Text and prompt/response records get the beginning-of-text token when the tokenizer
    adds one itself (Llama 3, Gemma; not Qwen) and always end with the end-of-text token;
    the beginning token is not a target. Chats get exactly what the chat template writes
    (its BOS and turn markers) and nothing else."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:   # fast path, and no "longer than max length" warnings
            self.encode = lambda text: backend.encode(text, add_special_tokens=False).ids
        else:
            self.encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
        self.eos = tokenizer.eos_token_id
        if self.eos is None:
            raise ConfigError("the tokenizer has no end-of-text token (eos_token): set one "
                              "in the model's tokenizer_config.json")
        bos = getattr(tokenizer, "bos_token_id", None)
        probe = tokenizer.encode("a", add_special_tokens=True) if bos is not None else []
        self.bos = bos if probe and probe[0] == bos else None
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad = self.eos if pad is None else pad

    def documents(self, record, fields: TextFields, where: str
                  ) -> list[tuple[list[int], list[int]]]:
        """The record's documents as ``(ids, labels)``: one, or one per assistant turn of
        a chat whose template renders history differently (:func:`chat_documents`)."""
        kind, value = record_parts(record, fields, where)
        head = [] if self.bos is None else [self.bos]
        if kind == "text":
            ids = self.encode(value) + [self.eos]
            return [(head + ids, [IGNORE] * len(head) + ids)]
        if kind == "pair":
            p, r = head + self.encode(value[0]), self.encode(value[1]) + [self.eos]
            return [(p + r, [IGNORE] * len(p) + r)]
        docs = []
        for segments in chat_documents(self.tokenizer, value, where):
            ids, labels = [], []
            for text, counts in segments:
                t = self.encode(text)
                ids += t
                labels += t if counts else [IGNORE] * len(t)
            docs.append((ids, labels))
        return docs

    def record(self, record, fields: TextFields, where: str) -> tuple[list[int], list[int]]:
        """A record that is one document as ``(ids, labels)`` (several: concatenated)."""
        docs = self.documents(record, fields, where)
        return [i for d in docs for i in d[0]], [x for d in docs for x in d[1]]


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
                return self.tokens.documents(rec, self.fields, f"{path}:{i + 1}")
            self.file_pos, self.record, self._records = self.file_pos + 1, 0, None

    def next_row(self) -> tuple[list[int], list[int], list[int] | None, list[int] | None] | None:
        """``(ids, labels, position ids or None, attention mask or None)`` of the next
        ``seq``-token sequence; None when a held-out pass ends."""
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
                self.carry_labels += labels
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
        """The next :class:`Batch` (``[batch, seq]`` tensors)."""
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
