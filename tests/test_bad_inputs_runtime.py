"""The runtime's promises under misuse and faults (issue 15, runtime half).

Each class of failure a training library must not have: silent corruption (a module
shared by two live pipelines, non-finite losses and gradients, a partial
``load_state_dict``, in-place parameter updates in forward, evaluation changing the
batch size), hangs (calls after ``close()``, closing or exiting with a stuck worker)
and messages that do not name what was running. Every case asserts the exception
type, a message naming the problem, a bounded time, and that the state is unchanged
(or equal to a plain PyTorch reference) afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch import nn

import rotapipe
from models import Sleepy, emulated
from train_util import deadline

RTOL, ATOL = 1e-5, 1e-6


def linear_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 4))


def batch(n: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 4, generator=g)


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_state(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=0, msg=k)


# -- lifecycle -------------------------------------------------------------------------

CLOSED_CALLS = {
    "forward_backward": lambda p, x, y: p.forward_backward(x, y),
    "train_step": lambda p, x, y: p.train_step(x, y),
    "evaluate": lambda p, x, y: p(x),
    "step": lambda p, x, y: p.step(),
    "flush": lambda p, x, y: p.flush(),
    "state_dict": lambda p, x, y: p.state_dict(),
    "load_state_dict": lambda p, x, y: p.load_state_dict({}),
    "parameters": lambda p, x, y: p.parameters(),
    "zero_grad": lambda p, x, y: p.zero_grad(),
    "pipeline_state": lambda p, x, y: p.pipeline_state(),
    "attach_optimizer": lambda p, x, y: p.attach_optimizer(torch.optim.SGD(p.layerset.params, lr=1)),
    "schedule": lambda p, x, y: p.schedule(),
    "last_timeline": lambda p, x, y: p.last_timeline(),
    "train": lambda p, x, y: p.train(),
    "eval": lambda p, x, y: p.eval(),
    "calls (set)": lambda p, x, y: setattr(p, "calls", 3),
    "peak_memory": lambda p, x, y: p.peak_memory(),
    "reset_peak_memory": lambda p, x, y: p.reset_peak_memory(),
}


@pytest.mark.parametrize("method", sorted(CLOSED_CALLS))
def test_a_closed_pipeline_raises_at_once(method):
    model = linear_model()
    pipe = rotapipe.RoundPipe(model, nn.functional.mse_loss,
                              config=emulated(2, 2, timeout_s=30))
    pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
    x, y = batch()
    pipe.train_step(x, y)
    before = state_of(model)
    pipe.close()
    pipe.close()                       # closing twice does nothing
    t0 = time.monotonic()
    with deadline(10), pytest.raises(rotapipe.PipelineClosedError, match="was closed"):
        CLOSED_CALLS[method](pipe, x, y)
    assert time.monotonic() - t0 < 0.5
    assert_state(model, before)        # the trained weights stay in the model


@contextlib.contextmanager
def _ended(shells):
    """Ends the stall of the workers' ``Sleepy`` shells on the way out: the abandoned
    thread wakes instead of sleeping on for the rest of its stall (it used to hold the
    emulated backend's CPU generator lock meanwhile, which stalled the next test's
    pipeline for 25 s)."""
    try:
        yield
    finally:
        for shell in shells:
            shell[1].module.seconds = 0


def test_a_stall_names_the_action_running_and_close_is_bounded():
    model = nn.Sequential(nn.Linear(4, 4), Sleepy(30.0), nn.Linear(4, 4))
    pipe = rotapipe.RoundPipe(model, nn.functional.mse_loss,
                              config=emulated(2, 2, timeout_s=0.5))
    stuck = next(s for s in pipe.plan.forward if 1 in s.layers)
    shells = pipe._calls.shells
    x, y = batch(4)
    with deadline(20), _ended(shells):
        t0 = time.monotonic()
        with pytest.raises(rotapipe.WorkerError) as info:
            pipe.forward_backward(x, y)
        msg = str(info.value)
        # The stalled forward is the one named as running, with its worker.
        assert f"running: F:{stuck.name}:m0 (forward) on worker " in msg
        assert "cannot run again" in msg and f"F:{stuck.name}:m0 (forward)" in \
            msg.split("cannot run again")[0].rsplit("\n\n", 1)[-1]
        assert time.monotonic() - t0 < 5
        t0 = time.monotonic()
        with pytest.warns(RuntimeWarning, match=r"abandoning rotapipe-w\d\.compute"):
            pipe.close()
        assert time.monotonic() - t0 < 3


def test_a_script_with_a_stuck_worker_exits_without_close(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent("""
        import sys, time, torch
        from torch import nn
        import rotapipe

        class Sleepy(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)
            def forward(self, x):
                time.sleep(60)
                return self.lin(x)

        pipe = rotapipe.RoundPipe(
            nn.Sequential(nn.Linear(4, 4), Sleepy(), nn.Linear(4, 4)),
            nn.functional.mse_loss,
            config=rotapipe.PipeConfig(workers=2, microbatches=2, backend="emulated",
                                       timeout_s=0.5))
        try:
            pipe.forward_backward(torch.randn(4, 4), torch.randn(4, 4))
        except rotapipe.WorkerError as exc:
            print("raised:", str(exc).splitlines()[0])
        # no close(): the interpreter's exit must not wait for the stuck worker
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=40, env=env)
    took = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    assert "raised: forward F:" in done.stdout
    assert "abandoning rotapipe-w" in done.stderr
    assert took < 20, f"exit took {took:.1f} s (the stuck layer sleeps 60 s)"


