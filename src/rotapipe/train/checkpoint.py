"""Checkpoints written atomically: a complete directory appears, or nothing does.

Layout of ``out_dir/checkpoints/step-00000050/``:

- ``masters.safetensors``: the fp32 master weights (trainable parameters, HF names);
  the compute-dtype copies are derived from them, frozen weights come from the model
- ``state.pt``: optimizer, LR scheduler, pipeline counters and loss scaler, RNG states,
  data cursor (``torch.load(weights_only=True)`` reads it)
- ``meta.json``: step, plan, the model fingerprint (parameter names and shapes,
  architecture) and the config
- ``tokenizer/``: the tokenizer the run uses
- ``shard-<rank>-of-<world>.pt`` (``TrainConfig.shard``, torchrun): each rank's pieces
  of the fp32 masters and the optimizer state; ``masters.safetensors`` is then their
  consolidation and ``state.pt`` holds no optimizer state
  (:func:`save_sharded_checkpoint`; docs/distributed.md, "Sharded checkpoints")
- ``manifest.json`` (``manifest.py``): the size in bytes of every other file and a
  CRC-32 of every 64 MiB of it (written last): a file truncated, deleted or changed
  later (a flipped bit) marks the checkpoint as damaged, and resuming falls back to the
  newest checkpoint that is whole (:func:`resume_from`)

A save writes everything into ``checkpoints/.tmp-step-...``, fsyncs each file and the
directory, then renames the directory into place (``os.replace`` of a directory is
atomic on POSIX) and fsyncs the parent. A crash at any moment leaves either the old
set of checkpoints or the old set plus the new one; leftovers of ``.tmp-`` are removed
by the next save. Only then are checkpoints beyond the last ``keep`` deleted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pathlib
import re
import shutil
import struct

import torch

from .. import _validate
from ..errors import CheckpointError, ConfigError
from .manifest import verify_checkpoint, verify_checksums, write_manifest

__all__ = ["save_checkpoint", "latest_checkpoint", "load_checkpoint", "list_checkpoints",
           "resume_from", "check_resumable", "check_out_dir", "save_shard", "load_shards",
           "save_consolidated", "save_sharded_checkpoint", "is_sharded"]

log = logging.getLogger("rotapipe.train")

ALIASES = "rotapipe.aliases"
"""masters.safetensors' metadata key: ``{key: key of the same tensor}`` (tied weights)."""

_NAME = re.compile(r"^step-(\d{8})$")


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: pathlib.Path) -> None:
    for root, dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(pathlib.Path(root))


def list_checkpoints(ckpt_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """Complete checkpoints, oldest first."""
    ckpt_dir = pathlib.Path(ckpt_dir)      # a str too
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir()
             if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(ckpt_dir: str | pathlib.Path) -> pathlib.Path | None:
    ckpt_dir = pathlib.Path(ckpt_dir)      # a str too
    found = list_checkpoints(ckpt_dir)
    return found[-1] if found else None


def save_checkpoint(ckpt_dir: str | pathlib.Path, step: int, *,
                    masters: dict[str, torch.Tensor], state: dict, meta: dict,
                    tokenizer=None, keep: int = 3) -> pathlib.Path:
    """Write checkpoint ``step`` atomically; delete all but the newest ``keep``."""
    ckpt_dir = pathlib.Path(ckpt_dir)      # a str too
    from safetensors.torch import save_file

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for stale in ckpt_dir.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = ckpt_dir / f"step-{step:08d}"
    tmp = ckpt_dir / f".tmp-step-{step:08d}-{os.getpid()}"
    tensors, aliases = _distinct(masters)
    tmp.mkdir()
    with _writing(tmp, final):
        save_file(tensors, str(tmp / "masters.safetensors"),
                  metadata={ALIASES: json.dumps(aliases)} if aliases else None)
    _publish(tmp, final, state, meta, tokenizer, keep)
    return final


def _distinct(masters: dict[str, torch.Tensor]) -> tuple[dict, dict[str, str]]:
    """safetensors wants contiguous tensors that share no storage: each tensor once, and
    ``{key: earlier key}`` of the keys naming a tensor already written (a tied weight
    in ``pipe.state_dict()``: :func:`load_checkpoint` gives it under both keys again);
    a partial overlap of storage is written as a copy."""
    out, aliases, seen, storages = {}, {}, {}, set()
    for k, v in masters.items():
        v = v.detach()
        same = (v.untyped_storage().data_ptr(), v.storage_offset(), v.shape, v.stride(),
                v.dtype)
        if same in seen:
            aliases[k] = seen[same]
            continue
        seen[same] = k
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.contiguous() if ptr not in storages else v.clone()
        storages.add(ptr)
    return out, aliases


@contextlib.contextmanager
def _writing(tmp: pathlib.Path, final: pathlib.Path):
    """A failed write into ``tmp`` (a full disk, a lost mount) removes it, which would
    hold the space a full disk lacks, and raises :class:`CheckpointError` naming the
    cause and what is kept (``torch.save`` says only "unexpected pos 295104 vs ...")."""
    try:
        yield
    except Exception as exc:
        from safetensors import SafetensorError
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, (OSError, RuntimeError, SafetensorError)):
            raise                       # not the write: e.g. state that cannot be pickled
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        kept = list_checkpoints(final.parent)
        try:
            free = f"; {shutil.disk_usage(final.parent).free / 1e6:,.0f} MB free there"
        except OSError:
            free = ""
        raise CheckpointError(
            f"writing checkpoint {final} failed ({type(exc).__name__}: {first}{free}): "
            "nothing of it was kept, " + (f"the previous checkpoints are intact (newest: "
                                          f"{kept[-1].name})" if kept else
                                          "and there is no earlier checkpoint")
            + ". Free space on that file system (or pass an --out-dir with room) and "
            "--resume") from exc


