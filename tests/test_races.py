"""The stream-race checker flags a deliberately missing wait.

At the backend level: data written on one emulated stream and read on another that did
not wait on an event recorded after the write raises :class:`rotapipe.RaceError`; a
wait (direct or transitive) makes the same read legal. At the schedule level: a
schedule with one data dependency deleted fails with a race naming the action, while
the generated schedule passes; a schedule whose dependencies form a cycle is rejected
before it runs. A buffer held by several layers is ordered per buffer, not per layer:
every upload of it waits for its last download, and training matches plain PyTorch.
"""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch
from torch import nn

import rotapipe
from rotapipe.runtime.emulated import EmulatedDevice
from rotapipe.runtime.store import Store
from rotapipe.schedule import ActionKind as K, Lane
from models import emulated, lm_loss, reference_forward_backward, tiny_transformer, token_batch


# -- backend level -----------------------------------------------------------------------

@pytest.fixture
def device():
    dev = EmulatedDevice(0)
    yield dev
    dev.close()


def on(stream, fn) -> list[BaseException]:
    """Run ``fn`` on ``stream``; block the host until it ran; return its errors."""
    errors: list[BaseException] = []
    stream.submit(fn, errors.append, threading.Event())
    stream.record().synchronize()
    return errors


def write(stream, store: Store, key, value):
    """Write on ``stream``; return the event recorded after the write. The host waits
    for it, so the data is certainly in the store when the reader runs: only the
    reader's stream-side wait is missing."""
    assert on(stream, lambda: store.put(key, value)) == []
    event = stream.record()
    event.synchronize()
    return event


def test_read_without_wait_is_a_race_and_a_wait_fixes_it(device):
    store = Store("worker 0", device, check=True)
    upload, compute = device.stream(Lane.UPLOAD), device.stream(Lane.COMPUTE)
    written = write(upload, store, ("in", "F0", 0), torch.ones(4))

    errors = on(compute, lambda: store.get(("in", "F0", 0)))
    assert len(errors) == 1 and isinstance(errors[0], rotapipe.RaceError)
    msg = str(errors[0])
    assert "w0.compute read in(F0, 0)" in msg and "written by w0.upload" in msg, msg
    assert "without waiting" in msg

    compute.wait(written)
    got = []
    assert on(compute, lambda: got.append(store.get(("in", "F0", 0)))) == []
    assert torch.equal(got[0], torch.ones(4))


def test_wait_orders_transitively_through_a_third_stream(device):
    store = Store("worker 0", device, check=True)
    upload = device.stream(Lane.UPLOAD)
    download, compute = device.stream(Lane.DOWNLOAD), device.stream(Lane.COMPUTE)
    written = write(upload, store, "x", torch.ones(2))
    download.wait(written)
    relayed = download.record()           # recorded after download waited on the write
    compute.wait(relayed)
    assert on(compute, lambda: store.get("x")) == []


def test_a_wait_before_a_newer_write_does_not_cover_it(device):
    """Waiting on an old event does not make a later overwrite visible (stale data)."""
    store = Store("worker 0", device, check=True)
    upload, compute = device.stream(Lane.UPLOAD), device.stream(Lane.COMPUTE)
    compute.wait(write(upload, store, "x", torch.zeros(2)))
    assert on(compute, lambda: store.get("x")) == []
    write(upload, store, "x", torch.ones(2))
    errors = on(compute, lambda: store.get("x"))
    assert len(errors) == 1 and isinstance(errors[0], rotapipe.RaceError)


def test_an_overwrite_without_wait_is_a_race_and_a_wait_fixes_it(device):
    """Two streams writing one key with no wait between them: on a GPU either write
    could land last, and a reader that waited on both would not know which it sees.
    The second write is refused (the first value stays, nothing is charged for the
    refused one); once the second stream waited on the first write it may replace it."""
    store = Store("worker 0", device, check=True)
    upload, download = device.stream(Lane.UPLOAD), device.stream(Lane.DOWNLOAD)
    written = write(upload, store, ("buf", 3), torch.zeros(4))
    used = device.memory_in_use()

    errors = on(download, lambda: store.put(("buf", 3), torch.ones(4)))
    assert len(errors) == 1 and isinstance(errors[0], rotapipe.RaceError)
    msg = str(errors[0])
    assert "w0.download overwrote buf(3)" in msg and "written by w0.upload" in msg, msg
    assert "without waiting" in msg
    assert torch.equal(store.get(("buf", 3)), torch.zeros(4))
    assert device.memory_in_use() == used

    download.wait(written)
    assert on(download, lambda: store.put(("buf", 3), torch.ones(4))) == []
    assert torch.equal(store.get(("buf", 3)), torch.ones(4))
    assert device.memory_in_use() == used
    # The same stream replacing its own value needs no wait (stream order).
    assert on(download, lambda: store.put(("buf", 3), torch.full((4,), 2.0))) == []