# -- non-finite losses and gradients ---------------------------------------------------

class InfGrad(torch.autograd.Function):
    """Identity forward; backward multiplies by inf while armed (a finite loss with a
    non-finite gradient, as a sqrt at 0 or an overflowing custom kernel gives)."""

    @staticmethod
    def forward(ctx, x, armed):
        ctx.armed = armed
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g * float("inf") if ctx.armed else g), None


class Switch:
    armed = False

    def __deepcopy__(self, memo):        # workers' shells share the user's switch
        return self


class MaybeInf(nn.Module):
    def __init__(self, switch: Switch):
        super().__init__()
        self.switch = switch

    def forward(self, x):
        return InfGrad.apply(x, self.switch.armed)


def nonfinite_model(switch: Switch) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), MaybeInf(switch), nn.Tanh(), nn.Linear(8, 8),
                         nn.Linear(8, 4))


def reference_steps(start: dict, batches, lr: float) -> nn.Module:
    """Plain PyTorch from the state ``start``: one SGD step per batch."""
    ref = nonfinite_model(Switch())
    ref.load_state_dict(start)
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    for x, y in batches:
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return ref


def full_state(pipe, opt) -> dict:
    out = {f"w.{k}": v.detach().clone() for k, v in pipe.layerset.layers[0].state_dict().items()}
    for i, p in enumerate(pipe.layerset.params):
        out[f"param{i}"] = p.detach().clone()
        out[f"grad{i}"] = None if p.grad is None else p.grad.clone()
        st = opt.state.get(p, {})
        for k, v in st.items():
            out[f"opt{i}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def assert_full_state(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for k in before:
        a, b = before[k], after[k]
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), k
        else:
            assert a == b, k


MODES = ("sync", "overlap", "stale")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_a_non_finite_loss_or_gradient_raises_and_changes_nothing(mode, where):
    switch = Switch()
    model = nonfinite_model(switch)
    start = state_of(model)
    pipe = rotapipe.RoundPipe(model, nn.functional.mse_loss,
                              config=emulated(2, 2, optimizer_mode=mode))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    pipe.attach_optimizer(opt)
    good = [batch(8, seed) for seed in (1, 2, 3)]
    with deadline(60):
        pipe.train_step(*good[0])
        pipe.flush()
        before = full_state(pipe, opt)
        x, y = batch(8, 9)
        if where == "loss":
            x[3, 1] = float("nan")
        switch.armed = where == "gradient"
        # sync checks the loss first; with overlapping calls the gradient hand-off of the
        # tail may see the NaN gradients before the caller sees the loss.
        loss_msg = r"loss of training call 1 is nan \(microbatch losses \[nan, [-0-9.e]+\]\)"
        grad_msg = r"gradient of \d\.\w+ .*is not finite \(NaN\)" if where == "loss" else \
            r"gradient of 0\.\w+ .*is not finite"
        with pytest.raises(rotapipe.NonFiniteError,
                           match=loss_msg if where == "loss" and mode == "sync" else
                           f"{loss_msg}|{grad_msg}" if where == "loss" else grad_msg) as info:
            pipe.train_step(x, y)
            pipe.flush()          # overlap/stale: a failure of a call in flight
        switch.armed = False
        assert re.search("changed nothing|no weight, gradient or optimizer state changed",
                         str(info.value))
        assert info.value.calls_committed == 1
        assert_full_state(before, full_state(pipe, opt))
        if mode == "stale":
            return     # the delayed reference is test_pipelined_calls's; state checked
        for b in good[1:]:
            pipe.train_step(*b)
        pipe.flush()
    ref = reference_steps(start, good, 0.05)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)
    pipe.close()


def test_a_non_finite_gradient_in_an_accumulating_call_raises_and_keeps_the_gradient():
    switch = Switch()
    model = nonfinite_model(switch)
    with rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(2, 2)) as pipe:
        pipe.forward_backward(*batch(8, 1))
        grads = [p.grad.clone() for p in pipe.parameters()]
        switch.armed = True
        with pytest.raises(rotapipe.NonFiniteError, match=r"gradient of 0\.\w+ .*not finite"):
            pipe.forward_backward(*batch(8, 2))
        for p, g in zip(pipe.parameters(), grads):
            assert torch.equal(p.grad, g)


@pytest.mark.parametrize("mode", MODES)
def test_skip_drops_the_non_finite_step_counts_it_and_trains_on(mode):
    switch = Switch()
    model = nonfinite_model(switch)
    start = state_of(model)
    pipe = rotapipe.RoundPipe(model, nn.functional.mse_loss,
                              config=emulated(2, 2, optimizer_mode=mode, nonfinite="skip"))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    pipe.attach_optimizer(opt)
    good = [batch(8, seed) for seed in (1, 2, 3)]
    with deadline(60):
        pipe.train_step(*good[0])
        bad_x, bad_y = batch(8, 9)
        bad_x[0, 0] = float("inf") * 0        # NaN input: NaN loss and gradients
        loss = pipe.train_step(bad_x, bad_y)
        assert loss != loss
        for b in good[1:]:
            pipe.train_step(*b)
        pipe.flush()
        assert pipe.nonfinite_skips == 1
        assert pipe.step_result(1).skipped and not pipe.step_result(2).skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if mode != "stale":        # stale's delayed steps: checked by finiteness above
        ref = reference_steps(start, good, 0.05)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)
    pipe.close()


