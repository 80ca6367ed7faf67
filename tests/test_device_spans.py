"""Compute spans are the device's time, not the host's.

On CUDA an action's body only issues its kernels, so the host time of the body says
nothing about how long the device ran it. The executor brackets every compute action
with timing events and takes its span from them once the call completed; the
planner's ``partition="refine"`` (on by default on CUDA) learns layer costs from
those spans. Here a backend that behaves like CUDA in that respect (bodies run inline
on the dispatcher thread; each stream has a device clock that the work advances) shows
the spans follow the device clock, not the host's.
"""

from __future__ import annotations

import pathlib
import sys
import time

import torch

import rotapipe
from rotapipe.runtime.backend import _DoneEvent
from rotapipe.runtime.executor import Executor
from rotapipe.schedule import HOST, ActionKind as K, Lane
from rotapipe.schedule.actions import COMPUTE_PASSES

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from issue_overhead import NullDevice, NullStream  # noqa: E402  (the null backend)


class _InlineStream(NullStream):
    """Runs bodies now on the dispatcher thread (as CUDA's streams do); the device
    clock advances only by the cost the work declares, so the host time of a body
    and the device time of its work differ."""

    def __init__(self, name: str, device: _ClockDevice):
        super().__init__(name)
        self.device = device

    def record(self, notify=None, timing=False):
        ev = _DoneEvent()              # complete at once, at the device clock's time
        ev.at = self.device.clock
        return ev


class _ClockDevice(NullDevice):
    def __init__(self, index: int):
        super().__init__(index)
        self.clock = 1e9 * (index + 1)       # device seconds, far from the host clock
        self._streams = {lane: _InlineStream(f"clock{index}.{lane.value}", self)
                         for lane in Lane if lane is not Lane.HOST}


def _cost(a) -> float:
    """The device seconds the work of ``a`` takes: distinct per action."""
    return 0.001 * (1 + len(a.key) % 7) + (0.0005 * a.mb if a.mb is not None else 0.0)


def test_compute_spans_are_the_device_time_of_the_work():
    devices = [_ClockDevice(0), _ClockDevice(1)]
    schedule = rotapipe.roundpipe_schedule(rotapipe.even_plan(6, 3, 3), 2, 3)

    def body(a):
        if a.worker == HOST:
            return
        time.sleep(0.002 if a.kind in COMPUTE_PASSES else 0.0)   # host time: 2 ms each
        devices[a.worker].clock += _cost(a)                      # device time: _cost

    ex = Executor(devices)
    ex.run(schedule, body)
    compute = [s for s in ex.last_spans if s[0].kind in COMPUTE_PASSES]
    assert len(compute) == sum(a.kind in COMPUTE_PASSES for a in schedule.actions)
    for a, start, end in compute:
        assert abs((end - start) - _cost(a)) < 1e-6, (a.key, end - start, _cost(a))
        assert start >= 1e9 * (a.worker + 1), a.key      # on the device's clock
    # Copies keep the host time of their bodies (the only clock they have here).
    host = [s for s in ex.last_spans if s[0].kind not in COMPUTE_PASSES]
    assert host and all(0 <= end - start < 1.0 and start < 1e9 for _, start, end in host)


def test_emulated_compute_spans_still_cover_the_work():
    """On emulated workers the work runs on the stream's thread, between the events:
    a compute span covers at least the time its body took."""
    import models
    slow = 0.01
    layers = models.tiny_transformer()
    forward = layers[1].forward

    def slowed(*args, **kwargs):
        time.sleep(slow)
        return forward(*args, **kwargs)
    layers[1].forward = slowed
    config = models.emulated(2, 2)
    with rotapipe.RoundPipe(layers, models.lm_loss, config=config) as pipe:
        pipe.forward_backward(*models.token_batch(4, 6))
        spans = pipe._stream.last_spans
    stages = pipe.plan.jobs()
    holding = {s.name for s in stages if s.start <= 1 < s.stop}
    covered = [end - start for a, start, end in spans
               if a.kind in (K.FORWARD, K.RECOMPUTE) and a.stage in holding]
    assert covered and min(covered) >= slow, covered


def test_host_seconds_split_the_callers_time_by_phase():
    import models
    x, y = models.token_batch(4, 6)
    config = models.emulated(2, 2, partition="refine")
    with rotapipe.RoundPipe(models.tiny_transformer(), models.lm_loss, config=config,
                            optimizer=torch.optim.SGD) as pipe:
        before = pipe.host_seconds()
        t = time.perf_counter()
        pipe.forward_backward(x, y)
        pipe.train_step(x, y)
        pipe.zero_grad()
        wall = time.perf_counter() - t
        got = {k: v - before.get(k, 0.0) for k, v in pipe.host_seconds().items()}
    assert set(got) == {"wait for the loss", "wait for the rest of the call",
                        "check, merge and step", "re-plan", "zero_grad"}, got
    assert all(v >= 0 for v in got.values()) and got["wait for the loss"] > 0
    assert sum(got.values()) <= wall
