"""CUDA devices: real streams, events, pinned host buffers and non-blocking copies.

A thin layer: ``submit`` runs the action body now, on the dispatcher thread, with the
lane's stream current, so its kernels and copies are queued asynchronously; events are
``torch.cuda.Event``. Everything else (what runs when, on which stream, after which
event) is the shared executor's logic.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import torch

from ..errors import DeviceOutOfMemoryError
from ..schedule import Lane
from .backend import Aborted, Device, Event, Stream
from .pool import BlockPool


class DeviceClock:
    """Maps a GPU's timing events to the host clock: a reference event, recorded on
    an idle stream and waited for, taken to have completed at the host time read
    right after (CUDA events measure time between two events of one device:
    ``cudaEventElapsedTime``)."""

    def __init__(self, stream: torch.cuda.Stream):
        self.ref = torch.cuda.Event(enable_timing=True)
        self.ref.record(stream)
        self.ref.synchronize()
        self.host = time.perf_counter()

    def seconds(self, event: torch.cuda.Event) -> float:
        return self.host + self.ref.elapsed_time(event) / 1e3


class CudaEvent(Event):
    def __init__(self, stream: torch.cuda.Stream, timing: bool = False,
                 timer: DeviceClock | None = None):
        self.event = torch.cuda.Event(enable_timing=timing)
        self.event.record(stream)
        # Not ``clock``: on events that name is the race checker's vector clock,
        # which the host lane merges after waiting (store.Actor.merge).
        self.timer = timer

    def synchronize(self, abort=None):
        # Poll so that an aborted call does not leave a host thread blocked forever.
        while not self.event.query():
            if abort is not None and abort.is_set():
                raise Aborted()
            time.sleep(0.0002)

    def query(self):
        return self.event.query()

    def seconds(self):
        return self.timer.seconds(self.event)

    def since(self, start):
        # Directly between the two events: exact to the event timer's resolution,
        # where a difference of two times since the clock's reference would lose
        # precision to the float milliseconds CUDA reports over a long run.
        return start.event.elapsed_time(self.event) / 1e3


class CudaStream(Stream):
    def __init__(self, device: torch.device, name: str, priority: int = 0,
                 timer: DeviceClock | None = None):
        self.name = name
        self.device = device
        self.stream = torch.cuda.Stream(device=device, priority=priority)
        self.timer = timer

    def submit(self, fn, on_error, abort, what=""):
        if abort.is_set():
            return
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                fn()
        except torch.cuda.OutOfMemoryError as exc:
            on_error(out_of_memory(self.device, exc))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            on_error(exc)

    def wait(self, event):
        self.stream.wait_event(event.event)

    def record(self, notify=None, timing=False):
        return CudaEvent(self.stream, timing, self.timer)


def out_of_memory(device: torch.device, exc: BaseException) -> DeviceOutOfMemoryError:
    """A GPU's out-of-memory error as the emulated budget's: the caller can catch
    :class:`~rotapipe.DeviceOutOfMemoryError` on either backend (torch's is its cause)."""
    err = DeviceOutOfMemoryError(
        f"worker {device.index} ({device}) is out of memory: {exc} Use more (smaller) "
        "stages, more microbatches, or grain='layer'; device_memory below the GPU's "
        "memory makes the planner leave more room")
    err.__cause__ = exc
    return err


class CudaDevice(Device):
    """One GPU. Host tensors it downloads into are pinned so copies overlap compute."""

    def __init__(self, index: int, budget: int | None = None):
        self.index = index
        self.torch_device = torch.device("cuda", index)
        self.budget = budget
        # Stream priority orders kernels only, never copies (CUDA driver API,
        # cuStreamCreateWithPriority): copies get theirs from the gated chunks
        # (transfer.py), so every stream has the default priority.
        self._streams = {lane: CudaStream(self.torch_device, f"cuda{index}.{lane.value}")
                         for lane in (Lane.COMPUTE, Lane.WEIGHTS, Lane.TRAINED, Lane.UPLOAD,
                                      Lane.DOWNLOAD, Lane.GRADS)}
        with torch.cuda.device(self.torch_device):
            timer = DeviceClock(self._streams[Lane.COMPUTE].stream)
        for s in self._streams.values():
            s.timer = timer
        self._lock = threading.Lock()
        self._used = 0
        self._peak = 0
        self._pinned = BlockPool(pin=True)   # download targets, reused (TRAPS.md)

    def stream(self, lane):
        return self._streams[lane]

    def upload(self, host, dtype=None):
        # Always a copy the device owns, as on emulated workers: a layer may change its
        # input in place, and a tensor already on this GPU (a side input computed here)
        # would otherwise be the caller's, or the host copy a recompute reads again.
        out = host.to(self.torch_device, non_blocking=True, copy=True)
        return out if dtype is None or out.dtype == dtype else out.to(dtype)

    def download(self, dev):
        out = self._pinned.empty(dev.shape, dev.dtype)
        out.copy_(dev.detach(), non_blocking=True)
        return out

    def empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, device=self.torch_device)

    def empty_host(self, shape, dtype):
        return self._pinned.empty(shape, dtype)

    def use_on(self, tensor):
        # Rule 4 of the event protocol: the caching allocator must not hand this
        # tensor's memory to another allocation before the current stream used it.
        if tensor.is_cuda:
            tensor.record_stream(torch.cuda.current_stream(self.torch_device))

    @contextmanager
    def seeded(self, seed):
        # Seed the GPU's generator for the layer and put the caller's state back, as
        # emulated workers do with the CPU's: a plain-PyTorch loop that draws on this
        # GPU between steps must not get numbers that depend on the model's last layer
        # seed. A kernel takes its Philox seed and offset when it is queued (the
        # generator advances its offset on the host), so putting the state back once
        # the layer's kernels are queued changes none of them.
        gen = torch.cuda.default_generators[self.index]
        state = gen.get_state()
        gen.manual_seed(seed)
        try:
            yield
        finally:
            gen.set_state(state)

    def allocate(self, nbytes, what):
        # The real allocator raises torch.cuda.OutOfMemoryError itself; we only count.
        with self._lock:
            self._used += nbytes
            self._peak = max(self._peak, self._used)

    def free(self, nbytes):
        with self._lock:
            self._used -= nbytes

    def memory_in_use(self):
        return self._used

    def peak_memory(self):
        return max(self._peak, torch.cuda.max_memory_allocated(self.torch_device))

    def reset_peak(self):
        torch.cuda.reset_peak_memory_stats(self.torch_device)
        with self._lock:
            self._peak = self._used

    def drain(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            events = [s.record() for s in self._streams.values()]
            while not all(ev.query() for ev in events):
                if deadline is not None and time.monotonic() > deadline:
                    return False
                time.sleep(0.001)
        except RuntimeError:
            # An asynchronous CUDA error (a device-side assert, an illegal address) is
            # sticky: every later CUDA call raises it, and the context runs nothing
            # more, so the streams are idle. The drain runs while a failure is being
            # handled; raising here would lose that failure's report and leave the calls
            # in flight neither kept nor undone (tests/test_cuda_errors.py). An error
            # that is not sticky: wait for the device the blunt way.
            try:
                torch.cuda.synchronize(self.torch_device)
            except RuntimeError:
                pass
        return True