# -- the training job: skip, stop after skips in a row, never a non-finite checkpoint ----

def _train_config(tmp_path, **changes):
    from rotapipe.train import TrainConfig
    from train_util import TINY, text_jsonl
    data = text_jsonl(tmp_path / "corpus.jsonl")
    settings = {**TINY, "data": str(data), "out_dir": str(tmp_path / "run"), "warmup": 0,
                "eval_interval": 0, "grad_clip": 0, "steps": 30, **changes}
    return TrainConfig(**settings)


def test_train_skips_non_finite_steps_then_stops_after_too_many_in_a_row(tmp_path, capsys):
    from rotapipe.train import train
    # SGD at lr 1e30: the first step blows the weights up, every later gradient is NaN.
    cfg = _train_config(tmp_path, optimizer="sgd", lr=1e30, max_skipped_steps=3,
                        save_interval=1)
    with deadline(120), pytest.raises(rotapipe.NonFiniteError,
                                      match=r"3 optimizer steps in a row were skipped "
                                            r"\(non-finite loss or gradient, steps 2\.\.4\)"):
        train(cfg)
    out = capsys.readouterr().out
    assert out.count("(skipped: non-finite loss or gradient)") == 3
    # every checkpoint written holds finite weights
    from rotapipe.train import load_checkpoint, latest_checkpoint
    ck = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert ck is not None and ck.name == "step-00000003"
    masters, _, _ = load_checkpoint(ck)
    assert all(torch.isfinite(t).all() for t in masters.values())


def test_train_with_nonfinite_raise_stops_at_the_first_bad_step(tmp_path):
    from rotapipe.train import train
    cfg = _train_config(tmp_path, optimizer="sgd", lr=1e30, nonfinite="raise")
    with deadline(120), pytest.raises(rotapipe.NonFiniteError, match="not finite"):
        train(cfg)


def test_train_never_writes_a_checkpoint_with_non_finite_weights(tmp_path, monkeypatch):
    from rotapipe.train import latest_checkpoint, loop, train
    real = loop._Job.train_step

    def poisoned(job):             # a step that left a weight NaN (finite gradients)
        record = real(job)
        if job.step == 2:
            job.pipe.flush()
            with torch.no_grad():
                next(iter(job.pipe.parameters())).view(-1)[0] = float("nan")
        return record
    monkeypatch.setattr(loop._Job, "train_step", poisoned)
    cfg = _train_config(tmp_path, steps=4, save_interval=1)
    with deadline(120), pytest.raises(rotapipe.NonFiniteError,
                                      match=r"weights are not finite at step 2 .*no "
                                            r"checkpoint written; the last one is .*step-00000001"):
        train(cfg)
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step-00000001"


# -- one owner per parameter -----------------------------------------------------------

def test_a_module_shared_by_two_live_pipelines_is_refused_and_free_after_close():
    model = linear_model()
    first = rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(2, 2))
    first.forward_backward(*batch())
    grads = [p.grad.clone() for p in first.parameters()]
    with pytest.raises(rotapipe.ConfigError, match=r"parameter 0\.weight \(and 5 more\) is "
                                                   r"already trained by another live "
                                                   r"RoundPipe: close\(\) that one first"):
        rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(2, 2))
    # the refused pipeline touched nothing: the first one's gradient is intact
    for p, g in zip(first.parameters(), grads):
        assert torch.equal(p.grad, g)
    first.close()
    with rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(2, 2)) as second:
        second.forward_backward(*batch())
    # a pipeline dropped without close() frees its parameters too
    other = linear_model(3)
    rotapipe.RoundPipe(other, nn.functional.mse_loss, config=emulated(1, 1))
    with rotapipe.RoundPipe(other, nn.functional.mse_loss, config=emulated(1, 1)):
        pass


@pytest.mark.parametrize("mode", ["overlap", "stale"])
def test_a_pipelined_pipeline_dropped_with_calls_in_flight_is_collected(mode):
    """A helper that trains and returns without close() or flush(): the calls in flight
    commit, then the pipeline is collected (its finalizer may run on the worker thread
    the last commit ran on, and closes from another thread), every thread it started
    ends, and its parameters are free for a new pipeline. The weights are those after
    the three steps (``stale``: the last one taken in the background after its call
    committed), as ``state_dict()`` would have given them."""
    import gc
    import weakref
    before = {t.ident for t in threading.enumerate()}
    model = linear_model()
    ref = copy.deepcopy(model)
    data = [batch(seed=s) for s in range(3)]

    def train_and_forget():
        pipe = rotapipe.RoundPipe(model, nn.functional.mse_loss,
                                  config=emulated(2, 2, optimizer_mode=mode))
        pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
        for x, y in data:
            pipe.train_step(x, y)
        return weakref.ref(pipe)

    gone = train_and_forget()
    deadline_s = time.monotonic() + 30
    while (gone() is not None or {t.ident for t in threading.enumerate()} - before) \
            and time.monotonic() < deadline_s:
        gc.collect()
        time.sleep(0.05)
    assert gone() is None
    assert not {t.name for t in threading.enumerate() if t.ident not in before}
    with rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(1, 1)):
        pass
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    on, pending = copy.deepcopy(ref), None       # ``on``: the weights a call reads
    for x, y in data:
        on.zero_grad(set_to_none=True)
        nn.functional.mse_loss(on(x), y).backward()
        grads = [q.grad for q in on.parameters()]
        if mode == "stale":      # each gradient on the weights one step back
            pending, grads = grads, pending
        if grads is not None:
            for p, g in zip(ref.parameters(), grads):
                p.grad = g
            opt.step()
        on.load_state_dict(ref.state_dict())
    if pending is not None:      # the last stale step runs once its call committed
        for p, g in zip(ref.parameters(), pending):
            p.grad = g
        opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("method", ["state_dict", "flush", "close", "call"])