def test_read_before_any_write_is_reported(device):
    store = Store("worker 0", device, check=True)
    errors = on(device.stream(Lane.COMPUTE), lambda: store.get(("gout", "B1", 2)))
    assert len(errors) == 1 and isinstance(errors[0], rotapipe.RaceError)
    assert "before any action wrote it" in str(errors[0])
    assert "gout(B1, 2)" in str(errors[0])


def test_checker_off_lets_the_same_read_through(device):
    """The error above comes from the checker, not from the stores themselves."""
    store = Store("worker 0", device, check=False)
    upload, compute = device.stream(Lane.UPLOAD), device.stream(Lane.COMPUTE)
    write(upload, store, "x", torch.ones(2))
    assert on(compute, lambda: store.get("x")) == []


# -- schedule level ------------------------------------------------------------------------

def edit_deps(schedule: rotapipe.Schedule, key: str, *, drop: str | None = None,
              add: str | None = None) -> rotapipe.Schedule:
    """The schedule with action ``key`` losing dependency ``drop`` or gaining ``add``
    (schedules are data), read back through the text form."""
    actions = []
    for a in schedule.actions:
        if a.key == key:
            assert drop is None or drop in a.deps, a.to_line()
            deps = tuple(d for d in a.deps if d != drop) + ((add,) if add else ())
            a = dataclasses.replace(a, deps=deps)
        actions.append(a)
    edited = dataclasses.replace(schedule, actions=tuple(actions))
    return rotapipe.Schedule.from_text(edited.to_text())


