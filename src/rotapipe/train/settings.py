"""A training job's settings from files and flags: reading a TOML/YAML/JSON file
(:func:`read_file`), layering it and the flags over the defaults (:func:`load_config`),
the fields' docs and types (``rotapipe train --help``), and the LoRA flags checked
against the run (:func:`check_lora_flags`). No torch at import."""

from __future__ import annotations

import dataclasses
import enum
import pathlib
import typing
from dataclasses import fields

from ..errors import ConfigError
from .config import TrainConfig, _check_names

__all__ = ["load_config", "read_file", "field_docs", "field_types", "check_lora_flags",
           "LORA_FLAGS"]


LORA_FLAGS = ("lora_rank", "lora_alpha", "lora_targets")
"""The settings that shape a new LoRA adapter."""


def check_lora_flags(cfg: TrainConfig, given: dict) -> None:
    """The LoRA flags ``given`` on the command line (values by field name) take effect:
    refused on a run without LoRA, and with ``resume_from_adapter`` where they differ
    from the adapter's ``adapter_config.json`` (PEFT loads the adapter's own shape).
    Only flags: a config file or recipe may hold LoRA settings for other runs."""
    stray = [n for n in LORA_FLAGS if n in given]
    flag = {n: "--" + n.replace("_", "-") for n in LORA_FLAGS}
    if stray and not (cfg.lora or cfg.qlora or cfg.resume_from_adapter):
        raise ConfigError(" ".join(f"{flag[n]} {given[n]}" for n in stray) + " sets LoRA "
                          "adapters, but the run trains every weight: add --lora (or "
                          "--qlora), or drop " + ", ".join(flag[n] for n in stray))
    if not stray or not cfg.resume_from_adapter:
        return
    saved = _adapter_shape(cfg.resume_from_adapter)
    if saved is None:
        return              # the run's own check names the missing adapter_config.json
    clash = [n for n in stray if not _same_lora(n, given[n], saved[n])]
    if clash:
        theirs = ", ".join(f"{n}={_short(saved[n]) if n == 'lora_targets' else saved[n]}"
                           for n in clash)
        raise ConfigError(
            " ".join(f"{flag[n]} {given[n]}" for n in clash) + " conflicts with the adapter "
            f"resumed from {cfg.resume_from_adapter} ({theirs} in its adapter_config.json), "
            "whose own shape is kept: drop " + ", ".join(flag[n] for n in clash) + " (or "
            "give the adapter's values), or drop --resume-from-adapter to train a new "
            "adapter")


def _adapter_shape(folder: str) -> dict | None:
    """``{lora_rank, lora_alpha, lora_targets}`` of a PEFT adapter directory, or ``None``
    when it has no ``adapter_config.json``."""
    import json

    path = pathlib.Path(folder) / "adapter_config.json"
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read ({exc}): pass the directory a LoRA run "
                          "exported (its final/)") from None
    targets = saved.get("target_modules")
    if isinstance(targets, (list, tuple)):
        targets = ",".join(sorted(str(t) for t in targets))
    return {"lora_rank": saved.get("r"), "lora_alpha": saved.get("lora_alpha"),
            "lora_targets": targets}


def _short(targets) -> str:
    """Saved targets as the layer names they wrap (``q_proj,v_proj``), not every
    layer's full name."""
    return ",".join(sorted({t.rsplit(".", 1)[-1] for t in str(targets).split(",") if t}))


def _same_lora(name: str, given, saved) -> bool:
    """Whether a flag's value is the saved adapter's. PEFT writes ``all-linear`` out as
    the full name of every linear layer it wrapped, and keeps names given as they are:
    targets match as the same set of layer names (the last part of each full name)."""
    if name != "lora_targets":
        return saved is not None and float(given) == float(saved)
    names = {t.strip() for t in str(given).split(",") if t.strip()}
    wrapped = {t for t in str(saved).split(",") if t}
    if names == {"all-linear"}:
        return saved == "all-linear" or bool(wrapped) and all("." in t for t in wrapped)
    return names == wrapped or ",".join(sorted(names)) == _short(saved)


