"""Records: data files read one record at a time, and what a record holds (plain text,
a prompt/response pair or a chat).

A *record* is one JSONL line (a ``.json`` file may hold JSON Lines too), one object
of a JSON list, one row of a Parquet file, of a saved Hugging Face dataset or of a hub
dataset loaded by name (:func:`hub_dataset`), or a chunk of about 32 KiB of lines of a
text file (a longer line is cut at a space; the file stays one document:
:class:`TextChunk`). :mod:`rotapipe.train.tokens` makes a record into documents of
token ids and labels; :mod:`rotapipe.train.data` packs them into sequences.
"""

from __future__ import annotations

import functools
import json
import logging
import pathlib
import stat
import sysconfig
from collections.abc import Iterator

from ..errors import ConfigError, InputError
from .fingerprint import FINGERPRINT_BYTES, data_changes, data_fingerprint  # noqa: F401
from .hub import HubSplit, hub_dataset

__all__ = ["IGNORE", "TEXT_SUFFIXES", "RECORD_SUFFIXES", "CHUNK_CHARS", "COMPLETION",
           "CONVERSATIONS", "SHAREGPT_ROLES", "HubSplit", "TextChunk", "TextFields",
           "check_text", "data_changes", "data_fingerprint", "hub_dataset", "is_dataset_dir",
           "is_empty", "iter_records", "record_parts", "record_text", "source_files",
           "stdlib_files"]

log = logging.getLogger("rotapipe.train")

IGNORE = -100
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".text")
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
"""Files read as records (not as text): JSON lines, a JSON list, Parquet."""
CHUNK_CHARS = 32 * 1024
COMPLETION = "completion"
"""Accepted in place of ``response_field`` (TRL's prompt/completion records)."""
CONVERSATIONS = "conversations"
"""Accepted in place of ``messages_field`` (ShareGPT's chats)."""
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}
"""ShareGPT's role names and the chat template's (``system`` is the same in both)."""


class TextFields:
    """Which record fields hold a document (``text``), a prompt/response pair or a chat
    (``messages``: a list of ``{"role", "content"}``)."""

    def __init__(self, text: str = "text", prompt: str = "prompt", response: str = "response",
                 messages: str = "messages"):
        self.text, self.prompt, self.response, self.messages = text, prompt, response, messages


# -- files and records -------------------------------------------------------------------
def stdlib_files() -> list[pathlib.Path]:
    """The running interpreter's standard library ``.py`` files (no site-packages)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def source_files(spec: str, config: str | None = None, split: str | None = None,
                 what: str = "data") -> list[pathlib.Path]:
    """Resolve ``data``: comma-separated files, directories and hub dataset names
    (:func:`hub_dataset`, with ``config`` and the default ``split``), or ``stdlib``."""
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
            files += _one_kind(part, found)
        elif p.is_file():
            files.append(p)
        elif p.exists():
            raise ConfigError(f"data file {part!r} is a {_file_kind(p)}, not a regular "
                              "file: pass a file or a directory of files")
        elif _hub_dataset_spec(part):
            files.append(hub_dataset(part, config, split, what))
        else:
            raise ConfigError(f"data file {part!r} does not exist: check the path "
                              "(data is a comma-separated list of files or directories)")
    if not files:
        raise ConfigError("data is empty: pass files or directories (or 'stdlib')")
    for f in files:
        if f.is_file() and f.suffix != ".parquet":
            check_text(f)
    if all(f.is_file() and _blank(f) for f in files):
        raise ConfigError(f"data files {', '.join(map(str, files[:3]))} are empty (or hold "
                          "only blank lines): pass files that hold text")
    return files


def _one_kind(folder: str, found: list[pathlib.Path]) -> list[pathlib.Path]:
    """The files of a data directory of the kind most of them are: record files
    (.jsonl .json .parquet) or text files (.txt .md .py ...), records on a tie. A
    README.md beside the JSONL shards was trained on as text (and a package.json in a
    folder of code read as records), where ``datasets.load_dataset`` reads the files of
    the directory's most common format only. The others are named in a warning."""
    records = [f for f in found if f.suffix in RECORD_SUFFIXES]
    texts = [f for f in found if f.suffix not in RECORD_SUFFIXES]
    if not records or not texts:
        return found
    keep, drop = (records, texts) if len(records) >= len(texts) else (texts, records)
    more = f" and {len(drop) - 1} more" if len(drop) > 1 else ""
    what = "record" if keep is records else "text"
    log.warning(f"data directory {folder!r}: reading its {len(keep)} {what} files, not "
                f"{drop[0]}{more} (a directory is read as one kind of file, the kind most "
                "of its files are): list a file in data to read it too")
    return keep