@pytest.mark.parametrize("key, dep, read", [
    # w1's activation upload no longer waits for w0's download: it reads host memory
    # that w0 has not written yet, or wrote on a stream w1 never waited for.
    ("UA:F1:m0@1", "DA:F0:m0@1", "act(1, 0)"),
    # w0's forward of microbatch 1 no longer waits for its own upload of that input.
    ("F:F0:m1", "UA:F0:m1@0", "in(F0, 1)"),
], ids=["host-memory", "device-memory"])
def test_schedule_missing_a_wait_fails_with_a_race(key, dep, read):
    model = tiny_transformer()
    ref = copy.deepcopy(model)
    x, y = token_batch(8, 5)
    with rotapipe.RoundPipe(model, lm_loss, config=emulated(2, 2)) as pipe:
        generated = pipe.schedule()
        pipe.use_schedule(edit_deps(generated, key, drop=dep))
        for _ in range(3):            # whichever way the threads interleave
            with pytest.raises(rotapipe.RaceError) as info:
                pipe.forward_backward(x, y)
            err = info.value
            assert isinstance(err, rotapipe.WorkerError)
            assert err.action == key and f">>{key}<<" in str(err), str(err)
            assert read in str(err)
        assert pipe.calls == 0 and all(p.grad is None for p in pipe.parameters())

        pipe.use_schedule(generated)  # the unmodified schedule passes the checker
        loss = pipe.forward_backward(x, y)
        ref_loss = reference_forward_backward(ref, x, y, 2, call=0)
        assert abs(loss - ref_loss) < 1e-5
        for p, q in zip(pipe.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_generated_schedules_pass_the_checker_across_workers():
    x, y = token_batch(6, 5)
    for workers in (1, 3, 4):
        with rotapipe.RoundPipe(tiny_transformer(), lm_loss,
                                config=emulated(workers, 3, check_races=True)) as pipe:
            pipe.forward_backward(x, y)


def test_backward_without_its_gradient_dependency_is_rejected_statically():
    """Dropping the gradient upload's dependency lets the backward run before the fused
    tail: the validator refuses it before anything runs."""
    with rotapipe.RoundPipe(tiny_transformer(), lm_loss, config=emulated(2, 2)) as pipe:
        deepest, t = pipe.plan.backward[-1], pipe.plan.tail.start
        edited = edit_deps(pipe.schedule(), f"UG:{deepest.name}:m0@{t}", drop=f"DG:T:m0@{t}")
        with pytest.raises(rotapipe.ScheduleError, match="fused tail"):
            pipe.use_schedule(edited)


@pytest.mark.parametrize("key, extra", [
    ("UA:F0:m0@0", "F:F0:m0"),   # on one worker: the upload waits for its own consumer
    ("UW:F1", "X:F2"),           # across workers: F1 waits for F2, which needs F1's output
], ids=["same-worker", "across-workers"])
def test_dependency_cycle_is_rejected_as_a_deadlock(key, extra):
    with rotapipe.RoundPipe(tiny_transformer(), lm_loss, config=emulated(2, 2)) as pipe:
        cyclic = edit_deps(pipe.schedule(), key, add=extra)
        assert extra in cyclic.by_key()[key].deps
        with pytest.raises(rotapipe.ScheduleError, match="deadlock"):
            rotapipe.validate(cyclic)
        with pytest.raises(rotapipe.ScheduleError, match="deadlock"):
            pipe.use_schedule(cyclic)
        x, y = token_batch(4, 5)
        pipe.forward_backward(x, y)   # the pipeline kept its valid schedule


# -- a buffer held by several layers -------------------------------------------------------

def buffer_deps(schedule: rotapipe.Schedule) -> dict[str, set[str]]:
    """Weight upload -> the buffer downloads (``DB``) it waits for."""
    return {a.stage: {d for d in a.deps if d.startswith("DB:")} for a in schedule.actions
            if a.kind is K.UPLOAD_WEIGHTS}


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_a_shared_buffer_passes_from_holder_to_holder(workers):
    """Layers 0, 5 and 8 hold buffer ``c`` (layer 5 also one of its own): each upload of
    a stage holding ``c`` waits for the last earlier download of ``c``, forward stages
    included, and a backward stage for the last download of each buffer it holds. Keyed
    by layer (a plain collection) two holders of ``c`` were not ordered at all."""
    plan = rotapipe.Plan.from_text("F0[0:2] F1[2:4] F2[4:7] T[7:9] "
                                   "B0[0:1] B1[1:3] B2[3:5] B3[5:7]")
    held = {0: ["c"], 5: ["c", "own"], 8: ["c"]}
    s = rotapipe.roundpipe_schedule(plan, workers, 4, buffer_layers=held)
    rotapipe.validate(s, dataflow=True)
    assert rotapipe.Schedule.from_text(s.to_text()) == s
    assert [a.stage for a in s.actions if a.kind is K.DOWNLOAD_BUFFERS] == ["F0", "F2", "T"]
    assert buffer_deps(s) == {"F0": set(), "F1": set(), "F2": {"DB:F0"}, "T": {"DB:F2"},
                              "B3": {"DB:T", "DB:F2"}, "B2": set(), "B1": set(),
                              "B0": {"DB:T"}}
    per_layer = rotapipe.roundpipe_schedule(plan, workers, 4, buffer_layers=sorted(held))
    assert buffer_deps(per_layer) == {"F0": set(), "F1": set(), "F2": set(), "T": set(),
                                      "B3": {"DB:F2"}, "B2": set(), "B1": set(),
                                      "B0": {"DB:F0"}}


class SharedScale(nn.Module):
    """``tanh(lin(x) * scale)``: ``scale`` is a buffer several layers may hold (as PEFT
    VeRA's projections), ``seen`` one its forward updates in place (samples trained on),
    shared or ``None``."""

    def __init__(self, scale: torch.Tensor, seen: torch.Tensor | None):
        super().__init__()
        self.lin = nn.Linear(scale.numel(), scale.numel())
        self.register_buffer("scale", scale)
        self.register_buffer("seen", seen)

    def forward(self, x):
        if self.training and self.seen is not None:
            self.seen += x.shape[0]
        return torch.tanh(self.lin(x) * self.scale)


def shared_buffer_model(layers: int = 6, dim: int = 8) -> nn.Sequential:
    """Every layer holds one ``scale``; layers 0, 2 and the last one ``seen``."""
    torch.manual_seed(0)
    scale, seen = torch.rand(dim) + 0.5, torch.zeros((), dtype=torch.long)
    return nn.Sequential(*(SharedScale(scale, seen if l in (0, 2, layers - 1) else None)
                           for l in range(layers)))


def mse(y, t):
    return ((y - t) ** 2).mean()


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference_shared(microbatches: int, data, stale: bool):
    """Plain PyTorch, a step of SGD per call: (losses, each call's gradients, state).
    ``stale``: call ``t`` runs on the weights before step ``t - 1`` (``w_-1 = w_0``)
    and step ``t`` applies its gradients (``test_optimizer_modes``)."""
    model = shared_buffer_model()
    runs = copy.deepcopy(model) if stale else model     # the weights the calls run on
    opt = sgd(model.parameters())
    losses, grads = [], []
    for call, (x, y) in enumerate(data):
        runs.zero_grad(set_to_none=True)
        losses.append(reference_forward_backward(runs, x, y, microbatches, call,
                                                 loss_fn=mse))
        grads.append({n: p.grad.clone() for n, p in runs.named_parameters()})
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = grads[-1][n]
        opt.step()
        if stale:
            with torch.no_grad():
                for n, p in runs.named_parameters():
                    p.copy_(before[n])
    # The buffers as the forwards left them, the weights as the optimizer did.
    return losses, grads, {**runs.state_dict(), **dict(model.named_parameters())}


@pytest.mark.parametrize("mode", ["sync", "overlap", "stale"])
@pytest.mark.parametrize("workers, microbatches", [(2, 2), (3, 4), (4, 8)])
def test_buffers_shared_by_layers_train_exactly(workers, microbatches, mode):
    """Every layer holds one buffer, three layers a second one their forward updates:
    losses, gradients (``sync``), weights and buffers over three steps equal plain
    PyTorch's, element by element. Keyed by layer, the uploads raced with the other
    holders' downloads (a RaceError on almost every run), and a holder started from
    the call's first value of ``seen``, losing the earlier holders' counts."""
    data = [(torch.randn(16, 8, generator=torch.Generator().manual_seed(c)),
             torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + c)))
            for c in range(3)]
    model = shared_buffer_model()
    config = emulated(workers, microbatches, optimizer_mode=mode)
    losses, grads = [], []
    with rotapipe.RoundPipe(model, mse, config=config, optimizer=sgd) as pipe:
        for x, y in data:
            if mode == "sync":
                losses.append(pipe.forward_backward(x, y))
                grads.append({n: p.grad.clone() for n, p in pipe.named_parameters()})
                assert pipe.step()
            else:
                losses.append(pipe.train_step(x, y))
        state = {k: v.clone() for k, v in pipe.state_dict().items()}
    want_losses, want_grads, want = reference_shared(microbatches, data, mode == "stale")
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    for got_call, want_call in zip(grads, want_grads):
        assert got_call.keys() == want_call.keys()
        for n in want_call:
            torch.testing.assert_close(got_call[n], want_call[n], rtol=1e-5, atol=1e-6)
    assert state.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(state[k], want[k].detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=k: f"{k}: {m}")
    assert int(state["0.seen"]) == 3 * 16 * len(data)


