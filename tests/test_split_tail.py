"""A fused tail split over several jobs: each runs a share of the microbatches on its
own worker (for heavy heads, e.g. a large vocabulary)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rotapipe
from rotapipe.errors import PlanError, ScheduleError
from rotapipe.model.tiny import lm_loss, stride_batch, tiny_gpt
from rotapipe.plan import Plan, even_plan
from rotapipe.schedule import roundpipe_schedule, validate
from rotapipe.sim import ActionTimes, run
from rotapipe.plan import ModelCosts


def test_plan_text_and_jobs():
    plan = dataclasses.replace(even_plan(6, 2, 3), tail_jobs=3)
    assert plan.to_text() == "F0[0:2] F1[2:5] T[5:6]x3 B0[0:1] B1[1:3] B2[3:5]"
    assert Plan.from_text(plan.to_text()) == plan
    assert [s.name for s in plan.jobs()] == ["F0", "F1", "T", "T1", "T2", "B2", "B1", "B0"]
    # Dealt in turn: the first microbatches out of the forward reach every tail job at
    # once, and their gradients feed the backward stages as soon as possible.
    assert [list(plan.tail_microbatches(i, 7)) for i in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
    assert plan.tail_for(4, 7).name == "T1"
    with pytest.raises(PlanError, match="at least 3 microbatches"):
        plan.tail_microbatches(0, 2)
    with pytest.raises(PlanError, match="tail_jobs"):
        dataclasses.replace(plan, tail_jobs=0)


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("jobs", [2, 3])
def test_split_tail_schedules_validate_and_simulate(workers, jobs):
    plan = dataclasses.replace(even_plan(7, 3, 4), tail_jobs=jobs)
    s = roundpipe_schedule(plan, workers, 5)
    validate(s, dataflow=True)
    for t in plan.tails():
        mbs = sorted(a.mb for a in s.actions if a.kind.value == "FT" and a.stage == t.name)
        assert mbs == list(plan.tail_microbatches(t.index, 5))
    run(s, ActionTimes(plan, ModelCosts.uniform(7, 1.0, 2.0)))


def test_split_tail_refuses_what_it_cannot_do():
    plan = dataclasses.replace(even_plan(5, 2, 2), tail_jobs=2)
    with pytest.raises(ScheduleError, match="tail_context"):
        roundpipe_schedule(plan, 2, 4, tail_barrier=True)
    with pytest.raises(ScheduleError, match="buffers"):
        roundpipe_schedule(plan, 2, 4, buffer_layers={4})
    with pytest.raises(PlanError, match="microbatches"):
        roundpipe_schedule(plan, 2, 1)


@pytest.mark.parametrize("workers,jobs", [(1, 2), (2, 2), (3, 3)])
def test_split_tail_is_exact(workers, jobs):
    torch.manual_seed(0)
    model = tiny_gpt(32, 16, 4, heads=2)
    ref = tiny_gpt(32, 16, 4, heads=2)
    ref.load_state_dict(model.state_dict())
    plan = dataclasses.replace(even_plan(6, 2, 3), tail_jobs=jobs)
    x, y = stride_batch(8, 8, 32)
    M = 4
    pipe = rotapipe.RoundPipe(model, lm_loss, plan=plan, config=rotapipe.PipeConfig(
        workers=workers, microbatches=M, backend="emulated"))
    try:
        loss = pipe.forward_backward(x, y)
    finally:
        pipe.close()
    want = 0.0
    for xm, ym in zip(x.chunk(M), y.chunk(M)):
        l = lm_loss(ref(xm), ym) / M
        l.backward()
        want += l.item()
    assert loss == pytest.approx(want, rel=1e-6)
    for (name, p), q in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_planner_splits_a_heavy_tail_and_only_then():
    from rotapipe.plan import LayerCost
    from rotapipe.planner.autoplan import PlannerConfig, choose_plan

    def costs(head_ms):
        blocks = [LayerCost(f"b{i}", 1.0, 2.0, 1.0, 0.2, 0.05, weight_bytes=100)
                  for i in range(12)]
        head = LayerCost("head", head_ms, 2 * head_ms, head_ms, 0.5, 0.05, weight_bytes=200)
        return ModelCosts(tuple(blocks) + (head,), 1)

    for head_ms, split in ((12.0, True), (0.5, False)):
        c = costs(head_ms)
        one = choose_plan(lambda m: c, PlannerConfig(4, 10**9, (8,)))
        any_ = choose_plan(lambda m: c, PlannerConfig(4, 10**9, (8,), tail_jobs=(1, 2, 3, 4)))
        assert one.plan.tail_jobs == 1
        assert any_.step_ms <= one.step_ms + 1e-9
        assert (any_.plan.tail_jobs > 1) == split, any_.plan.to_text()
        if split:
            assert any_.step_ms < 0.9 * one.step_ms, (any_.step_ms, one.step_ms)


def test_every_tail_job_must_download_its_losses():
    from rotapipe.schedule.validate import check_runnable
    plan = dataclasses.replace(even_plan(6, 2, 3), tail_jobs=2)
    s = roundpipe_schedule(plan, 2, 4)
    check_runnable(s)
    gone = "DG:T1:m3@5"
    broken = dataclasses.replace(s, actions=tuple(a for a in s.actions if a.key != gone))
    with pytest.raises(ScheduleError, match="FT:T1:m3 .*never downloaded"):
        check_runnable(broken)


def test_each_tail_job_moves_the_head_weights_in_the_runtime_as_in_the_simulator(
        monkeypatch):
    """A split tail uploads the tail's weights once per job and downloads their
    gradients once per job: the runtime's chunked copies move the same bytes for
    ``T1`` as for ``T``, and the simulator charges every job's copies in full."""
    from rotapipe.plan import LayerCost
    from rotapipe.runtime.chunks import ChunkedCopies

    moved: dict[str, int] = {}

    def counting(method, pick):
        def wrapped(self, a):
            layers = self._layers(a, pick(self))
            moved[a.key] = sum(hi - lo for l, _, sizes in layers
                               for pieces in self._parts(l, sizes) for _, lo, hi in pieces)
            return method(self, a)
        return wrapped

    monkeypatch.setattr(ChunkedCopies, "upload",
                        counting(ChunkedCopies.upload, lambda self: lambda p: True))
    monkeypatch.setattr(ChunkedCopies, "download", counting(
        ChunkedCopies.download, lambda self: lambda p: self.r.ls.params[p].requires_grad))
    torch.manual_seed(0)
    model = tiny_gpt(32, 16, 4, heads=2)
    plan = dataclasses.replace(even_plan(6, 2, 3), tail_jobs=3)
    pipe = rotapipe.RoundPipe(model, lm_loss, plan=plan, config=rotapipe.PipeConfig(
        workers=3, microbatches=6, backend="emulated"))
    try:
        pipe.forward_backward(*stride_batch(6, 8, 32))
    finally:
        pipe.close()
    head = sum(p.numel() * p.element_size() for p in model[5].parameters())
    for t in ("T", "T1", "T2"):
        assert moved[f"UW:{t}"] == head, (t, moved[f"UW:{t}"], head)
        assert moved[f"DW:{t}"] == head, (t, moved[f"DW:{t}"], head)
    # The simulator: one UW and one DW per tail job, each the whole tail's time.
    costs = ModelCosts(tuple(LayerCost(f"l{i}", 1.0, 2.0, 1.0, upload_ms=3.0 + i)
                             for i in range(6)), 1)
    s = roundpipe_schedule(plan, 3, 6)
    times = ActionTimes(plan, costs)
    for kind in ("UW", "DW"):
        acts = [a for a in s.actions if a.kind.value == kind and a.stage.startswith("T")]
        assert sorted(a.stage for a in acts) == ["T", "T1", "T2"]
        assert all(sum(times(a)) == pytest.approx(8.0) for a in acts)