def field_docs() -> dict[str, str]:
    """``{field name: its docstring}``, read from this module's source (for ``--help``
    and the docs)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and \
                isinstance(b.value, ast.Constant):
            docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def field_types() -> dict[str, type]:
    """``{field name: the scalar type a flag or file value converts to}``."""
    hints = typing.get_type_hints(TrainConfig)
    out = {}
    for f in fields(TrainConfig):
        t = hints[f.name]
        args = [a for a in typing.get_args(t) if a is not type(None)]
        out[f.name] = args[0] if args else t
    return out


def _coerce(name: str, value):
    t = field_types()[name]
    if value is None or isinstance(value, t) or (name == "resume" and value == "auto"):
        return value
    if isinstance(t, type) and issubclass(t, enum.Enum) and isinstance(value, str):
        return value                       # a choice by name: TrainConfig checks it
    if t is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if t in (int, float) and isinstance(value, str) and _number(value, t) is not None:
        kind = "an int" if t is int else "a float"
        raise ConfigError(f"config field {name!r} = {value!r} is a string, not {kind}: "
                          f"write it without quotes ({name} = {value.strip()})")
    raise ConfigError(f"config field {name!r} = {value!r} should be of type {t.__name__}")


def _number(text: str, t: type):
    """``text`` as a ``t`` (int or float), or None."""
    try:
        return t(text)
    except ValueError:
        return None


def _yaml_load(yaml, text: str):
    """``yaml.safe_load``, reading ``1e-4`` as a float. PyYAML reads YAML 1.1, where a
    float needs a dot (``1.0e-4``) and ``1e-4`` is a string; YAML 1.2, TOML and JSON
    read it as a number, and so does this (it was refused as "should be of type
    float"). A quoted ``"1e-4"`` stays a string."""
    import re

    class Loader(yaml.SafeLoader):
        pass
    exponent = re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$")
    # On a subclass, add_implicit_resolver copies SafeLoader's resolvers first.
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", exponent, list("-+0123456789"))
    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader


def read_file(path: str | pathlib.Path) -> dict:
    """The settings in a ``.toml``, ``.yaml``/``.yml`` or ``.json`` file: a flat table of
    ``name = value``, or one ``[train]`` table of them and nothing else."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist: check the path")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {p} is not UTF-8 text (byte {exc.start}): write the "
                          "settings as TOML, YAML or JSON") from None
    try:
        if p.suffix == ".toml":
            import tomllib
            values = tomllib.loads(text)
        elif p.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ConfigError(f"{p} is YAML but PyYAML is not installed: pip install "
                                  "pyyaml, or write the config as TOML") from None
            values = _yaml_load(yaml, text) or {}
        elif p.suffix == ".json":
            import json
            values = json.loads(text)
        else:
            raise ConfigError(f"config file {p}: use a .toml, .yaml or .json file")
    except ConfigError:
        raise
    except Exception as exc:             # the parsers' own error types differ
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"config file {p} does not parse: {first}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {p} holds a {type(values).__name__}, not a table "
                          "of settings (name = value)")
    layout = ("write the settings as name = value at the top level (as the recipes in "
              "rotapipe/recipes/ do), or all of them in one 'train' table ([train] in TOML)")
    if isinstance(values.get("train"), dict):
        others = [k for k in values if k != "train"]
        if others:
            raise ConfigError(f"config file {p} has a 'train' table and also "
                              f"{', '.join(map(repr, others[:3]))}"
                              f"{' and more' if len(others) > 3 else ''}: {layout}")
        values = values["train"]
    tables = [k for k, v in values.items() if isinstance(v, dict)]
    if tables:
        raise ConfigError(f"config file {p}: {tables[0]!r} is a table, not a setting (no "
                          f"setting takes a table): {layout}")
    return values


def load_config(path: str | pathlib.Path | None = None, overrides: dict | None = None,
                base: TrainConfig | None = None) -> TrainConfig:
    """``base`` (default: the defaults), then the file's settings, then ``overrides``
    (e.g. command-line flags). Unknown names fail with the closest known name."""
    values = dict(read_file(path)) if path is not None else {}
    _check_names(values, f" in {path}" if path is not None else "")
    values.update(overrides or {})
    _check_names(values)
    values = {k: _coerce(k, v) for k, v in values.items()}
    return dataclasses.replace(base or TrainConfig(), **values)
