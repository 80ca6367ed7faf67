"""The host optimizer: its thread, global-norm clipping, undoable steps, overlapped steps.

Three ways to step (``PipeConfig.optimizer``, docs/optimizer.md): ``sync`` steps every
master after the call; ``overlap`` steps each stage's parameters on the optimizer
thread as soon as their gradients are complete (:class:`OverlapStep`); ``stale`` steps
the previous call's gradients in the background while the next call runs
(:func:`step_params`); :class:`HostOptimizer` drives all three for a pipeline.

Stepping a subset of the parameters with the user's optimizer works by giving only
those parameters a ``.grad``: ``torch.optim`` skips parameters whose gradient is
``None``, and optimizers whose state is per parameter (SGD with momentum, Adam, AdamW
and their foreach/fused kernels) then compute exactly what one step over all of them
would. Optimizers that couple parameters (LBFGS, or a global-norm trust ratio inside
``step``) are not exact in ``overlap``.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from ..config import OptimizerMode
from ..schedule import ActionKind as K, Schedule
from .host import CallGrads, HostState, LossScaler

Cost = Callable[[list[int]], None] | None


class HostOptimizer:
    """The optimizer side of a pipeline: its mode, its thread (started on first use),
    and the stale mode's pending step. The optimizer and the cost hook are passed per
    call: the user may attach the optimizer late, timed emulation sets the hook."""

    def __init__(self, host: HostState, scaler: LossScaler, mode: OptimizerMode,
                 max_norm: float | None):
        self.host, self.scaler, self.mode, self.max_norm = host, scaler, mode, max_norm
        self._thread: OptimizerThread | None = None
        self.pending: dict[int, torch.Tensor] | None = None   # stale: the next step
        self.behind = False     # stale: masters stepped, compute copies not yet
        self.last_norm: float | None = None
        """Global gradient norm (before clipping) of the last step taken, when
        clipping is on (``None`` otherwise)."""

    def sync_step(self, optimizer: torch.optim.Optimizer, cost: Cost) -> bool:
        """Step every master on its ``.grad`` now; ``False``: skipped (overflow)."""
        host = self.host
        overflow = self.scaler.dynamic and not host.grads_finite()
        if not overflow:
            params = host.layerset.params
            self.last_norm = clip((params[pid] for pid in host.trainable), self.max_norm)
            optimizer.step()
            host.write_back()
            if cost is not None:
                cost(list(host.trainable))
        self.scaler.update(overflow)
        host.zero_grad()
        return not overflow

    def start_call(self, optimizer, schedule: Schedule, stage_pids: Callable[[str], list[int]],
                   grads: CallGrads, units: float, overlap: bool, cost: Cost,
                   reduce=None):
        """The optimizer work running alongside a training call (``abort()`` if the call
        fails, ``finish()`` if it succeeds): the overlapped step of this call
        (``overlap``; ``reduce``: the call's data-parallel all-reduce), the pending
        stale step, or ``None``."""
        if overlap:
            return OverlapStep(optimizer, self.host, schedule, stage_pids, grads, units,
                               self.max_norm, self.scaler, self._worker(), cost, self,
                               reduce)
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        future = self._worker().submit(step_params, optimizer, self.host,
                                       list(self.host.trainable), pending, self.max_norm,
                                       self.scaler, cost, self)

        def applied():
            self.behind = True

        def restore():
            self.pending = pending
        return StaleStart(future, applied, restore)

    def stash(self) -> None:
        """Stale, after a train_step's call: its gradients become the pending step (run
        by the next call, in the background); the weights the previous pending step
        produced become the ones workers read."""
        params = self.host.layerset.params
        self.pending = {pid: params[pid].grad for pid in self.host.trainable
                        if params[pid].grad is not None}
        self.host.zero_grad()
        self.catch_up()

    def flush(self, optimizer, cost: Cost) -> None:
        """Stale: apply the pending step here and now, then refresh the compute copies."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            try:
                step_params(optimizer, self.host, list(self.host.trainable), pending,
                            self.max_norm, self.scaler, cost, self)
            except BaseException:
                self.pending = pending
                raise
            self.behind = True
        self.catch_up()

    def catch_up(self) -> None:
        if self.behind:
            self.host.write_back()
            self.behind = False

    def _worker(self) -> OptimizerThread:
        if self._thread is None:
            self._thread = OptimizerThread()
        return self._thread

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()
            self._thread = None


