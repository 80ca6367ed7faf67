"""The adapter's exception type (its own module: every adapter module raises it)."""

from __future__ import annotations

from ..errors import ConfigError

__all__ = ["AdapterError"]


class AdapterError(ConfigError):
    """A model could not be adapted, or its inputs do not fit: the message names what
    was not found and how to pass it explicitly."""
