"""The device-backend interface shared by the CUDA and emulated CPU backends.

The executor (``executor.py``) only ever calls the methods below; the backends differ
only in how a copy, a kernel launch, an event and an allocation happen.

Event protocol (the one note other modules refer to):

1. Every action runs on its worker's stream for its lane; after submitting it, the
   dispatcher records an event on that stream. A consumer reads an action's results
   only after its own stream *waited* on that event (``Stream.wait``), or, for host
   work and memory reuse, after the host *synchronized* on it.
2. A stream may only wait on an event that was already recorded: a dispatcher issues
   an action only once every producing action's event was recorded (not until it ran).
3. Data handed between actions goes through a :class:`~rotapipe.runtime.store.Store`
   (one per device, one for the host); with the race checker on, every read checks
   that rule 1 held, and a violation raises :class:`~rotapipe.errors.RaceError`.
4. A device tensor produced on one stream and read on another is registered with the
   reader's stream (``Device.use_on``) so the CUDA caching allocator does not reuse its
   memory before the reader finished (``record_stream``).
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from ..schedule import Lane


class Aborted(Exception):
    """Raised inside waits when the call was aborted because another action failed."""


class Event(abc.ABC):
    @abc.abstractmethod
    def synchronize(self, abort: threading.Event | None = None) -> None:
        """Block the calling host thread until the event completed (or the call aborted,
        raising :class:`Aborted`)."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True once the work before the event has completed."""

    def seconds(self) -> float:
        """When the device reached the event, in ``time.perf_counter`` seconds (an
        event recorded with ``timing=True``, read once complete)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no time")

    def since(self, start: Event) -> float:
        """Seconds the device took from ``start`` (an earlier timing event on the same
        device) to this one."""
        return self.seconds() - start.seconds()


class Stream(abc.ABC):
    """An ordered queue of work on one device (a CUDA stream or an emulated one)."""

    name: str

    @abc.abstractmethod
    def submit(self, fn: Callable[[], None], on_error: Callable[[BaseException], None],
               abort: threading.Event, what: str = "") -> None:
        """Run ``fn`` in stream order. On CUDA it runs now on the calling thread with
        the stream current (kernels launch asynchronously); emulated streams run it on
        their own thread later. An exception goes to ``on_error``; once ``abort`` is set,
        queued work is skipped. On a copy lane ``fn`` is one copy (``what`` names it in
        the emulated engines' records)."""

    @abc.abstractmethod
    def wait(self, event: Event) -> None:
        """Make later work on this stream wait until ``event`` completed."""

    @abc.abstractmethod
    def record(self, notify: Callable[[], None] | None = None,
               timing: bool = False) -> Event:
        """An event that completes when the work submitted so far has completed.
        Backends whose ``Device.notifies`` is true call ``notify`` then (the emulated
        one); on CUDA the dispatcher polls instead. ``timing``: the event keeps when
        the device reached it (:meth:`Event.seconds`; a CUDA timing event)."""

    def host_wait(self, event: Event, abort: threading.Event | None = None) -> None:
        """Host thread feeding this stream waits for ``event`` (memory reuse, host work).
        Work submitted afterwards is ordered after the event, so the stream also waits
        on it (free on a completed event; it tells the race checker, too). An event of
        the host lane (work done on the host) needs no stream wait."""
        event.synchronize(abort)
        if not isinstance(event, _DoneEvent):
            self.wait(event)


class Device(abc.ABC):
    """One worker's device: its streams, copies, memory meter and random generator."""

    index: int
    torch_device: torch.device
    budget: int | None
    notifies: bool = False
    """Whether events call the ``notify`` given to :meth:`Stream.record` on completion
    (else dispatchers waiting for a completion poll)."""

    @abc.abstractmethod
    def stream(self, lane: Lane) -> Stream: ...

    @abc.abstractmethod
    def upload(self, host: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Copy a host tensor to this device (optionally casting); called on a stream."""

    @abc.abstractmethod
    def download(self, dev: torch.Tensor) -> torch.Tensor:
        """Copy a device tensor to (pinned, where it matters) host memory."""

    @abc.abstractmethod
    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised device memory (the target of a chunked upload)."""

    @abc.abstractmethod
    def empty_host(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Reused page-locked host memory (the target of a chunked download)."""

    def use_on(self, tensor: torch.Tensor) -> None:
        """Tell the allocator ``tensor`` is used on the current stream (rule 4)."""

    @abc.abstractmethod
    def seeded(self, seed: int) -> AbstractContextManager:
        """Context in which random ops on this device draw from a stream seeded with
        ``seed``: the device's generator, seeded (CUDA), or a generator of the calling
        thread's own (emulated: the CPU generator is the process's, see
        ``docs/concepts.md``)."""

    def seeded_layer(self, seed: int, shell) -> AbstractContextManager:
        """:meth:`seeded` for a call of one layer; ``shell`` is the worker's copy of it
        (:class:`~rotapipe.model.layers.Shell`), where a backend may keep whether the
        layer draws at all (``shell.draws``)."""
        return self.seeded(seed)

    @abc.abstractmethod
    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every stream of the device is idle (after an abort); False if
        that took longer than ``timeout`` seconds."""

    @abc.abstractmethod
    def allocate(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` against the budget; raise DeviceOutOfMemoryError past it."""

    @abc.abstractmethod
    def free(self, nbytes: int) -> None: ...

    def memory_in_use(self) -> int:
        return 0

    def peak_memory(self) -> int:
        return 0

    def reset_peak(self) -> None:
        pass

    def stop(self) -> None:
        """Tell the device's threads to end once their work is done (:meth:`close`
        waits for them); closing several devices, stop them all first."""

    def close(self, timeout: float | None = None) -> list:
        """Release the device's threads and memory. Waits at most ``timeout`` seconds
        (``None``: as long as it takes) for threads still running work; returns those
        that did not stop (the caller abandons them)."""
        return []


class HostStream(Stream):
    """The host lane: runs work inline on the dispatcher thread."""

    name = "host"

    def __init__(self, clock_owner=None):
        self.clock_owner = clock_owner

    def submit(self, fn, on_error, abort, what=""):
        if abort.is_set():
            return
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            on_error(exc)

    def wait(self, event):
        raise NotImplementedError("the host lane waits with host_wait")

    def record(self, notify=None, timing=False) -> Event:
        return _DoneEvent()

    def host_wait(self, event, abort=None):
        event.synchronize(abort)
        if self.clock_owner is not None:
            self.clock_owner.merge(event)


class _DoneEvent(Event):
    clock: dict = {}

    def __init__(self):
        self.at = time.perf_counter()

    def synchronize(self, abort=None):
        return None

    def query(self):
        return True

    def seconds(self):
        return self.at