class OptimizerThread:
    """One persistent thread that runs optimizer work in submission order, owned by a
    pipeline and joined by :meth:`close`. Work on it never overlaps other work on it,
    so the optimizer is only ever driven by one thread at a time."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rotapipe-optimizer")

    def submit(self, fn: Callable, *args) -> Future:
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def clip(params: Iterable[nn.Parameter], max_norm: float | None) -> float | None:
    """Scale gradients to a global L2 norm of at most ``max_norm`` (``None``: no-op),
    exactly as ``torch.nn.utils.clip_grad_norm_``, which it calls; return the norm
    before clipping (``None`` when off or without gradients)."""
    if max_norm is not None:
        with_grad = [p for p in params if p.grad is not None]
        if with_grad:
            return float(torch.nn.utils.clip_grad_norm_(with_grad, max_norm))
    return None


def step_params(optimizer: torch.optim.Optimizer, host: HostState, pids: list[int],
                grads: dict[int, torch.Tensor], max_norm: float | None,
                scaler: LossScaler, cost: Cost, owner: HostOptimizer | None = None) -> bool:
    """One whole step of the parameters ``pids`` on ``grads`` (the stale step): clip,
    skip on overflow under dynamic loss scaling, step, report the cost. The compute
    copies are left alone (workers may be reading them): the caller writes back. The
    parameters' own ``.grad`` is set aside and put back meanwhile."""
    params = host.layerset.params
    saved = {pid: params[pid].grad for pid in pids}
    try:
        for pid in pids:
            params[pid].grad = grads.get(pid)
        overflow = scaler.dynamic and not all(torch.isfinite(g).all() for g in grads.values())
        if not overflow:
            norm = clip((params[pid] for pid in pids), max_norm)
            if owner is not None:
                owner.last_norm = norm
            optimizer.step()
            if cost is not None:
                cost(pids)
        scaler.update(overflow)
        return not overflow
    finally:
        for pid, g in saved.items():
            params[pid].grad = g


class StaleStart:
    """The pending stale step, running on the optimizer thread during a call. Whether
    the call succeeds or fails, the step completes (the masters move on, the compute
    copies the call reads do not): ``applied`` is called. If the step itself raised,
    ``restore`` puts the gradients back as pending (and :meth:`finish` re-raises)."""

    def __init__(self, future: Future, applied: Callable[[], None],
                 restore: Callable[[], None]):
        self.future, self.applied, self.restore = future, applied, restore

    def _wait(self) -> BaseException | None:
        exc = self.future.exception()
        if exc is None:
            self.applied()
        else:
            self.restore()
        return exc

    def abort(self) -> None:
        self._wait()

    def finish(self) -> bool:
        exc = self._wait()
        if exc is not None:
            raise exc
        return True