def test_the_planner_weighs_a_split_tails_extra_head_uploads():
    """Every extra tail job uploads the head again: with dear head weights a split pays
    less, by the planner's job-grain estimate and by the simulator alike."""
    from rotapipe.plan import Footprint, LayerCost
    from rotapipe.plan.partitioner import estimate_step_ms
    from rotapipe.planner.autoplan import simulate_plan

    def costs(head_upload_ms):
        blocks = [LayerCost(f"b{i}", 1.0, 2.0, 1.0, 2.0, 0.05, weight_bytes=100)
                  for i in range(12)]
        head = LayerCost("head", 12.0, 24.0, 12.0, head_upload_ms, 0.05, weight_bytes=200)
        return ModelCosts(tuple(blocks) + (head,), 1)

    one = even_plan(13, 4, 8)
    split = dataclasses.replace(one, tail_jobs=4)
    gains = {}
    for up in (1.0, 150.0):
        c = costs(up)
        fp = Footprint.of(c, 8)
        est = estimate_step_ms(one, fp, 4) / estimate_step_ms(split, fp, 4)
        sim = simulate_plan(one, c, 4, 8).step_ms / simulate_plan(split, c, 4, 8).step_ms
        gains[up] = est, sim
    assert gains[1.0][0] > gains[150.0][0] and gains[1.0][1] > gains[150.0][1], gains
    assert gains[1.0][1] - gains[150.0][1] > 0.3, gains   # 1.82x down to 1.30x
