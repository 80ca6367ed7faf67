"""The ``rotapipe`` command line: a table from command names to functions.

Each entry of :data:`COMMANDS` is ``name -> (add_arguments, run, help)``; ``run``
takes the parsed arguments and returns the exit code. ``train`` is the training job
(:mod:`rotapipe.train`: a config file and a flag per :class:`TrainConfig` field; with
no arguments, the demo). ``simulate`` runs pipeline schedules side by side on a cost model
(:mod:`rotapipe.sim`); ``plan`` says whether a run fits, with which partition and how
fast (:mod:`rotapipe.planner.advise`).

Exit codes (docs/training.md, "Exit codes"): 0 success; 1 the run failed (bad data,
a damaged checkpoint, a worker error, an I/O error); 2 usage: a flag or setting is
wrong (argparse's own errors, :class:`~rotapipe.errors.ConfigError`); 3 ``plan``: the
run does not fit; 130 interrupted. Every error is one line on stderr, never a
traceback; an unexpected exception says so and suggests ``--debug``, which shows the
traceback.

Each command is a module of this package: ``train_cmd.py``, ``simulate_cmd.py`` and
``plan_cmd.py`` (the flags ``plan`` and ``simulate`` share are ``flags.py``'s); exit
codes and the error line are ``exits.py``'s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from .exits import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_NO_FIT, EXIT_OK, EXIT_USAGE,
                    _error_line)
from .plan_cmd import _plan_arguments, plan
from .simulate_cmd import _simulate_arguments, simulate
from .train_cmd import _train_arguments, recipe_path, train

__all__ = ["main", "COMMANDS", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_NO_FIT",
           "recipe_path"]


COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None],
                          Callable[[argparse.Namespace], int], str]] = {
    "train": (_train_arguments, train,
              "train or fine-tune a causal LM (default: the demo, a small Qwen3 from "
              "scratch on the Python standard library's source)"),
    "simulate": (_simulate_arguments, simulate,
                 "simulate pipeline schedules side by side (bubbles, tokens/s, memory, "
                 "timeline pictures)"),
    "plan": (_plan_arguments, plan,
             "will a model fit a machine (device and host memory), with which partition, "
             "how fast"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``rotapipe`` command; returns the exit code (argparse's own
    usage errors and ``--help`` raise ``SystemExit``, with code 2 and 0)."""
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the traceback of an error")
    parser = argparse.ArgumentParser(
        prog="rotapipe", description="RoundPipe pipeline training on stateless workers.",
        parents=[debug], epilog="exit codes: 0 success, 1 the run failed, 2 a flag or "
        "setting is wrong, 3 (plan) does not fit, 130 interrupted")
    from .. import __version__
    parser.add_argument("--version", action="version", version=f"rotapipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Only the chosen command's flags are built: they import torch and the library, which
    # `rotapipe --help` and `--version` do not need.
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, (add_arguments, run, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[debug])
        if name == chosen:
            add_arguments(p)
        p.set_defaults(run=run)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(f"rotapipe {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if getattr(args, "debug", False):
            raise
        code, message = _error_line(exc)
        print(f"rotapipe {args.command}: error: {message}", file=sys.stderr)
        return code
