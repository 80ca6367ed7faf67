"""Failure behaviour of the executor on emulated workers, with injected faults.

A layer raises on a chosen worker, microbatch and pass (forward, recompute, backward or
the fused tail), over 20 seeded random placements. Each failing call must reach the
caller promptly as a :class:`rotapipe.WorkerError` naming the stage, its layers, the
microbatch and the worker, with the schedule grid and the failing action marked; it
must change no weight, buffer, gradient or optimizer state; and the next clean call
and step must match plain PyTorch. An emulated out-of-memory error in a worker fails
the same way, and leaves no thread or accounted byte behind.
"""

from __future__ import annotations

import copy
import random
import threading
import time

import pytest
import torch
from torch import nn

import rotapipe
from rotapipe.runtime.emulated import running_seed
from models import (Sleepy, emulated, lm_loss, reference_forward_backward, tiny_transformer,
                    token_batch)

RTOL, ATOL = 1e-5, 1e-6
PROMPT_S = 1.0          # the bound: the caller sees the fault within a second
PASSES = ("forward", "recompute", "backward", "tail-forward", "tail-backward")


class Fault(Exception):
    """The exception the injected layer raises."""


class Trigger:
    """Where the next fault fires: (layer, microbatch, call, pass).

    Workers run *shells*, deep copies of the layers; ``__deepcopy__`` returns ``self``
    so every shell and the user's layer share this one trigger object.
    """

    def __init__(self):
        self.layer = self.mb = self.pass_ = None
        self.seeds: frozenset[int] = frozenset()
        self.fired_at: float | None = None

    def __deepcopy__(self, memo):
        return self

    def arm(self, layer: int, mb: int, call: int | range, pass_: str) -> None:
        """Fire in ``layer`` on microbatch ``mb`` of call ``call`` (or any in a range)."""
        calls = call if isinstance(call, range) else [call]
        self.layer, self.mb, self.pass_ = layer, mb, pass_
        self.seeds = frozenset(rotapipe.layer_seed(0, c, mb, layer) for c in calls)
        self.fired_at = None

    def disarm(self) -> None:
        self.layer = None

    def fire(self):
        self.fired_at = time.monotonic()
        raise Fault(f"injected fault in layer {self.layer}, microbatch {self.mb}, "
                    f"pass {self.pass_}")


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, trigger):
        ctx.trigger = trigger
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.trigger.fire()


class Faulty(nn.Module):
    """Wraps layer ``index``; raises when the trigger names this layer and pass.

    The microbatch is recognised from the random stream rotapipe seeds before running
    layer ``l`` on microbatch ``m`` of call ``c`` (``layer_seed(0, c, m, l)``, the
    contract the reference in ``models.py`` reproduces). A forward stage runs without
    autograd, a recompute and the fused tail with it; a backward fault is raised by an
    autograd node attached while the graph is built.
    """

    def __init__(self, inner: nn.Module, index: int, trigger: Trigger):
        super().__init__()
        self.inner, self.index, self.trigger = inner, index, trigger

    def forward(self, x):
        t = self.trigger
        hit = t.layer == self.index and running_seed() in t.seeds
        grad = torch.is_grad_enabled()
        if hit and ((t.pass_ == "forward" and not grad)
                    or (t.pass_ in ("recompute", "tail-forward") and grad)):
            t.fire()
        y = self.inner(x)
        if hit and grad and t.pass_ in ("backward", "tail-backward"):
            y = _RaiseInBackward.apply(y, t)
        return y


def faulty_model(trigger: Trigger, **kw) -> nn.Sequential:
    return nn.Sequential(*[Faulty(layer, i, trigger)
                           for i, layer in enumerate(tiny_transformer(**kw))])


def snapshot(pipe: rotapipe.RoundPipe, opt: torch.optim.Optimizer) -> dict:
    """Every piece of training state a failed call must leave alone."""
    return {
        "state": {k: v.detach().clone() for k, v in pipe.state_dict().items()},
        "grads": {n: None if p.grad is None else p.grad.clone()
                  for n, p in pipe.named_parameters()},
        "opt": copy.deepcopy(opt.state_dict()),
        "calls": pipe.calls,
    }


