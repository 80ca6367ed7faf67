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
    assert [list(plan.tail_microbatches(i, 7)) for i in range(3)] == [[0, 1], [2, 3], [4, 5, 6]]
    assert plan.tail_for(3, 7).name == "T1"
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
    from rotapipe.sim.autoplan import PlannerConfig, choose_plan

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
