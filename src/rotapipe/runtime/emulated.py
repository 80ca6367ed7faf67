"""Emulated CPU workers: virtual devices with stream threads, events and a memory budget.

Each virtual device has one thread per stream (compute, weight upload, activation
upload, download) running an ordered queue, like a CUDA stream: work submitted from
the dispatcher threads runs later, in order; events complete when their stream reaches
them and can be waited on from any other stream. Every stream carries a vector clock
(``store.Actor``) so the race checker can prove a read was ordered after its write.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import DeviceOutOfMemoryError
from ..schedule import Lane
from .backend import Aborted, Device, Event, Stream
from .dispatchers import mark_worker_thread
from .pool import BlockPool
from .store import Actor
from .transfer import DOWN, UP, CopyEngine, direction

# torch's CPU generator is one per process and shared by every thread (TRAPS.md).
# Layers draw from generators of their own (_LayerDraws); the few random ops that take
# no generator swap their layer's stream into the process's generator under this lock
# (between workers: the caller's threads take no lock). It and the memo of op schemas
# (_random_use) are the only module-level state here.
_CPU_RNG_LOCK = threading.Lock()

# The seed of the layer (or loss) call this thread runs: running_seed().
_RUNNING = threading.local()

# Frees made by the function a download stream is running: [device, bytes] entries,
# counted until that function has returned (see EmulatedDevice.free).
_STREAM_FREES = threading.local()


class EmulatedEvent(Event):
    def __init__(self, notify=None):
        self.done = threading.Event()
        self.clock: dict[str, int] = {}
        self._notify = notify

    def complete(self) -> None:
        self.at = time.perf_counter()     # the stream thread reached it
        self.done.set()
        if self._notify is not None:
            self._notify()

    def synchronize(self, abort=None):
        while not self.done.wait(0.02):
            if abort is not None and abort.is_set():
                raise Aborted()

    def query(self):
        return self.done.is_set()

    def seconds(self):
        return self.at


class EmulatedStream(Stream):
    """A stream thread. On a copy lane every submitted function is one copy on the
    device's :class:`~rotapipe.runtime.transfer.CopyEngine` for its direction: it
    reaches the engine (takes its ticket) once it is runnable, i.e. when every wait
    submitted before it has passed (at submission if none is outstanding, so copies
    issued back to back on one stream reach the engine together), and runs when the
    engine serves it."""

    def __init__(self, name: str, engine: CopyEngine | None = None, owner: int = 0,
                 downloads: bool = False):
        self.name, self.owner = name, owner     # owner: the id of its device
        self.actor = Actor(name)
        self.engine = engine
        self.downloads = downloads   # frees in its functions wait for them to return
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waits = 0             # blocking waits submitted
        self._passed = 0            # ... and passed by the stream thread
        self._deferred: list = []   # copy items behind a blocking wait, in order
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"rotapipe-{name}",
                                        daemon=True)
        self._thread.start()

    def submit(self, fn, on_error, abort, what: str = ""):
        item = [fn, on_error, abort, what, None, 0]   # ..., ticket, waits ahead of it
        with self._lock:
            if self.engine is not None:
                item[5] = self._waits
                if self._waits == self._passed:
                    item[4] = self.engine.ticket()
                else:
                    self._deferred.append(item)
            self._q.put(("fn", item))

    def wait(self, event):
        with self._lock:
            blocking = not event.done.is_set()
            if blocking:
                self._waits += 1
            self._q.put(("wait", (event, blocking)))

    def record(self, notify=None, timing=False):
        ev = EmulatedEvent(notify)
        self._q.put(("record", ev))
        return ev

    def stop(self) -> None:
        """Let the thread end once its queue is done; a wait for an event that never
        completes (its producer is stuck) no longer holds it."""
        self._closing.set()
        self._q.put(None)

    def join(self, timeout: float | None = None) -> threading.Thread | None:
        """After :meth:`stop`: the thread, if it is still running work after
        ``timeout`` seconds (stuck in an action: abandoned by the caller)."""
        # Join: a daemon thread still freeing tensors while the interpreter shuts down
        # aborts the process ("terminate called without an active exception").
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        return self._thread if self._thread.is_alive() else None

    def _passed_wait(self) -> None:
        """A blocking wait passed: copies queued behind it (and no later wait) are
        runnable now and reach the engine in stream order."""
        with self._lock:
            self._passed += 1
            keep = []
            for item in self._deferred:
                if item[5] <= self._passed:
                    item[4] = self.engine.ticket()
                else:
                    keep.append(item)
            self._deferred = keep

    def _loop(self):
        mark_worker_thread(self.owner)
        while True:
            item = self._q.get()
            if item is None:
                return
            kind, payload = item
            if kind == "fn":
                self._run(*payload)
            elif kind == "wait":
                event, blocking = payload
                while not event.done.wait(0.05):
                    if self._closing.is_set():
                        return
                self.actor.merge(event)
                if blocking and self.engine is not None:
                    self._passed_wait()
            else:
                payload.clock = self.actor.snapshot()
                payload.complete()

    def _run(self, fn, on_error, abort, what, ticket, _waits):
        if abort.is_set():
            if ticket is not None:
                self.engine.release(ticket)
            return
        start = self.engine.acquire(ticket) if ticket is not None else None
        self.actor.tick()
        held = _STREAM_FREES.pending = [] if self.downloads else None
        try:
            with self.actor:
                fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            on_error(exc)
        finally:
            _STREAM_FREES.pending = None
            for device, nbytes in held or ():
                if nbytes:
                    device.free(nbytes)
            if ticket is not None:
                self.engine.release(ticket, what, start)


class EmulatedDevice(Device):
    """A virtual worker device backed by host memory, with a byte budget and one copy
    engine per direction (:class:`~rotapipe.runtime.transfer.CopyEngine`) that its
    copying lanes share as a GPU's streams share its copy engines: in the order copies
    become runnable, without priority or preemption. ``record_copies=True`` keeps
    every copy's times in ``engines[UP].copies`` / ``engines[DOWN].copies``."""

    notifies = True
    """Events call the ``notify`` given to :meth:`Stream.record` when they complete."""

    def __init__(self, index: int, budget: int | None = None, record_copies: bool = False):
        self.index = index
        self.torch_device = torch.device("cpu")
        self.budget = budget
        self.engines = {d: CopyEngine(f"w{index} {d}", record_copies) for d in (UP, DOWN)}
        self._streams = {}
        for lane in (Lane.COMPUTE, Lane.WEIGHTS, Lane.TRAINED, Lane.UPLOAD, Lane.DOWNLOAD,
                     Lane.GRADS):
            d = direction(lane)
            self._streams[lane] = EmulatedStream(f"w{index}.{lane.value}",
                                                 self.engines[d] if d else None, id(self),
                                                 downloads=d == DOWN)
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

    def upload(self, host, dtype=None):
        out = self._device_blocks.empty(host.shape, dtype or host.dtype)
        out.copy_(host)
        return out

    def download(self, dev):
        out = self._host_blocks.empty(dev.shape, dev.dtype)
        out.copy_(dev.detach())
        return out

    def empty(self, shape, dtype):
        return self._device_blocks.empty(shape, dtype)

    def empty_host(self, shape, dtype):
        return self._host_blocks.empty(shape, dtype)

    def seeded(self, seed):
        # Random ops draw from a generator seeded with ``seed``, never from the
        # process's CPU generator: the caller's threads draw from that one while calls
        # are in flight (overlap, stale), and it would move their masks and they ours.
        return _layer_stream(seed)

    def seeded_layer(self, seed, shell):
        # A layer seen to draw nothing since its copy last changed runs as it is: the
        # dispatch mode that routes random ops costs a Python call per op.
        return _Running(seed) if shell.draws is False else _layer_stream(seed, shell)

    def allocate(self, nbytes: int, what: str) -> None:
        nbytes -= self._reuse(nbytes)
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
        pending = getattr(_STREAM_FREES, "pending", None)
        if pending is not None:
            # Let go by a download while its copy still reads it: a GPU's caching
            # allocator frees stream-ordered (record_stream), so the memory returns to
            # other streams when the copy has completed. Counted until the stream's
            # function returns (with a timed emulation, after the copy's duration).
            pending.append([self, nbytes])
            return
        with self._lock:
            self._used -= nbytes

    def _reuse(self, nbytes: int) -> int:
        """Bytes of an allocation served by what the download stream running it freed
        in its current function (still counted): the same stream reuses its own frees
        in stream order, as the CUDA caching allocator does."""
        reused = 0
        for entry in getattr(_STREAM_FREES, "pending", None) or ():
            if entry[0] is self and reused < nbytes:
                take = min(entry[1], nbytes - reused)
                entry[1] -= take
                reused += take
        return reused

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

    def stop(self):
        for s in self._streams.values():
            s.stop()

    def close(self, timeout=None):
        self.stop()
        deadline = None if timeout is None else time.monotonic() + timeout
        stuck = [t for t in (s.join(None if deadline is None else
                                    max(0.0, deadline - time.monotonic()))
                             for s in self._streams.values()) if t]
        self._device_blocks, self._host_blocks = BlockPool(), BlockPool()
        return stuck