def _blank(path: pathlib.Path) -> bool:
    """Empty, or only whitespace (blank lines) in a small file: else the run trains a
    tokenizer and builds the model before the data setup finds no records."""
    size = path.stat().st_size
    if size > SNIFF_BYTES:
        return False
    with open(path, "rb") as f:
        return not f.read().strip()


def _file_kind(path: pathlib.Path) -> str:
    """What a path that is neither a file nor a directory is (``/dev/null``: a character
    device)."""
    mode = path.stat().st_mode
    for test, kind in ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return kind
    return "special file"


def describe_sources(files) -> str:
    """What :func:`source_files` resolved, for the run summary: ``3 files``, ``1 saved
    dataset``, ``dataset split org/name:train (1,000 rows)``, joined by commas."""
    splits = [f for f in files if isinstance(f, HubSplit)]
    saved = sum(1 for f in files if f not in splits and f.is_dir())
    plain = len(files) - len(splits) - saved
    parts = [f"{n} {what}{'s' if n != 1 else ''}"
             for n, what in ((plain, "file"), (saved, "saved dataset")) if n]
    parts += [f"dataset split {f} ({len(f):,} rows)" for f in splits]
    return ", ".join(parts)


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


def _json_list(path: pathlib.Path) -> list | None:
    """:func:`_read_json_list`, kept for the few files read last (the order reads a
    list's spans of records one at a time: :mod:`rotapipe.train.order`)."""
    st = path.stat()
    return _json_list_of(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _json_list_of(path: str, size: int, mtime: int) -> list | None:
    return _read_json_list(pathlib.Path(path))


def _read_json_list(path: pathlib.Path) -> list | None:
    """A ``.json`` data file: a list of records (read whole; use JSONL for big data), or
    None when it holds JSON Lines (an object, then more after it: what ``datasets``'
    json loader reads from a ``.json`` file too; it was refused as "line 2: not valid
    JSON (Extra data)")."""
    try:
        text = path.read_text(encoding="utf-8-sig")                 # a BOM may open it
    except UnicodeDecodeError as exc:
        raw = path.read_bytes()
        at = exc.start + (3 if raw.startswith(b"\xef\xbb\xbf") else 0)   # after a BOM
        line = raw.count(b"\n", 0, at) + 1
        raise InputError(f"{path}:{line}: not UTF-8 text (byte {at} of the file): a .json "
                         "data file is UTF-8 JSON; save it as UTF-8") from None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and text.lstrip().startswith("{"):
            return None
        raise InputError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(values, list):
        raise InputError(f"{path} holds a JSON {type(values).__name__}: a .json data file "
                         "is a list of records (one object per record), or use JSONL")
    return values


def _hub_dataset_spec(part: str) -> bool:
    """``org/name[:split]`` that is not a missing file (``corpus/train.jsonl``)."""
    from .hub import is_hub_id
    name = part.split(":", 1)[0]
    return pathlib.PurePath(name).suffix not in TEXT_SUFFIXES + RECORD_SUFFIXES and \
        is_hub_id(name)


def is_dataset_dir(path: pathlib.Path) -> bool:
    """A folder ``datasets.Dataset.save_to_disk`` wrote (``state.json`` + ``.arrow``)."""
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


class TextChunk(str):
    """A record of a text file: about :data:`CHUNK_CHARS` of its lines. The file is one
    document: only its ``first`` chunk gets the beginning-of-text token and only its
    ``last`` the end-of-text token (:class:`~rotapipe.train.tokens.Tokens`); every chunk
    had both, which trained the model to end a document at a line in its middle (480
    such end-of-text targets in the demo's 1,790 files)."""

    def __new__(cls, text: str, *, first: bool, last: bool):
        chunk = super().__new__(cls, text)
        chunk.first, chunk.last = first, last
        return chunk


def iter_records(path: pathlib.Path, start: int = 0, *, stop: int | None = None,
                 offset: int | None = None, first: int = 0, group: int | None = None
                 ) -> Iterator[tuple[int, object]]:
    """``(record index, record)`` of one source from record ``start`` on (before
    ``stop``): a parsed JSONL line, JSON list item, Parquet row or dataset row (dict),
    or a text chunk (str). ``offset``: the byte offset of JSONL line ``first`` (read
    from there); ``group``: the Parquet row group, starting at record ``first``, that
    holds the records (:mod:`rotapipe.train.order`'s spans)."""
    if stop is not None:
        for i, rec in iter_records(path, start, offset=offset, first=first, group=group):
            if i >= stop:
                return
            yield i, rec
        return
    if path.suffix == ".json" and offset is None:
        values = _json_list(path)
        if values is not None:
            yield from enumerate(values[start:], start)
            return
    if path.suffix in (".jsonl", ".json"):                  # .json: JSON Lines in it
        with open(path, "rb") as f:
            if offset is not None:
                f.seek(offset)
            for i, raw in enumerate(f, first if offset is not None else 0):
                if i < start or not raw.strip():
                    continue
                try:
                    # utf-8-sig: a byte-order mark (Notepad, PowerShell) opens the file
                    line = raw.decode("utf-8-sig" if i == 0 else "utf-8")
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
    if path.suffix == ".parquet":
        pq = _optional("pyarrow.parquet", "Parquet data", "pyarrow")
        i = first if group is not None else 0
        groups = {} if group is None else {"row_groups": [group]}
        for table in pq.ParquetFile(path).iter_batches(batch_size=1024, **groups):
            rows = table.to_pylist()
            for j, row in enumerate(rows):
                if i + j >= start:
                    yield i + j, row
            i += len(rows)
        return
    if isinstance(path, HubSplit):
        yield from _rows(path.data, start)
        return
    if path.is_dir():
        ds = _optional("datasets", "a saved Hugging Face dataset", "datasets")
        data = ds.load_from_disk(str(path))
        if isinstance(data, ds.DatasetDict):
            if "train" not in data:
                raise InputError(f"dataset {path} has splits {sorted(data)} and no 'train': "
                                 "pass the folder of one split")
            data = data["train"]
        yield from _rows(data, start)
        return
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        before = None                         # one chunk behind: is it the file's last?
        for i, text in enumerate(_chunks(f)):
            if before is not None and i > start:
                yield i - 1, TextChunk(before, first=i == 1, last=False)
            before = text
        if before is not None and i >= start:
            yield i, TextChunk(before, first=i == 0, last=True)


def _chunks(lines) -> Iterator[str]:
    """The text of ``lines`` in chunks of whole lines (:func:`_pieces` of a long one) of
    at least :data:`CHUNK_CHARS` characters, the last one shorter."""
    chunk, size = [], 0
    for line in lines:
        for piece in _pieces(line):
            chunk.append(piece)
            size += len(piece)
            if size >= CHUNK_CHARS:
                yield "".join(chunk)
                chunk, size = [], 0
    if chunk:
        yield "".join(chunk)


def _pieces(line: str) -> Iterator[str]:
    """``line`` in pieces of at most :data:`CHUNK_CHARS` characters, each cut after the
    last whitespace before that length when there is one. A line longer than a chunk (a
    book on one line, minified code) was one record: a 24 MB line packed into a single
    lane, and the run failed with "lane 1 of the training split is empty"."""
    while len(line) > CHUNK_CHARS:
        cut = max(line.rfind(" ", 0, CHUNK_CHARS), line.rfind("\t", 0, CHUNK_CHARS)) + 1
        cut = cut or CHUNK_CHARS
        yield line[:cut]
        line = line[cut:]
    yield line


def _rows(data, start: int, batch: int = 1024) -> Iterator[tuple[int, dict]]:
    """``(index, row)`` of a ``datasets.Dataset`` from row ``start`` on, read in slices
    of ``batch`` rows (one Arrow read per slice, not per row)."""
    for i in range(start, len(data), batch):
        columns = data[i:i + batch]                      # {column: [values]}
        names = list(columns)
        for j, values in enumerate(zip(*columns.values())):
            yield i + j, dict(zip(names, values))


def record_parts(record, fields: TextFields, where: str) -> tuple[str, object]:
    """What a record holds: ``("text", str)``, ``("pair", (prompt, response))`` or
    ``("chat", messages)`` (ShareGPT's ``conversations``, ``from``/``value`` and
    ``human``/``gpt`` read as ``messages``, ``role``/``content`` and ``user``/
    ``assistant``); an :class:`InputError` naming ``where`` and the field otherwise (a
    field that is null or not a string is never made into text, a record that holds two
    forms is not guessed at)."""
    if isinstance(record, str):
        return "text", record
    forms = _forms(record, fields) if isinstance(record, dict) else []
    form = _form(record, forms)
    if form is None:
        raise InputError(f"{where}: a record needs a {fields.text!r} field, {fields.prompt!r} "
                         f"and {fields.response!r} (or {COMPLETION!r}) fields, or a "
                         f"{fields.messages!r} (or {CONVERSATIONS!r}) list: set text_field / "
                         "prompt_field / response_field / messages_field")
    whole = [f for f in forms if all(record.get(n) is not None for n in f[1])]
    if len(whole) > 1:
        held = " and ".join(" and ".join(map(repr, names)) for _, names in whole)
        raise InputError(f"{where}: the record holds {held}: it is {_FORMS[whole[0][0]]} "
                         f"and {_FORMS[whole[1][0]]} at once, and which one to train on "
                         "is ambiguous; keep one form's fields in each record (or point "
                         "text_field / prompt_field / response_field / messages_field at "
                         "the field the form you mean uses)")
    kind, names = form
    if kind == "chat":
        return "chat", _check_messages(record[names[0]], where, names[0])
    values = tuple(_string(record, name, where) for name in names)
    return ("pair", values) if kind == "pair" else ("text", values[0])


_FORMS = {"chat": "a chat", "pair": "a prompt/response pair", "text": "a text"}


def is_empty(kind: str, value) -> bool:
    """A record with nothing to learn but the end-of-text token: a text that is empty
    or blank, or a pair whose response is. Such records are skipped (and counted)."""
    if kind == "text":
        # A blank last chunk of a text file still ends it (TextChunk): not empty.
        return not value.strip() and not (getattr(value, "last", True) and
                                          not getattr(value, "first", True))
    return kind == "pair" and not value[1].strip()


def _forms(record: dict, fields: TextFields) -> list[tuple[str, tuple[str, ...]]]:
    """The forms whose fields a dict record has, as ``(kind, field names)``, in the order
    chat, pair, text (``completion`` for a pair's response, ``conversations`` for a
    chat's messages when the named fields are missing or null)."""
    answer = [n for n in (fields.response, COMPLETION) if n in record]
    answer.sort(key=lambda n: record[n] is None)          # a non-null one first
    chat = fields.messages
    if record.get(chat) is None and record.get(CONVERSATIONS) is not None:
        chat = CONVERSATIONS
    forms = [("chat", (chat,)), ("text", (fields.text,))]
    if fields.prompt in record and answer:
        forms.insert(1, ("pair", (fields.prompt, answer[0])))
    return forms


def _form(record: dict, forms) -> tuple[str, tuple[str, ...]] | None:
    """``(kind, its field names)`` of a dict record: the first of its ``forms`` with a
    field holding a value; else (every such field null) the first whose fields are
    there, so that the error names the null field. Parquet and dataset rows hold every
    column, null where a row has none: such a null does not hide the row's form."""
    for kind, names in forms:
        if any(record.get(n) is not None for n in names):
            return kind, names
    return next(((kind, names) for kind, names in forms if all(n in record for n in names)),
                None)


def _string(record: dict, name: str, where: str) -> str:
    """The string in field ``name``; an :class:`InputError` when it is null or another
    type (``str()`` of it would train on "None" or "['a', 'b']")."""
    value = record[name]
    if isinstance(value, str):
        return value
    raise InputError(f"{where}: {name!r} is {_kind(value)}: expected a string; fix or "
                     "remove the record")


def _kind(value) -> str:
    """``null``, ``an int (5)``, ``a list (['a', 'b'])``: what a JSON value is."""
    if value is None:
        return "null"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name} ({str(value)[:40]})"


