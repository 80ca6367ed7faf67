"""The CUDA backend's own code, run here on stand-ins for ``torch.cuda``'s primitives.

No GPU is available in CI, so the emulated backend tests the runtime; but
``runtime/cuda.py`` itself (its events, streams, device clock and the way the executor
and the host lane use them) would otherwise run for the first time on a GPU machine.
Session 15's first GPU run found exactly such a bug: the CUDA event kept its timing
clock under the attribute the host lane reads as the race checker's vector clock, and
every call that handed gradients to the host failed.

Here ``torch.cuda.Event`` / ``Stream`` / ``device`` / ``stream`` and the generator and
memory-statistics calls are replaced by CPU stand-ins that behave as the real ones do
for work issued synchronously (an event is complete once recorded; ``elapsed_time``
needs both events created with ``enable_timing``, as on CUDA). The real
:class:`~rotapipe.runtime.cuda.CudaDevice` runs on CPU tensors, and a pipeline on two
of them must compute what plain PyTorch computes. The dispatcher threads that issue
a worker's work live across calls (CUDA libraries cache per thread), and end with the
pipeline, closed or dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
from contextlib import contextmanager

import pytest
import torch

import rotapipe
from rotapipe.runtime.emulated import EmulatedDevice
from models import lm_loss, tiny_transformer, token_batch
from test_exactness import OPTIMIZERS, assert_close_trained, step_batches, train_reference
from test_exactness import Trained, _grads, _snapshot


class _Event:
    def __init__(self, enable_timing: bool = False, **_):
        self.timing = enable_timing
        self.at = None

    def record(self, stream=None):
        self.at = time.perf_counter()

    def query(self) -> bool:
        return self.at is not None

    def synchronize(self):
        assert self.at is not None, "synchronize on an event never recorded"

    def elapsed_time(self, end: _Event) -> float:
        # cudaEventElapsedTime: both events need timing, both must have completed.
        if not (self.timing and end.timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1e3


class _Stream:
    def __init__(self, device=None, priority: int = 0):
        self.device, self.priority = device, priority

    def wait_event(self, event: _Event):
        assert event.at is not None, "a stream waits on an event never recorded"


@contextmanager
def _within(_):
    yield


@pytest.fixture
def fake_cuda(monkeypatch):
    """CudaDevice factory on CPU stand-ins."""
    from rotapipe.runtime import cuda
    from rotapipe.runtime.pool import BlockPool
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "device", _within)
    monkeypatch.setattr(torch.cuda, "stream", _within)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(device))
    monkeypatch.setattr(torch.cuda, "default_generators",
                        [torch.Generator() for _ in range(4)], raising=False)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)

    def make(index: int) -> cuda.CudaDevice:
        dev = cuda.CudaDevice(index)
        dev.torch_device = torch.device("cpu")     # its tensors live on the CPU
        dev._pinned = BlockPool()                  # no page-locking without a GPU
        # Layers on a GPU draw from the GPU's generator, which CudaDevice.seeded seeds;
        # on the CPU they draw from the CPU's, which the emulated device seeds.
        dev.seeded = functools.partial(EmulatedDevice.seeded, dev)
        return dev
    return make


def test_events_keep_the_vector_clock_attribute_free(fake_cuda):
    """The host lane merges ``event.clock`` as a vector clock after waiting; a CUDA
    event must not put anything else there."""
    dev = fake_cuda(0)
    ev = dev.stream(rotapipe.schedule.Lane.COMPUTE).record(timing=True)
    assert not getattr(ev, "clock", None)
    start = dev.stream(rotapipe.schedule.Lane.COMPUTE).record(timing=True)
    time.sleep(0.002)
    end = dev.stream(rotapipe.schedule.Lane.COMPUTE).record(timing=True)
    assert end.since(start) >= 0.002
    assert abs(end.seconds() - time.perf_counter()) < 1.0   # on the host clock


def _train(mode: str, devices=None, pipelined: bool = False) -> Trained:
    """Three AdamW steps of a tiny transformer (dropout, tied embedding), 2 workers,
    2 microbatches, ``partition='refine'`` (the CUDA default, which reads the timing
    events); ``devices``: the workers (default emulated ones). ``pipelined``: one
    ``train_step`` per step (calls overlap in the asynchronous modes) and weights in
    chunks of 1 KiB (many gated chunks per layer); else ``forward_backward``, the
    gradients read, then ``step``."""
    config = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated",
                                 partition="refine", optimizer_mode=mode,
                                 copy_chunk_mb=1 / 1024 if pipelined else 32.0)
    model = tiny_transformer(dropout=0.1, tied=True)
    losses, grads, first = [], None, None
    with rotapipe.RoundPipe(model, lm_loss, config=config, devices=devices,
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        for (x, y), in step_batches((8,)):
            if pipelined:
                losses.append(pipe.train_step(x, y))
                continue
            losses.append(pipe.forward_backward(x, y))
            first = first or _snapshot(model)
            grads = grads or _grads(model)
            assert pipe.step()
        return Trained(tuple(losses), grads or {}, first or {}, pipe.state_dict())


@pytest.mark.parametrize("mode", ["sync", "overlap", "stale"])
def test_pipelined_chunked_calls_on_the_cuda_backend(fake_cuda, mode):
    """``train_step`` after ``train_step`` (the asynchronous modes keep calls in flight)
    with weights in many gated chunks, on CudaDevices: the emulated backend's losses
    and weights, element by element."""
    devices = [fake_cuda(0), fake_cuda(1)]
    try:
        got = _train(mode, devices, pipelined=True)
    finally:
        for d in devices:
            d.stop()
        for d in devices:
            d.close()
    assert_close_trained(got, _train(mode, pipelined=True))


@pytest.mark.parametrize("mode", ["sync", "overlap", "stale"])
def test_cuda_backend_trains_as_the_emulated_one(fake_cuda, mode):
    """Two CudaDevices: the losses, gradients and weights of plain PyTorch (``sync``,
    ``overlap``) and of the emulated backend (every mode; ``stale`` is checked against
    its own definition on emulated workers in test_optimizer_modes)."""
    devices = [fake_cuda(0), fake_cuda(1)]
    try:
        got = _train(mode, devices)
    finally:
        for d in devices:
            d.stop()
        for d in devices:
            d.close()
    assert_close_trained(got, _train(mode))
    if mode != "stale":
        want = train_reference(tiny_transformer(dropout=0.1, tied=True), (8,), 2, "adamw")
        if mode == "overlap":     # the gradients go straight to the optimizer, not .grad
            assert not got.grads
            want = dataclasses.replace(want, grads={})
        assert_close_trained(got, want)


def test_a_worker_issues_every_call_from_one_thread(fake_cuda):
    """CUDA libraries cache per thread (cuDNN's attention graphs): a worker's layers
    run on the same dispatcher thread call after call, that thread ends with close(),
    and a failed call retires it (the next call gets a fresh one)."""
    model = tiny_transformer()
    seen: list[threading.Thread] = []
    fail = [False]

    def hook(module, args):
        seen.append(threading.current_thread())
        if fail[0]:
            raise RuntimeError("injected")
    model[1].register_forward_pre_hook(hook)
    devices = [fake_cuda(0)]
    x, y = token_batch(4, 6)
    config = rotapipe.PipeConfig(workers=1, microbatches=2, backend="emulated")
    before = set(threading.enumerate())         # another test's, not yet collected
    try:
        with rotapipe.RoundPipe(model, lm_loss, config=config, devices=devices) as pipe:
            for _ in range(3):
                pipe.forward_backward(x, y)
            assert len(set(seen)) == 1 and seen[0].is_alive(), seen
            first = seen[0]
            fail[0] = True
            with pytest.raises(rotapipe.WorkerError, match="injected"):
                pipe.forward_backward(x, y)
            fail[0] = False
            first.join(5.0)
            assert not first.is_alive()        # retired after the failure
            seen.clear()
            pipe.forward_backward(x, y)
            assert len(set(seen)) == 1 and seen[0] is not first
            last = seen[0]
        last.join(5.0)
        assert not last.is_alive()             # close() ended it
        assert not [t for t in threading.enumerate()
                    if t.name.startswith("rotapipe-dispatch") and t not in before]
    finally:
        for d in devices:
            d.stop()
            d.close()


def test_a_pipeline_dropped_without_close_ends_its_dispatchers():
    import gc
    from models import emulated

    def alive():
        return [t for t in threading.enumerate() if t.name.startswith("rotapipe-dispatch")]
    before = set(alive())                          # another test's, not yet collected
    pipe = rotapipe.RoundPipe(tiny_transformer(), lm_loss, config=emulated(2, 2))
    pipe.forward_backward(*token_batch(4, 6))
    threads = set(alive()) - before
    assert len(threads) == 3                       # two workers and the host lane
    del pipe
    gc.collect()
    for t in threads:
        t.join(5.0)
    assert not [t for t in threads if t.is_alive()]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_pool_reuses_a_dispatcher_only_after_a_clean_job():
    from rotapipe.runtime.dispatchers import DispatcherPool
    pool = DispatcherPool()
    seen: list[threading.Thread] = []

    def job(fail=False):
        seen.append(threading.current_thread())
        if fail:
            raise RuntimeError("a job that raised")
    for fail, keep in ((False, True), (True, True), (False, False), (False, True)):
        assert not pool.run({0: lambda fail=fail: job(fail)}, keep=lambda k=keep: k) \
            .wait(lambda: 5.0)
    assert seen[1] is seen[0]                   # reused after a clean job
    assert seen[2] is not seen[1]               # the job raised: its thread ended
    assert seen[3] is not seen[2]               # keep() said no: so did this one
    for t in seen[:3]:
        t.join(5.0)
        assert not t.is_alive()
    pool.close()
    seen[3].join(5.0)
    assert not seen[3].is_alive()               # close() ends the idle ones


def test_a_call_that_cannot_start_its_dispatchers_leaves_none_running(monkeypatch):
    """No thread left to start the second dispatcher: the call raises, the first one's
    loop ends instead of spinning, and the next call runs."""
    from models import emulated
    from rotapipe.runtime import dispatchers
    real, made = dispatchers._Dispatcher.__init__, []

    def second_fails(self, name, owner):
        if len(made) == 1:
            raise RuntimeError("can't start new thread")
        real(self, name, owner)
        made.append(self)
    x, y = token_batch(4, 6)
    with rotapipe.RoundPipe(tiny_transformer(), lm_loss, config=emulated(2, 2)) as pipe:
        monkeypatch.setattr(dispatchers._Dispatcher, "__init__", second_fails)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            pipe.forward_backward(x, y)
        monkeypatch.undo()
        made[0].thread.join(5.0)
        assert not made[0].thread.is_alive()
        assert math.isfinite(pipe.forward_backward(x, y))


def test_uploads_are_private_copies_for_layers_that_change_their_input(fake_cuda):
    """A stage whose first layer changes its input in place (``ReLU(inplace=True)``,
    ``x.add_()``) must not write into the host's copy that the recompute uploads
    again. A GPU upload is a copy; ``CudaDevice.upload`` also copies a tensor already
    on its device (a side input computed there), as the emulated upload does: before,
    ``.to(device)`` returned that tensor itself."""
    from test_user_code import (INPLACE_PLANS, _assert_like_reference, batches,
                                inplace_mlp, mse)
    workers, microbatches, text = INPLACE_PLANS["starts-3x2"]
    devices = [fake_cuda(i) for i in range(workers)]
    model = inplace_mlp()
    data = batches(3, width=6)
    config = rotapipe.PipeConfig(workers=workers, microbatches=microbatches,
                                 backend="emulated")
    try:
        with rotapipe.RoundPipe(model, mse, config=config, devices=devices,
                                plan=rotapipe.Plan.from_text(text),
                                optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1,
                                                                     momentum=0.9)) as pipe:
            losses = [pipe.forward_backward(data[0][0].clone(), data[0][1])]
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            pipe.step()
            losses += [pipe.train_step(x.clone(), y) for x, y in data[1:]]
            with torch.no_grad():
                out = pipe(data[0][0].clone())
    finally:
        for d in devices:
            d.stop()
            d.close()
    _assert_like_reference(losses, grads, model, out)


def test_a_gpu_out_of_memory_is_a_device_out_of_memory_error(fake_cuda):
    """``torch.cuda.OutOfMemoryError`` in a worker reaches the caller as the emulated
    budget's does: a ``WorkerError`` that is also a ``DeviceOutOfMemoryError`` (so a
    script that backs off on it runs the same on a GPU), naming the worker and what to
    change, torch's message kept; the failed call changed nothing and the next one runs.
    Before, it was a plain ``WorkerError``."""
    model = tiny_transformer()
    oom = [False]

    def hook(module, args):
        if oom[0]:
            raise torch.cuda.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB")
    model[2].register_forward_pre_hook(hook)
    devices = [fake_cuda(0), fake_cuda(1)]
    x, y = token_batch(4, 6)
    config = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated")
    try:
        with rotapipe.RoundPipe(model, lm_loss, config=config, devices=devices) as pipe:
            oom[0] = True
            with pytest.raises(rotapipe.DeviceOutOfMemoryError) as info:
                pipe.forward_backward(x, y)
            assert isinstance(info.value, rotapipe.WorkerError)
            text = str(info.value)
            assert "Tried to allocate 2.00 GiB" in text and "grain='layer'" in text, text
            assert all(p.grad is None for p in model.parameters())
            oom[0] = False
            assert math.isfinite(pipe.forward_backward(x, y))
    finally:
        for d in devices:
            d.stop()
            d.close()


def test_a_layer_seed_leaves_the_callers_gpu_generator_where_it_was(fake_cuda):
    """A layer draws from its seed on the GPU's generator; the caller's own draws on
    that GPU continue their stream afterwards as if no layer had run (before, the GPU
    generator was left seeded with the last layer's seed)."""
    from rotapipe.runtime import cuda
    dev = cuda.CudaDevice(1)          # the real ``seeded``: the stand-in generators
    gen = torch.cuda.default_generators[1]
    gen.manual_seed(1234)
    want = torch.rand(5, generator=torch.Generator().manual_seed(1234))
    with dev.seeded(99):
        inside = torch.rand(3, generator=gen)
    torch.testing.assert_close(inside, torch.rand(3, generator=torch.Generator().manual_seed(99)),
                               rtol=0, atol=0)
    torch.testing.assert_close(torch.rand(5, generator=gen), want, rtol=0, atol=0)
