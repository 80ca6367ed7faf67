"""The priority transfer engine, deeper weight prefetch, and timed emulation.

Timed emulation makes emulated workers take the time a cost model says; these tests
check what it promises functionally (actions last at least their emulated time, the
link order follows priorities, results do not change). How close the runtime's step
time comes to the simulator's is measured in ``benchmarks/timed_emulation.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import rotapipe
from rotapipe.errors import ConfigError, ScheduleError
from rotapipe.model.tiny import lm_loss, stride_batch
from rotapipe.plan import LayerCost, ModelCosts, even_plan
from rotapipe.runtime.emulated import EmulatedDevice
from rotapipe.runtime.transfer import CRITICAL, PREFETCH, Link
from rotapipe.schedule import prefetch_depth, roundpipe_schedule, validate
from rotapipe.sim import ActionTimes, TimedEmulation, run


def test_link_grants_the_critical_copy_before_an_earlier_prefetch():
    link = Link("test", record=True)
    release = threading.Event()
    holding = threading.Event()

    def holder():
        with link.hold(PREFETCH, what="running chunk"):
            holding.set()
            release.wait(5)

    def waiter(priority, what):
        with link.hold(priority, what=what):
            pass

    threads = [threading.Thread(target=holder)]
    threads[0].start()
    assert holding.wait(5)
    threads.append(threading.Thread(target=waiter, args=(PREFETCH, "prefetch chunk")))
    threads[-1].start()
    while len(link._waiting) < 1:
        time.sleep(0.001)
    threads.append(threading.Thread(target=waiter, args=(CRITICAL, "activation")))
    threads[-1].start()
    while len(link._waiting) < 2:
        time.sleep(0.001)
    release.set()
    for t in threads:
        t.join(5)
    assert [what for what, *_ in link.chunks] == ["running chunk", "activation",
                                                    "prefetch chunk"]


def _costs(layers: int, fwd: float, upload: float, hop: float) -> ModelCosts:
    return ModelCosts(tuple(LayerCost(f"layer{i}", fwd, 2 * fwd, fwd, upload, hop,
                                      weight_bytes=1000) for i in range(layers)), tokens=16)


def _pipe(costs, plan, workers, microbatches, devices=None, **config):
    torch.manual_seed(0)
    em = TimedEmulation(costs, dilation=1.0)
    model = em.stand_in()
    cfg = rotapipe.PipeConfig(workers=workers, microbatches=microbatches,
                              backend="emulated", emulation=em, **config)
    return rotapipe.RoundPipe(model, lm_loss, config=cfg, plan=plan, devices=devices)


def test_activation_upload_overtakes_a_weight_prefetch_in_the_runtime():
    # One worker, two forward stages of 3 layers whose weights take 3 x 20 ms to load.
    # The upload of microbatch 2's input waits for microbatch 0's forward, by which
    # time the next stage's weight prefetch holds the link: it must get the link
    # after at most one 20 ms chunk, and finish long before the prefetch does.
    costs = _costs(8, fwd=4.0, upload=20.0, hop=2.0)
    plan = even_plan(8, 2, 1, tail_layers=2)
    devices = [EmulatedDevice(0, record_links=True)]
    pipe = _pipe(costs, plan, 1, 4, devices=devices)
    try:
        x, y = stride_batch(4, 8, 32)
        pipe.forward_backward(x, y)
        chunks = devices[0].link(rotapipe.schedule.Lane.UPLOAD).chunks
    finally:
        pipe.close()
        devices[0].close()
    ua = [c for c in chunks if c[0] == "UA:F0:m2@0"]
    prefetch = [c for c in chunks if c[0] == "UW:F1"]
    assert len(ua) == 1 and len(prefetch) == 3
    _, ua_asked, ua_start, ua_end = ua[0]
    # It asked while the prefetch held the link, and finished before the prefetch did.
    assert prefetch[0][2] < ua_asked < prefetch[-1][2], (ua, prefetch)
    assert ua_end < prefetch[-1][3]
    # It waited for at most the chunk that was running when it asked: no prefetch chunk
    # started between its request and its grant.
    assert not [c for c in prefetch if ua_asked < c[2] < ua_start], (ua, prefetch)


def test_timed_emulation_takes_the_emulated_time_and_changes_no_result():
    costs = _costs(6, fwd=6.0, upload=3.0, hop=1.0)
    plan = even_plan(6, 2, 2, tail_layers=1)
    x, y = stride_batch(8, 8, 32)
    timed = _pipe(costs, plan, 2, 4)
    try:
        loss_timed = timed.forward_backward(x, y)
        measured = timed.last_timeline()
        simulated = run(timed.schedule(), ActionTimes(plan, costs))
        grads_timed = [p.grad.clone() for p in timed.parameters()]
    finally:
        timed.close()
    torch.manual_seed(0)
    model = TimedEmulation(costs).stand_in()
    plain = rotapipe.RoundPipe(model, lm_loss, plan=plan, config=rotapipe.PipeConfig(
        workers=2, microbatches=4, backend="emulated"))
    try:
        assert plain.forward_backward(x, y) == loss_timed
        for g, p in zip(grads_timed, plain.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=0, atol=0)
    finally:
        plain.close()
    # Every compute action lasted at least its emulated time; the call as a whole at
    # least the simulated makespan (the upper side is the benchmark's business).
    for sp in measured.spans:
        want = sum(ActionTimes(plan, costs)(sp.action))
        if sp.action.kind.lane is rotapipe.schedule.Lane.COMPUTE and want:
            assert sp.end - sp.start >= want * 0.999, sp.action.key
    assert measured.makespan >= simulated.makespan * 0.99


def test_timed_emulation_must_match_the_model():
    costs = _costs(5, fwd=1.0, upload=1.0, hop=1.0)
    torch.manual_seed(0)
    model = rotapipe.model.tiny.tiny_gpt(32, 8, 2, heads=2)     # 4 layers, not 5
    cfg = rotapipe.PipeConfig(workers=1, backend="emulated", emulation=TimedEmulation(costs))
    with pytest.raises(ConfigError, match="5 layers but the model has 4"):
        rotapipe.RoundPipe(model, lm_loss, config=cfg)
    with pytest.raises(ConfigError, match="backend='emulated'"):
        rotapipe.PipeConfig(backend="cuda", emulation=TimedEmulation(costs))
    with pytest.raises(ConfigError, match="TimedEmulation"):
        rotapipe.PipeConfig(emulation="rtx4090")
    with pytest.raises(ConfigError, match="dilation"):
        TimedEmulation(costs, dilation=0)


def test_prefetch_depth_follows_the_budget():
    plan = even_plan(12, 6, 5, tail_layers=1)
    resident = {s.name: 100 * (s.stop - s.start) for s in plan.jobs()}
    # 2 workers: a worker holds jobs g, g + 2, g + 4, ...; stages of 2 layers = 200 B
    # (the 1-layer tail and backward stages of 2-3 layers mix in).
    assert prefetch_depth(plan, 2, resident, budget=10**9) == 4
    assert prefetch_depth(plan, 2, resident, budget=1) == 1
    worst3 = max(sum(resident[s.name] for s in plan.jobs()[g::2][:3])
                 for g in range(len(plan.jobs())))
    assert prefetch_depth(plan, 2, resident, budget=worst3) >= 2
    assert prefetch_depth(plan, 2, resident, budget=worst3 - 1) == 1
    with pytest.raises(ScheduleError, match="prefetch"):
        roundpipe_schedule(plan, 2, 2, prefetch=0)
    with pytest.raises(ConfigError, match="prefetch"):
        rotapipe.PipeConfig(prefetch=0)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_prefetch_bounds_the_resident_stages(depth):
    # Walk each worker's list: a weight upload may start only after the free of the
    # job depth + 1 back on that worker, so at most depth + 1 stages are resident.
    plan = even_plan(13, 6, 6, tail_layers=1)
    s = roundpipe_schedule(plan, 2, 4, prefetch=depth)
    validate(s, dataflow=True)
    for w in range(2):
        jobs = [a.stage for a in s.worker_actions(w) if a.kind.value == "UW"]
        for g, a in enumerate(a for a in s.worker_actions(w) if a.kind.value == "UW"):
            frees = [d for d in a.host_deps if d.startswith("X:")]
            if g > depth:
                assert frees == [f"X:{jobs[g - depth - 1]}"], (a.key, frees)
            else:
                assert frees == [], (a.key, frees)


@pytest.mark.parametrize("prefetch", [2, 3])
def test_deeper_prefetch_is_exact(prefetch):
    torch.manual_seed(0)
    model = rotapipe.model.tiny.tiny_gpt(32, 16, 6, heads=2)
    ref = rotapipe.model.tiny.tiny_gpt(32, 16, 6, heads=2)
    ref.load_state_dict(model.state_dict())
    x, y = stride_batch(6, 8, 32)
    pipe = rotapipe.RoundPipe(model, lm_loss, config=rotapipe.PipeConfig(
        workers=2, microbatches=3, backend="emulated", prefetch=prefetch))
    try:
        loss = pipe.forward_backward(x, y)
    finally:
        pipe.close()
    ref_loss = 0.0
    for xm, ym in zip(x.chunk(3), y.chunk(3)):
        l = lm_loss(ref(xm), ym) / 3
        l.backward()
        ref_loss += l.item()
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
