"""Data handed between actions (one store per device, one for the host), with the
stream-race checker and device-memory accounting.

Rules 1 and 3 of the event protocol (``backend.py``) are enforced here: each actor (an
emulated stream or the host lane) keeps a vector clock; a write is tagged with the
writer's clock entry, and a read checks that the reader has (transitively) waited on an
event recorded after that write. So does a write that replaces a value another actor
wrote: two writes of one key that no wait orders could land in either order on a GPU,
and a reader that waited on both would see whichever landed last.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ..errors import RaceError

_current = threading.local()


class Actor:
    """Something that runs actions in order and carries a vector clock."""

    def __init__(self, name: str):
        self.name = name
        self.clock: dict[str, int] = {name: 0}
        self._lock = threading.Lock()

    def tick(self) -> int:
        with self._lock:
            self.clock[self.name] += 1
            return self.clock[self.name]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.clock)

    def merge(self, event) -> None:
        """Merge the clock an event captured at record time (after waiting on it)."""
        other = getattr(event, "clock", None) or {}
        with self._lock:
            for k, v in other.items():
                if v > self.clock.get(k, 0):
                    self.clock[k] = v

    def covers(self, writer: str, seq: int) -> bool:
        with self._lock:
            return writer == self.name or self.clock.get(writer, 0) >= seq

    def __enter__(self):
        self._prev = getattr(_current, "actor", None)
        _current.actor = self
        return self

    def __exit__(self, *exc):
        _current.actor = self._prev


def current_actor() -> Actor | None:
    return getattr(_current, "actor", None)


def tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value)
               if isinstance(t, torch.Tensor))


class Store:
    """A dictionary of in-flight data keyed by tuples such as ``("act", 3, 0)``.

    With ``device`` set, stored bytes count against that device's memory budget until
    popped. With ``check``, reads are race-checked against the writer's clock entry.
    """

    def __init__(self, name: str, device=None, check: bool = False):
        self.name = name
        self.device = device
        self.check = check
        self._items: dict[Any, tuple[Any, str | None, int, int]] = {}
        self._lock = threading.Lock()

    def put(self, key, value, what: str | None = None, extra_bytes: int = 0) -> None:
        """Store ``value``; its tensor bytes (plus ``extra_bytes``, e.g. the autograd
        graph it keeps alive) count against the device budget until popped."""
        actor = current_actor()
        writer, seq = (actor.name, actor.clock[actor.name]) if actor else (None, 0)
        if self.check and actor is not None:
            with self._lock:
                old = self._items.get(key)
            if old is not None and old[1] is not None and not actor.covers(old[1], old[2]):
                raise RaceError(
                    f"{actor.name} overwrote {_describe(key)} in {self.name}, written by "
                    f"{old[1]} (its op {old[2]}), without waiting on an event recorded "
                    "after that write: on a GPU the two writes could land in either order")
        nbytes = tensor_bytes(value) + extra_bytes if self.device is not None else 0
        if nbytes:
            self.device.allocate(nbytes, what or _describe(key))
        with self._lock:
            old = self._items.get(key)
            self._items[key] = (value, writer, seq, nbytes)
        if old is not None and old[3]:
            self.device.free(old[3])

    def get(self, key, pop: bool = False):
        with self._lock:
            item = self._items.pop(key, None) if pop else self._items.get(key)
        actor = current_actor()
        if item is None:
            who = actor.name if actor else "the host"
            raise RaceError(f"{who} read {_describe(key)} from {self.name} before any action "
                            "wrote it: a dependency is missing from the schedule")
        value, writer, seq, nbytes = item
        if self.check and actor is not None and writer is not None \
                and not actor.covers(writer, seq):
            raise RaceError(f"{actor.name} read {_describe(key)} from {self.name}, written by "
                            f"{writer} (its op {seq}), without waiting on an event recorded "
                            "after that write: on a GPU this read could see stale data")
        if self.device is not None:
            for t in tree_leaves(value):
                if isinstance(t, torch.Tensor):
                    self.device.use_on(t)
        if pop and nbytes:
            self.device.free(nbytes)
        return value

    def pop(self, key):
        return self.get(key, pop=True)

    def contains(self, key) -> bool:
        with self._lock:
            return key in self._items

    def clear(self) -> None:
        with self._lock:
            items, self._items = self._items, {}
        freed = sum(i[3] for i in items.values())
        if freed:
            self.device.free(freed)

    def keys(self):
        with self._lock:
            return list(self._items)


def _describe(key) -> str:
    if isinstance(key, tuple):
        return key[0] + "(" + ", ".join(str(k) for k in key[1:]) + ")"
    return str(key)