def assert_same_state(before: dict, after: dict) -> None:
    assert before["calls"] == after["calls"]
    assert before["state"].keys() == after["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(v, after["state"][k]), f"{k} changed by the failed call"
    for n, g in before["grads"].items():
        h = after["grads"][n]
        assert (g is None) == (h is None), f"grad of {n} appeared or vanished"
        assert g is None or torch.equal(g, h), f"grad of {n} changed by the failed call"
    assert before["opt"]["param_groups"] == after["opt"]["param_groups"]
    so, ao = before["opt"]["state"], after["opt"]["state"]
    assert so.keys() == ao.keys()
    for i in so:
        for name, v in so[i].items():
            assert torch.equal(v, ao[i][name]), f"optimizer state {i}.{name} changed"


def assert_close_to_reference(pipe, ref: nn.Module, what: str, grads: bool = True) -> None:
    ours = dict(pipe.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(ours[name].detach(), p.detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what} {name}: {m}")
        if grads:
            torch.testing.assert_close(ours[name].grad, p.grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{what} grad {name}: {m}")
    for name, b in ref.named_buffers():
        torch.testing.assert_close(pipe.state_dict()[name], b, rtol=RTOL, atol=ATOL)


def stage_text(s: rotapipe.Stage) -> str:
    """How the error names a stage: ``F1 (layer 3)`` or ``B0 (layers 0-2)``; accept
    either wording of a one-layer range."""
    return f"{s.name} (layer"


def layer_words(s: rotapipe.Stage) -> list[str]:
    return [f"{s.start}"] if s.stop - s.start == 1 else [f"{s.start}-{s.stop - 1}"]


def dispatcher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("rotapipe-dispatch")]


def assert_threads_back_to(baseline: int) -> None:
    deadline = time.monotonic() + 5.0
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    left = [t.name for t in threading.enumerate()]
    assert threading.active_count() <= baseline, f"threads left after close(): {left}"


# -- placements ----------------------------------------------------------------------

def placement(i: int) -> dict:
    """Placement ``i``: a seeded random choice of workers, microbatches, batch size,
    pass, worker, stage, layer and microbatch of the fault, and model options."""
    rng = random.Random(1000 + i)
    p = {"workers": rng.randint(1, 4), "microbatches": rng.randint(1, 4),
         "pass_": PASSES[i % len(PASSES)],  # every pass 4 times over the 20
         "tail_layers": rng.choice([1, 2]), "dropout": rng.choice([0.0, 0.1]),
         "buffers": rng.choice([False, True]), "seed": rng.randint(0, 99)}
    p["batch"] = rng.randint(p["microbatches"], 3 * p["microbatches"])
    # Recompute grain matters only for the backward pass: at layer grain the recompute
    # runs the stage without autograd, which a forward fault could not tell from the
    # forward stage, so forward and recompute faults use stage grain.
    p["grain"] = rng.choice(["stage", "layer"]) if p["pass_"] == "backward" else "stage"
    p["mb"] = rng.randrange(p["microbatches"])
    p["pick"] = rng.random()          # which worker, then which stage and layer
    p["pick_layer"] = rng.random()
    return p


def expected_action(pipe: rotapipe.RoundPipe, pass_: str, pick: float, pick_layer: float,
                    mb: int):
    """Choose a worker among those that run a stage of the pass's kind, then one of its
    stages and a layer in it. Returns (layer, stage, action key, worker)."""
    plan, sched = pipe.plan, pipe.schedule()
    kind = {"forward": "F", "recompute": "R", "backward": "B"}.get(pass_, "FT")
    stages = {"F": plan.forward, "R": plan.backward, "B": plan.backward}.get(kind, (plan.tail,))
    by_key = sched.by_key()
    on = {}
    for s in stages:
        on.setdefault(by_key[f"{kind}:{s.name}:m{mb}"].worker, []).append(s)
    workers = sorted(on)
    worker = workers[int(pick * len(workers))]
    candidates = [(s, l) for s in on[worker] for l in s.layers]
    stage, layer = candidates[int(pick_layer * len(candidates))]
    return layer, stage, f"{kind}:{stage.name}:m{mb}", worker


@pytest.mark.parametrize("i", range(20), ids=lambda i: f"placement{i}")
def test_layer_fault_is_reported_promptly_and_changes_nothing(i):
    p = placement(i)
    M = p["microbatches"]
    trigger = Trigger()
    model = faulty_model(trigger, dropout=p["dropout"], buffers=p["buffers"], seed=p["seed"])
    ref = copy.deepcopy(model)
    config = emulated(p["workers"], M, grain=p["grain"], tail_layers=p["tail_layers"])
    x0, y0 = token_batch(p["batch"], 5, seed=1)
    x1, y1 = token_batch(p["batch"], 5, seed=2)
    x2, y2 = token_batch(p["batch"], 5, seed=3)
    with rotapipe.RoundPipe(model, lm_loss, config=config) as pipe:
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        pipe.attach_optimizer(opt)
        layer, stage, key, worker = expected_action(pipe, p["pass_"], p["pick"],
                                                    p["pick_layer"], p["mb"])
        # One step (optimizer state exists), then one call whose gradients accumulate.
        pipe.forward_backward(x0, y0)
        pipe.step()
        reference_forward_backward(ref, x0, y0, M, call=0)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        pipe.forward_backward(x1, y1)
        reference_forward_backward(ref, x1, y1, M, call=1)
        before = snapshot(pipe, opt)

        trigger.arm(layer, p["mb"], pipe.calls, p["pass_"])
        with pytest.raises(rotapipe.WorkerError) as info:
            pipe.forward_backward(x2, y2)
        caught = time.monotonic()
        trigger.disarm()
        assert trigger.fired_at is not None, "the fault never fired"
        assert caught - trigger.fired_at < PROMPT_S, \
            f"the caller saw the fault {caught - trigger.fired_at:.2f} s after it fired"

        err = info.value
        msg = str(err)
        assert isinstance(err.cause, Fault) and err.__cause__ is err.cause
        assert err.action == key and err.worker == worker, (err.action, err.worker, msg)
        assert f"stage {stage_text(stage)}" in msg, msg
        for words in layer_words(stage):
            assert words in msg.split("\n")[0], msg
        assert f"microbatch {p['mb']}" in msg and f"worker {worker}" in msg, msg
        assert f">>{key}<<" in msg and str(err.cause) in msg, msg
        assert not dispatcher_threads(), "dispatcher threads outlived the failed call"
        assert all(d.memory_in_use() == 0 for d in pipe.devices), \
            [d.memory_in_use() for d in pipe.devices]
        assert_same_state(before, snapshot(pipe, opt))

        # The next clean call accumulates on top of call 1; failed calls do not count,
        # so its random streams are those of call 2 in the reference.
        pipe.forward_backward(x2, y2)
        reference_forward_backward(ref, x2, y2, M, call=2)
        for q in ref.parameters():           # the reference accumulated two sums with
            if q.grad is not None:           # weights 1 each; rotapipe gives the mean
                q.grad.mul_(0.5)             # over both batches (equal sizes here)
        assert_close_to_reference(pipe, ref, "after the clean call")
        pipe.step()
        ref_opt.step()
        assert_close_to_reference(pipe, ref, "after the clean step", grads=False)


@pytest.mark.parametrize("lookups", [False, True], ids=["whole", "rows"])
def test_fault_in_every_call_keeps_the_pipeline_usable(lookups):
    """Faults in several calls in a row: each one is reported, none leaks state (nor
    device memory: with the embedding moved by rows, its transient buffers too)."""
    trigger = Trigger()
    model = faulty_model(trigger)
    ref = copy.deepcopy(model)
    x, y = token_batch(8, 5)
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 4),
                            lookups={model[0].inner.emb: lambda ids: ids} if lookups
                            else None) as pipe:
        before = snapshot(pipe, torch.optim.SGD(pipe.parameters(), lr=0.1))
        for layer, mb, pass_ in ((0, 3, "forward"), (2, 1, "recompute"),
                                 (1, 0, "backward"), (5, 2, "tail-backward")):
            trigger.arm(layer, mb, pipe.calls, pass_)
            with pytest.raises(rotapipe.WorkerError, match=f"microbatch {mb}"):
                pipe.forward_backward(x, y)
            trigger.disarm()
        assert pipe.calls == 0
        assert_same_state(before, snapshot(pipe, torch.optim.SGD(pipe.parameters(), lr=0.1)))
        assert [d.memory_in_use() for d in pipe.devices] == [0, 0]
        pipe.forward_backward(x, y)
        reference_forward_backward(ref, x, y, 4, call=0)
        assert_close_to_reference(pipe, ref, "after four failed calls")


