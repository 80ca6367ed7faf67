"""Hugging Face hub ids (``org/name``) resolved to local snapshot folders through the
hub cache: models for ``model``, and dataset repositories for ``data`` and
``eval_data`` (which ``datasets.load_dataset`` then loads from the snapshot:
:func:`rotapipe.train.records.hub_dataset`).

The cache is asked first (``snapshot_download(local_files_only=True)``: no request), so
offline use of an existing cache works; otherwise the snapshot is downloaded into the
cache, unless ``HF_HUB_OFFLINE`` is set. ``HF_HOME`` / ``HF_HUB_CACHE`` say where the
cache is, as for every Hugging Face library.
"""

from __future__ import annotations

import os
import pathlib
import re

from ..errors import ConfigError

__all__ = ["cached_snapshot", "is_hub_id", "snapshot"]

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(name: str) -> bool:
    """``org/name``, and not a local path: neither it nor its folder exists (``data/x``
    with a local ``data/`` folder is a mistyped path, not a hub id)."""
    p = pathlib.Path(name)
    return bool(_HUB_ID.fullmatch(name)) and not p.exists() and not p.parent.is_dir()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cached_snapshot(repo: str, what: str, *, repo_type: str = "model"
                    ) -> pathlib.Path | None:
    """The folder of hub repository ``repo`` in the Hugging Face cache, or None when the
    cache does not hold it (no request is made)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(f"{what} {repo!r} is a hub id, and resolving it needs "
                          "huggingface_hub: pip install huggingface_hub, or pass a local "
                          "path") from None
    try:
        return pathlib.Path(snapshot_download(repo, repo_type=repo_type,
                                              local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (LocalEntryNotFoundError and kin)
        return None


def snapshot(repo: str, what: str, *, repo_type: str = "model",
             patterns: list[str] | None = None) -> pathlib.Path:
    """The local folder of hub repository ``repo``; ``what`` names the setting in
    errors (``"model"``, ``"data"``)."""
    kind = "dataset " if repo_type == "dataset" else ""
    cached = cached_snapshot(repo, what, repo_type=repo_type)
    if cached is not None:
        return cached
    from huggingface_hub import snapshot_download
    if _offline():
        raise ConfigError(f"{what} {repo!r} is not in the Hugging Face cache and "
                          "HF_HUB_OFFLINE is set: download it first (hf download "
                          f"{'--repo-type dataset ' if kind else ''}{repo}) where there is "
                          "network, point HF_HOME at that cache, or pass a local path")
    try:
        return pathlib.Path(snapshot_download(repo, repo_type=repo_type,
                                              allow_patterns=patterns))
    except Exception as exc:  # noqa: BLE001 - network, auth and not-found errors differ
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise ConfigError(f"{what} {repo!r} is neither a local path nor a {kind}repository "
                          f"in the Hugging Face cache, and downloading it failed "
                          f"({type(exc).__name__}: {first}): check the id, log in (hf auth "
                          "login) for a gated one, or pass a local path") from None