def running_seed() -> int | None:
    """The seed of the layer (or loss) call running on this emulated worker's thread
    (``None`` outside one): ``layer_seed(seed, call, microbatch, layer)``. The workers
    leave the process's generator alone, so ``torch.initial_seed()`` does not say it."""
    return getattr(_RUNNING, "seed", None)


class _Running:
    """Context: :func:`running_seed` gives ``seed`` on this thread."""

    __slots__ = ("seed", "_outer")

    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self):
        self._outer = getattr(_RUNNING, "seed", None)
        _RUNNING.seed = self.seed

    def __exit__(self, *exc):
        _RUNNING.seed = self._outer


@contextmanager
def _layer_stream(seed: int, shell=None):
    """Run a layer (or the loss) drawing from its own stream, a generator seeded with
    ``seed``: the same numbers as plain PyTorch's after ``torch.manual_seed(seed)``.
    Records in ``shell.draws`` whether it drew."""
    mode = _LayerDraws(torch.Generator().manual_seed(seed))
    with _Running(seed), mode:
        yield
    if shell is not None:
        shell.draws = mode.drew


class _LayerDraws(TorchDispatchMode):
    """Random CPU ops run under it (on this thread only: dispatch modes are
    thread-local) draw from ``gen``: an op with a ``generator`` argument gets ``gen``
    where it was given none; one without (``torch.rand``'s default overload) runs as
    its overload that takes one; the rest (``native_dropout``) swap ``gen``'s state into
    the process's generator for the op. ``drew``: whether a random op drew from it."""

    def __init__(self, gen: torch.Generator):
        super().__init__()
        self.gen, self.drew = gen, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        use = _random_use(func)
        if use is None:
            return func(*args, **kwargs)
        if use == "overload":
            self.drew = True
            return func._overloadpacket(*args, generator=self.gen, **kwargs)
        if use == "swap":
            return self._swapped(func, args, kwargs)
        index, keyword = use
        if keyword or len(args) <= index:
            if kwargs.get("generator") is None:
                kwargs = {**kwargs, "generator": self.gen}
                self.drew = True
        elif args[index] is None:
            args = (*args[:index], self.gen, *args[index + 1:])
            self.drew = True
        return func(*args, **kwargs)

    def _swapped(self, func, args, kwargs):
        if _draws_nothing(func, args, kwargs):
            return func(*args, **kwargs)
        cpu = torch.default_generator
        with _CPU_RNG_LOCK:
            saved, before = cpu.get_state(), self.gen.get_state()
            cpu.set_state(before)
            try:
                return func(*args, **kwargs)
            finally:
                after = cpu.get_state()
                cpu.set_state(saved)
                self.gen.set_state(after)
                self.drew = self.drew or not torch.equal(before, after)


@functools.cache
def _random_use(func):
    """How op ``func`` draws: ``None`` (it does not), ``(index, keyword_only)`` of its
    ``generator`` argument, ``"overload"`` (another overload takes a generator) or
    ``"swap"`` (no overload does)."""
    args = func._schema.arguments
    for i, a in enumerate(args):
        if a.name == "generator":
            return i, a.kwarg_only
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return None
    packet = func._overloadpacket
    if any(a.name == "generator" for name in packet.overloads()
           for a in getattr(packet, name)._schema.arguments):
        return "overload"
    return "swap"


def _draws_nothing(func, args, kwargs) -> bool:
    """An op taking no generator that draws only with a dropout on: attention kernels
    with ``dropout_p=0``, ``native_dropout`` with ``train=False`` or ``p=0``."""
    for i, a in enumerate(func._schema.arguments):
        v = args[i] if i < len(args) else \
            kwargs.get(a.name, a.default_value if a.has_default_value() else None)
        if (a.name in ("dropout_p", "p") and v == 0) or (a.name == "train" and v is False):
            return True
    return False


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
