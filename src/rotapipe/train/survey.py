"""Reading the data once before the tokenizer and the model are built: every record
parsed (a bad one fails with its ``file:line``), empty records counted, and every row of
the batch checked to get training records.

:func:`rotapipe.train.loop.train` calls these first, so that data that cannot train
fails in a second, not after the model is built.
"""

from __future__ import annotations

import dataclasses
import math

from ..errors import ConfigError, InputError
from .data import is_heldout, lane_of
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


SUGGEST_LIMIT = 5_000
"""Training records up to which :func:`check_lanes` works out a batch that fits."""


def check_lanes(files, fields: TextFields, *, batch: int, microbatches: int,
                holdout: float) -> None:
    """Every row of the batch (a *lane*: :class:`~rotapipe.train.data.TrainBatches`)
    packs its own share of the training records, chosen by a hash of file name and
    record index; a row with none cannot be filled. Checked from the records alone (no
    tokenizer), stopping as soon as every row has a record: on a real corpus that is
    after a few times ``batch`` records."""
    filled: set[int] = set()
    seen = []                            # the training records' row hashes, while few
    for path in files:
        for i, rec in iter_records(path):
            if is_heldout(path, i, holdout) or is_empty(*record_parts(rec, fields, "")):
                continue
            key = lane_of(path, i, 2**64)        # the row's hash, before "% batch"
            filled.add(key % batch)
            if len(filled) == batch:
                return
            if len(seen) <= SUGGEST_LIMIT:
                seen.append(key)
    n = len(seen)
    rows = [r for r in range(batch) if r not in filled]
    fixes = ["add data (a hash fills every row once the training split holds a few "
             "times batch records)"]
    fit = _largest_batch(seen, batch) if n <= SUGGEST_LIMIT else None
    if fit:
        m = math.gcd(fit, microbatches)
        fixes.append(f"use --batch {fit}" + (f" --microbatches {m}" if m != microbatches
                                             else "") + " (every row of it gets records)")
    if holdout:
        fixes.append("lower --holdout")
    more = f" and {len(rows) - 3} more" if len(rows) > 3 else ""
    raise ConfigError(
        f"the training split has {n} record{'s' if n != 1 else ''} (holdout={holdout:g}, "
        f"empty records skipped) for batch={batch}: each of the batch's {batch} rows packs "
        f"its own share of the records, chosen by a hash of file name and record index, "
        f"and {len(rows)} rows get none (row {', '.join(map(str, rows[:3]))}{more}): "
        + ", ".join(fixes[:-1]) + (" or " if len(fixes) > 1 else "") + fixes[-1])


def _largest_batch(seen: list[int], batch: int) -> int | None:
    """The largest batch below ``batch`` whose every row gets one of the training
    records whose row hashes are ``seen``, or None."""
    import numpy as np
    keys = np.array(seen, dtype=np.uint64)
    for b in range(min(batch - 1, len(seen)), 0, -1):
        if np.unique(keys % np.uint64(b)).size == b:
            return b
    return None
