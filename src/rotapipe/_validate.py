"""Field checks shared by the config dataclasses: type, range, finiteness, enums; the
command line's typed flags (:func:`int_flag`, :func:`real_flag`); and the output-folder
probe the commands share (:func:`cannot_make_folder`).

Each check returns the value (normalized: an enum member, an ``int`` for an integral
float of bytes) or raises :class:`~rotapipe.errors.ConfigError` whose message names the
field, the value and what is allowed, e.g. ``timeout_s=nan: use a finite number of
seconds > 0``. ``bool`` is never accepted as a number (``True`` is an ``int`` in
Python, but ``microbatches=True`` is a mistake, not 1).
"""

from __future__ import annotations

import argparse
import enum
import math
import os
import pathlib
import tempfile
from dataclasses import dataclass
from numbers import Integral, Real

from .errors import ConfigError

__all__ = ["integer", "number", "boolean", "text", "choice", "int_flag", "real_flag",
           "nearest_existing", "cannot_make_folder", "Limit", "PLAN_LIMITS", "check_limits"]


def _fail(name: str, value, allowed: str, optional: bool, wrong_type: bool):
    got = f" (got {type(value).__name__})" if wrong_type else ""
    raise ConfigError(f"{name}={value!r}: use {allowed}{' or None' if optional else ''}"
                      f"{got}")


def integer(name: str, value, *, minimum: int = 1, maximum: int | None = None,
            optional: bool = False, allowed: str | None = None) -> int | None:
    """An ``int`` (not a ``bool``) of at least ``minimum`` (and at most ``maximum``);
    ``None`` when ``optional``."""
    if value is None and optional:
        return None
    wrong_type = isinstance(value, bool) or not isinstance(value, Integral)
    if wrong_type or value < minimum or (maximum is not None and value > maximum):
        _fail(name, value, allowed or (f"an int in [{minimum}, {maximum:,}]"
                                       if maximum is not None else "a positive int"
                                       if minimum == 1 else f"an int >= {minimum}"),
              optional, wrong_type and not isinstance(value, float))
    return value


def _range(low, high, low_open, high_open) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return ""


def number(name: str, value, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False, optional: bool = False,
           unit: str = "", allowed: str | None = None) -> float | int | None:
    """A finite real number (``int`` or ``float``, not ``bool``, never NaN or inf) in
    the range ``low``..``high`` (each bound open or closed); ``None`` when ``optional``.
    ``unit`` goes into the message ("a finite number of seconds > 0")."""
    if value is None and optional:
        return None
    wrong_type = isinstance(value, bool) or not isinstance(value, Real)
    ok = not wrong_type and math.isfinite(value)
    if ok:
        ok = (low is None or (value > low if low_open else value >= low)) and \
             (high is None or (value < high if high_open else value <= high))
    if not ok:
        what = f"a finite number{' of ' + unit if unit else ''}"
        rng = _range(low, high, low_open, high_open)
        _fail(name, value, allowed or (f"{what} {rng}" if rng else what), optional,
              wrong_type)
    return value


def boolean(name: str, value) -> bool:
    """``True`` or ``False`` (not ``"no"``, not ``0``)."""
    if value is not True and value is not False:
        _fail(name, value, "True or False", False, True)
    return value


def text(name: str, value, *, optional: bool = False, empty: bool = False,
         allowed: str | None = None) -> str | None:
    """A ``str`` (non-empty unless ``empty``); ``None`` when ``optional``."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or (not empty and not value.strip()):
        _fail(name, value, allowed or ("a string" if empty else "a non-empty string"),
              optional, not isinstance(value, str))
    return value


def choice(kind: type[enum.Enum], name: str, value) -> enum.Enum:
    """A member of ``kind``, given as the member or its value as a string (any case,
    surrounding spaces ignored): ``grain="Layer"`` is ``RecomputeGrain.LAYER``."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        for member in kind:
            if str(member.value).lower() == key or member.name.lower() == key:
                return member
    choices = ", ".join(repr(k.value) for k in kind)
    got = "" if isinstance(value, str) else f" (got {type(value).__name__})"
    raise ConfigError(f"{name}={value!r} is invalid: use one of {choices}{got}")