def _publish(tmp: pathlib.Path, final: pathlib.Path, state: dict, meta: dict, tokenizer,
             keep: int) -> None:
    """Write the rest of a checkpoint into ``tmp`` (state, meta, tokenizer, manifest),
    fsync it, move it to ``final`` in one rename and prune to the newest ``keep``."""
    ckpt_dir = final.parent
    with _writing(tmp, final):
        torch.save(state, tmp / "state.pt")
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / "tokenizer"))
        write_manifest(tmp)
        _fsync_tree(tmp)
    if final.exists():                 # re-saving a step (resumed, then stopped at once)
        old = ckpt_dir / f".tmp-old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(ckpt_dir)
    for old in list_checkpoints(ckpt_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str | pathlib.Path, masters: bool = True
                    ) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """``(masters, state, meta)`` of a checkpoint directory; :class:`CheckpointError`
    (naming the file) when it is damaged. ``masters=False``: ``{}`` instead of reading
    ``masters.safetensors`` (a sharded checkpoint resumes from its shards)."""
    path = pathlib.Path(path)      # a str too
    verify_checkpoint(path)
    want_masters = masters
    try:
        meta = json.loads((path / "meta.json").read_text())
        masters = _load_masters(path / "masters.safetensors") if want_masters else {}
        state = torch.load(path / "state.pt", weights_only=True)
    except Exception as exc:   # noqa: BLE001 - safetensors, pickle, zip, json errors
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        first = first.split(". ")[0][:200]              # torch's reasons run on
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(exc).__name__}: "
                              f"{first})") from None
    for name, value in (("meta.json", meta), ("state.pt", state)):
        if not isinstance(value, dict):
            raise CheckpointError(f"checkpoint {path}: {name} holds a {type(value).__name__}, "
                                  "not the dict a save writes")
    return masters, state, meta


def _load_masters(f: pathlib.Path) -> dict[str, torch.Tensor]:
    """``masters.safetensors`` with each tied key naming its tensor again (:func:`_distinct`)."""
    from safetensors import safe_open
    with safe_open(str(f), framework="pt") as fh:
        masters = {k: fh.get_tensor(k) for k in fh.keys()}
        aliases = json.loads((fh.metadata() or {}).get(ALIASES, "{}"))
    masters.update({k: masters[v] for k, v in aliases.items()})
    return masters


_KINDS = (("state.pt", ("step",), int), ("state.pt", ("tokens",), int),
          *(("state.pt", (k,), dict) for k in ("optimizer", "scheduler", "pipe", "rng",
                                                "data")),
          ("meta.json", ("config",), dict), ("meta.json", ("config", "steps"), int),
          ("meta.json", ("fingerprint",), dict),
          ("meta.json", ("fingerprint", "params"), dict))
