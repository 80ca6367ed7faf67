"""The lean host layout: ``overlap`` with ``PipeConfig(undo_steps=False)``.

- Exact: losses, the gradients the optimizer sees and the weights equal plain PyTorch
  element by element (AdamW and SGD, 1-3 workers, 2-4 microbatches, accumulation,
  clipping off / hit / miss).
- Gradients die as their stage is stepped: without accumulation the fp32 weight
  gradients alive on the host at any moment (downloaded, staged or being stepped) stay
  within ``prefetch + 2`` backward stages' worth; with clipping the whole model's are
  kept once (the exact step waits for the global norm), never twice.
- No snapshot is taken, so a call that fails after some stages stepped leaves the
  pipeline refusing further training with an error that says why and what to do.
"""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch

import rotapipe
from models import emulated, tiny_transformer, token_batch
from rotapipe.runtime.kernels import ActionRunner
from rotapipe.runtime.stepping import Snapshot
from rotapipe.runtime.store import Store
from rotapipe.schedule.roundpipe import grad_window
from test_exactness import OPTIMIZERS, RTOL, ATOL, step_batches, train_reference
from test_faults import faulty_model
from test_optimizer_modes import CLIP, MODEL, WaitingTrigger, train_fused

CASES = [   # workers, microbatches, optimizer, clip, batch sizes of a step's calls
    (1, 2, "adamw", "off", (8,)),
    (2, 3, "adamw", "hit", (8, 12)),
    (3, 4, "adamw", "miss", (8,)),
    (2, 4, "sgd", "off", (8, 12)),
    (3, 2, "sgd", "hit", (8,)),
]


@pytest.mark.parametrize("workers,microbatches,optimizer,clip,sizes", CASES)
def test_lean_overlap_matches_plain_pytorch(workers, microbatches, optimizer, clip, sizes):
    data = step_batches(sizes)
    want = train_reference(tiny_transformer(**MODEL), sizes, microbatches, optimizer,
                           data=data, clip=CLIP[clip])
    config = emulated(workers, microbatches, optimizer_mode="overlap",
                      clip_grad_norm=CLIP[clip], undo_steps=False)
    losses, grads, state, costs, n = train_fused(tiny_transformer(**MODEL), data, config,
                                                 optimizer)
    torch.testing.assert_close(losses, want.losses, rtol=RTOL, atol=ATOL)
    assert grads.keys() == want.grads.keys()
    coef = 1.0
    if CLIP[clip] is not None:
        # The one whole step clips before the optimizer sees the gradients.
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                     for g in want.grads.values()]))
        coef = min(1.0, float(CLIP[clip] / (norm + 1e-6)))
    for k in want.grads:
        torch.testing.assert_close(grads[k], want.grads[k] * coef, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, k=k: f"grad {k}: {m}")
    for k in want.state:
        torch.testing.assert_close(state[k], want.state[k], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, k=k: f"{k}: {m}")
    # Without clipping each stage is stepped as it lands; with clipping one whole step
    # per optimizer step (no speculative step to undo, no redo).
    if CLIP[clip] is None:
        assert len(costs) > 2 * len(data) and sum(costs) == len(data) * n, costs
    else:
        assert costs == [n] * len(data), costs


class GradMeter:
    """Live bytes of fp32 weight gradients on the host: each tensor the workers' weight
    gradients are downloaded into counts from its arrival until it is freed. Also
    checks, after every ``O`` action, that the gradients it handed off are gone."""

    def __init__(self, monkeypatch):
        self.live = self.peak = 0
        self.refs: list[tuple[weakref.ref, str]] = []
        self.handoffs = 0
        self.check = True
        put, optimizer = Store.put, ActionRunner._optimizer
        meter = self

        def counting_put(store, key, value, what=None, extra_bytes=0):
            if store.device is None and isinstance(key, tuple) and key[0] == "wgrad":
                for t in value.values():
                    meter._track(t, key[1])
            return put(store, key, value, what, extra_bytes)

        def checked_optimizer(runner, a):
            mine = [r for r, stage in meter.refs if stage == a.stage and r() is not None]
            optimizer(runner, a)
            left = [r for r in mine if r() is not None]
            assert not (meter.check and left), f"{len(left)} gradients of {a.stage} outlive its step"
            meter.handoffs += 1
        monkeypatch.setattr(Store, "put", counting_put)
        monkeypatch.setattr(ActionRunner, "_optimizer", checked_optimizer)

    def _track(self, t: torch.Tensor, stage: str) -> None:
        n = t.numel() * t.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        self.refs.append((weakref.ref(t), stage))
        weakref.finalize(t, self._free, n)

    def _free(self, n: int) -> None:
        self.live -= n


def _three_lean_steps(workers: int, prefetch: int) -> int:
    """Three ``overlap`` steps without undo of a 12-backward-stage model; its stages."""
    model = tiny_transformer(dim=16, widths=(64,) * 10)
    config = emulated(workers, 2, optimizer_mode="overlap", undo_steps=False,
                      prefetch=prefetch, backward_stages=12, forward_stages=4)
    with rotapipe.RoundPipe(model, lambda y, t: torch.nn.functional.cross_entropy(
            y.flatten(0, 1), t.flatten()), config=config,
            optimizer=OPTIMIZERS["adamw"]) as pipe:
        for s in range(3):
            pipe.train_step(*token_batch(4, 6, seed=s))
        pipe.flush()
        return 1 + len(pipe.plan.backward)


