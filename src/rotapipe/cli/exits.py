"""How a command ends: the exit codes of the ``rotapipe`` command, and an error that ends
a command as its exit code and one line for stderr (:func:`_error_line`)."""

from __future__ import annotations

from ..errors import ConfigError, RotapipeError

EXIT_OK = 0
EXIT_FAILED = 1
"""The run failed: bad data, a damaged checkpoint, a worker or I/O error."""
EXIT_USAGE = 2
"""A flag, config file or setting is wrong (argparse uses 2 for its own errors too)."""
EXIT_NO_FIT = 3
"""``rotapipe plan``: the run does not fit the machine."""
EXIT_INTERRUPTED = 130

_HF_EXTRAS = ("transformers", "peft", "safetensors", "tokenizers", "huggingface_hub")


def _error_line(exc: Exception) -> tuple[int, str]:
    """``(exit code, message)`` of an error that ends a command: the library's own
    messages as they are; an OS error as its reason and path; anything else, which is a
    bug, as one line that points to ``--debug``."""
    if isinstance(exc, ConfigError):
        return EXIT_USAGE, str(exc)
    if isinstance(exc, RotapipeError):
        return EXIT_FAILED, str(exc)
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return EXIT_FAILED, f"{exc.strerror}{where}"
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.split(".")[0]
        if top in _HF_EXTRAS:
            return EXIT_FAILED, (f"{top} is not installed: pip install 'rotapipe[hf]' (the "
                                 "Hugging Face extras: transformers, peft, safetensors)")
        return EXIT_FAILED, f"the {top!r} package is not installed: pip install {top}"
    if isinstance(exc, MemoryError):
        return EXIT_FAILED, "out of host memory: use a smaller model, batch or sequence"
    first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return EXIT_FAILED, (f"unexpected {type(exc).__name__}{': ' + first if first else ''} "
                         "(run with --debug for the traceback)")
