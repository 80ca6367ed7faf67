"""RoundPipe, the training API: :class:`RoundPipe` (in :mod:`.core`, with its parts in
:mod:`.training`, :mod:`.state` and :mod:`.introspect`; argument checks in
:mod:`.checks`)."""

from .core import RoundPipe

__all__ = ["RoundPipe"]