def test_a_pipeline_used_from_inside_its_own_work_is_refused_at_once(method):
    """A loss function that logs ``pipe.state_dict()`` (or evaluates, flushes, closes)
    runs on a worker while the call holds the pipeline: it would wait for itself.
    Refused at once, naming the method; nothing changed, and the pipeline trains on."""
    model = linear_model()
    ref = copy.deepcopy(model)
    x, y = batch()
    armed = [True]

    def loss(out, labels):
        if armed[0]:
            armed[0] = False
            {"state_dict": pipe.state_dict, "flush": pipe.flush, "close": pipe.close,
             "call": lambda: pipe(x)}[method]()
        return nn.functional.mse_loss(out, labels)

    pipe = rotapipe.RoundPipe(model, loss, config=emulated(2, 2))
    pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
    name = "pipe(...)" if method == "call" else f"RoundPipe.{method}()"
    with deadline(30), pytest.raises(rotapipe.InputError, match=re.escape(name) +
                                     r" was called from inside the pipeline's own work"):
        pipe.train_step(x, y)
    assert_state(model, state_of(ref))
    pipe.train_step(x, y)
    pipe.close()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    nn.functional.mse_loss(ref(x), y).backward()
    opt.step()
    for k, v in state_of(ref).items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_another_pipeline_used_from_inside_a_pipelines_work_is_refused():
    """Pipelines do not nest (a teacher evaluated inside the student's loss would run
    its call from the student's worker thread): refused at once, naming the method,
    with the way around it; the student trains on."""
    student, x = linear_model(), batch()[0]
    with rotapipe.RoundPipe(linear_model(3), nn.functional.mse_loss,
                            config=emulated(2, 2)) as teacher:
        def distill(out, rows):
            return nn.functional.mse_loss(out, teacher(rows))

        with rotapipe.RoundPipe(student, distill, config=emulated(2, 2)) as pipe:
            with deadline(30), pytest.raises(rotapipe.InputError, match=re.escape(
                    "pipe(...) was called from a worker thread of another RoundPipe")):
                pipe.forward_backward(x, x)
            target = teacher(x)
            with rotapipe.RoundPipe(copy.deepcopy(student), nn.functional.mse_loss,
                                    config=emulated(2, 2)) as ok:
                ok.forward_backward(x, target)     # the way around it: outputs first


def test_a_pipeline_used_from_its_callers_own_side_inputs_is_refused():
    """``side_inputs`` runs on the caller's thread while it holds the pipeline."""
    model = linear_model()
    holder = {}

    def side(inputs):
        holder["pipe"].state_dict()
        return {}

    pipe = rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(2, 2),
                              side_inputs=side)
    holder["pipe"] = pipe
    with deadline(30), pytest.raises(rotapipe.InputError, match=re.escape(
            "RoundPipe.state_dict() was called from inside the pipeline's own work")):
        pipe.forward_backward(*batch())
    pipe.close()


@pytest.mark.parametrize("mode", ["sync", "overlap", "stale"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_weights_edited_in_place_between_calls_are_what_the_next_call_reads(mode, dtype):
    """The masters are the model's parameters: an edit under ``torch.no_grad()`` (after
    ``flush()`` when calls overlap) reaches the workers' compute copies at the next
    call, evaluation or training, as ``load_state_dict`` of the same weights does."""
    precision = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    x, y = batch()
    outs, losses = [], []
    for edit in ("in place", "load_state_dict"):
        model = linear_model()
        pipe = rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(
            2, 2, precision=precision, optimizer_mode=mode))
        pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
        pipe.train_step(x, y)
        pipe.flush()
        if edit == "in place":
            with torch.no_grad():
                model[0].weight.mul_(-2.0)
                model[3].bias.zero_()
        else:
            state = {k: v.clone() for k, v in pipe.state_dict().items()}
            state["0.weight"].mul_(-2.0)
            state["3.bias"].zero_()
            pipe.load_state_dict(state)
        outs.append(pipe(x))
        losses.append(pipe.train_step(x, y))
        pipe.close()
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert losses[0] == losses[1]


@pytest.mark.parametrize("workers,microbatches", [(2, 2), (3, 4)])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_users_own_optimizer_loop_equals_plain_pytorch(workers, microbatches,
                                                           set_to_none):
    """``opt.zero_grad(); pipe.forward_backward(x, y); opt.step()``, the plain PyTorch
    idiom with the user stepping their own optimizer: every call starts a new
    accumulation once the gradients were cleared (either way), as ``pipe.zero_grad()``
    does; before, each call's gradient was weighted as one part of the mean over
    every call since construction (1, 1/2, 1/3, ...)."""
    ref = linear_model()
    model = copy.deepcopy(ref)
    pipe = rotapipe.RoundPipe(model, nn.functional.mse_loss,
                              config=emulated(workers, microbatches))
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    for step in range(4):
        x, y = batch(seed=step)
        opt.zero_grad(set_to_none=set_to_none)
        pipe.forward_backward(x, y)
        ref_opt.zero_grad(set_to_none=set_to_none)
        nn.functional.mse_loss(ref(x), y).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL,
                                       msg=f"step {step} {name}")
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    pipe.close()