class Snapshot:
    """Weights and optimizer state of some parameters, taken before stepping them, so
    that the step can be undone exactly (one copy of each tensor)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                 pids: list[int]):
        self.optimizer, self.pids = optimizer, pids
        self.items = [(p, p.detach().clone(), _copy_state(optimizer.state.get(p)))
                      for p in params]

    def restore(self) -> None:
        with torch.no_grad():
            for p, w, state in self.items:
                p.copy_(w)
                if state is None:
                    self.optimizer.state.pop(p, None)
                else:
                    self.optimizer.state[p] = state


def _copy_state(state: dict | None) -> dict | None:
    if not state:
        return None
    return {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in state.items()}


class OverlapStep:
    """The optimizer side of one ``overlap`` train_step.

    The host lane calls :meth:`handoff` after each O action has added its stage's
    gradients to ``grads``. A parameter is complete once every stage holding it has
    handed off (a tied weight: after its shallowest stage); the complete ones are
    stepped on the optimizer thread while shallower stages still run backward. Each
    step is speculative: a snapshot taken just before it lets :meth:`abort` (the call
    failed) or :meth:`finish` (the global norm needs clipping, or a gradient overflowed
    under dynamic loss scaling) undo it. On success nothing is left in ``param.grad``.

    Data parallel (``reduce``, a :class:`~rotapipe.runtime.allreduce.CallReduce`): a
    hand-off first starts the all-reduce of the parameters it completes; the optimizer
    thread waits for it and steps them on the reduced gradients, which are identical on
    every rank (so are the overflow check, the global norm and the step).

    Write-back of the stepped parameters' compute copies happens right after their
    step: once a backward stage has handed off, no action of this call uploads its
    layers again (forward stages uploaded them before the tail ran, shallower backward
    stages hold other layers, and a tied weight is stepped only after its last stage).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, host: HostState,
                 schedule: Schedule, stage_pids: Callable[[str], list[int]],
                 grads: CallGrads, units: float, max_norm: float | None,
                 scaler: LossScaler, thread: OptimizerThread, cost: Cost,
                 owner: HostOptimizer | None = None, reduce=None):
        self.opt, self.host, self.grads, self.owner = optimizer, host, grads, owner
        self.reduce = reduce
        self.max_norm, self.scaler, self.thread, self.cost = max_norm, scaler, thread, cost
        self.params = host.layerset.params
        trainable = set(host.trainable)
        self.by_key = {a.key: [pid for pid in stage_pids(a.stage) if pid in trainable]
                       for a in schedule.actions if a.kind is K.OPTIMIZER}
        self.left = Counter(pid for pids in self.by_key.values() for pid in pids)
        # Gradients of earlier accumulated calls: merged with this call's as
        # HostState.commit would (``keep``/``new`` weights), never modified in place.
        total = host.samples + units
        self.keep, self.new = host.samples / total, units / total
        self.prev = {pid: self.params[pid].grad for pid in host.trainable}
        for pid in host.trainable:
            self.params[pid].grad = None
        self.final: dict[int, torch.Tensor] = {}     # pid -> gradient the step used
        self.norms: dict[int, torch.Tensor] = {}     # pid -> its L2 norm (clipping)
        self.snapshots: list[Snapshot] = []
        self.futures: list[Future] = []
        self.overflow = False

    # -- during the call (host lane) -----------------------------------------------------
    def handoff(self, key: str) -> None:
        # The reducer's buckets at ``key`` hold exactly the parameters completed here.
        buckets = self.reduce.handoff(key) if self.reduce is not None else []
        done = []
        for pid in self.by_key.get(key, ()):
            self.left[pid] -= 1
            if self.left[pid] == 0:
                done.append(pid)
        if done or buckets:
            self.futures.append(self.thread.submit(self._step, done, buckets))

    # -- on the optimizer thread ---------------------------------------------------------
    def _step(self, pids: list[int], buckets=()) -> None:
        if buckets:
            self.reduce.apply(buckets)      # the reduced gradients replace the staged
        stepped = []
        for pid in pids:
            g = self._merge(pid)
            if g is None:
                continue        # no loss depends on it: torch would skip it too
            self.final[pid] = g
            if self.max_norm is not None:
                self.norms[pid] = torch.linalg.vector_norm(g)
            if self.scaler.dynamic and not torch.isfinite(g).all():
                self.overflow = True
            stepped.append(pid)
        if not stepped or self.overflow:
            return              # finish() skips the whole step
        params = [self.params[pid] for pid in stepped]
        self.snapshots.append(Snapshot(self.opt, params, stepped))
        for pid, p in zip(stepped, params):
            p.grad = self.final[pid]
        try:
            self.opt.step()
        finally:
            for p in params:
                p.grad = None
        self.host.write_back(stepped)
        if self.cost is not None:
            self.cost(stepped)

    def _merge(self, pid: int) -> torch.Tensor | None:
        """This call's gradient merged with the accumulated one, as HostState.commit."""
        g, prev = self.grads.staged.get(pid), self.prev.get(pid)
        if prev is None:
            return None if g is None else (g.mul_(self.new) if self.new != 1.0 else g)
        if g is None:
            return torch.mul(prev, self.keep)
        return torch.mul(prev, self.keep).add_(g, alpha=self.new)

    # -- after the call (caller thread) --------------------------------------------------
    def _wait(self) -> BaseException | None:
        error = None
        for f in self.futures:
            exc = f.exception()
            error = error or exc
        return error

    def finish(self) -> bool:
        """The call succeeded: complete the step. Returns ``False`` when it was skipped
        (overflow under dynamic loss scaling)."""
        error = self._wait()
        if error is not None:
            self._undo()
            raise error
        missing = [pid for pid, n in self.left.items() if n > 0]
        assert not missing, f"parameters {missing} were never handed off"
        if self.owner is not None and self.max_norm is not None and self.norms:
            norms = [self.norms[pid] for pid in self.host.trainable if pid in self.norms]
            self.owner.last_norm = float(torch.linalg.vector_norm(torch.stack(norms)))
        if self.overflow:
            self._undo(grads=False)
        elif self.max_norm is not None and self.norms and self._needs_clipping():
            # The total norm is known only now: undo the speculative steps and redo one
            # whole step on the clipped gradients (exact, not overlapped).
            self._undo(grads=False)
            pids = [pid for pid in self.host.trainable if pid in self.final]
            for pid in pids:
                self.params[pid].grad = self.final[pid]
            clip((self.params[pid] for pid in pids), self.max_norm)
            self.opt.step()
            self.host.write_back(pids)
            if self.cost is not None:
                self.cost(pids)
        for pid in self.host.trainable:
            self.params[pid].grad = None
        self.host.samples = 0.0
        self.scaler.update(self.overflow)
        return not self.overflow

    def _needs_clipping(self) -> bool:
        # torch.nn.utils.clip_grad_norm_'s formula, on the per-parameter norms in
        # parameter order: coef = max_norm / (total + 1e-6), clamped at 1.
        norms = [self.norms[pid] for pid in self.host.trainable if pid in self.norms]
        total = torch.linalg.vector_norm(torch.stack(norms))
        return bool(self.max_norm / (total + 1e-6) < 1.0)

    def abort(self) -> None:
        """The call failed: undo every step and put the accumulated gradients back."""
        self._wait()
        self._undo()

    def _undo(self, grads: bool = True) -> None:
        for snap in reversed(self.snapshots):
            snap.restore()
        self.host.write_back([pid for snap in self.snapshots for pid in snap.pids])
        self.snapshots = []
        if grads:
            for pid, g in self.prev.items():
                self.params[pid].grad = g
