"""A record's tokens: chats rendered with the tokenizer's own chat template (the loss on
the assistant turns only), and :class:`Tokens`, which makes a record into one or more
documents of token ids and labels (``-100`` where a token does not count): the
beginning-of-text token as the tokenizer adds it, the end-of-text token after text and
responses. The records themselves are :mod:`rotapipe.train.records`'.
"""

from __future__ import annotations

from ..errors import ConfigError, InputError
from .records import (IGNORE, RECORD_SUFFIXES, TextFields, is_empty, iter_records,
                      record_parts)

__all__ = ["Tokens", "RendersDifferently", "chat_documents", "chat_segments", "check_chats"]


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
        head = _head(render, messages, i)
        upto = render(messages[:i + 1], False)
        if not (full.startswith(upto) and upto.startswith(head) and len(head) >= done):
            raise RendersDifferently(f"{where}: the chat template renders message {i} "
                                     "differently once later messages follow")
        segments += [(full[done:len(head)], False), (full[len(head):len(upto)], True)]
        done = len(upto)
    segments.append((full[done:], False))
    return [(t, c) for t, c in segments if t]


_SENTINEL = "rotapipe0opening0sentinel"


def _head(render, messages: list[dict], i: int) -> str:
    """What the template renders before assistant message ``i``'s own text (not trained
    on): ``messages[:i]`` with the generation prompt. A chat that opens with the
    assistant has no earlier messages, and transformers renders no empty conversation:
    its head is what the template writes before that message's content (BOS, a default
    system prompt, the assistant header), found with a sentinel content. It was none,
    and all of that was trained on as the assistant's."""
    if i:
        return render(messages[:i], True)
    probe = render([{**messages[0], "content": _SENTINEL}], False)
    at = probe.find(_SENTINEL)
    head = probe[:at] if at > 0 else ""
    # A template that renders this content's opening otherwise: counted as before.
    return head if render(messages[:1], False).startswith(head) else ""


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
        head = _head(lambda msgs, prompt: tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=prompt), messages, i)
        upto = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not upto.startswith(head):
            raise InputError(f"{where}: the chat template's generation prompt for message "
                             f"{i} is not how it renders that message, so the assistant "
                             "tokens cannot be found: use a template whose "
                             "add_generation_prompt output starts the assistant turn")
        docs.append([(t, c) for t, c in ((head, False), (upto[len(head):], True)) if t])
    return docs


def check_chats(files, tokenizer, fields: TextFields) -> int:
    """Render every chat record of ``files`` with the tokenizer's chat template (as
    :func:`chat_documents` does, without tokenizing), so that a template failing on any
    record (a role it refuses, its own ``raise_exception``) fails before training,
    naming ``file:line``, rather than at the step that first reads the record. Returns
    the number of chats rendered."""
    chats = 0
    for path in files:
        if path.is_file() and path.suffix not in RECORD_SUFFIXES:
            continue                                  # a text file holds no chats
        for i, rec in iter_records(path):
            where = f"{path}:{i + 1}"
            kind, value = record_parts(rec, fields, where)
            if kind == "chat":
                chat_documents(tokenizer, value, where)
                chats += 1
    return chats


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
        a chat whose template renders history differently (:func:`chat_documents`);
        none for an empty record (:func:`~rotapipe.train.records.is_empty`: it would
        train on the end-of-text token alone)."""
        kind, value = record_parts(record, fields, where)
        if is_empty(kind, value):
            return []
        head = [] if self.bos is None else [self.bos]
        if kind == "text":
            # A chunk of a text file: the file's first chunk alone opens the document,
            # its last alone ends it (records.TextChunk).
            head = head if getattr(value, "first", True) else []
            ids = self.encode(value) + ([self.eos] if getattr(value, "last", True) else [])
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
