"""Emulated CPU workers: virtual devices with stream threads, events and a memory budget.

Each virtual device has one thread per stream (compute, weight upload, activation
upload, download) running an ordered queue, like a CUDA stream: work submitted from
the dispatcher threads runs later, in order; events complete when their stream reaches
them and can be waited on from any other stream. Every stream carries a vector clock
(``store.Actor``) so the race checker can prove a read was ordered after its write.
"""

from __future__ import annotations

import queue
import threading
from contextlib import contextmanager

import torch

from ..errors import DeviceOutOfMemoryError
from ..schedule import Lane
from .backend import Aborted, Device, Event, Stream
from .pool import BlockPool
from .store import Actor
from .transfer import Link

# torch's CPU generator is one per process and shared by every thread (TRAPS.md), so
# seeding it and drawing from it must not interleave between emulated workers. This
# lock guards that process-wide resource; it is the only module-level state here.
_CPU_RNG_LOCK = threading.Lock()


class EmulatedEvent(Event):
    def __init__(self):
        self.done = threading.Event()
        self.clock: dict[str, int] = {}

    def synchronize(self, abort=None):
        while not self.done.wait(0.02):
            if abort is not None and abort.is_set():
                raise Aborted()

    def query(self):
        return self.done.is_set()


class EmulatedStream(Stream):
    def __init__(self, name: str):
        self.name = name
        self.actor = Actor(name)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"rotapipe-{name}",
                                        daemon=True)
        self._thread.start()

    def submit(self, fn, on_error, abort):
        self._q.put(("fn", (fn, on_error, abort)))

    def wait(self, event):
        self._q.put(("wait", event))

    def record(self):
        ev = EmulatedEvent()
        self._q.put(("record", ev))
        return ev

    def close(self):
        # Join: a daemon thread still freeing tensors while the interpreter shuts down
        # aborts the process ("terminate called without an active exception").
        self._q.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _loop(self):
        while True:
            item = self._q.get()
            if item is None:
                return
            kind, payload = item
            if kind == "fn":
                fn, on_error, abort = payload
                if abort.is_set():
                    continue
                self.actor.tick()
                try:
                    with self.actor:
                        fn()
                except BaseException as exc:  # noqa: BLE001 - reported to the caller
                    on_error(exc)
            elif kind == "wait":
                payload.done.wait()
                self.actor.merge(payload)
            else:
                payload.clock = self.actor.snapshot()
                payload.done.set()


class EmulatedDevice(Device):
    """A virtual worker device backed by host memory, with a byte budget and a host
    link per direction (:class:`~rotapipe.runtime.transfer.Link`) that its copying
    lanes share by priority."""

    def __init__(self, index: int, budget: int | None = None, record_links: bool = False):
        self.index = index
        self.torch_device = torch.device("cpu")
        self.budget = budget
        self._streams = {lane: EmulatedStream(f"w{index}.{lane.value}")
                         for lane in (Lane.COMPUTE, Lane.WEIGHTS, Lane.UPLOAD, Lane.DOWNLOAD,
                                      Lane.GRADS)}
        up = Link(f"w{index} host->device", record_links)
        down = Link(f"w{index} device->host", record_links)
        self._links = {Lane.WEIGHTS: up, Lane.UPLOAD: up, Lane.DOWNLOAD: down,
                       Lane.GRADS: down}
        self._lock = threading.Lock()
        self._used = 0
        self._peak = 0
        # Copies land in reused blocks, as on CUDA (caching allocator on the device,
        # pinned buffer pool on the host): fresh memory would be page-faulted in on
        # every step, costing more CPU than the copy itself.
        self._device_blocks = BlockPool()
        self._host_blocks = BlockPool()

    def __repr__(self):
        return f"EmulatedDevice({self.index}, budget={self.budget})"

    def stream(self, lane):
        return self._streams[lane]

    def link(self, lane):
        return self._links.get(lane)

    def upload(self, host, dtype=None):
        out = self._device_blocks.empty(host.shape, dtype or host.dtype)
        out.copy_(host)
        return out

    def download(self, dev):
        out = self._host_blocks.empty(dev.shape, dev.dtype)
        out.copy_(dev.detach())
        return out

    @contextmanager
    def seeded(self, seed):
        with _CPU_RNG_LOCK:
            torch.default_generator.manual_seed(seed)
            yield

    def allocate(self, nbytes: int, what: str) -> None:
        with self._lock:
            if self.budget is not None and self._used + nbytes > self.budget:
                raise DeviceOutOfMemoryError(
                    f"worker {self.index} is out of memory: allocating {what} needs "
                    f"{_fmt(nbytes)} with {_fmt(self._used)} in use, over its budget of "
                    f"{_fmt(self.budget)}: raise device_memory, use more (smaller) stages, "
                    "more microbatches, or grain='layer'")
            self._used += nbytes
            self._peak = max(self._peak, self._used)

    def free(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    def memory_in_use(self):
        return self._used

    def peak_memory(self):
        return self._peak

    def reset_peak(self):
        with self._lock:
            self._peak = self._used

    def drain(self, timeout=None):
        events = [s.record() for s in self._streams.values()]
        return all(ev.done.wait(timeout) for ev in events)

    def close(self):
        for s in self._streams.values():
            s.close()
        self._device_blocks, self._host_blocks = BlockPool(), BlockPool()


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