def test_gradients_cleared_for_part_of_the_model_are_refused():
    """Clearing some accumulated gradients and not others leaves no single set of
    calls the next gradient could average over: an InputError, nothing changed."""
    model = linear_model()
    with rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(2, 2)) as pipe:
        x, y = batch()
        pipe.forward_backward(x, y)
        model[0].weight.grad = None
        grads = {n: p.grad for n, p in model.named_parameters()}
        with pytest.raises(rotapipe.InputError, match=r"gradient of 0\.weight was cleared.*"
                           r"pipe\.zero_grad\(\)"):
            pipe.forward_backward(x, y)
        assert {n: p.grad for n, p in model.named_parameters()} == grads
        assert pipe.calls == 1
        pipe.zero_grad()
        pipe.forward_backward(x, y)          # and it trains on


@pytest.mark.parametrize("fused", [True, False])
def test_a_step_of_the_users_own_optimizer_reaches_the_workers_copies(fused):
    """bf16: the workers upload bf16 copies of the fp32 masters. A step the user takes
    with their own optimizer reaches them at the next call even when its kernel
    (``fused=True``) does not bump the parameters' version counters: the evaluation
    and the next loss equal those of a pipeline given the same weights with
    ``load_state_dict``."""
    x, y = batch()
    outs, losses = [], []
    for how in ("own step", "load_state_dict"):
        model = linear_model()
        pipe = rotapipe.RoundPipe(model, nn.functional.mse_loss,
                                  config=emulated(2, 2, precision="bfloat16"))
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.05, fused=fused)
        pipe.forward_backward(x, y)
        if how == "own step":
            opt.step()
        else:
            twin = copy.deepcopy(model)
            for p, q in zip(twin.parameters(), model.parameters()):
                p.grad = q.grad.clone()
            torch.optim.AdamW(twin.parameters(), lr=0.05, fused=fused).step()
            pipe.load_state_dict({k: v.clone() for k, v in twin.state_dict().items()})
        pipe.zero_grad()
        outs.append(pipe(x))
        losses.append(pipe.forward_backward(x, y))
        pipe.close()
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert losses[0] == losses[1]


def _replace_weight(model):
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())


def _new_storage(model):
    model[0].weight.data = model[0].weight.detach().clone()


def _swap_layer(model):
    model[2] = nn.Linear(8, 8)


CHANGES = {
    "a new nn.Parameter": (_replace_weight, r"parameter 0\.weight was replaced"),
    ".data = ...": (_new_storage, r"parameter 0\.weight got new storage"),
    ".half()": (lambda m: m[2].half(), r"parameter 2\.weight was converted from "
                                       r"torch\.float32 to torch\.float16"),
    "a swapped submodule": (_swap_layer, r"submodule 2 was replaced"),
    "unfrozen": (lambda m: m[3].bias.requires_grad_(True),
                 r"parameter 3\.bias was frozen .* requires_grad=True"),
}


@pytest.mark.parametrize("mode", ["sync", "overlap"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_parameters_changed_after_wrapping_are_refused(change, mode):
    """The workers run copies of the layers taken at construction and the host keeps
    the tensors it wrapped: a parameter replaced, converted or unfrozen after wrapping
    would be silently ignored (the model and ``state_dict()`` showing one set of
    weights, training another). The next call, training or evaluation, refuses it
    and changes nothing; freezing a trained parameter is followed."""
    model = linear_model()
    model[3].bias.requires_grad_(False)
    pipe = rotapipe.RoundPipe(model, nn.functional.mse_loss,
                              config=emulated(2, 2, optimizer_mode=mode))
    pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
    x, y = batch()
    pipe.train_step(x, y)
    pipe.flush()
    do, message = CHANGES[change]
    do(model)
    before = state_of(model)
    for call in (lambda: pipe.train_step(x, y), lambda: pipe(x)):
        with pytest.raises(rotapipe.InputError, match=message + ".*build a new RoundPipe"):
            call()
    assert_state(model, before)
    assert pipe.calls == 1
    pipe.close()


def test_a_parameter_frozen_after_wrapping_stops_training():
    """Freezing is followed: the frozen weight gets no gradient and keeps its value,
    the rest trains as plain PyTorch with that weight frozen."""
    ref = linear_model()
    model = copy.deepcopy(ref)
    pipe = rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(2, 2))
    pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model[0].weight.requires_grad_(False)
    ref[0].weight.requires_grad_(False)
    for step in range(2):
        x, y = batch(seed=step)
        pipe.train_step(x, y)
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    pipe.close()


# -- load_state_dict: all or nothing ---------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["sync", "stale"])
def test_load_state_dict_validates_everything_first_and_refreshes_the_workers(dtype, mode):
    model = linear_model()
    pipe = rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(
        2, 2, precision={"fp32": "float32", "bf16": "bfloat16"}[dtype], optimizer_mode=mode))
    pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
    x, y = batch()
    pipe.train_step(x, y)
    pipe.flush()                     # stale: the pending step lands first
    before, out_before = state_of(model), pipe(x)
    new = {k: v * 2 + 1 for k, v in before.items()}
    bad = dict(new)
    bad["2.weight"] = torch.zeros(3, 3)
    bad["3.bias"] = torch.zeros(4, dtype=torch.int64)
    bad["extra"] = torch.zeros(1)
    del bad["0.bias"]
    with pytest.raises(rotapipe.ConfigError) as info:
        pipe.load_state_dict(bad)
    msg = str(info.value)
    for part in ("missing key '0.bias'", "unexpected key 'extra'",
                 "'2.weight' has shape (3, 3), the model's is (8, 8)",
                 "'3.bias' has dtype torch.int64", "Nothing was loaded"):
        assert part in msg
    assert_state(model, before)
    assert torch.equal(pipe(x), out_before)        # the workers' copies did not move
    pipe.load_state_dict(new)
    # the workers compute with the new weights: equal to a fresh pipeline over them
    fresh_model = linear_model(5)
    fresh_model.load_state_dict(new)
    with rotapipe.RoundPipe(fresh_model, nn.functional.mse_loss, config=emulated(
            2, 2, precision={"fp32": "float32", "bf16": "bfloat16"}[dtype])) as fresh:
        assert torch.equal(pipe(x), fresh(x))
    pipe.close()


