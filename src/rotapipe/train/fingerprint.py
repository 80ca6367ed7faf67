"""Fingerprints of a run's files (data, pretrained model): each file's size and a hash
of its ends, kept in a checkpoint's ``meta.json`` so that a resume can say what changed.
"""

from __future__ import annotations

import hashlib

from .hub import HubSplit

__all__ = ["FINGERPRINT_BYTES", "data_changes", "data_fingerprint"]

FINGERPRINT_BYTES = 64 * 1024
"""Bytes at each end of a data file that :func:`data_fingerprint` hashes."""


def data_fingerprint(files) -> dict[str, list]:
    """``{path: [size, hash of its first and last FINGERPRINT_BYTES]}`` of the plain data
    files (saved and hub datasets are left out): kept in a checkpoint's ``meta.json``,
    so that a resume can say the data changed (:func:`data_changes`). Cheap on any
    corpus; an edit in the middle of a large file that keeps its size goes unseen."""
    out = {}
    for f in files:
        if isinstance(f, HubSplit) or not f.is_file():
            continue
        size = f.stat().st_size
        h = hashlib.blake2b(digest_size=16)
        with open(f, "rb") as fh:
            h.update(fh.read(FINGERPRINT_BYTES))
            if size > FINGERPRINT_BYTES:
                fh.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
                h.update(fh.read())
        out[str(f)] = [size, h.hexdigest()]
    return out


def data_changes(saved, now: dict[str, list]) -> str | None:
    """What changed in the data files since ``saved`` (a :func:`data_fingerprint`; not a
    dict in a checkpoint from before it was kept: nothing to say), or ``None``."""
    if not isinstance(saved, dict):
        return None
    changed = [p for p in now if p in saved and list(saved[p]) != now[p]]
    added = [p for p in now if p not in saved]
    removed = [p for p in saved if p not in now]
    parts = []
    for what, paths in (("changed", changed), ("new", added), ("gone", removed)):
        if paths:
            more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
            parts.append(f"{what}: {paths[0]}{more}")
    return "; ".join(parts) or None
