"""Copy engines and gated chunks, deeper weight prefetch, and timed emulation.

The emulated copy engines serve copies as a GPU's do (in arrival order, no priority,
no preemption); the runtime's gated chunks earn critical copies their priority.
Timed emulation makes emulated workers take the time a cost model says; these tests
check what it promises functionally (actions last at least their emulated time,
results do not change). How close the runtime's step
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
from rotapipe.runtime.transfer import UP, CopyEngine
from rotapipe.schedule import Lane
from rotapipe.schedule import prefetch_depth, roundpipe_schedule, validate
from rotapipe.runtime.emulation import TimedEmulation
from rotapipe.sim import ActionTimes, run


def test_copy_engine_serves_in_arrival_order_without_priority():
    # Three copies reach the engine while a first one runs: they are served in the
    # order they arrived, whatever lane they come from.
    engine = CopyEngine("test", record=True)
    first = engine.ticket()
    started = engine.acquire(first)
    order = [engine.ticket() for _ in range(3)]
    done = []

    def copy(t, what):
        s = engine.acquire(t)
        done.append(what)
        engine.release(t, what, s)

    threads = [threading.Thread(target=copy, args=(t, w))
               for t, w in reversed(list(zip(order, ["weights", "activation", "grads"])))]
    for t in threads:
        t.start()
    time.sleep(0.05)
    assert done == []                      # nothing preempts the running copy
    engine.release(first, "running", started)
    for t in threads:
        t.join(5)
    assert done == ["weights", "activation", "grads"]


def test_copies_reach_the_engine_when_runnable_and_together_per_stream():
    # A stream's copies issued back to back reach the engine at once; a copy behind a
    # stream wait reaches it only when the wait passes, after copies of other streams.
    dev = EmulatedDevice(0, record_copies=True)
    abort = threading.Event()
    gate = threading.Event()
    blocker = dev.stream(Lane.COMPUTE)
    blocker.submit(lambda: gate.wait(5), print, abort)
    produced = blocker.record()
    up, weights = dev.stream(Lane.UPLOAD), dev.stream(Lane.WEIGHTS)
    up.wait(produced)
    up.submit(lambda: None, print, abort, "activation")
    for i in range(3):
        weights.submit(lambda: time.sleep(0.01), print, abort, f"chunk{i}")
    time.sleep(0.005)
    gate.set()
    assert dev.drain(5)
    dev.close()
    names = [c[0] for c in dev.engines[UP].copies]
    assert names == ["chunk0", "chunk1", "chunk2", "activation"], names


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


def _prefetch_race(gate: bool):
    """One worker, two forward stages of 3 layers; each layer's weights (1000 B) move
    in two 10 ms chunks (chunk size 500 B). The upload of microbatch 2's input becomes
    runnable when microbatch 0's forward ends, while the next stage's weight prefetch
    is on the engine. Returns (that upload's record, the prefetch chunks' records)."""
    costs = _costs(8, fwd=4.0, upload=20.0, hop=2.0)
    plan = even_plan(8, 2, 1, tail_layers=2)
    devices = [EmulatedDevice(0, record_copies=True)]
    pipe = _pipe(costs, plan, 1, 4, devices=devices, gate_copies=gate,
                 copy_chunk_mb=500 / 2**20)
    try:
        x, y = stride_batch(4, 8, 32)
        pipe.forward_backward(x, y)
        copies = devices[0].engines[UP].copies
    finally:
        pipe.close()
        devices[0].close()
    ua = [c for c in copies if c[0] == "UA:F0:m2@0"]
    prefetch = sorted((c for c in copies if c[0].startswith("UW:F1#")), key=lambda c: c[2])
    assert len(ua) == 1 and len(prefetch) == 6, copies
    return ua[0], prefetch


def test_without_gating_an_activation_upload_waits_for_the_whole_prefetch():
    (_, reached, start, end), prefetch = _prefetch_race(gate=False)
    # It became runnable while the prefetch was on the engine ...
    assert prefetch[0][2] < reached < prefetch[-1][3], (reached, prefetch)
    # ... and, copies being served in arrival order, ran only after all of it.
    assert start >= prefetch[-1][3] - 1e-4, (start, prefetch[-1])


def test_gated_chunks_let_an_activation_upload_wait_for_at_most_one_chunk():
    (_, reached, start, end), prefetch = _prefetch_race(gate=True)
    assert prefetch[0][2] < reached < prefetch[-1][3], (reached, prefetch)
    assert end < prefetch[-1][3]
    # No prefetch chunk started between its arrival and its start: it waited at most
    # for the chunk already on the engine (10 ms).
    assert not [c for c in prefetch if reached < c[2] < start], (reached, start, prefetch)
    assert start - reached < 0.010 + 0.008


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


def test_calibrated_dilation_sets_the_shortest_compute_action():
    """TimedEmulation.calibrated (examples/timed_emulation.py and the benchmarks): the
    shortest compute action of the schedule lasts min_action_ms of real time, a call at
    least target_s, and the emulation is never faster than the hardware."""
    costs = _costs(6, fwd=0.5, upload=0.2, hop=0.1)
    plan = even_plan(6, 2, 2, tail_layers=1)
    schedule = roundpipe_schedule(plan, 2, 4)
    times = ActionTimes(plan, costs)
    compute = [sum(times(a)) for a in schedule.actions if a.kind.lane is Lane.COMPUTE]
    shortest = min(ms for ms in compute if ms > 0)
    em = TimedEmulation(costs).calibrated(plan, schedule, min_action_ms=20.0)
    assert shortest * em.dilation == pytest.approx(20.0)
    makespan = run(schedule, times).makespan
    slow = TimedEmulation(costs).calibrated(plan, schedule, target_s=5.0)
    assert makespan * slow.dilation == pytest.approx(5000.0) and slow.dilation > em.dilation
    assert TimedEmulation(costs).calibrated(plan, schedule, min_action_ms=1e-6).dilation == 1.0


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


def _twins(dim: int, layers: int):
    """A tiny GPT and an identical plain-PyTorch reference."""
    torch.manual_seed(0)
    model = rotapipe.model.tiny.tiny_gpt(32, dim, layers, heads=2)
    ref = rotapipe.model.tiny.tiny_gpt(32, dim, layers, heads=2)
    ref.load_state_dict(model.state_dict())
    return model, ref


def _reference_loss(ref, x, y, microbatches: int) -> float:
    """Accumulate ``ref``'s gradients over the microbatches as the pipeline does."""
    total = 0.0
    for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
        l = lm_loss(ref(xm), ym) / microbatches
        l.backward()
        total += l.item()
    return total


