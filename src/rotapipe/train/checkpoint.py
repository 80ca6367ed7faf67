"""Checkpoints written atomically: a complete directory appears, or nothing does.

Layout of ``out_dir/checkpoints/step-00000050/``:

- ``masters.safetensors``: the fp32 master weights (trainable parameters, HF names);
  the compute-dtype copies are derived from them, frozen weights come from the model
- ``state.pt``: optimizer, LR scheduler, pipeline counters and loss scaler, RNG states,
  data cursor (``torch.load(weights_only=True)`` reads it)
- ``meta.json``: step, plan, the model fingerprint (parameter names and shapes,
  architecture) and the config
- ``tokenizer/``: the tokenizer the run uses

A save writes everything into ``checkpoints/.tmp-step-...``, fsyncs each file and the
directory, then renames the directory into place (``os.replace`` of a directory is
atomic on POSIX) and fsyncs the parent. A crash at any moment leaves either the old
set of checkpoints or the old set plus the new one; leftovers of ``.tmp-`` are removed
by the next save. Only then are checkpoints beyond the last ``keep`` deleted.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil

import torch

from ..errors import ConfigError

__all__ = ["save_checkpoint", "latest_checkpoint", "load_checkpoint", "list_checkpoints"]

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


def list_checkpoints(ckpt_dir: pathlib.Path) -> list[pathlib.Path]:
    """Complete checkpoints, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir()
             if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(ckpt_dir: pathlib.Path) -> pathlib.Path | None:
    found = list_checkpoints(ckpt_dir)
    return found[-1] if found else None


def save_checkpoint(ckpt_dir: pathlib.Path, step: int, *, masters: dict[str, torch.Tensor],
                    state: dict, meta: dict, tokenizer=None, keep: int = 3) -> pathlib.Path:
    """Write checkpoint ``step`` atomically; delete all but the newest ``keep``."""
    from safetensors.torch import save_file

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for stale in ckpt_dir.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = ckpt_dir / f"step-{step:08d}"
    tmp = ckpt_dir / f".tmp-step-{step:08d}-{os.getpid()}"
    tmp.mkdir()
    # safetensors wants contiguous tensors that share no storage (tied weights are
    # one parameter, so they appear once).
    save_file({k: v.detach().contiguous() for k, v in masters.items()},
              str(tmp / "masters.safetensors"))
    torch.save(state, tmp / "state.pt")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
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
    return final


def load_checkpoint(path: pathlib.Path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """``(masters, state, meta)`` of a checkpoint directory."""
    from safetensors.torch import load_file

    try:
        meta = json.loads((path / "meta.json").read_text())
        masters = load_file(str(path / "masters.safetensors"))
        state = torch.load(path / "state.pt", weights_only=True)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"checkpoint {path} cannot be read ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}): delete it to "
                          "resume from the one before") from None
    return masters, state, meta


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