def test_fault_in_evaluation_is_reported_and_next_evaluation_works():
    trigger = Trigger()
    model = faulty_model(trigger).eval()
    ref = copy.deepcopy(model)
    x, _ = token_batch(6, 5)
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(3, 3)) as pipe:
        trigger.arm(3, 2, range(-3, 3), "forward")    # evaluation has its own streams
        with pytest.raises(rotapipe.WorkerError, match="microbatch 2") as info:
            pipe(x)
        trigger.disarm()
        assert isinstance(info.value.cause, Fault) and ">>F:" in str(info.value)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), ref(x), rtol=RTOL, atol=ATOL)


def test_emulated_oom_in_a_worker_is_clean_and_the_next_call_fits():
    """A batch whose activations exceed the budget fails with an out-of-memory error
    naming the worker, the budget and the allocation; nothing changes, no thread or
    accounted byte is left behind, and a batch that fits trains exactly."""
    baseline = threading.active_count()
    model = tiny_transformer()
    ref = copy.deepcopy(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # 4x all the model's weights: far more than a short-sequence call needs (its peak
    # is about one weight set per worker), far less than the one activation of a
    # 4 x 1000-token microbatch (4 * 1000 * 16 floats = 250 KiB) that F0 produces.
    # The even partition: the runtime's own plan would refuse the long call before
    # any work (tests/test_plan_memory_room.py); this test is about a worker's error.
    budget = 4 * weight_bytes
    config = emulated(2, 2, device_memory=budget, partition="even")
    with rotapipe.RoundPipe(model, lm_loss, config=config) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        pipe.attach_optimizer(opt)
        before = snapshot(pipe, opt)
        big_x, big_y = token_batch(8, 1000)
        start = time.monotonic()
        with pytest.raises(rotapipe.DeviceOutOfMemoryError) as info:
            pipe.forward_backward(big_x, big_y)
        assert time.monotonic() - start < 5.0
        err = info.value
        msg = str(err)
        assert isinstance(err, rotapipe.WorkerError)
        assert isinstance(err.cause, rotapipe.DeviceOutOfMemoryError)
        assert err.worker == 0 and err.action == "F:F0:m0", msg
        assert "worker 0 is out of memory" in msg and "activation at layer 1 mb 0" in msg
        assert f"{budget / 1024:.2f} KiB" in msg, msg            # the budget, stated
        assert "device_memory" in msg and ">>F:F0:m0<<" in msg    # the fix, the grid
        assert not dispatcher_threads()
        assert [d.memory_in_use() for d in pipe.devices] == [0, 0]
        assert_same_state(before, snapshot(pipe, opt))

        x, y = token_batch(8, 6)
        pipe.forward_backward(x, y)
        reference_forward_backward(ref, x, y, 2, call=0)
        assert_close_to_reference(pipe, ref, "after the out-of-memory call")
        assert max(pipe.peak_memory()) <= budget
    assert_threads_back_to(baseline)


def test_threads_return_to_baseline_after_a_failed_call_and_close():
    baseline = threading.active_count()
    trigger = Trigger()
    pipe = rotapipe.RoundPipe(faulty_model(trigger), lm_loss, config=emulated(4, 2))
    try:
        trigger.arm(4, 1, 0, "tail-forward")
        x, y = token_batch(4, 5)
        with pytest.raises(rotapipe.WorkerError):
            pipe.forward_backward(x, y)
    finally:
        pipe.close()
    assert_threads_back_to(baseline)


def test_a_stalled_worker_times_out_instead_of_hanging():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Sleepy(1.6), nn.Linear(4, 4))
    config = emulated(2, 2, timeout_s=1.0)
    with rotapipe.RoundPipe(model, nn.functional.mse_loss, config=config) as pipe:
        x, y = torch.randn(4, 4), torch.randn(4, 4)
        t0 = time.monotonic()
        with pytest.raises(rotapipe.WorkerError, match=r"no action completed for \d+ s "
                                                       r"\(timeout_s=1.0\)") as info:
            pipe.forward_backward(x, y)
        assert isinstance(info.value.cause, TimeoutError)
        assert ">>" in str(info.value)
        assert time.monotonic() - t0 < 5.0
        assert all(p.grad is None for p in pipe.parameters())
        for shell in pipe._calls.shells:       # the stall is over: the next call works
            shell[1].module.seconds = 0
        assert pipe.forward_backward(x, y) > 0