"""``(file, key path, type)`` of what a resume reads before the model is built."""


def check_resumable(path: pathlib.Path, masters: dict[str, torch.Tensor], state: dict,
                    meta: dict) -> None:
    """Raise :class:`CheckpointError` when a loaded checkpoint cannot be resumed: a field
    a resume reads is missing or of another type (:data:`_KINDS`), or a master weight is
    not finite (a save never writes one: the file was changed after it was written)."""
    top = [keys[0] for file, keys, _ in _KINDS if len(keys) == 1
           and keys[0] not in (state if file == "state.pt" else meta)]
    if top:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(top)}: it was not "
                              "written by rotapipe train")
    for file, keys, kind in _KINDS:
        value = state if file == "state.pt" else meta
        for key in keys:                  # the parents were checked to be dicts before
            value = value.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            field = "".join(f"[{k!r}]" for k in keys)
            got = "missing" if value is None else f"a {type(value).__name__}"
            raise CheckpointError(f"checkpoint {path}: {file}{field} is {got}, not the "
                                  f"{kind.__name__} a save writes")
    # One tensor at a time: a bool copy of one tensor, never of the whole set.
    bad = [n for n, t in masters.items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise CheckpointError(f"checkpoint {path}: masters.safetensors holds non-finite "
                              f"values in {bad[0]}" + (f" and {len(bad) - 1} more"
                                                       if len(bad) > 1 else ""))


def resume_from(ckpt_dir: pathlib.Path, resume: bool | str
                ) -> tuple[pathlib.Path, dict, dict, dict] | None:
    """The checkpoint a training run continues from, as ``(path, masters, state, meta)``,
    or ``None`` to start at step 0.

    ``resume=False``: ``None``, and an error when ``ckpt_dir`` already holds checkpoints
    (a fresh run would mix with them). ``True``: the newest checkpoint that is whole; a
    damaged one is skipped with a warning naming it; an error when there is none.
    ``"auto"``: as ``True``, but ``None`` when the directory holds no checkpoint."""
    found = list_checkpoints(ckpt_dir)
    if not resume:
        if found:
            raise ConfigError(f"{ckpt_dir} already holds checkpoints: pass --resume to "
                              "continue that run, or a new --out-dir")
        return None
    damaged = []
    for path in reversed(found):
        try:
            masters, state, meta = load_checkpoint(path, masters=not is_sharded(path))
            check_resumable(path, masters, state, meta)
            verify_checksums(path)
        except CheckpointError as exc:
            log.warning("%s: skipping it", exc)
            damaged.append(path.name)
            continue
        if damaged:
            log.warning("resuming from %s, the newest whole checkpoint (damaged: %s)", path,
                        ", ".join(damaged))
        return path, masters, state, meta
    if damaged:
        raise CheckpointError(f"every checkpoint in {ckpt_dir} is damaged ({', '.join(damaged)}"
                              "): nothing to resume; use a new --out-dir to start over")
    if resume == "auto":
        return None
    raise ConfigError(f"--resume: {ckpt_dir} holds no checkpoint to resume: check --out-dir,"
                      " or pass --resume auto to start from step 0 when there is none")


def check_out_dir(out: pathlib.Path) -> None:
    """Fail (one line, before any work) when ``out`` cannot be the output directory:
    it or a parent is a file, it is not writable, or what the job writes there
    (``checkpoints/``, ``final/``, ``metrics.jsonl``) exists with the wrong kind."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir {str(out)!r} is a file, not a directory: pass a new "
                          "--out-dir")
    base = _validate.nearest_existing(out)
    if not base.is_dir():
        raise ConfigError(f"out_dir {str(out)!r} cannot be created: {str(base)!r} is a file")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"out_dir {str(out)!r} cannot be written: no write permission on "
                          f"{str(base)!r}")
    reason = _validate.cannot_make_folder(base)
    if reason is not None:
        where = "be written" if base == out else f"be created in {str(base)!r}"
        raise ConfigError(f"out_dir {str(out)!r} cannot {where} (making a folder there "
                          f"fails: {reason}): pass an --out-dir on a writable file "
                          "system")
    for name, is_dir in (("checkpoints", True), ("final", True), ("metrics.jsonl", False)):
        p = out / name
        if p.exists() and p.is_dir() != is_dir:
            kind = "a directory" if is_dir else "a file"
            raise ConfigError(f"out_dir {str(out)!r}: {name} exists but is not {kind}: move "
                              "it away or pass a new --out-dir")
        if is_dir and p.is_dir() and not os.access(p, os.W_OK | os.X_OK):
            # else the run trains until its first checkpoint (or its export) and fails there
            raise ConfigError(f"out_dir {str(out)!r}: {name}/ cannot be written (no write "
                              "permission): fix its permissions or pass a new --out-dir")


def check_compatible(path: pathlib.Path, meta: dict, fingerprint: dict) -> None:
    """Fail (one line) when a checkpoint was written for a different model."""
    theirs = meta.get("fingerprint", {})
    for key in ("architecture", "vocab_size", "hidden_size", "num_hidden_layers"):
        if theirs.get(key) != fingerprint.get(key):
            raise ConfigError(f"checkpoint {path} is from a different model ({key} "
                              f"{theirs.get(key)!r} there, {fingerprint.get(key)!r} now): "
                              "use the original model settings or a new out_dir")
    a, b = theirs.get("params", {}), fingerprint.get("params", {})
    if a != b:
        diff = sorted(set(a) ^ set(b)) or [k for k in a if a[k] != b.get(k)]
        name = diff[0]
        raise ConfigError(f"checkpoint {path} is from a different model (parameter {name!r}: "
                          f"{a.get(name)} there, {b.get(name)} now): use the original model "
                          "settings (lora, lora_rank, ...) or a new out_dir")


# -- sharded state (DataParallelConfig(shard=...)): one file per rank -------------------

_SHARD = re.compile(r"^shard-(\d{5})-of-(\d{5})\.pt$")


def save_shard(path: str | pathlib.Path, shard: dict) -> pathlib.Path:
    """Write one rank's :func:`rotapipe.distributed.shard_state_dict` into the directory
    ``path`` as ``shard-<rank>-of-<world>.pt``, atomically (a temporary file, fsynced,
    then renamed into place): a reader finds the whole file or none."""
    path = pathlib.Path(path)      # a str too
    path.mkdir(parents=True, exist_ok=True)
    final = path / f"shard-{shard['rank']:05d}-of-{shard['world']:05d}.pt"
    tmp = path / f".tmp-{final.name}-{os.getpid()}"
    torch.save(shard, tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    _fsync_dir(path)
    return final


def is_sharded(path: pathlib.Path) -> bool:
    """Whether checkpoint ``path`` holds per-rank shards (written under
    ``DataParallelConfig(shard=...)``)."""
    return path.is_dir() and any(_SHARD.match(f.name) for f in path.glob("shard-*-of-*.pt"))


def load_shards(path: str | pathlib.Path, mmap: bool = False) -> list[dict]:
    """Every rank's shard in ``path`` (:func:`save_shard`); :class:`CheckpointError`
    naming the missing ranks when the set is incomplete. ``mmap``: the tensors stay
    memory-mapped (read when used), so a reader holding every shard does not hold the
    whole optimizer state in RAM."""
    path = pathlib.Path(path)      # a str too
    found = {}
    for f in path.glob("shard-*-of-*.pt") if path.is_dir() else ():
        m = _SHARD.match(f.name)
        if m:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = f
    if len(found) != 1:
        raise CheckpointError(f"{path} holds shards of world sizes {sorted(found)}: expected "
                              "the shards of one run (shard-<rank>-of-<world>.pt)")
    (world, files), = found.items()
    missing = [r for r in range(world) if r not in files]
    if missing:
        raise CheckpointError(f"{path}: the shards of rank(s) {missing} of {world} are "
                              "missing (a rank did not finish writing): resume from an "
                              "earlier checkpoint")
    try:
        return [torch.load(files[r], weights_only=True, mmap=mmap) for r in range(world)]
    except Exception as exc:  # noqa: BLE001 - pickle / zip errors
        raise CheckpointError(f"a shard in {path} cannot be read ({type(exc).__name__})") \
            from None


def save_consolidated(path: str | pathlib.Path, names: dict[str, str] | None = None
                      ) -> pathlib.Path:
    """The consolidated export of a sharded checkpoint: the whole fp32 masters of every
    rank's shard in ``path`` as ``path / "masters.safetensors"`` (one rank writes it,
    after every shard is written), atomically. ``names``: the tensor names to write
    (``{pipeline parameter name: name in the file}``, e.g. the Hugging Face names;
    default the pipeline's). The pieces stream from the memory-mapped shards into the
    file one at a time: the whole model is never in RAM (:func:`_write_safetensors`)."""
    path = pathlib.Path(path)      # a str too
    shards = load_shards(path, mmap=True)
    parts: dict[str, list[dict]] = {}
    for s in shards:
        for name, piece in s["pieces"].items():
            parts.setdefault(name, []).append(piece)
    entries = []
    for name, ps in parts.items():
        ps.sort(key=lambda p: p["range"][0])
        shape = tuple(ps[0]["shape"])
        n = math.prod(shape)
        got = [tuple(p["range"]) for p in ps]
        if got[0][0] != 0 or got[-1][1] != n or any(x[1] != y[0] for x, y in zip(got, got[1:])):
            raise CheckpointError(f"{path}: the shards hold {got} of {name!r} ({n} elements):"
                                  " a rank's shard is missing or from another checkpoint")
        out_name = names.get(name, name) if names is not None else name
        entries.append((out_name, shape, [p["master"] for p in ps]))
    return _write_safetensors(path / "masters.safetensors", entries)


def _write_safetensors(path: pathlib.Path,
                       entries: list[tuple[str, tuple, list[torch.Tensor]]]) -> pathlib.Path:
    """Write fp32 tensors, each given as pieces to concatenate, in the safetensors
    format (an 8-byte little-endian header length, a JSON header of dtype, shape and
    byte offsets, then the bytes), streaming piece by piece; atomically (temporary
    file, fsync, rename). ``safetensors.torch.save_file`` needs every tensor whole in
    memory at once, which is what sharding avoids."""
    header, off = {}, 0
    for name, shape, pieces in entries:
        n = 4 * sum(p.numel() for p in pieces)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)                  # the data starts 8-byte aligned
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, _, pieces in entries:
            for p in pieces:
                f.write(memoryview(p.detach().float().contiguous().numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return path


def save_sharded_checkpoint(ckpt_dir: str | pathlib.Path, step: int, *, shard: dict,
                            names: dict[str, str], state: dict, meta: dict, tokenizer=None,
                            keep: int = 3, is_main: bool, barrier) -> pathlib.Path:
    """Checkpoint ``step`` of a sharded data-parallel run; every rank calls it
    (``barrier()`` waits for all of them). Into ``checkpoints/.tmp-step-...-sharded``
    (on storage every rank sees):

    1. rank 0 clears leftovers and creates the directory; barrier;
    2. every rank writes its shard (:func:`save_shard`: temporary file, fsync,
       rename); barrier;
    3. rank 0 checks every shard is there, writes the consolidated fp32 masters
       (``masters.safetensors`` under the names ``names`` gives, what a run without
       data parallelism and other tools read), ``state.pt`` (the state every rank
       shares: scheduler, counters, RNG, data cursor; the optimizer state is in the
       shards), ``meta.json``, the tokenizer and the manifest (the shards' sizes
       included), fsyncs, renames the directory into place, prunes to ``keep``; barrier.

    A crash at any point leaves the previous checkpoints whole: nothing is visible
    before the rename."""
    ckpt_dir = pathlib.Path(ckpt_dir)      # a str too
    final = ckpt_dir / f"step-{step:08d}"
    tmp = ckpt_dir / f".tmp-step-{step:08d}-sharded"
    if is_main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        _fsync_dir(ckpt_dir)
    barrier()
    save_shard(tmp, shard)
    barrier()
    if is_main:
        try:
            save_consolidated(tmp, names)
        except CheckpointError as exc:
            raise CheckpointError(f"{exc} (every rank writes its shard into out_dir: put it "
                                  "on storage every server sees)") from None
        _publish(tmp, final, state, meta, tokenizer, keep)
    barrier()
    return final
