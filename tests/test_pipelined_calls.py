"""Pipelined training calls (``optimizer_mode="stale"`` / ``"overlap"``): a call returns once
its loss is in host memory and the next call's stages start on the workers its draining
backward frees.

- exactness: ``stale`` equals the one-step-delayed plain-PyTorch reference
  (g_t = grad L_t(w_{t-1})), ``overlap`` equals plain PyTorch, over 6 pipelined steps,
  1-4 workers, 1-8 microbatches, clipping on and off (fp32, element by element);
- the actions run are :func:`rotapipe.schedule.roundpipe_stale_schedule`'s (what the
  simulator simulates);
- overlap is real: a call returns while its backward is held, and (stale) the next
  call's loss comes back while the previous call's backward is still held;
- a fault at 20 random points of a run: no hang, the error names call, stage,
  microbatch and worker, the state is that of a run stopped at the reported step
  boundary, and training continues exactly from there;
- ``use_schedule`` runs a schedule's own microbatch count or refuses other counts.
"""

from __future__ import annotations

import copy
import random
import threading

import pytest
import torch
from torch import nn

import rotapipe
from rotapipe.runtime.emulated import running_seed
from rotapipe.schedule import ActionKind as K, one_f_one_b_schedule, roundpipe_stale_schedule
from rotapipe.plan import bound_plan

from models import emulated, lm_loss, reference_forward_backward, tiny_transformer, token_batch
from test_exactness import OPTIMIZERS
from test_faults import PASSES, Fault, Trigger, faulty_model

RTOL, ATOL = 1e-5, 1e-6
STEPS = 6
CLIP = {"off": None, "hit": 0.05}     # "hit" clips every step
SHAPES = [(1, 1), (2, 4), (3, 8), (4, 3)]      # (workers, microbatches)


def batches(n: int = STEPS, size: int = 8, seed: int = 0):
    return [token_batch(size, 6, seed=seed + s) for s in range(n)]


def reference(mode: str, model: nn.Module, data, M: int, clip,
              optimizer: str = "adamw") -> tuple[list, dict]:
    """Plain PyTorch: losses and final weights of ``len(data)`` steps; ``stale`` computes
    step t's gradient on the weights before step t - 1 (w_{-1} = w_0)."""
    ref = copy.deepcopy(model)
    shadow = copy.deepcopy(model)
    opt = OPTIMIZERS[optimizer](ref.parameters())

    def apply(grads):
        for name, q in ref.named_parameters():
            q.grad = grads.get(name)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    losses = []
    runs_on = {k: v.clone() for k, v in ref.state_dict().items()}
    pending = None
    for t, (x, y) in enumerate(data):
        shadow.load_state_dict(runs_on if mode == "stale" else ref.state_dict())
        shadow.zero_grad(set_to_none=True)
        losses.append(reference_forward_backward(shadow, x, y, M, call=t))
        grads = {n: q.grad.clone() for n, q in shadow.named_parameters() if q.grad is not None}
        if mode == "stale":
            if pending is not None:
                apply(pending)
            runs_on = {k: v.clone() for k, v in ref.state_dict().items()}
            pending = grads
        else:
            apply(grads)
    if pending is not None:
        apply(pending)                       # state_dict() applies the last stale step
    return losses, {k: v.clone() for k, v in ref.state_dict().items()}


def assert_weights(got: dict, want: dict, what: str = "") -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, k=k: f"{what} {k}: {m}")


@pytest.mark.parametrize("mode", ["stale", "overlap"])
@pytest.mark.parametrize("clip", ["off", "hit"])
@pytest.mark.parametrize("workers,microbatches", SHAPES,
                         ids=[f"w{w}-m{m}" for w, m in SHAPES])
def test_pipelined_calls_match_plain_pytorch(mode, clip, workers, microbatches):
    ran, frozen = run_and_compare(tiny_transformer(tied=True, dropout=0.1), mode, clip,
                                  workers, microbatches)
    assert frozen == () and K.UPLOAD_TRAINED not in {a.kind for a in ran.actions}