@pytest.mark.parametrize("prefetch", [2, 3])
def test_deeper_prefetch_is_exact(prefetch):
    model, ref = _twins(16, 6)
    x, y = stride_batch(6, 8, 32)
    pipe = rotapipe.RoundPipe(model, lm_loss, config=rotapipe.PipeConfig(
        workers=2, microbatches=3, backend="emulated", prefetch=prefetch))
    try:
        loss = pipe.forward_backward(x, y)
    finally:
        pipe.close()
    assert loss == pytest.approx(_reference_loss(ref, x, y, 3), rel=1e-6)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_simulator_models_the_same_engines():
    # The simulator's copy engines: gated, an activation upload waits for at most one
    # weight chunk; ungated, for the whole prefetch that reached the engine before it.
    costs = _costs(8, fwd=4.0, upload=20.0, hop=2.0)
    plan = even_plan(8, 2, 1, tail_layers=2)
    s = roundpipe_schedule(plan, 1, 4)
    times = ActionTimes(plan, costs, chunk_bytes=500)     # two 10 ms chunks per layer
    assert times(s.by_key()["UW:F1"]) == (10.0,) * 6
    gated, ungated = run(s, times), run(s, times, gate=False)
    # F1's first input is downloaded while F1's weights are on the upload engine.
    for tl in (gated, ungated):
        assert tl.start["UW:F1"] < tl.end["DA:F0:m0@3"] < tl.end["UW:F1"]
    ua = "UA:F1:m0@3"       # runnable once its input is on the host and F0's uploads are done
    runnable = max(gated.end["DA:F0:m0@3"], gated.end["UA:F0:m3@0"])
    assert gated.start["UW:F1"] < runnable < gated.end["UW:F1"]
    assert gated.start[ua] - runnable <= 10.0 + 1e-9
    assert ungated.start[ua] >= ungated.end["UW:F1"] - 1e-9


@pytest.mark.parametrize("pin,gate", [("copy", True), ("off", True), ("off", False),
                                      ("register", True)])
def test_small_chunks_are_exact(pin, gate):
    # Chunks of 1000 bytes cut weight tensors (and their gradients) into byte ranges,
    # mid-element too, through bounce buffers when the weights are pageable: gradients
    # and weights after a step equal plain PyTorch's.
    model, ref = _twins(32, 4)
    x, y = stride_batch(6, 8, 32)
    pipe = rotapipe.RoundPipe(model, lm_loss, config=rotapipe.PipeConfig(
        workers=2, microbatches=3, backend="emulated", pin=pin, gate_copies=gate,
        copy_chunk_mb=1000 / 2**20))
    try:
        assert pipe.pin_mode.value == pin
        pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
        loss = pipe.forward_backward(x, y)
        grads = [p.grad.clone() for p in model.parameters()]
        pipe.step()
        uploads = [sp for sp in pipe.last_timeline().spans if sp.action.kind.value == "UW"]
        if pin == "off":
            assert pipe.pinning.stats["buffers_peak"] > 0       # bounce buffers were used
    finally:
        pipe.close()
    assert len(uploads) > 2 * len({sp.action.key for sp in uploads})   # several chunks each
    assert loss == pytest.approx(_reference_loss(ref, x, y, 3), rel=1e-6)
    for (name, p), g in zip(ref.named_parameters(), grads):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():
        for p in ref.parameters():
            p.sub_(0.1 * p.grad)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-5, atol=1e-6, msg=name)
