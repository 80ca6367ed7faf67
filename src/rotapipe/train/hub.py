"""Hugging Face hub ids (``org/name``) resolved through the Hugging Face caches: models
for ``model`` (a snapshot folder), and datasets by name for ``data`` and ``eval_data``
(:func:`hub_dataset`: one split, loaded with ``datasets.load_dataset`` from a snapshot,
the ``datasets`` cache or the hub).

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

__all__ = ["HubSplit", "cached_snapshot", "hub_dataset", "is_hub_id", "snapshot"]

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


class HubSplit:
    """One split of a Hugging Face dataset loaded by name (``datasets.load_dataset``): a
    data source like a file, read row by row (:func:`iter_records`). Its
    :meth:`as_posix`, which the held-out and lane hashes read, names the dataset, config
    and split, not where the cache is; printed, it is ``org/name[config]:split``, so a
    row's place reads ``org/name:train:12``."""

    suffix = ""

    def __init__(self, name: str, config: str | None, split: str, data):
        self.name, self.config, self.split, self.data = name, config, split, data

    def as_posix(self) -> str:
        return f"hf://datasets/{self.name}/{self.config or 'default'}/{self.split}"

    def __str__(self) -> str:
        return f"{self.name}{f'[{self.config}]' if self.config else ''}:{self.split}"

    __repr__ = __str__

    def __eq__(self, other) -> bool:
        return isinstance(other, HubSplit) and self.as_posix() == other.as_posix()

    def __hash__(self) -> int:
        return hash(self.as_posix())

    def __len__(self) -> int:
        return len(self.data)

    def is_file(self) -> bool:
        return False

    def is_dir(self) -> bool:
        return False


def hub_dataset(spec: str, config: str | None = None, split: str | None = None,
                what: str = "data") -> HubSplit:
    """``org/name[:split]`` as the Hugging Face ``datasets`` library loads it
    (``load_dataset(name, config, split=split)``: the repository's own configs and
    split files, as its dataset card declares them), with builder config ``config``
    and split ``split`` (default ``train``; a split named in ``spec`` wins; any split
    expression ``load_dataset`` takes, such as ``train[:1000]``).

    Looked up in the caches first: a snapshot of the repository in the hub cache (``hf
    download --repo-type dataset``, or a previous download) is loaded from there, with
    no request; otherwise ``load_dataset(name)`` uses the ``datasets`` cache when
    offline (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``) and downloads otherwise."""
    name, _, named = spec.partition(":")
    split = named or split or "train"
    try:
        import datasets as ds
    except ImportError:
        raise ConfigError(f"{what} {name!r} is a Hugging Face dataset name, and loading it "
                          "needs the 'datasets' package: pip install 'rotapipe[data]' (or "
                          "datasets), or pass a local path") from None
    local = cached_snapshot(name, what, repo_type="dataset")
    label = f"dataset {name!r}" + (f" (config {config!r})" if config else "")
    try:
        data = ds.load_dataset(str(local) if local else name, config, split=split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types for these
        raise _dataset_error(ds, exc, name, local, config, split, label, what) from None
    if isinstance(data, dict) or not hasattr(data, "__len__"):
        raise ConfigError(f"{label} split {split!r} is not one table of rows: name one "
                          "split (--data-split, or org/name:SPLIT)")
    return HubSplit(name, config, split, data)


def _dataset_error(ds, exc: Exception, name: str, local, config, split: str, label: str,
                   what: str) -> ConfigError:
    """The one-line error of a hub dataset ``load_dataset`` refused: a config or split
    it does not have (with the ones it has), or not cached offline (with the fix)."""
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    source = str(local) if local else name
    configs = None
    try:      # the snapshot's card lists them; offline, a name's lookup would guess
        configs = ds.get_dataset_config_names(source) if local else None
    except Exception:  # noqa: BLE001 - a card that does not parse: no list to give
        pass
    if configs and (config is None and len(configs) > 1 or
                    config is not None and config not in configs):
        choose = "choose one with --data-config (data_config)" if config is None else \
            f"data_config={config!r} is not one of them"
        return ConfigError(f"{what} {name!r} has the configs {', '.join(configs)}: {choose}")
    if local:
        try:
            splits = ds.get_dataset_split_names(source, config)
        except Exception:  # noqa: BLE001
            splits = []
        base = split.split("[", 1)[0]
        if splits and base not in splits:
            return ConfigError(f"{label} has no {base!r} split (it has "
                               f"{', '.join(splits)}): name one with --data-split, or "
                               f"{name}:SPLIT")
    if local is None and ds.config.HF_HUB_OFFLINE:
        return ConfigError(
            f"{what} {name!r} is not in the Hugging Face cache (neither a snapshot in the "
            "hub cache nor a dataset the datasets library prepared"
            + (f" with config {config!r}" if config else "") + f"; datasets: {first}) "
            "and offline mode is set (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE): download it "
            "first on a connected machine (python -c \"import datasets; datasets.load_dataset("
            f"'{name}'{f', {config!r}' if config else ''})\", or hf download "
            f"--repo-type dataset {name}) and use that HF_HOME here, or pass a local path")
    return ConfigError(f"{label}, split {split!r}, could not be loaded "
                       f"({type(exc).__name__}: {first}): check the name, config and "
                       "split, log in (hf auth login) for a gated one, or pass a local path")