def test_a_hand_off_that_finds_no_gradients_fails_instead_of_dropping_them(monkeypatch):
    """Runtime backstop behind the validator's check that ``O`` waits for its ``DW``
    (disabled here): a hand-off running before the gradients reached the host raised
    nothing and stepped without that stage's gradients; it is a race naming them."""
    import importlib
    monkeypatch.setattr(importlib.import_module("rotapipe.schedule.validate"),
                        "_check_hand_offs", lambda *args: None)
    x, y = token_batch(8, 5)
    with rotapipe.RoundPipe(tiny_transformer(), lm_loss, config=emulated(2, 2)) as pipe:
        lines = []
        for line in pipe.schedule().to_text().splitlines():
            if line.startswith("host O:B0 "):
                line = "host O:B0"                    # no longer waits for DW:B0 ...
            elif line.startswith("w0 DW:B0 "):
                line += " <~ O:B0"                    # ... which even waits for it
            lines.append(line)
        pipe.use_schedule(rotapipe.Schedule.from_text("\n".join(lines)))
        with pytest.raises(rotapipe.RaceError, match=r"wgrad\(B0\).*before any action"):
            pipe.forward_backward(x, y)
        assert pipe.calls == 0 and all(p.grad is None for p in pipe.parameters())


def test_a_stream_dependency_on_host_work_is_refused_statically():
    """A device action waiting for a host action with ``<-`` (a stream wait) failed in
    the worker (``'_DoneEvent' object has no attribute 'done'``): the host's work has
    no stream event. The validator names the fix, ``<~``."""
    with rotapipe.RoundPipe(tiny_transformer(), lm_loss, config=emulated(2, 2)) as pipe:
        text = "\n".join(line + " O:B1" if line.startswith("w0 DW:B0 ") else line
                         for line in pipe.schedule().to_text().splitlines())
        with pytest.raises(rotapipe.ScheduleError, match=r"<~ O:B1"):
            pipe.use_schedule(rotapipe.Schedule.from_text(text))
