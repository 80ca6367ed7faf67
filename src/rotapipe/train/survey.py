"""Reading the data once before the tokenizer and the model are built: every record
parsed (a bad one fails with its ``file:line``), empty records counted, and the training
split checked to hold a record to learn from.

:func:`rotapipe.train.loop.train` calls these first, so that data that cannot train
fails in a second, not after the model is built.
"""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError, InputError
from .data import is_heldout
from .records import RECORD_SUFFIXES, TextFields, is_empty, iter_records, record_parts

__all__ = ["DataSurvey", "check_data", "check_lanes"]


@dataclasses.dataclass
class DataSurvey:
    """What :func:`check_data` found in the record files (text files are not read)."""

    records: int = 0
    """Records read."""
    empty: int = 0
    """Records with nothing to learn (:func:`~rotapipe.train.records.is_empty`): skipped."""
    first_empty: str | None = None
    """``file:line`` of the first empty record."""


def check_data(files, fields: TextFields, what: str = "data") -> DataSurvey:
    """Read every record of the record files once (streaming) so a bad one fails before
    training; count the empty ones, and refuse data whose every record is empty."""
    survey = DataSurvey()
    for path in files:
        if path.suffix != ".parquet" and path.is_file() and path.suffix not in (".jsonl",
                                                                                ".json"):
            continue                                        # text: every chunk is good
        for i, rec in iter_records(path):
            where = f"{path}:{i + 1}"
            kind, value = record_parts(rec, fields, where)
            survey.records += 1
            if is_empty(kind, value):
                survey.empty += 1
                survey.first_empty = survey.first_empty or where
    text_files = any(p.is_file() and p.suffix not in RECORD_SUFFIXES for p in files)
    if survey.records and survey.empty == survey.records and not text_files:
        raise InputError(
            f"every record of {what} is empty ({survey.empty} of them, the first at "
            f"{survey.first_empty}: a blank {fields.text!r}, or a blank response), so there "
            "is nothing to learn but the end-of-text token: fill in the records, or check "
            "that text_field / response_field name the fields that hold the text")
    return survey


def check_lanes(files, fields: TextFields, *, batch: int, microbatches: int,
                holdout: float) -> None:
    """The training split holds a record to learn from (read until the first one),
    before the tokenizer and the model are built. Every row of the batch then gets
    records: the rows draw from one shared order (:mod:`rotapipe.train.order`), so a
    split smaller than the batch repeats its records within a step, as further epochs
    do. (Each row used to pack its own hash-chosen share, and a split of a few times
    ``batch`` records left rows with none.)"""
    seen = 0
    for path in files:
        for i, rec in iter_records(path):
            seen += 1
            if not is_heldout(path, i, holdout) and \
                    not is_empty(*record_parts(rec, fields, f"{path}:{i + 1}")):
                return
    raise ConfigError(f"the training split is empty: each of the {seen} records of the "
                      f"data is held out (holdout={holdout:g}) or empty: lower --holdout "
                      "(--holdout 0 trains on every record), or add data")