# -- flag types: argparse turns their errors into "argument --x: ..." and exit 2 -----------
def int_flag(minimum: int = 1, maximum: int = 2**20):
    """An int flag in ``[minimum, maximum]``: the default maximum (a million) is far
    beyond any real run, so a typo fails here, not as an overflow or a simulation that
    never ends."""
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{text}: use an integer in [{minimum}, "
                                             f"{maximum:,}]")
        return value
    convert.__name__ = "int"
    return convert


def real_flag(low: float | None = 0.0, high: float | None = None, *, low_open: bool = True,
              unit: str = ""):
    """A finite float flag in a range (NaN and inf refused); default: > 0. A flag that
    prices something physical (a rate, a size, a time) takes both bounds, far beyond
    any real machine on either side: ``1e-300`` or ``1e300`` is a typo, not a setting,
    and would print numbers of hundreds of digits."""
    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        try:
            return number("", value, low=low, high=high, low_open=low_open, unit=unit)
        except ConfigError as exc:
            allowed = str(exc).split(": ", 1)[1]           # "use a finite number > 0"
            raise argparse.ArgumentTypeError(f"{text}: {allowed}") from None
    convert.__name__ = "float"
    return convert


MAX_MICROBATCHES = 65536
"""Microbatches of one call at most (``PipeConfig.microbatches`` and the schedule
generators): a million took minutes to generate; 65,536 takes seconds."""


# -- the ranges of the planner's inputs: ``rotapipe plan``'s flags and ``analyze``'s checks ----
@dataclass(frozen=True)
class Limit:
    """The accepted range of one planner input, far beyond any real run on both sides
    (a value outside is a typo: ``1e-300`` parameters per second said "fits"), with
    the flag that sets it on the command line."""
    flag: str
    low: float
    high: float
    unit: str = ""
    integral: bool = False

    def check(self, name: str, value):
        """``value`` (``None`` passes: the default), or a :class:`ConfigError` naming
        both the Python argument and the flag."""
        if value is None:
            return None
        try:
            if self.integral:
                return integer(name, value, minimum=int(self.low), maximum=int(self.high))
            return number(name, value, low=self.low, high=self.high, unit=self.unit)
        except ConfigError as exc:
            raise ConfigError(f"{exc} ({self.flag} on the command line)") from None

    def flag_type(self):
        """The argparse type of :attr:`flag` (a host-RAM flag in GB is its own)."""
        if self.integral:
            return int_flag(int(self.low), int(self.high))
        return real_flag(self.low, self.high, low_open=False, unit=self.unit)


PLAN_LIMITS = {
    "seq": Limit("--seq", 1, 2**20, integral=True),
    "global_batch": Limit("--global-batch", 1, 2**20, integral=True),
    "microbatches": Limit("--microbatches", 1, 4096, integral=True),
    "lora_rank": Limit("--lora-rank", 1, 65536, integral=True),
    "host_ram": Limit("--host-ram", 1e9, 1e15, "bytes"),
    "optimizer_rate": Limit("--optimizer-rate", 1e6, 1e15, "parameters per second"),
    "memory_fraction": Limit("--memory-fraction", 0.01, 1.0),
    "chunk_mb": Limit("--copy-chunk-mb", 0.01, 65536, "MiB"),
    "nodes": Limit("--nodes", 1, 65536, integral=True),
    "network_gbps": Limit("--network-gbps", 0.01, 1e5, "Gb/s"),
    "inflight_mb": Limit("--inflight-mb", 0.01, 1e6, "MiB"),
    "prefetch": Limit("--prefetch", 1, 1024, integral=True),
}
"""What ``rotapipe plan`` and :func:`rotapipe.planner.analyze` accept: one table, so the
flags and the Python function refuse the same values (``host_ram`` in bytes here, in
GB on the command line: 1 GB to a petabyte)."""


def check_limits(limits: dict[str, Limit], **values) -> None:
    """Check each ``name=value`` against ``limits[name]``."""
    for name, value in values.items():
        limits[name].check(name, value)


def nearest_existing(path: pathlib.Path) -> pathlib.Path:
    """``path``, or its nearest ancestor that exists."""
    base = path
    while not base.exists() and base != base.parent:
        base = base.parent
    return base


def cannot_make_folder(base: pathlib.Path) -> str | None:
    """Why no folder can be made in ``base`` (an existing, writable-looking folder), or
    ``None``: makes and removes an empty one, since write permission does not say it
    (``/proc`` refuses even root, a read-only mount everyone)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rotapipe-check-", dir=base))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
