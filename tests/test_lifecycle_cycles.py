"""A pipeline dropped without ``close()`` is freed by reference counting alone.

Its threads stop from a finalizer that runs when its last reference goes away; a
reference cycle through it would leave them (and its weights, pinned buffers and the
call's tensors) alive until the cyclic collector happens to run, which in a long job
with a large heap may be never. Checked with the collector off, in every optimizer
mode, after a clean call, after each kind of failed call (a layer raising, the loss
function raising, a bad input, a non-finite loss) and with data parallelism on.
"""

from __future__ import annotations

import gc
import math
import threading
import time
import weakref

import pytest
import torch
from torch import nn

import rotapipe
from models import emulated, lm_loss, token_batch, tiny_transformer

MODES = ("sync", "overlap", "stale")


class InjectedFault(RuntimeError):
    """(A Python subclass: weak references to it work.)"""


class Faults:
    """Which fault to inject; shared by the workers' copies of the layers."""

    def __init__(self):
        self.layer = self.loss = self.nan = False

    def __deepcopy__(self, memo):
        return self


class Switch(nn.Module):
    """A linear layer that raises while ``faults.layer`` is set."""

    def __init__(self, faults: Faults):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.faults = faults

    def forward(self, x):
        if self.faults.layer:
            raise InjectedFault("injected layer fault")
        return self.lin(x)


def _build(mode: str, **kw):
    torch.manual_seed(0)
    faults = Faults()

    def loss_fn(out, y):
        if faults.loss:
            raise InjectedFault("injected loss fault")
        loss = nn.functional.mse_loss(out, y)
        return loss * math.nan if faults.nan else loss

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Switch(faults), nn.Linear(16, 4))
    pipe = rotapipe.RoundPipe(model, loss_fn, config=emulated(2, 2, optimizer_mode=mode, **kw))
    pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-3))
    return pipe, faults


def _fail_a_call(pipe, faults: Faults, kind: str) -> None:
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    pipe.train_step(x, y)
    pipe(x)
    if kind == "none":
        return
    if kind in ("layer", "loss", "nan"):
        setattr(faults, kind, True)
    else:
        x = x[:, :3]                       # the first layer cannot take it
    with pytest.raises(Exception):
        pipe.train_step(x, y)
        pipe.flush()


def _assert_freed(ref: weakref.ref, baseline: int) -> None:
    deadline = time.monotonic() + 5.0
    assert ref() is None, "the dropped pipeline is kept alive by a reference cycle"
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.02)
    assert threading.active_count() == baseline, threading.enumerate()


@pytest.fixture
def no_cyclic_gc():
    # A first pipeline imports what torch loads lazily (some of it in reference cycles
    # of its own) before the collector is turned off.
    pipe, faults = _build("sync")
    _fail_a_call(pipe, faults, "layer")
    pipe.close()
    del pipe
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


@pytest.mark.parametrize("kind", ["none", "layer", "loss", "input", "nan"])
@pytest.mark.parametrize("mode", MODES)
def test_a_dropped_pipeline_is_freed_without_the_cyclic_collector(no_cyclic_gc, mode, kind):
    baseline = threading.active_count()
    pipe, faults = _build(mode)
    _fail_a_call(pipe, faults, kind)
    ref = weakref.ref(pipe)
    del pipe
    _assert_freed(ref, baseline)


@pytest.mark.parametrize("mode", MODES)
def test_a_dropped_data_parallel_pipeline_is_freed_without_the_cyclic_collector(
        one_rank_group, no_cyclic_gc, mode):
    baseline = threading.active_count()
    torch.manual_seed(0)
    config = emulated(2, 2, optimizer_mode=mode, data_parallel=rotapipe.DataParallelConfig(
        enabled=True, heartbeat_s=0.05, timeout_s=10))
    pipe = rotapipe.RoundPipe(tiny_transformer(), lm_loss, config=config)
    pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters(), lr=1e-3))
    x, y = token_batch(4, 5)
    pipe.train_step(x, y)
    assert pipe.data_parallel is not None
    ref = weakref.ref(pipe)
    del pipe
    _assert_freed(ref, baseline)



@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["layer", "loss", "evaluation"])
def test_a_workers_exception_is_not_kept_once_raised(no_cyclic_gc, mode, kind):
    # The worker's exception has a traceback through the closures of the call's session
    # (whose events point back at it): the session must not keep it once raised, or the
    # frames it holds (the call's tensors) live on until the cyclic collector runs.
    pipe, faults = _build(mode)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    pipe.train_step(x, y)
    fault = "layer" if kind == "evaluation" else kind
    setattr(faults, fault, True)
    with pytest.raises(rotapipe.WorkerError) as info:
        if kind == "evaluation":
            pipe(x)
        pipe.train_step(x, y)
        pipe.flush()
    cause = weakref.ref(info.value.cause)
    del info
    assert cause() is None, "the worker's exception is kept by a reference cycle"
    setattr(faults, fault, False)
    pipe.train_step(x, y)                # and the pipeline trains on
    pipe.close()