_MESSAGE = ('each message is an object with a string "role" and a string "content" '
            '(ShareGPT\'s "from" and "value" are read too)')


def _check_messages(messages, where: str, name: str) -> list[dict]:
    """The chat's messages as ``{"role", "content", ...}`` objects, ShareGPT's names
    mapped (``from``/``value``; roles ``human``/``gpt``: :data:`SHAREGPT_ROLES`)."""
    if isinstance(messages, list) and not messages:
        raise InputError(f"{where}: {name!r} is an empty list: a chat needs its messages, "
                         "at least one of them the assistant's; fix or remove the record")
    if not isinstance(messages, list):
        raise InputError(f"{where}: {name!r} is {_kind(messages)}: use a list of "
                         '{"role": ..., "content": ...} objects')
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InputError(f"{where}: {name}[{k}] = {str(m)[:80]!r}: {_MESSAGE}")
        # role/content first; ShareGPT's from/value when the message has them instead
        keys = ["role" if "role" in m or "from" not in m else "from",
                "content" if "content" in m or "value" not in m else "value"]
        for key in keys:
            if not isinstance(m.get(key), str):
                got = "missing" if key not in m else _kind(m[key])
                raise InputError(f"{where}: {name}[{k}][{key!r}] is {got}: {_MESSAGE}")
        role = SHAREGPT_ROLES.get(m[keys[0]], m[keys[0]])
        if keys != ["role", "content"] or role != m.get("role"):
            m = {**{x: v for x, v in m.items() if x not in ("from", "value")},
                 "role": role, "content": m[keys[1]]}
        out.append(m)
    if not any(m["role"] == "assistant" for m in out):
        found = ", ".join(dict.fromkeys(repr(m["role"]) for m in out))
        raise InputError(f"{where}: no 'assistant' message (the roles are {found}): the "
                         "loss is on the assistant's turns, so a chat needs at least one; "
                         "the roles are 'system', 'user' and 'assistant' (ShareGPT's "
                         "'human' and 'gpt' are read as 'user' and 'assistant')")
    return out


def record_text(record, fields: TextFields, where: str) -> tuple[str, str | None]:
    """``(prompt or text, response or None)`` of a record (a chat: its messages' text,
    for training a tokenizer)."""
    kind, value = record_parts(record, fields, where)
    if kind == "chat":
        return "\n".join(m["content"] for m in value), None
    return (value, None) if kind == "text" else value