@pytest.mark.parametrize("prefetch", [1, 2])
def test_overlap_frees_each_stages_gradients_at_its_step(monkeypatch, prefetch):
    """Every O action leaves no gradient of its stage alive (how many stages' gradients
    wait for the host lane at once is bounded by the gradient window: the next test)."""
    meter = GradMeter(monkeypatch)
    stages = _three_lean_steps(2, prefetch)
    assert meter.handoffs == 3 * stages and meter.peak > 0
    assert meter.live == 0


class StageMeter(GradMeter):
    """:class:`GradMeter` by stage: the most stages with a weight gradient alive on the
    host at one moment (a stage counts from its first gradient's arrival until its
    last one is freed)."""

    def __init__(self, monkeypatch):
        super().__init__(monkeypatch)
        self.alive: dict[str, int] = {}
        self.peak_stages = 0
        self._lock = threading.Lock()

    def _track(self, t: torch.Tensor, stage: str) -> None:
        super()._track(t, stage)
        with self._lock:
            self.alive[stage] = self.alive.get(stage, 0) + 1
            self.peak_stages = max(self.peak_stages, len(self.alive))
        weakref.finalize(t, self._gone, stage)

    def _gone(self, stage: str) -> None:
        with self._lock:
            self.alive[stage] -= 1
            if not self.alive[stage]:
                del self.alive[stage]


@pytest.mark.parametrize("prefetch,workers", [(1, 2), (2, 3)])
def test_a_slow_host_lane_holds_back_gradient_downloads(monkeypatch, prefetch, workers):
    """Without accumulation, ``overlap`` holds fp32 gradients of at most ``prefetch + 2``
    stages (the planner's count, the schedule's gradient window) whatever
    the timing: here every hand-off sleeps, so the host lane lags far behind the
    workers, and the gradient downloads wait for it (roundpipe.grad_window)."""
    meter = StageMeter(monkeypatch)
    handoff = ActionRunner._optimizer

    def slow(runner, a):
        time.sleep(0.03)      # a host optimizer slower than the workers
        handoff(runner, a)
    monkeypatch.setattr(ActionRunner, "_optimizer", slow)
    stages = _three_lean_steps(workers, prefetch)
    assert meter.handoffs == 3 * stages and meter.live == 0
    assert grad_window(prefetch) == prefetch + 2
    assert 2 <= meter.peak_stages <= prefetch + 2, meter.peak_stages


def test_clipping_keeps_one_copy_of_the_gradients(monkeypatch):
    model = tiny_transformer(dim=16, widths=(64,) * 6)
    config = emulated(2, 2, optimizer_mode="overlap", undo_steps=False,
                      clip_grad_norm=0.05, backward_stages=8)
    meter = GradMeter(monkeypatch)
    meter.check = False
    snaps = []
    monkeypatch.setattr(Snapshot, "__init__", lambda *a, **k: snaps.append(1))
    with rotapipe.RoundPipe(model, lambda y, t: torch.nn.functional.cross_entropy(
            y.flatten(0, 1), t.flatten()), config=config,
            optimizer=OPTIMIZERS["adamw"]) as pipe:
        total = 4 * sum(p.numel() for p in pipe.parameters())
        for s in range(2):
            pipe.train_step(*token_batch(4, 6, seed=s))
        pipe.flush()
    assert meter.peak == total and not snaps


def test_lean_failure_refuses_further_calls():
    M = 3
    trigger = WaitingTrigger()
    model = faulty_model(trigger, tied=True)
    batches = [token_batch(6, 5, seed=s) for s in range(3)]
    from models import lm_loss
    config = emulated(2, M, optimizer_mode="overlap", undo_steps=False)
    with rotapipe.RoundPipe(model, lm_loss, config=config) as pipe:
        pipe.attach_optimizer(OPTIMIZERS["adamw"](pipe.parameters()))
        stepped = []
        deeper = 1 + sum(1 for st in pipe.plan.backward if st.start > 1)

        def cost(pids):
            stepped.append(pids)
            if len(stepped) >= deeper:
                trigger.ready.set()
        pipe._optimizer_cost = cost
        pipe.train_step(*batches[0])
        pipe.flush()
        stepped.clear()
        trigger.ready.clear()
        trigger.arm(1, M - 1, pipe.calls, "backward")
        with pytest.raises(rotapipe.WorkerError):
            pipe.train_step(*batches[1])
            pipe.flush()
        trigger.disarm()
        with pytest.raises(rotapipe.errors.CheckpointError, match="partly stepped.*undo_steps"):
            pipe.train_step(*batches[2])


def test_undo_steps_must_be_a_bool():
    with pytest.raises(rotapipe.ConfigError, match="undo_steps"):
        rotapipe.PipeConfig(undo_steps="no")