@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_load_state_dict_refuses_tensors_without_dense_values_before_writing(kind):
    model = linear_model()
    with rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(2, 2)) as pipe:
        before = state_of(model)
        new = {k: v * 2 + 1 for k, v in before.items()}
        # The last key in order: a check made only while copying would have written
        # the others first.
        new["3.bias"] = torch.empty(4, device="meta") if kind == "meta" else \
            torch.zeros(4).to_sparse()
        with pytest.raises(rotapipe.ConfigError, match=rf"'3.bias' is a "
                           rf"{'meta' if kind == 'meta' else 'torch.sparse_coo'} tensor"):
            pipe.load_state_dict(new)
        assert_state(model, before)


# -- values a training call derives from the user's callables ---------------------------

@pytest.mark.parametrize("weight, named", [
    (lambda y: torch.tensor([1.0, 2.0]), "a torch.float32 tensor of shape (2,)"),
    (lambda y: "a", "'a'"),
    (lambda y: float("inf"), "inf"),
])
def test_a_bad_loss_weight_is_named_and_changes_nothing(weight, named):
    model = linear_model()
    before = state_of(model)
    with rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(2, 2),
                            loss_weight=weight) as pipe:
        with pytest.raises(rotapipe.InputError, match=re.escape(f"loss_weight returned "
                                                                f"{named} for microbatch 0")):
            pipe.forward_backward(*batch())
        assert pipe.calls == 0
    assert_state(model, before)


def test_sparse_inputs_and_a_complex_loss_are_refused():
    x, y = batch()
    with rotapipe.RoundPipe(linear_model(), nn.functional.mse_loss,
                            config=emulated(2, 2)) as pipe:
        with pytest.raises(rotapipe.InputError, match="inputs leaf 0 is a torch.sparse_coo "
                           "tensor: pass dense tensors"):
            pipe.forward_backward(x.to_sparse(), y)
        with pytest.raises(rotapipe.ConfigError, match=r"last_timeline\(calls=0\)"):
            pipe.last_timeline(0)
    with rotapipe.RoundPipe(linear_model(), lambda o, t: nn.functional.mse_loss(o, t).to(
            torch.complex64), config=emulated(2, 2, timeout_s=10)) as pipe:
        with pytest.raises(rotapipe.WorkerError, match="returned a torch.complex64 tensor"):
            pipe.forward_backward(x, y)
        assert pipe.calls == 0


LOSSES = {
    # (loss_fn, what the error says)
    "tuple with a metric": (lambda o, t: (nn.functional.mse_loss(o, t), (o - t).abs().mean()),
                            "returned a tuple of 2: return the microbatch's mean loss as "
                            "one scalar tensor"),
    "tuple of 3": (lambda o, t: (nn.functional.mse_loss(o, t),) * 3, "returned a tuple of 3"),
    "detached": (lambda o, t: nn.functional.mse_loss(o, t).detach(),
                 "returned a torch.float32 tensor that does not require grad"),
    "an accuracy": (lambda o, t: (o.argmax(1) == t.argmax(1)).sum(),
                    "returned a torch.int64 tensor that does not require grad"),
}


@pytest.mark.parametrize("case", sorted(LOSSES))
def test_a_loss_that_cannot_train_is_refused_and_changes_nothing(case):
    """A tuple (a logged metric beside the loss) was once read as a whole-batch term and
    trained on; a loss cut from the graph failed inside backward()."""
    loss_fn, says = LOSSES[case]
    model = linear_model()
    before = state_of(model)
    with rotapipe.RoundPipe(model, loss_fn, config=emulated(2, 2)) as pipe:
        with pytest.raises(rotapipe.InputError, match=re.escape(says)):
            pipe.forward_backward(*batch())
        assert pipe.calls == 0 and all(p.grad is None for p in pipe.parameters())
    assert_state(model, before)


# -- construction and the call counter ---------------------------------------------------

@pytest.mark.parametrize("kwargs, says", [
    (dict(config={"microbatches": 2}), "config must be a rotapipe.PipeConfig, got a dict"),
    (dict(optimizer="adamw"), "optimizer must be a torch.optim.Optimizer or a callable "
                              "params -> Optimizer, got a str"),
    (dict(optimizer=nn.Linear), "got the class Linear"),
    (dict(side_inputs=5), "side_inputs must be callable (or None), got an int"),
    (dict(loss_weight="tokens"), "loss_weight must be callable (or None), got a str"),
], ids=["config-dict", "optimizer-str", "optimizer-class", "side-int", "weight-str"])
def test_arguments_of_the_wrong_kind_are_named_at_construction(kwargs, says):
    model = linear_model()
    with pytest.raises(rotapipe.ConfigError, match=re.escape(says)):
        rotapipe.RoundPipe(model, nn.functional.mse_loss, **kwargs)
    with rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(1, 1)):
        pass                          # the refused one claimed nothing


