"""``rotapipe train``: the training job (:mod:`rotapipe.train`) from a config file, a
named recipe and a flag per :class:`~rotapipe.train.config.TrainConfig` field."""

from __future__ import annotations

import argparse

from ..errors import ConfigError


def _plain(text: str) -> str:
    """Docstring text as plain help text (no reStructuredText literals)."""
    return text.replace("``", "")


def _train_arguments(p: argparse.ArgumentParser) -> None:
    from ..train.config import CHOICES, REPORT_TO, TrainConfig
    from ..train.settings import field_docs, field_types

    p.add_argument("--config", metavar="FILE", default=None,
                   help="TOML (or YAML/JSON) file of settings; flags override it")
    p.add_argument("--demo", action="store_true",
                   help="the demo, which is also what the defaults do: a small Qwen3 from "
                        "scratch on the Python standard library's source (every GPU, or 2 "
                        "emulated CPU workers)")
    p.add_argument("--recipe", metavar="NAME", default=None,
                   help="a named recipe shipped with rotapipe (full, lora: fine-tuning "
                        "settings for a pretrained --model); --config and flags override it")
    import dataclasses

    docs, types = field_docs(), field_types()
    # The fields' declared defaults, without building a TrainConfig (that imports torch,
    # which --help and argument errors do not need).
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    g = p.add_argument_group("settings (rotapipe.train.TrainConfig; every one also a config "
                             "file key)")
    choices = {**CHOICES, "report_to": REPORT_TO}
    for name, t in types.items():
        flag = "--" + name.replace("_", "-")
        default = defaults[name]
        if hasattr(default, "value"):                  # an enum member: its value
            default = default.value
        text = _plain(f"{docs.get(name, '')} (default: {default})").replace("%", "%%")
        if name == "resume":       # --resume, --resume auto, --no-resume
            g.add_argument(flag, dest=name, nargs="?", const=True, type=_resume_mode,
                           default=argparse.SUPPRESS, metavar="auto", help=text)
            g.add_argument("--no-resume", dest=name, action="store_false",
                           default=argparse.SUPPRESS)
        elif t is bool:
            g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                           default=argparse.SUPPRESS, help=text)
        elif name in choices:           # checked (in any case) by TrainConfig
            g.add_argument(flag, dest=name, type=str, default=argparse.SUPPRESS,
                           metavar="{" + ",".join(choices[name]) + "}", help=text)
        else:
            metavar = {"model": "DIR|ORG/NAME", "resume_from_adapter": "DIR",
                       "out_dir": "DIR"}.get(name, t.__name__.upper())
            g.add_argument(flag, dest=name, type=_none_or(t), default=argparse.SUPPRESS,
                           metavar=metavar, help=text)
    flags = ["--config", "--demo", "--recipe"] + [
        f"--{no}{n.replace('_', '-')}" for n, t in types.items()
        for no in ("", "no-")[:2 if t is bool or n == "resume" else 1]]
    _name_unknown_flags(p, flags)


def _name_unknown_flags(p: argparse.ArgumentParser, flags: list[str]) -> None:
    """An unknown flag fails naming ours: ``--max-steps 3`` (transformers' name) or
    ``--eval_interval 5`` stopped with argparse's "unrecognized arguments", which names
    no flag that works."""
    import difflib

    from ..train.config import OTHER_MEANING, OTHER_NAMES

    parse = p.parse_known_args

    def parse_known_args(args=None, namespace=None):
        namespace, extras = parse(args, namespace)
        for arg in extras:
            name = arg.split("=", 1)[0]
            if not name.startswith("--"):
                continue
            key = name[2:].replace("-", "_")
            ours = OTHER_NAMES.get(key)
            if ours is None and "--" + key.replace("_", "-") in flags:
                ours = key
            if ours is None:
                close = difflib.get_close_matches(name, flags, n=1, cutoff=0.75)
                ours = close[0][2:].replace("-", "_") if close else None
            if ours is not None:
                p.error(f"unknown flag {name}: did you mean --{ours.replace('_', '-')}"
                        f"{OTHER_MEANING.get(ours, '')}? (rotapipe train --help lists them)")
        return namespace, extras
    p.parse_known_args = parse_known_args


def _resume_mode(text: str) -> str:
    if text.strip().lower() != "auto":
        raise argparse.ArgumentTypeError(f"{text!r}: use --resume (the latest checkpoint, "
                                         "which must exist) or --resume auto (it, if any)")
    return "auto"


def _none_or(t):
    def convert(text: str):
        return None if text.lower() == "none" else t(text)
    convert.__name__ = t.__name__
    return convert


def train(args: argparse.Namespace) -> int:
    """Run the training job (:func:`rotapipe.train.train`) from a config file and flags."""
    import logging

    from ..train import load_config
    from ..train import train as run_training
    from ..train.settings import check_lora_flags, field_types

    overrides = {k: v for k, v in vars(args).items() if k in field_types()}
    base = load_config(recipe_path(args.recipe)) if args.recipe else None
    cfg = load_config(args.config, overrides, base=base)
    # As plan's --lora-rank: a LoRA flag that would be ignored (no LoRA, or an adapter
    # resumed with another shape) is refused.
    check_lora_flags(cfg, overrides)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    run_training(cfg)              # Ctrl-C: the job saves a checkpoint and returns
    return 0


def recipe_path(name: str):
    """The TOML file of the recipe ``name`` (``rotapipe/recipes/NAME.toml``)."""
    import difflib
    import pathlib

    folder = pathlib.Path(__file__).parent.parent / "recipes"
    path = folder / f"{name}.toml"
    if not path.is_file():
        names = sorted(f.stem for f in folder.glob("*.toml"))
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"--recipe {name!r} is not a recipe: {hint}use one of "
                          f"{', '.join(names)} (or --config FILE)")
    return path
