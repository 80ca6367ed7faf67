"""An asynchronous CUDA error (a device-side assert, an illegal address), on stand-ins
for ``torch.cuda``'s primitives (``test_cuda_backend_logic.py``'s).

On a GPU such an error is raised by whatever CUDA call comes next, on any thread, and it
is sticky: every later event query, record or stream wait raises it too. The failure
must still reach the caller as any worker failure does, with the pipeline left at the
step boundary the exception reports (``calls_committed``), never half-changed; the
emulated backend cannot raise this way, so only these stand-ins show it.
"""

from __future__ import annotations

import threading

import pytest
import torch

import rotapipe
from models import lm_loss, tiny_transformer
from test_cuda_backend_logic import _Event, _Stream, fake_cuda  # noqa: F401 - fixture
from test_exactness import OPTIMIZERS, _snapshot, assert_same_state, step_batches

ASSERT = "CUDA error: device-side assert triggered"

_poison: dict[str, str | None] = {"on": None}
"""Where the sticky error shows: ``"record"`` (every thread's next event record or stream
wait: a dispatcher sees it first) or ``"caller"`` (event queries of the caller's
thread: the caller's wait for the loss sees it first)."""


def _raise_if(where: str) -> None:
    on = _poison["on"]
    caller = threading.current_thread() is threading.main_thread()
    if on == where and (on != "caller" or caller):
        raise RuntimeError(ASSERT)


class _StickyEvent(_Event):
    def record(self, stream=None):
        _raise_if("record")
        super().record(stream)

    def query(self):
        _raise_if("caller")
        return super().query()

    def synchronize(self):
        _raise_if("caller")
        super().synchronize()


class _StickyStream(_Stream):
    def wait_event(self, event):
        _raise_if("record")
        super().wait_event(event)


def _synchronize(device=None):
    if _poison["on"] is not None:      # sticky: any thread's device-wide wait raises
        raise RuntimeError(ASSERT)


@pytest.fixture
def sticky_cuda(fake_cuda, monkeypatch):  # noqa: F811 - the imported fixture
    monkeypatch.setattr(torch.cuda, "Event", _StickyEvent)
    monkeypatch.setattr(torch.cuda, "Stream", _StickyStream)
    monkeypatch.setattr(torch.cuda, "synchronize", _synchronize)
    yield fake_cuda
    _poison["on"] = None


def _train(calls: int, devices=None) -> dict:
    """``calls`` overlapping train_steps (per-stage steps during the call) on 2 workers;
    the model's state after the pipeline closed."""
    model = tiny_transformer()
    config = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated",
                                 optimizer_mode="overlap")
    with rotapipe.RoundPipe(model, lm_loss, config=config, devices=devices,
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        for (x, y), in step_batches((8,))[:calls]:
            pipe.train_step(x, y)
    return _snapshot(model)


@pytest.mark.parametrize("where", ["record", "caller"])
def test_a_sticky_cuda_error_fails_the_call_and_keeps_a_step_boundary(sticky_cuda, where):
    """The error shows up after the second call's first layer ran (it returned; its
    kernel asserted). The call fails with the error (a dispatcher that saw it first:
    a WorkerError naming the action), and the model holds exactly the calls the
    exception says committed. Before, the devices' drain after the failure asked the
    dead context again and raised from inside the failure handling: the dispatcher's
    case lost the WorkerError, the caller's left the calls in flight neither committed
    nor undone (the overlapping call's stepped stages stayed stepped)."""
    model = tiny_transformer()
    armed = [False]

    def hook(module, args, out):
        if armed[0]:
            armed[0] = False
            _poison["on"] = where
    model[2].register_forward_hook(hook)
    config = rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated",
                                 optimizer_mode="overlap")
    devices = [sticky_cuda(0), sticky_cuda(1)]
    batches = step_batches((8,))
    try:
        pipe = rotapipe.RoundPipe(model, lm_loss, config=config, devices=devices,
                                  optimizer=OPTIMIZERS["adamw"])
        (x, y), = batches[0]
        pipe.train_step(x, y)
        armed[0] = True
        with pytest.raises(Exception, match="device-side assert") as info:
            for (x, y), in batches[1:]:
                pipe.train_step(x, y)
        exc = info.value
        _poison["on"] = None
        if where == "record":
            assert isinstance(exc, rotapipe.WorkerError), repr(exc)
        committed = exc.calls_committed
        assert pipe.calls == committed
        pipe.close()
        assert_same_state(_snapshot(model), _train(committed))
    finally:
        _poison["on"] = None
        for d in devices:
            d.stop()
            d.close()
