"""A checkpoint's manifest: the size and the CRC-32s of every file of it, written last
by a save, checked by a resume (``checkpoint.py``'s module docstring).

A file truncated, deleted or changed later (a flipped bit) no longer matches, and
resuming falls back to the newest checkpoint that is whole. The CRCs cover every
:data:`CRC_PIECE` bytes, computed on several threads (``zlib.crc32`` releases the GIL).
"""

from __future__ import annotations

import json
import os
import pathlib
import zlib
from concurrent.futures import ThreadPoolExecutor

from ..errors import CheckpointError

__all__ = ["MANIFEST", "CRC_PIECE", "write_manifest", "verify_checkpoint",
           "verify_checksums"]

MANIFEST = "manifest.json"
CRC_PIECE = 1 << 26
"""The manifest keeps a CRC-32 of every 64 MiB of each file (pieces checked in parallel)."""


def write_manifest(path: pathlib.Path) -> None:
    """Write checkpoint ``path``'s manifest (:func:`_sizes`), last, before its fsync."""
    (path / MANIFEST).write_text(json.dumps(_sizes(path), indent=1))


def _sizes(path: pathlib.Path) -> dict[str, dict]:
    """``{relative file path: {"bytes": size, "crc32": [hex, ...]}}`` of every file of a
    checkpoint but the manifest (:func:`_crc32s`)."""
    files = [f for f in sorted(path.rglob("*")) if f.is_file() and f.name != MANIFEST]
    return {f.relative_to(path).as_posix(): {"bytes": f.stat().st_size, "crc32": crcs}
            for f, crcs in zip(files, _crc32s(files))}


def _crc32s(files: list[pathlib.Path]) -> list[list[str]]:
    """Each file's CRC-32s, one per :data:`CRC_PIECE` bytes, the pieces read in parallel
    (``zlib.crc32`` releases the GIL): a checkpoint of hundreds of GB is read back at
    the disk's or the page cache's speed, not at one core's (about 1 GB/s)."""
    jobs = [(i, off) for i, f in enumerate(files)
            for off in range(0, f.stat().st_size, CRC_PIECE)]

    def one(job):
        with open(files[job[0]], "rb") as fh:
            fh.seek(job[1])
            crc, left = 0, CRC_PIECE
            while left and (chunk := fh.read(min(left, 1 << 24))):
                crc, left = zlib.crc32(chunk, crc), left - len(chunk)
        return f"{crc:08x}"
    with ThreadPoolExecutor(max_workers=max(1, min(16, os.cpu_count() or 1, len(jobs)))) \
            as pool:
        crcs = list(pool.map(one, jobs))
    out: list[list[str]] = [[] for _ in files]
    for (i, _), crc in zip(jobs, crcs):
        out[i].append(crc)
    return out


def _manifest(path: pathlib.Path) -> list[tuple[str, int, list | None]]:
    """``(file, bytes, CRC-32s or None)`` of ``path``'s manifest, checked to be what a save
    writes (a bare size: a manifest from before checksums); ``[]`` without one."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return []
    try:
        want = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable "
                              f"({type(exc).__name__})") from None
    if not isinstance(want, dict):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a JSON object (it holds "
                              f"a {type(want).__name__}; a save writes {{file: {{bytes, "
                              "crc32}})")
    out = []
    for name, entry in want.items():
        rel = pathlib.PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} names {name!r}, which is "
                                  "not a file inside the checkpoint")
        size, crc = (entry.get("bytes"), entry.get("crc32")) if isinstance(entry, dict) \
            else (entry, None)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} gives {name} a size of "
                                  f"{size!r}, not a number of bytes")
        if crc is not None and not (isinstance(crc, list)
                                    and all(isinstance(c, str) for c in crc)):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} gives {name} the checksums "
                                  f"{crc!r}, not a list of CRC-32s")
        out.append((name, size, crc))
    return out


def verify_checkpoint(path: pathlib.Path) -> None:
    """Raise :class:`CheckpointError` naming the first file of ``path`` that is missing
    or not the size its manifest says, or the manifest when it is not the object of
    ``{file: {"bytes", "crc32"}}`` a save writes (checkpoints written before manifests
    existed are only checked by reading them). The checksums: :func:`verify_checksums`."""
    for name, size, _ in _manifest(path):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path}: {name} has {f.stat().st_size} bytes, "
                                  f"{size} were written (truncated or overwritten)")


def verify_checksums(path: pathlib.Path) -> None:
    """Raise :class:`CheckpointError` naming the first file of ``path`` whose CRC-32 is
    not its manifest's: changed after the save, its size kept (a flipped bit on disk),
    which neither the sizes nor reading the file finds. Reads every file once."""
    entries = [(n, c) for n, _, c in _manifest(path) if c is not None]
    try:
        got = _crc32s([path / n for n, _ in entries])
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(exc).__name__}: "
                              f"{exc.strerror or exc})") from None
    for (name, want), have in zip(entries, got):
        want = [w.lower() for w in want]
        if have != want:
            i = next((i for i, (a, b) in enumerate(zip(have, want)) if a != b),
                     min(len(have), len(want)))
            where = f" in bytes {i * CRC_PIECE}.." if len(have) > 1 else ""
            raise CheckpointError(
                f"checkpoint {path}: {name} has CRC-32 {(have + ['-'])[i]}{where}, "
                f"{(want + ['-'])[i]} was written (its bytes changed after the save)")