def test_a_worker_stuck_past_the_drain_timeout_retires_the_pipeline():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Sleepy(2.5), nn.Linear(4, 4))
    with rotapipe.RoundPipe(model, nn.functional.mse_loss,
                            config=emulated(1, 1, timeout_s=0.5)) as pipe:
        x, y = torch.randn(4, 4), torch.randn(4, 4)
        t0 = time.monotonic()
        with pytest.raises(rotapipe.WorkerError) as info:
            pipe.forward_backward(x, y)
        assert time.monotonic() - t0 < 2.0          # the caller is not held hostage
        msg = str(info.value)
        assert "no action completed" in msg and "cannot run again" in msg
        with pytest.raises(rotapipe.WorkerError, match="cannot run again"):
            pipe.forward_backward(x, y)
        with pytest.warns(RuntimeWarning, match="abandoning rotapipe-w0.compute"):
            pipe.close()


# -- an optimizer step raising part-way -------------------------------------------------

class StepsThenRaises(torch.optim.SGD):
    """SGD whose step, while ``armed``, steps the first parameter group (as SGD would)
    and then raises on the second: an optimizer failing part-way through a step."""

    armed = False

    @torch.no_grad()
    def step(self, closure=None):
        if not self.armed:
            return super().step(closure)
        groups = self.param_groups
        self.param_groups = groups[:1]
        try:
            super().step(closure)
        finally:
            self.param_groups = groups
        raise RuntimeError("optimizer failed on parameter group 1")