def run_and_compare(model: nn.Module, mode: str, clip: str, workers: int,
                    microbatches: int):
    """``STEPS`` pipelined calls of ``model`` against plain PyTorch (losses and weights
    element by element); what ran must be the simulator's overlapping schedule, call for
    call. Returns that schedule and the pipeline's layers holding frozen weights."""
    data = batches(size=max(8, microbatches))
    want_losses, want = reference(mode, model, data, microbatches, CLIP[clip])
    config = emulated(workers, microbatches, optimizer_mode=mode, clip_grad_norm=CLIP[clip])
    with rotapipe.RoundPipe(copy.deepcopy(model), lm_loss, config=config,
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        losses = [pipe.train_step(x, y) for x, y in data]
        got = {k: v.clone() for k, v in pipe.state_dict().items()}
        ran = pipe.last_timeline(calls=STEPS).schedule
        frozen = pipe._frozen
        sim = roundpipe_stale_schedule(pipe.plan, workers, microbatches, calls=STEPS,
                                       staleness=1 if mode == "stale" else 0,
                                       whole_step=clip != "off", ties=pipe._ties,
                                       frozen=frozen)
    torch.testing.assert_close(losses, want_losses, rtol=RTOL, atol=ATOL)
    assert_weights(got, want, f"{mode} clip={clip}")
    assert ran.to_text() == sim.to_text()
    return ran, frozen


class Hold(torch.autograd.Function):
    """Identity whose backward waits for ``gate`` (a layer's backward held open)."""

    @staticmethod
    def forward(ctx, x, gate, seeds):
        ctx.gate, ctx.seeds = gate, seeds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        assert ctx.gate.wait(30.0), "the held backward was never released"
        return g, None, None


class Holding(nn.Module):
    """Layer wrapper: in the calls whose seeds are in ``seeds``, its backward waits for
    ``gate`` (set by the test)."""

    def __init__(self, inner: nn.Module, index: int, gate: threading.Event, seeds: set):
        super().__init__()
        self.inner, self.index, self.gate, self.seeds = inner, index, gate, seeds

    def __deepcopy__(self, memo):
        new = Holding(copy.deepcopy(self.inner, memo), self.index, self.gate, self.seeds)
        return new

    def forward(self, x):
        y = self.inner(x)
        if torch.is_grad_enabled() and running_seed() in self.seeds:
            y = Hold.apply(y, self.gate, self.seeds)
        return y


@pytest.mark.parametrize("mode", ["stale", "overlap"])
def test_a_call_returns_while_its_backward_is_held(mode):
    """The held backward (layer 1, call 1) blocks the call's completion, not its loss:
    ``train_step`` returns while the backward is still held. (The next call cannot run
    whole past it, even in ``stale`` where it does not read call 1's update: its stages
    are dealt to every worker, and the held worker runs its actions in order, as a GPU's
    stream would.)"""
    gate = threading.Event()
    seeds: set = set()
    layers = [Holding(l, i, gate, seeds) if i == 1 else l
              for i, l in enumerate(tiny_transformer(tied=True))]
    data = batches(4)
    M = 2
    config = emulated(2, M, optimizer_mode=mode, tail_layers=1)
    with rotapipe.RoundPipe(nn.Sequential(*layers), lm_loss, config=config,
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        pipe.train_step(*data[0])
        seeds.update(rotapipe.layer_seed(0, 1, m, 1) for m in range(M))
        done = {}

        def steps():
            done[1] = pipe.train_step(*data[1])

        t = threading.Thread(target=steps)
        t.start()
        t.join(20.0)
        returned = not t.is_alive() and sorted(done) == [1]   # the gate is still shut
        gate.set()
        assert returned
        pipe.flush()          # the held backward completes once released


def fault_point(i: int) -> dict:
    rng = random.Random(2000 + i)
    return {"mode": ("stale", "overlap")[i % 2], "workers": rng.randint(1, 4),
            "microbatches": rng.randint(1, 4), "pass_": PASSES[i % len(PASSES)],
            "call": rng.randint(0, STEPS - 1), "clip": rng.choice([None, 0.05]),
            "mb": rng.random(), "layer": rng.random()}


def fault_layer(pipe: rotapipe.RoundPipe, pass_: str, pick: float) -> int:
    """A layer that runs ``pass_`` in this plan."""
    plan = pipe.plan
    if pass_.startswith("tail"):
        layers = list(plan.tail.layers)
    elif pass_ == "forward":
        layers = [l for s in plan.forward for l in s.layers]
    else:
        layers = [l for s in plan.backward for l in s.layers]
    return layers[int(pick * len(layers))]


@pytest.mark.parametrize("i", range(20), ids=lambda i: f"point{i}")
def test_fault_in_a_run_of_pipelined_calls(i):
    p = fault_point(i)
    M = p["microbatches"]
    trigger = Trigger()
    model = faulty_model(trigger, tied=True, dropout=0.1)
    data = batches()
    config = emulated(p["workers"], M, optimizer_mode=p["mode"], clip_grad_norm=p["clip"],
                      grain="stage", timeout_s=60.0)
    _, want = reference(p["mode"], model, data, M, p["clip"])
    with rotapipe.RoundPipe(copy.deepcopy(model), lm_loss, config=config,
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        layer, mb = fault_layer(pipe, p["pass_"], p["layer"]), int(p["mb"] * M)
        trigger.arm(layer, mb, p["call"], p["pass_"])
        t = 0
        with pytest.raises(rotapipe.WorkerError) as info:
            for t, (x, y) in enumerate(data):
                pipe.train_step(x, y)
            pipe.flush()
        trigger.disarm()
        err = info.value
        msg = str(err)
        assert isinstance(err.cause, Fault), msg
        # The failing action: its call, stage, microbatch and worker are named.
        assert f"call {p['call']}" in msg and f"microbatch {mb}" in msg, msg
        assert f"worker {err.worker}" in msg and f">>{err.action}<<" in msg, msg
        # Calls that committed before the fault are kept; the faulty call and every
        # call in flight that had not committed (at most the one before it) are dropped.
        k = err.calls_committed
        assert p["call"] - 1 <= k <= p["call"] and k == pipe.calls, (k, p["call"], msg)
        assert err.calls_discarded == list(range(k, k + len(err.calls_discarded)))
        assert p["call"] in err.calls_discarded, msg
        assert all(d.memory_in_use() == 0 for d in pipe.devices)
        # The state is that of a run that stopped after step k (masters read without
        # flushing: stale's next call still runs on the weights one step old) ...
        _, stopped = reference(p["mode"], model, data[:k], M, p["clip"]) if k else \
            (None, {n: v for n, v in model.state_dict().items()})
        if p["mode"] == "overlap" or k == 0:
            assert_weights(pipe._container.state_dict(), stopped, f"after the fault ({k})")
        # ... and training continues exactly from there.
        for x, y in data[k:]:
            pipe.train_step(x, y)
        got = {n: v.clone() for n, v in pipe.state_dict().items()}
    assert_weights(got, want, "after resuming")


def test_use_schedule_runs_the_schedules_own_microbatch_count():
    model = tiny_transformer()
    plan = bound_plan([1.0] * len(model), 2)
    x, y = token_batch(8, 6, seed=3)
    with rotapipe.RoundPipe(copy.deepcopy(model), lm_loss, plan=plan,
                            config=emulated(2, 4)) as pipe:
        pipe.use_schedule(one_f_one_b_schedule(plan, 2, 2, offload_optimizer=True))
        loss = pipe.forward_backward(x, y)
        grads = {n: q.grad.clone() for n, q in pipe.named_parameters()}
        assert pipe.last_timeline().schedule.microbatches == 2
    ref = copy.deepcopy(model)
    want = reference_forward_backward(ref, x, y, 2, call=0)
    assert loss == pytest.approx(want, rel=RTOL)
    for n, q in ref.named_parameters():
        torch.testing.assert_close(grads[n], q.grad, rtol=RTOL, atol=ATOL)


def test_use_schedule_refuses_another_worker_count():
    model = tiny_transformer()
    plan = bound_plan([1.0] * len(model), 2)
    with rotapipe.RoundPipe(model, lm_loss, plan=plan, config=emulated(2, 4)) as pipe:
        with pytest.raises(rotapipe.ConfigError, match="for 3 workers.*has 2 workers"):
            pipe.use_schedule(rotapipe.roundpipe_schedule(plan, 3, 4))
        stale = roundpipe_stale_schedule(pipe.plan, 2, 4, calls=2)
        with pytest.raises(rotapipe.ConfigError, match="spans 2 calls"):
            pipe.use_schedule(stale)


def test_a_stale_pipeline_plans_for_overlapping_calls():
    """``optimizer_mode="stale"`` gets the planner's plan for the steady state of
    overlapping calls (as ``rotapipe plan --stale``), the exact modes the plan for one
    call: on Qwen3-1.7B's emulated costs (8x RTX 4090) each plan is the faster in the
    mode it was chosen for."""
    from rotapipe.planner.autoplan import simulate_plan
    from rotapipe.runtime.emulation import TimedEmulation
    em = TimedEmulation.of("qwen3-1.7b", "rtx4090x8", seq=2048, call_tokens=16 * 2048)
    model = em.stand_in()
    plans = {}
    for mode in ("sync", "stale"):
        cfg = rotapipe.PipeConfig(workers=8, microbatches=16, backend="emulated",
                                  emulation=em, optimizer_mode=mode)
        with rotapipe.RoundPipe(model, lm_loss, config=cfg) as pipe:
            plans[mode] = pipe.plan
    assert plans["sync"] != plans["stale"]
    steady = {m: simulate_plan(p, em.costs, 8, 16, stale=True).step_ms
              for m, p in plans.items()}
    one = {m: simulate_plan(p, em.costs, 8, 16).step_ms for m, p in plans.items()}
    assert steady["stale"] < 0.98 * steady["sync"] and one["sync"] < one["stale"]


def freeze_part(model: nn.Module, embedding: bool) -> nn.Module:
    """A LoRA-like model: every block's ``qkv`` and ``up`` frozen (layers holding frozen
    and trained weights), block 3 frozen whole, and with ``embedding`` the tied
    embedding and head frozen too."""
    for name, p in model.named_parameters():
        if ".qkv." in name or ".up." in name or name.startswith("3.") or \
                (embedding and name.startswith("0.")):
            p.requires_grad_(False)
    return model


FROZEN_CASES = [("stale", "off", 2, 4, False), ("stale", "hit", 3, 8, True),
                ("overlap", "off", 3, 8, True), ("overlap", "hit", 2, 4, False)]


@pytest.mark.parametrize("mode,clip,workers,microbatches,embedding", FROZEN_CASES,
                         ids=["-".join(map(str, c)) for c in FROZEN_CASES])
def test_frozen_weights_upload_before_the_hand_off(mode, clip, workers, microbatches,
                                                   embedding):
    """A stage holding frozen weights uploads them without waiting for the optimizer
    (``UW``) and its trained part after the hand-off (``UT``): still exact."""
    model = freeze_part(tiny_transformer(tied=True, dropout=0.1), embedding)
    ran, frozen = run_and_compare(model, mode, clip, workers, microbatches)
    assert frozen == ((0, 1, 2, 3, 4, 5) if embedding else (1, 2, 3, 4))
    split = [a for a in ran.actions if a.kind is K.UPLOAD_TRAINED]
    assert split and all(a.call > 0 for a in split)


@pytest.mark.parametrize("mode", ["stale", "overlap"])
def test_a_failed_trained_upload_leaves_the_last_step_boundary(mode):
    """A ``UT`` (the adapters' upload after the hand-off) failing in call 3: the error
    names it, the state is the step boundary it reports, and training continues exactly
    from there."""
    model = freeze_part(tiny_transformer(tied=True), embedding=False)
    data = batches()
    _, want = reference(mode, model, data, 4, None)
    fired = []
    config = emulated(3, 4, optimizer_mode=mode, timeout_s=60.0)
    with rotapipe.RoundPipe(copy.deepcopy(model), lm_loss, config=config,
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        copies = pipe._calls.runner.copies
        upload = copies.upload

        def failing(a):
            chunks = upload(a)
            if a.kind is K.UPLOAD_TRAINED and a.call == 3 \
                    and not fired:
                fired.append(a.key)

                def boom():
                    raise Fault("injected: trained upload")
                chunks[0].copy = boom
            return chunks
        copies.upload = failing
        with pytest.raises(rotapipe.WorkerError) as info:
            for x, y in data:
                pipe.train_step(x, y)
            pipe.flush()
        copies.upload = upload
        err, msg = info.value, str(info.value)
        assert fired and isinstance(err.cause, Fault), msg
        assert "trained-weight upload" in msg and f">>{err.action}<<" in msg, msg
        assert err.action.startswith("UT:") and "call 3" in msg, msg
        k = err.calls_committed
        assert 2 <= k <= 3 and k == pipe.calls and 3 in err.calls_discarded, msg
        assert all(d.memory_in_use() == 0 for d in pipe.devices)
        if mode == "overlap":
            _, stopped = reference(mode, model, data[:k], 4, None)
            assert_weights(pipe._container.state_dict(), stopped, f"after the fault ({k})")
        for x, y in data[k:]:
            pipe.train_step(x, y)
        got = {n: v.clone() for n, v in pipe.state_dict().items()}
    assert_weights(got, want, "after resuming")


ROWS_PLAN = "F0[0:1] F1[1:3] F2[3:5] T[5:6] B0[0:1] B1[1:3] B2[3:5]"
ROWS_CASES = [(True, 2, 4, "adamw", "fp32"), (False, 3, 8, "adamw", "bf16"),
              (True, 1, 1, "sgd", "fp32"), (False, 4, 3, "sgd", "fp32")]


def few_rows(size: int = 8):
    """``STEPS`` batches, each looking up at most 12 of the embedding's 61 rows (a
    different 12 each call): few enough that stepping them first is cheaper than the
    whole table (``ROWS_FIRST_COST``)."""
    out = []
    for s, (x, _) in enumerate(batches(size=size)):
        x = x % 12 + 3 * s
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def rows_run(model: nn.Module, workers: int, microbatches: int, optimizer: str,
             states: str = "fp32", between=None, fail_at: int | None = None, data=None):
    """``overlap`` calls of ``model`` with its embedding moved by rows on a plan whose
    backward gives the table a stage of its own; each call's ``OR`` waits (test side)
    until the next call is issued, so that it has the next call's rows to step first.
    ``fail_at``: the ``fail_at``-th rows step raises; ``data``: the batches (default
    :func:`few_rows`). Returns the pipeline (open), the data, the losses, one entry per
    table whose rows were stepped first, and the failure (``None``)."""
    from rotapipe.runtime.calls import Call
    from rotapipe.runtime.overlapstep import OverlapStep
    data = data or few_rows(size=max(8, microbatches))
    previews = []
    real_rows_first, real_preview = Call.rows_first, OverlapStep._preview

    def rows_first(call, key):
        if between is None and call.index < STEPS - 1:
            for _ in range(30_000):
                if call.next_store() is not None:
                    break
                threading.Event().wait(0.001)
        real_rows_first(call, key)

    def preview(step, pid, rows):
        previews.append(len(previews))
        if fail_at is not None and len(previews) == fail_at:
            raise Fault("injected: rows stepped first")
        return real_preview(step, pid, rows)
    model = copy.deepcopy(model)
    config = emulated(workers, microbatches, optimizer_mode="overlap",
                      optimizer_state_dtype=states, timeout_s=60.0)
    pipe = rotapipe.RoundPipe(model, lm_loss, config=config,
                              optimizer=OPTIMIZERS[optimizer],
                              plan=rotapipe.Plan.from_text(ROWS_PLAN),
                              lookups={model[0].emb: lambda ids: ids})
    Call.rows_first, OverlapStep._preview = rows_first, preview
    losses, error = [], None
    try:
        for x, y in data:
            losses.append(pipe.train_step(x, y))
            if between is not None:
                between(pipe)
        pipe.flush()
    except rotapipe.WorkerError as exc:
        error = exc
    finally:
        Call.rows_first, OverlapStep._preview = real_rows_first, real_preview
    if error is not None and fail_at is None:
        pipe.close()
        raise error
    return pipe, data, losses, previews, error


@pytest.mark.parametrize("tied,workers,microbatches,optimizer,states", ROWS_CASES,
                         ids=["-".join(map(str, c)) for c in ROWS_CASES])
def test_the_next_calls_rows_are_stepped_first(tied, workers, microbatches, optimizer,
                                              states):
    """``overlap`` with an embedding moved by rows: each call steps first the rows the
    next call looks up (``OR``), which the next call's first forward stage uploads while
    the whole table is stepped. The run equals plain PyTorch element by element (bf16
    optimizer state rounds its moments, so there: the same pipeline flushed after every
    call, whose ``OR`` has no next call and steps the whole table), and what ran is the
    simulator's schedule with ``rows_first``."""
    model = tiny_transformer(tied=tied)
    pipe, data, losses, previews, _ = rows_run(model, workers, microbatches, optimizer,
                                               states)
    with pipe:
        got = {k: v.clone() for k, v in pipe.state_dict().items()}
        ran = pipe.last_timeline(calls=STEPS).schedule
        sim = roundpipe_stale_schedule(pipe.plan, workers, microbatches, calls=STEPS,
                                       staleness=0, ties=pipe._ties, rows_first=(0,))
        assert pipe._rows_first == (0,)
    assert len(previews) == STEPS - 1      # every call but the last had a next call
    assert ran.to_text() == sim.to_text()
    if states == "fp32":
        want_losses, want = reference("overlap", model, data, microbatches, None, optimizer)
    else:
        flushed, _, want_losses, none, _ = rows_run(model, workers, microbatches,
                                                    optimizer, states,
                                                    between=lambda p: p.flush())
        with flushed:
            want = {k: v.clone() for k, v in flushed.state_dict().items()}
        assert none == []
    torch.testing.assert_close(losses, want_losses, rtol=RTOL, atol=ATOL)
    assert_weights(got, want, f"rows first, {optimizer}, {states} state")


ROWS_MEMORY = [("adamw", "fp32", 2), ("adamw", "bf16", 2), ("sgd", "fp32", 1)]


@pytest.mark.parametrize("optimizer,states,kept", ROWS_MEMORY,
                         ids=[f"{o}-{s}" for o, s, _ in ROWS_MEMORY])
def test_host_memory_counts_the_rows_buffers(optimizer, states, kept):
    """What ``rotapipe plan`` counts for stepping the next call's rows first
    (``HostMemory.rows``) is what the runtime keeps for it, to the byte, given the
    most rows a call looks up; other layouts and data parallelism count none."""
    from rotapipe.plan import LayerCost, ModelCosts, host_memory
    from rotapipe.plan.hostmem import per_server
    model = tiny_transformer(tied=False)
    pipe, data, _, previews, _ = rows_run(model, 2, 4, optimizer, states)
    with pipe:
        kept_bytes = sum(b.numel() * b.element_size()
                         for b in pipe._host_opt.rows_room.buffers.values())
        dtype = pipe._container.state_dict()["0.emb.weight"].element_size()
    assert len(previews) == STEPS - 1
    rows = max(x.unique().numel() for x, _ in data[1:])
    vocab, dim = model[0].emb.weight.shape
    layer = LayerCost("embedding", 0.0, 0.0, 0.0, weight_bytes=vocab * dim * dtype)
    costs = ModelCosts((layer, LayerCost("head", 1.0, 1.0, 1.0)), 1,
                       rows_bytes=rows * dim * dtype)
    plan = rotapipe.Plan.from_text("F0[0:1] T[1:2] B0[0:1]")

    def counted(layout):
        return host_memory(costs, plan, 4, 2, dtype_bytes=dtype, optimizer_states=kept,
                           state_dtype=states, layout=layout)
    assert counted("overlap").rows == kept_bytes > 0
    assert counted("lean").rows == kept_bytes
    assert counted("sync").rows == 0
    assert host_memory(costs, plan, 4, 2, dtype_bytes=dtype, state_dtype="int8",
                       layout="overlap").rows == 0     # bitsandbytes steps whole tables
    assert per_server(counted("overlap"), 2, "none").rows == 0
    assert counted("overlap").total == counted("sync").total + kept_bytes + \
        counted("overlap").snapshots


def test_a_failed_rows_step_leaves_the_last_step_boundary():
    """The ``OR`` of call 3 fails (its optimizer raises while stepping the next call's
    rows): the error names it and its call, the state is the step boundary it reports,
    and training continues exactly from there."""
    model = tiny_transformer(tied=True)
    pipe, data, _, _, err = rows_run(model, 3, 4, "adamw", fail_at=4)
    assert err is not None
    msg = str(err)
    with pipe:
        assert isinstance(err, rotapipe.WorkerError) and isinstance(err.cause, Fault), msg
        assert "next call's embedding rows" in msg and f">>{err.action}<<" in msg, msg
        assert err.action.startswith("OR:") and "call 3" in msg, msg
        k = err.calls_committed
        assert k == 3 == pipe.calls and err.calls_discarded[0] == 3, msg
        assert all(d.memory_in_use() == 0 for d in pipe.devices)
        _, stopped = reference("overlap", model, data[:k], 4, None)
        assert_weights(pipe._container.state_dict(), stopped, f"after the fault ({k})")
        for x, y in data[k:]:
            pipe.train_step(x, y)
        got = {n: v.clone() for n, v in pipe.state_dict().items()}
    _, want = reference("overlap", model, data, 4, None)
    assert_weights(got, want, "after resuming")


def test_rows_are_stepped_first_only_where_that_is_cheaper():
    """A call looking up more than 1 / ``ROWS_FIRST_COST`` of the table's rows: its
    rows cost more to step apart than the whole table, so the ``OR`` steps the whole
    table (no rows stepped first) and the next call reads it; still exact."""
    from rotapipe.plan.costs import ROWS_FIRST_COST
    model = tiny_transformer(tied=False)
    data = batches()
    assert all(x.unique().numel() * ROWS_FIRST_COST >= 61 for x, _ in data)
    pipe, _, losses, previews, _ = rows_run(model, 2, 4, "adamw", data=data)
    with pipe:
        got = {k: v.clone() for k, v in pipe.state_dict().items()}
        ran = pipe.last_timeline(calls=STEPS).schedule
    assert previews == [] and K.OPTIMIZER_ROWS in {a.kind for a in ran.actions}
    want_losses, want = reference("overlap", model, data, 4, None)
    torch.testing.assert_close(losses, want_losses, rtol=RTOL, atol=ATOL)
    assert_weights(got, want, "rows not stepped first")


class NanInput(torch.autograd.Function):
    """Identity whose backward hands a NaN gradient to the layers before it."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


class Poisoned(nn.Module):
    """Layer wrapper: in the calls whose seeds are in ``seeds``, every layer before it
    gets a NaN gradient; its own and later layers' gradients stay finite."""

    def __init__(self, inner: nn.Module, seeds: set):
        super().__init__()
        self.inner, self.seeds = inner, seeds

    def __deepcopy__(self, memo):
        return Poisoned(copy.deepcopy(self.inner, memo), self.seeds)

    def forward(self, x):
        y = self.inner(x)
        if torch.is_grad_enabled() and running_seed() in self.seeds:
            y = NanInput.apply(y)
        return y


@pytest.mark.parametrize("workers,microbatches", [(3, 8), (4, 4)])
def test_overlap_skips_a_step_the_next_call_has_not_read(workers, microbatches):
    """``overlap`` with ``nonfinite="skip"``: call 2's gradient is non-finite in the
    embedding only, which hands off last. The deeper stages were stepped speculatively
    by then; the skip undoes them, and the next call must not have uploaded them: its
    uploads wait for the whole step, as with clipping. Equals plain PyTorch with step 2
    skipped."""
    T, data, seeds = 2, batches(), set()
    base = tiny_transformer()
    ref = copy.deepcopy(base)
    opt = OPTIMIZERS["adamw"](ref.parameters())
    for t, (x, y) in enumerate(data):
        ref.zero_grad(set_to_none=True)
        reference_forward_backward(ref, x, y, microbatches, call=t)
        if t != T:
            opt.step()
    layers = list(copy.deepcopy(base))
    layers[1] = Poisoned(layers[1], seeds)
    config = emulated(workers, microbatches, optimizer_mode="overlap", nonfinite="skip")
    with rotapipe.RoundPipe(nn.Sequential(*layers), lm_loss, config=config,
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        for t, (x, y) in enumerate(data):
            if t == T:
                seeds.update(rotapipe.layer_seed(0, T, m, 1) for m in range(microbatches))
            pipe.train_step(x, y)
        got = {k.replace(".inner.", "."): v.clone() for k, v in pipe.state_dict().items()}
        assert pipe.nonfinite_skips == 1
        ran = pipe.last_timeline(calls=STEPS).schedule
        sim = roundpipe_stale_schedule(pipe.plan, workers, microbatches, calls=STEPS,
                                       staleness=0, whole_step=True, ties=pipe._ties)
    assert_weights(got, ref.state_dict(), "step 2 skipped")
    assert ran.to_text() == sim.to_text()