def test_an_optimizer_that_steps_with_a_closure_is_refused_at_attach():
    with rotapipe.RoundPipe(linear_model(), nn.functional.mse_loss,
                            config=emulated(2, 2, optimizer_mode="overlap")) as pipe:
        with pytest.raises(rotapipe.ConfigError, match=re.escape(
                "LBFGS.step() needs closure (it re-evaluates the loss itself)")):
            pipe.attach_optimizer(torch.optim.LBFGS(pipe.parameters()))
        assert pipe.optimizer is None
        pipe.attach_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1))
        pipe.train_step(*batch())


def test_a_one_layer_stage_over_the_budget_says_no_plan_cuts_it_smaller():
    with pytest.raises(rotapipe.ConfigError, match=re.escape(
            "needs 288 B for its weights alone, over the worker memory budget of 200 B: "
            "it holds one layer (2), so no plan can cut it smaller: raise device_memory")):
        rotapipe.RoundPipe(linear_model(), nn.functional.mse_loss,
                           config=emulated(2, 2, device_memory=200))


@pytest.mark.parametrize("value", ["abc", 2.7, -5, True, None])
def test_the_call_counter_takes_whole_numbers_only(value):
    with rotapipe.RoundPipe(linear_model(), nn.functional.mse_loss,
                            config=emulated(1, 1)) as pipe:
        with pytest.raises(rotapipe.ConfigError, match=re.escape(
                f"pipe.calls = {value!r}: the call counter is a whole number >= 0")):
            pipe.calls = value
        assert pipe.calls == 0
        pipe.calls = torch.tensor(7).numpy()[()]          # a numpy integer is one
        assert pipe.calls == 7


# -- schedulers --------------------------------------------------------------------------

def test_a_scheduler_that_needs_a_metric_is_refused_at_attach():
    with rotapipe.RoundPipe(linear_model(), nn.functional.mse_loss,
                            config=emulated(2, 2)) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        with pytest.raises(rotapipe.ConfigError, match=r"ReduceLROnPlateau.step\(\) needs "
                           r"metrics.*step it yourself after pipe.step\(\)"):
            pipe.attach_optimizer(opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
        for wrong in (torch.optim.SGD, [opt]):
            with pytest.raises(rotapipe.ConfigError, match="takes a torch.optim.Optimizer "
                               "instance"):
                pipe.attach_optimizer(wrong)
        assert pipe.optimizer is None and pipe.scheduler is None


@pytest.mark.parametrize("mode", MODES)
def test_a_scheduler_failing_after_the_step_reports_the_step_as_kept(mode):
    """The optimizer step is applied before the scheduler runs: the error says so, the
    call counts as committed, and the weights are one step on, exactly."""
    model, ref = linear_model(), linear_model()
    x, y = batch()
    pipe = rotapipe.RoundPipe(model, nn.functional.mse_loss,
                              config=emulated(2, 2, optimizer_mode=mode, timeout_s=10))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.attach_optimizer(opt, torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: 1.0 if step < 1 else 1 / 0))
    with deadline(30), pytest.raises(Exception) as info:
        if mode == "sync":
            pipe.forward_backward(x, y)
            pipe.step()
        else:
            pipe.train_step(x, y)
            pipe.flush()
    err = info.value
    cause = err if isinstance(err, rotapipe.ConfigError) else err.__cause__
    assert isinstance(cause, rotapipe.ConfigError)
    assert "the scheduler's step() failed (ZeroDivisionError" in str(err)
    assert "the optimizer step, which is applied and kept" in str(err)
    if mode != "sync":
        assert err.calls_committed == 1 and err.calls_discarded == []
        assert "call 0: completed, its update is kept" in str(err)
    assert pipe.calls == 1
    nn.functional.mse_loss(ref(x), y).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for (k, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=k)
    pipe.close()


# -- in-place parameter updates in forward ---------------------------------------------

class BumpsItsBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bump = False

    def forward(self, x):
        if self.bump:
            with torch.no_grad():
                self.lin.bias.add_(1.0)      # a running statistic kept in a parameter
        return self.lin(x)


@pytest.mark.parametrize("call", ["train", "evaluate"])
def test_a_layer_updating_its_parameter_in_place_is_refused(call):
    torch.manual_seed(0)
    bumper = BumpsItsBias()
    model = nn.Sequential(nn.Linear(4, 4), bumper, nn.Linear(4, 4))
    with rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(2, 2)) as pipe:
        x, y = batch(8)
        pipe.forward_backward(x, y)                # fine while it does not bump
        before = state_of(model)
        grads = [p.grad.clone() for p in pipe.parameters()]
        for shell in pipe._calls.shells:
            shell[1].module.bump = True
        with pytest.raises(rotapipe.InputError, match=r"layer 1 \(BumpsItsBias\) changed its "
                                                      r"parameter\(s\) 1\.lin\.bias in place"):
            pipe.forward_backward(x, y) if call == "train" else pipe(x)
        assert_state(model, before)
        for p, g in zip(pipe.parameters(), grads):
            assert torch.equal(p.grad, g)