def _two_groups(model: nn.Module) -> list[dict]:
    first = list(model[0].parameters())
    return [{"params": first},
            {"params": [p for p in model.parameters() if all(p is not q for q in first)]}]


class WholeStepRaises(torch.optim.SGD):
    """Steps stage by stage as usual; a step over every parameter at once (overlap's
    redo when the clip first takes effect) updates the first two, then raises."""

    armed = False

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        if not (self.armed and all(p.grad is not None for p in params)):
            return super().step(closure)
        for p in params[:2]:
            p.add_(p.grad, alpha=-0.1)
        raise RuntimeError("whole step failed part-way")


def test_overlaps_redo_step_raising_part_way_is_reported():
    """``overlap`` steps per stage speculatively; when the clip then takes effect it
    undoes them and steps the whole model once, with no snapshot. That step raising
    part-way leaves the call partly stepped, the workers' copies on the masters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    config = emulated(2, 2, optimizer_mode="overlap", clip_grad_norm=1e-3,
                      precision="bfloat16")
    with rotapipe.RoundPipe(model, nn.functional.mse_loss, config=config) as pipe:
        opt = WholeStepRaises(pipe.parameters(), lr=0.1)
        pipe.attach_optimizer(opt)
        opt.armed = True
        with pytest.raises(RuntimeError, match="whole step failed part-way") as info:
            pipe.train_step(x, y)
            pipe.flush()
        err, msg = info.value, str(info.value)
        assert err.calls_partly_stepped == [0] and err.calls_discarded == [], msg
        assert err.calls_committed == 1 == pipe.calls, msg
        changed = [k for k in before if not torch.equal(before[k], model.state_dict()[k])]
        assert changed == ["0.weight", "0.bias"], changed
        assert all(p.grad is not None for p in model.parameters())
        host = pipe.host
        for view in host.views:
            for pid in host.trainable:
                torch.testing.assert_close(view[pid], host.layerset.params[pid].detach()
                                           .to(view[pid].dtype), rtol=0, atol=0)


@pytest.mark.parametrize("mode,clip", [("sync", None), ("sync", 1e-3), ("stale", 1e-3),
                                       ("overlap", 1e-3)])
def test_an_optimizer_step_raising_part_way_in_a_training_call_is_reported(mode, clip):
    """``train_step``'s whole step (sync; stale with clipping; overlap once a clip took
    effect) merges the call's gradients and steps with no snapshot: when the optimizer
    raises part-way the call is not "discarded" but partly stepped: the exception says
    what stayed (the parameters stepped before the failure, the merged gradients), the
    workers compute with the masters, and restoring a checkpoint trains on exactly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    ref = copy.deepcopy(model)
    x0, y0 = torch.randn(8, 6), torch.randn(8, 3)
    x1, y1 = torch.randn(8, 6), torch.randn(8, 3)
    mse = nn.functional.mse_loss
    config = emulated(2, 2, optimizer_mode=mode, clip_grad_norm=clip)
    with rotapipe.RoundPipe(model, mse, config=config) as pipe:
        opt = StepsThenRaises(_two_groups(model), lr=0.1, momentum=0.9)
        ref_opt = StepsThenRaises(_two_groups(ref), lr=0.1, momentum=0.9)
        pipe.attach_optimizer(opt)

        def ref_grads(x, y):
            """Plain PyTorch's gradients of the batch, clipped as the pipeline clips."""
            mse(ref(x), y).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)

        pipe.train_step(x0, y0)
        pipe.flush()
        ref_grads(x0, y0)
        ref_opt.step()
        ref_opt.zero_grad()
        assert mode != "overlap" or pipe._host_opt.clipped   # the next step is whole
        checkpoint = {"pipe": {k: v.clone() for k, v in pipe.state_dict().items()},
                      "opt": copy.deepcopy(opt.state_dict())}

        opt.armed = ref_opt.armed = True
        with pytest.raises(RuntimeError, match="optimizer failed on parameter group 1") \
                as info:
            pipe.train_step(x1, y1)
            pipe.flush()
        opt.armed = False
        ref_grads(x1, y1)
        with pytest.raises(RuntimeError):
            ref_opt.step()       # plain PyTorch: group 0 stepped, group 1 not

        err, msg = info.value, str(info.value)
        assert err.calls_partly_stepped == [1] and err.calls_discarded == [], msg
        assert err.calls_committed == 2 == pipe.calls, msg
        assert "call 1: discarded" not in msg and "run the discarded" not in msg, msg
        assert "raised part-way" in msg and "keep their update" in msg, msg
        assert "restore a checkpoint" in msg, msg
        # What the message says: group 0 stepped, group 1 not, the merged (and clipped)
        # gradients in .grad; the workers compute with those weights.
        assert not torch.equal(model[0].weight, checkpoint["pipe"]["0.weight"])
        assert torch.equal(model[2].weight, checkpoint["pipe"]["2.weight"])
        assert_close_to_reference(pipe, ref, "after the failed step")
        with torch.no_grad():
            torch.testing.assert_close(pipe(x1), ref(x1), rtol=RTOL, atol=ATOL)

        # The fix the message names: restore the checkpoint, train on exactly.
        pipe.load_state_dict(checkpoint["pipe"])
        opt.load_state_dict(copy.deepcopy(checkpoint["opt"]))   # torch keeps the tensors
        pipe.zero_grad()
        ref.load_state_dict(checkpoint["pipe"])
        ref_opt.load_state_dict(copy.deepcopy(checkpoint["opt"]))
        ref_opt.armed = False
        ref_opt.zero_grad()
        pipe.train_step(x1, y1)
        pipe.flush()
        ref_grads(x1, y1)
        ref_opt.step()
        assert_close_to_reference(pipe, ref, "after the restored step", grads=False)


