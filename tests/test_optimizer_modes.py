"""Optimizer modes (``PipeConfig.optimizer_mode``) and exact gradient clipping.

- ``overlap`` against plain PyTorch (``test_exactness.train_reference``): losses, the
  gradients the optimizer is given and the weights, element by element, with AdamW and
  SGD with momentum, 1-3 workers, 2-4 microbatches, gradient accumulation, and clipping
  off, on at a norm that clips every step, and on at one that never does; and bitwise
  against ``sync``.
- ``overlap`` failure atomicity: a fault in a shallow backward stage after deeper
  stages were stepped leaves weights, optimizer state and gradients exactly as before.
- ``stale`` against an explicit one-step-delayed reference, with a failed call in the
  middle.
- ``sync`` with clipping against ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import rotapipe
from models import emulated, lm_loss, reference_forward_backward, tiny_transformer, token_batch
from test_exactness import (ATOL, OPTIMIZERS, RTOL, assert_close_trained, step_batches,
                            train_pipe, train_reference)
from test_faults import Trigger, assert_same_state, faulty_model, snapshot

CLIP = {"off": None, "hit": 0.05, "miss": 1e3}    # "hit" clips every step, "miss" never
MODEL = dict(tied=True, dropout=0.1, buffers=True)


def train_fused(model, data, config, optimizer: str):
    """Each step: ``forward_backward`` on all but the last batch, ``train_step`` on it.
    Returns (losses, the gradients the first step's optimizer saw first for each
    parameter (before clipping), state_dict, sizes of the stepped parameter sets)."""
    losses, seen, costs = [], {}, []
    with rotapipe.RoundPipe(model, lm_loss, config=config,
                            optimizer=OPTIMIZERS[optimizer]) as pipe:
        names = {id(p): n for n, p in pipe.named_parameters()}

        def record(opt, args, kwargs):
            if not losses:          # first step only; speculative steps come first
                for group in opt.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            seen.setdefault(names[id(p)], p.grad.clone())
        pipe.optimizer.register_step_pre_hook(record)
        pipe._optimizer_cost = lambda pids: costs.append(len(pids))
        for calls in data:
            total = sum(y.shape[0] for _, y in calls)
            loss = sum(pipe.forward_backward(x, y) * y.shape[0] / total
                       for x, y in calls[:-1])
            x, y = calls[-1]
            loss += pipe.train_step(x, y) * y.shape[0] / total
            assert all(p.grad is None for p in pipe.parameters())
            losses.append(loss)
        state = {k: v.clone() for k, v in pipe.state_dict().items()}
        trainable = len(list(pipe.parameters()))
    assert not [t for t in threading.enumerate() if t.name.startswith("rotapipe-optimizer")]
    return tuple(losses), seen, state, costs, trainable


CASES = [   # workers, microbatches, optimizer, clip, batch sizes of a step's calls
    (1, 2, "adamw", "off", (8,)),
    (2, 3, "adamw", "hit", (8, 12)),
    (3, 4, "adamw", "miss", (8,)),
    (2, 4, "sgd", "hit", (8,)),
    (3, 2, "sgd", "miss", (8, 12)),
    (2, 2, "sgd", "off", (8, 12)),
]


@pytest.mark.parametrize("workers,microbatches,optimizer,clip,sizes", CASES)
def test_overlap_matches_plain_pytorch(workers, microbatches, optimizer, clip, sizes):
    data = step_batches(sizes)
    want = train_reference(tiny_transformer(**MODEL), sizes, microbatches, optimizer,
                           data=data, clip=CLIP[clip])
    config = emulated(workers, microbatches, optimizer_mode="overlap", clip_grad_norm=CLIP[clip])
    losses, grads, state, costs, n = train_fused(tiny_transformer(**MODEL), data, config,
                                                 optimizer)
    torch.testing.assert_close(losses, want.losses, rtol=RTOL, atol=ATOL)
    assert grads.keys() == want.grads.keys()
    for k in want.grads:
        torch.testing.assert_close(grads[k], want.grads[k], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, k=k: f"grad {k}: {m}")
    for k in want.state:
        torch.testing.assert_close(state[k], want.state[k], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, k=k: f"{k}: {m}")
    # Stepped per stage (the tied weight last, alone), plus one whole redo per step
    # exactly when clipping is needed; after a step whose clip took effect, a step is
    # taken whole once its call is complete, without speculating: the first step
    # speculates, a step whose call was issued after it committed does not.
    whole = costs.count(n)
    speculated = (sum(costs) - whole * n) // n
    assert sum(costs) == (speculated + whole) * n, costs
    if clip == "hit":
        assert whole == len(data) == 3 and 1 <= speculated < len(data), costs
    else:
        assert whole == 0 and speculated == len(data) and len(costs) > len(data) * 2, costs


def test_overlap_stops_speculating_while_the_clip_takes_effect():
    """``overlap`` with a clip: after a step whose clip took effect the next step is
    taken whole once its call is complete (its speculative per-stage steps would be
    undone and redone), bit for bit what speculating gives; a step whose norm stays
    below the limit brings the speculation back."""
    from types import SimpleNamespace

    from rotapipe.runtime.optimizer import HostOptimizer
    from rotapipe.runtime.overlapstep import OverlapStep
    from rotapipe.runtime.stepping import WholeStep
    clipped = HostOptimizer.clipped.fget
    assert clipped(SimpleNamespace(max_norm=1.0, last_norm=2.0))
    assert not clipped(SimpleNamespace(max_norm=1.0, last_norm=0.5))
    assert not clipped(SimpleNamespace(max_norm=1.0, last_norm=None))
    assert not clipped(SimpleNamespace(max_norm=None, last_norm=2.0))
    data = [[token_batch(8, 6, seed=s)] for s in range(5)]
    real = HostOptimizer.call_hook

    hooks: list[str] = []

    def hook(self, *args, **kwargs):
        h = real(self, *args, **kwargs)
        hooks.append(type(h).__name__)
        return h

    def run(clip, speculate_always):
        hooks.clear()
        saved = HostOptimizer.clipped
        HostOptimizer.call_hook = hook
        if speculate_always:
            HostOptimizer.clipped = property(lambda self: False)
        try:
            config = emulated(3, 4, optimizer_mode="overlap", clip_grad_norm=CLIP[clip])
            _, _, state, _, _ = train_fused(tiny_transformer(**MODEL), data, config, "adamw")
        finally:
            HostOptimizer.call_hook, HostOptimizer.clipped = real, saved
        return state, list(hooks)
    state, made = run("hit", False)
    forced, always = run("hit", True)
    assert always == [OverlapStep.__name__] * len(data)
    # The first call speculates; from the third on (issued after the first committed)
    # every step is whole.
    assert made[0] == OverlapStep.__name__, made
    assert made[2:] == [WholeStep.__name__] * (len(data) - 2), made
    assert state.keys() == forced.keys()
    differ = [k for k in state if not torch.equal(state[k], forced[k])]
    assert not differ, differ
    _, made = run("miss", False)
    assert made == [OverlapStep.__name__] * len(data)
    # The last step's norm decides, either way: above the limit whole, below it per stage.
    config = emulated(2, 2, optimizer_mode="overlap", clip_grad_norm=1.0)
    with rotapipe.RoundPipe(tiny_transformer(**MODEL), lm_loss, config=config,
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        HostOptimizer.call_hook = hook
        try:
            for norm, want in ((2.0, WholeStep), (0.5, OverlapStep), (3.0, WholeStep)):
                pipe.flush()
                pipe._host_opt.last_norm = norm
                hooks.clear()
                pipe.train_step(*token_batch(8, 6, seed=7))
                assert hooks == [want.__name__], (norm, hooks)
        finally:
            HostOptimizer.call_hook = real


def test_overlap_is_bitwise_sync():
    data = step_batches((8, 12))
    for clip in ("hit", "miss"):
        sync = train_pipe(tiny_transformer(**MODEL), None,
                          emulated(2, 3, clip_grad_norm=CLIP[clip]), "adamw", data=data)
        _, _, state, _, _ = train_fused(
            tiny_transformer(**MODEL), data,
            emulated(2, 3, optimizer_mode="overlap", clip_grad_norm=CLIP[clip]), "adamw")
        differ = [k for k in state if not torch.equal(state[k], sync.state[k])]
        assert not differ, f"clip {clip}: {differ}"


@pytest.mark.parametrize("clip", ["off", "hit"])
def test_sync_clipping_matches_clip_grad_norm(clip):
    sizes = (8, 12)
    want = train_reference(tiny_transformer(**MODEL), sizes, 3, "adamw", clip=CLIP[clip])
    got = train_pipe(tiny_transformer(**MODEL), sizes,
                     emulated(2, 3, clip_grad_norm=CLIP[clip]), "adamw")
    assert_close_trained(got, want)
    # train_step in sync is forward_backward then step.
    _, _, state, _, _ = train_fused(tiny_transformer(**MODEL), step_batches(sizes),
                                    emulated(2, 3, clip_grad_norm=CLIP[clip]), "adamw")
    assert all(torch.equal(state[k], got.state[k]) for k in state)


class WaitingTrigger(Trigger):
    """Fires only after ``ready`` is set (deeper stages have been stepped)."""

    def __init__(self):
        super().__init__()
        self.ready = threading.Event()

    def fire(self):
        assert self.ready.wait(10.0), "deeper stages were never stepped"
        super().fire()


@pytest.mark.parametrize("clip", ["off", "miss"])
def test_overlap_failure_after_deeper_steps_changes_nothing(clip):
    M = 3
    trigger = WaitingTrigger()
    model = faulty_model(trigger, tied=True)
    ref = copy.deepcopy(model)
    batches = [token_batch(6, 5, seed=s) for s in range(3)]
    config = emulated(2, M, optimizer_mode="overlap", clip_grad_norm=CLIP[clip])
    with rotapipe.RoundPipe(model, lm_loss, config=config) as pipe:
        opt = OPTIMIZERS["adamw"](pipe.parameters())
        ref_opt = OPTIMIZERS["adamw"](ref.parameters())
        pipe.attach_optimizer(opt)
        stepped = []
        # The tail and every backward stage deeper than layer 1's are stepped before
        # layer 1's backward fails (whatever plan the planner picked).
        deeper = 1 + sum(1 for st in pipe.plan.backward if st.start > 1)
        assert deeper >= 2, pipe.plan.to_text()

        def cost(pids):
            stepped.append(pids)
            if len(stepped) >= deeper:
                trigger.ready.set()
        pipe._optimizer_cost = cost

        def ref_step():
            if CLIP[clip] is not None:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP[clip])
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)

        # A step (optimizer state exists), then a call whose gradients accumulate.
        pipe.train_step(*batches[0])
        reference_forward_backward(ref, *batches[0], M, call=0)
        ref_step()
        pipe.forward_backward(*batches[1])
        reference_forward_backward(ref, *batches[1], M, call=1)
        before = snapshot(pipe, opt)

        stepped.clear()
        trigger.ready.clear()      # set by the steps of the first train_step
        trigger.arm(1, M - 1, pipe.calls, "backward")
        with pytest.raises(rotapipe.WorkerError) as failed:
            # The loss is known before the backward fails: train_step returns it and
            # the failure surfaces at the next call or flush, naming the call's fate.
            pipe.train_step(*batches[2])
            pipe.flush()
        trigger.disarm()
        assert failed.value.calls_discarded == [2] and failed.value.calls_committed == 2
        assert "call 2: discarded (train_step already returned its loss)" in str(failed.value)
        assert trigger.fired_at is not None and len(stepped) >= deeper, stepped
        assert_same_state(before, snapshot(pipe, opt))

        pipe.train_step(*batches[2])
        reference_forward_backward(ref, *batches[2], M, call=2)
        for q in ref.parameters():          # mean over both calls (equal sizes)
            if q.grad is not None:
                q.grad.mul_(0.5)
        ref_step()
        ours = dict(pipe.named_parameters())
        for name, q in ref.named_parameters():
            torch.testing.assert_close(ours[name].detach(), q.detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("clip", ["off", "hit"])
def test_stale_matches_one_step_delayed_reference(clip):
    """w_{t+1} = opt(w_t, g_t) with g_t = grad L_t(w_{t-1}) (w_{-1} = w_0); the last
    pending step is applied by state_dict(). Call 2 fails once on the way."""
    M, steps = 3, 4
    trigger = Trigger()
    model = faulty_model(trigger, tied=True, dropout=0.1)
    ref, shadow = copy.deepcopy(model), copy.deepcopy(model)
    batches = [token_batch(8, 6, seed=10 + s) for s in range(steps)]
    config = emulated(2, M, optimizer_mode="stale", clip_grad_norm=CLIP[clip])
    with rotapipe.RoundPipe(model, lm_loss, config=config,
                            optimizer=OPTIMIZERS["adamw"]) as pipe:
        losses, t, fired = [], 0, False
        while t < steps:
            x, y = batches[t]
            if t == 2 and not fired:
                trigger.arm(3, 1, pipe.calls, "backward")
                with pytest.raises(rotapipe.WorkerError) as failed:
                    pipe.train_step(x, y)     # returns its loss: the backward drains
                    pipe.flush()
                trigger.disarm()
                fired = True
                # The failed call and any call still in flight that had not committed
                # (call 1, if its last hand-off had not run) are dropped: run them again.
                t = failed.value.calls_committed
                assert t in (1, 2) and failed.value.calls_discarded == list(range(t, 3))
                del losses[t:]
                continue
            losses.append(pipe.train_step(x, y))
            t += 1
        state = {k: v.clone() for k, v in pipe.state_dict().items()}

    opt = OPTIMIZERS["adamw"](ref.parameters())

    def apply(grads):
        for name, q in ref.named_parameters():
            q.grad = grads.get(name)
        if CLIP[clip] is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP[clip])
        opt.step()
        opt.zero_grad(set_to_none=True)

    runs_on = {k: v.clone() for k, v in ref.state_dict().items()}      # w_{-1} = w_0
    pending, want = None, []
    for t, (x, y) in enumerate(batches):
        shadow.load_state_dict(runs_on)
        shadow.zero_grad(set_to_none=True)
        want.append(reference_forward_backward(shadow, x, y, M, call=t))
        if pending is not None:
            apply(pending)                                            # w_t
        runs_on = {k: v.clone() for k, v in ref.state_dict().items()}
        pending = {n: q.grad.clone() for n, q in shadow.named_parameters()
                   if q.grad is not None}
    apply(pending)
    torch.testing.assert_close(tuple(losses), tuple(want), rtol=RTOL, atol=ATOL)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, k=k: f"{k}: {m}")


def test_config_is_validated():
    for bad in ({"optimizer_mode": "async"}, {"clip_grad_norm": 0}, {"clip_grad_norm": -1.0},
                {"clip_grad_norm": float("nan")}, {"clip_grad_norm": True}):
        with pytest.raises(rotapipe.ConfigError):
            rotapipe.PipeConfig(**bad)
    assert rotapipe.PipeConfig(optimizer_mode="overlap").optimizer_mode is \
        rotapipe.OptimizerMode.OVERLAP
    with rotapipe.RoundPipe(tiny_transformer(), lm_loss, config=emulated(1, 2)) as pipe:
        with pytest.raises(rotapipe.ConfigError, match="no optimizer"):
            pipe.train_step(*token_batch(4, 5))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_overlap_is_bitwise_sync_in_mixed_precision(dtype):
    """Compute copies written back per stage; fp16 starts at a loss scale that
    overflows, so overlap must undo its speculative steps and skip like sync."""
    precision = rotapipe.PrecisionConfig(compute_dtype=dtype, init_scale=2.0 ** 17,
                                         growth_interval=1000)
    results = {}
    for mode in ("sync", "overlap"):
        with rotapipe.RoundPipe(tiny_transformer(tied=True), lm_loss,
                                config=emulated(2, 3, optimizer_mode=mode, precision=precision,
                                                clip_grad_norm=CLIP["hit"]),
                                optimizer=OPTIMIZERS["adamw"]) as pipe:
            scales = []
            for s in range(6):
                pipe.train_step(*token_batch(8, 6, seed=s))
                scales.append(pipe.scaler.scale)
            results[mode] = (scales, {k: v.clone() for k, v in pipe.state_dict().items()},
                             [c.clone() for c in pipe.host.compute])
    (s0, st0, c0), (s1, st1, c1) = results["sync"], results["overlap"]
    assert s0 == s1
    if dtype == "fp16":
        assert s0[0] < 2.0 ** 17 and len(set(s0)) > 1, s0   # skipped, then stepped
    assert all(torch.equal(st0[k], st1[k]) for k in st0)
    assert all(torch.equal(a, b) for a, b in zip(c0, c1))