# -- one batch contract for training and evaluation ------------------------------------

class HalvesTheBatch(nn.Module):
    def forward(self, x):
        return x[: x.shape[0] // 2]


@pytest.mark.parametrize("call", ["train", "evaluate"])
def test_a_layer_changing_the_batch_size_is_refused_in_training_and_evaluation(call):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), HalvesTheBatch(), nn.Linear(4, 4))
    with rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(2, 2)) as pipe:
        x, y = batch(8)
        before = state_of(model)
        with pytest.raises(rotapipe.InputError, match=r"layer 1 \(HalvesTheBatch\) returned 2 "
                                                      r"rows in dim 0 \(shape \(2, 4\)\) for a "
                                                      r"microbatch of 4 samples: every layer "
                                                      r"must keep the batch in dim 0"):
            pipe.forward_backward(x, y) if call == "train" else pipe(x)
        assert_state(model, before)
        assert all(p.grad is None for p in pipe.parameters())


def test_devices_already_built_are_closed_when_one_cannot_be_built(monkeypatch):
    """Thread exhaustion (or a device failing) part-way through building the workers
    leaves no threads of the ones built behind."""
    import threading
    from rotapipe.runtime.devices import make_devices
    from rotapipe.runtime.emulated import EmulatedDevice
    real, built = EmulatedDevice.__init__, []

    def third_fails(self, *args, **kwargs):
        if len(built) == 2:
            raise RuntimeError("can't start new thread")
        real(self, *args, **kwargs)
        built.append(self)

    before = threading.active_count()
    monkeypatch.setattr(EmulatedDevice, "__init__", third_fails)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        make_devices(rotapipe.PipeConfig(workers=4, backend="emulated"))
    assert len(built) == 2
    assert threading.active_count() == before


@pytest.mark.parametrize("bad, named", [
    (None, "takes a dict, got None"),
    ({}, "'scaler' is missing"),
    ({"calls": 5, "evals": 0, "scaler": "junk"}, "'scaler' is a str"),
    ({"calls": "x", "evals": 0, "scaler": {"scale": 1.0, "good_steps": 0}}, "'calls' is 'x'"),
    ({"calls": -5, "evals": 0, "scaler": {"scale": 1.0, "good_steps": 0}}, "'calls' is -5"),
    ({"calls": 5, "evals": 1, "scaler": {"scale": 1.0}}, "'good_steps' is missing"),
    ({"calls": 5, "evals": 1, "scaler": {"scale": float("nan"), "good_steps": 0}},
     "'scale' is nan"),
])
def test_load_pipeline_state_checks_everything_before_changing_anything(bad, named):
    with rotapipe.RoundPipe(linear_model(), nn.functional.mse_loss,
                            config=emulated(2, 2)) as pipe:
        before = pipe.pipeline_state()
        with pytest.raises(rotapipe.CheckpointError, match=re.escape(named)):
            pipe.load_pipeline_state(bad)
        assert pipe.pipeline_state() == before
        pipe.load_pipeline_state({**before, "calls": 7, "evals": 2})
        assert pipe.calls == 7


class AuxHead(nn.Module):
    """The output, a 0-dim auxiliary loss and a record of twice the rows."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h):
        o = self.lin(h)
        return o, (o ** 2).mean(), o.reshape(-1, 2)


def test_evaluation_joins_what_it_can_and_lists_a_0_dim_output():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), AuxHead())
    x, y = batch(6)

    def loss(out, y):
        return nn.functional.mse_loss(out[0], y) + 0.1 * out[1]

    with rotapipe.RoundPipe(model, loss, config=emulated(2, 3)) as pipe:
        pipe.forward_backward(x, y)           # trains with the auxiliary loss
        out, aux, record = pipe(x)
    with torch.no_grad():
        parts = [model(m) for m in torch.tensor_split(x, 3)]
    torch.testing.assert_close(out, torch.cat([p[0] for p in parts]), rtol=RTOL, atol=ATOL)
    assert isinstance(aux, list) and len(aux) == 3
    for got, want in zip(aux, parts):
        torch.testing.assert_close(got, want[1], rtol=RTOL, atol=ATOL)
    # A record with other rows than the batch is still joined along dim 0, in order.
    torch.testing.assert_close(record, torch.cat([p[2] for p in parts]), rtol=RTOL,
                               atol=ATOL)


class RaisesAfterUpdating(torch.optim.SGD):
    def step(self, closure=None):
        super().step(closure)
        raise RuntimeError("boom after updating")


def test_a_sync_optimizer_raising_after_updating_keeps_the_workers_on_the_masters():
    """A synchronous step keeps no snapshot: the error says the update stays, and the
    workers compute with the masters (not with the weights from before the step)."""
    model, ref = linear_model(), linear_model()
    x, y = batch()
    with rotapipe.RoundPipe(model, nn.functional.mse_loss, config=emulated(2, 2)) as pipe:
        pipe.attach_optimizer(RaisesAfterUpdating(pipe.parameters(), lr=0.1))
        pipe.forward_backward(x, y)
        with pytest.raises(RuntimeError, match="boom after updating") as info:
            pipe.step()
        assert any("keep their update" in n for n in getattr(info.value, "__notes__", []))
        out = pipe(x)
    nn.functional.mse_loss(ref(x), y).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
        torch.testing.assert_close(out, ref(x), rtol=RTOL, atol=ATOL)
    for (k, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=k)