@pytest.mark.parametrize("mode,clip", [("sync", None), ("stale", 1e-3), ("overlap", 1e-3)])
def test_a_partly_stepped_call_leaves_the_workers_on_the_masters(mode, clip):
    """bf16 compute copies and a fused optimizer (which does not bump the masters'
    version counters, so no later check would notice them): after a step raising
    part-way every set of compute copies the workers upload holds the masters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    config = emulated(2, 2, optimizer_mode=mode, clip_grad_norm=clip,
                      precision=rotapipe.PrecisionConfig(compute_dtype=torch.bfloat16))
    with rotapipe.RoundPipe(model, nn.functional.mse_loss, config=config) as pipe:
        opt = StepsThenRaises(_two_groups(model), lr=0.1, fused=True)
        pipe.attach_optimizer(opt)
        pipe.train_step(x, y)
        pipe.flush()
        before = model[0].weight.detach().clone()
        opt.armed = True
        with pytest.raises(RuntimeError, match="part-way") as info:
            pipe.train_step(x, y)
            pipe.flush()
        assert info.value.calls_partly_stepped == [1]
        assert not torch.equal(model[0].weight, before)
        host = pipe.host
        for view in host.views:
            for pid in host.trainable:
                master = host.layerset.params[pid].detach()
                assert torch.equal(view[pid], master.to(torch.bfloat16)), \
                    host.layerset.param_names[pid]
