"""How one pipeline runs a call: batch splitting, schedules, per-call context, the run.

:class:`rotapipe.RoundPipe` is the API (arguments, locking, optimizer, state); a
:class:`CallRunner` is the machinery under it: it splits a batch into microbatches and
loss weights, builds and caches the schedule of each call kind, makes the call's
:class:`~rotapipe.runtime.kernels.CallContext` and host store, and runs a schedule on
the workers with the executor (``executor.py``) and the action bodies (``kernels.py``).
Timed emulation (:class:`rotapipe.runtime.emulation.TimedEmulation`) hooks in here: the action
durations of the current plan, and the modelled host optimizer time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..config import PipeConfig
from ..errors import ConfigError, InputError
from ..model import LayerSet
from ..plan import Plan
from ..schedule import Schedule, roundpipe_schedule, validate
from ..schedule.actions import stage_map
from .backend import Device
from .executor import Executor
from .host import CallGrads, HostState
from .kernels import ActionRunner, CallContext
from .pinning import HostPinning
from .pool import BlockPool
from .store import Store
from . import trees

__all__ = ["CallRunner", "split_batch", "check_stage_budget"]


def split_batch(inputs, labels, microbatches: int, dtype: torch.dtype,
                loss_weight: Callable[[object], float] | None):
    """``(input microbatches, label microbatches, loss units)`` of a training batch:
    split along dim 0, floating inputs cast to the compute dtype; a microbatch's units
    are ``loss_weight(labels)`` (default: its sample count). Raises :class:`InputError`
    naming the fix for mismatched or too small batches."""
    n = trees.batch_size(inputs, "inputs")
    n_labels = trees.batch_size(labels, "labels")
    if n != n_labels:
        raise InputError(f"inputs hold {n} samples but labels hold {n_labels}: pass "
                         "one label row per input row")
    if n < microbatches:
        raise InputError(f"the batch has {n} samples but config.microbatches={microbatches}"
                         f": pass at least {microbatches} samples or lower microbatches")
    mbs = trees.split(trees.cast_floating(inputs, dtype), microbatches)
    lbs = trees.split(labels, microbatches)
    if loss_weight is None:
        units = [float(trees.batch_size(x, "inputs")) for x in mbs]
    else:
        units = [float(loss_weight(y)) for y in lbs]
    return mbs, lbs, units


def check_stage_budget(plan: Plan, layerset: LayerSet, host: HostState,
                       devices: Sequence[Device]) -> None:
    """Fail before any work when one stage's weights alone exceed a worker budget."""
    budgets = [d.budget for d in devices if d.budget is not None]
    if not budgets:
        return
    budget = min(budgets)
    for s in plan.jobs():
        need = sum(host.compute[p].numel() * host.compute[p].element_size()
                   for p in layerset.stage_params(s.layers))
        if need > budget:
            raise ConfigError(
                f"stage {s} needs {need / 2**20:.2f} MiB for its weights alone, over the "
                f"worker memory budget of {budget / 2**20:.2f} MiB: use smaller stages "
                "(raise forward_stages / backward_stages, lower tail_layers) or raise "
                "device_memory")


class CallRunner:
    """Runs one pipeline's calls on its workers (see the module docstring)."""

    def __init__(self, layerset: LayerSet, host: HostState, loss_fn, devices: list[Device],
                 config: PipeConfig, plan: Plan, *, side_inputs, tail_context,
                 pinning: HostPinning | None = None):
        self.ls, self.host, self.devices, self.config = layerset, host, devices, config
        # User inputs, labels and side inputs are staged into page-locked blocks, reused
        # across calls, so that no upload reads pageable memory (None: no staging).
        self._staging = BlockPool(pinning=pinning) if pinning is not None else None
        self.side_inputs, self.tail_context = side_inputs, tail_context
        self.check = config.check_races and devices[0].torch_device.type == "cpu"
        self.stores = [Store(f"worker {d.index}", d, self.check) for d in devices]
        self.shells = [layerset.make_shells() for _ in devices]
        self.chunk_bytes = max(1, int(config.copy_chunk_mb * 2**20))
        pinning = getattr(host, "pinning", None)
        self.runner = ActionRunner(
            layerset, host, loss_fn, devices, self.stores, self.shells, _stages(plan),
            chunk_bytes=self.chunk_bytes,
            pinned=getattr(host, "is_pinned", lambda pid: True),
            pinned_empty=None if pinning is None else
            (lambda n: pinning.empty((n,), torch.uint8)))
        if config.emulation is not None:
            self.runner.copies.layer_bytes = [l.weight_bytes
                                              for l in config.emulation.costs.layers]
        self.executor = Executor(devices, config.timeout_s)
        self.schedules: dict[tuple[bool, int], Schedule] = {}
        self.last_schedule: Schedule | None = None
        self._timed: tuple[Plan, dict] | None = None

    @property
    def stages(self):
        """Stage name -> :class:`~rotapipe.plan.Stage` of the current plan."""
        return self.runner.stages

    def use_plan(self, plan: Plan) -> None:
        """Run later calls with ``plan`` (the cached schedules are dropped)."""
        self.schedules = {}
        # A new dict (not mutated): a pending stale step keeps the stages it started with.
        self.runner.stages = _stages(plan)

    def schedule(self, plan: Plan, training: bool, microbatches: int) -> Schedule:
        """The (cached) RoundPipe schedule of a call kind, or the one set by
        ``schedules[(training, microbatches)]``."""
        key = (training, microbatches)
        if key not in self.schedules:
            s = roundpipe_schedule(plan, len(self.devices), microbatches,
                                   side_inputs=self.side_inputs is not None,
                                   buffer_layers=self.ls.buffer_layers(),
                                   tail_barrier=self.tail_context is not None,
                                   training=training, prefetch=self.config.prefetch)
            validate(s)
            self.schedules[key] = s
        return self.schedules[key]

    def context(self, call: int, training: bool, weights: list[float],
                grads: CallGrads | None, microbatches: int, loss_scale: float) -> CallContext:
        """A call's context; autocast is captured from the caller's thread."""
        autocast = [(dt, torch.get_autocast_dtype(dt)) for dt in ("cpu", "cuda")
                    if torch.is_autocast_enabled(dt)]
        return CallContext(call=call, seed=self.config.seed, microbatches=microbatches,
                           weights=weights, loss_scale=loss_scale if training else 1.0,
                           training=training, grain=self.config.grain,
                           has_side=self.side_inputs is not None, autocast=autocast,
                           tail_context=self.tail_context, grads=grads)

    def host_store(self, mbs: list, lbs: list | None = None) -> Store:
        """The call's host store, holding each microbatch's inputs, labels (``lbs``) and
        side inputs, staged in page-locked memory (side inputs are computed from the
        caller's inputs, before staging)."""
        store = Store("host memory", None, self.check)
        for m, x in enumerate(mbs):
            store.put(("act", 0, m), self._stage(x))
            if lbs is not None:
                store.put(("labels", m), self._stage(lbs[m]))
            if self.side_inputs is not None:
                store.put(("side", m), self._stage(self.side_inputs(x)))
        return store

    def _stage(self, tree):
        """``tree`` with every CPU tensor leaf copied into a page-locked block."""
        pool = self._staging
        if pool is None:
            return tree

        def stage(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != "cpu" or pool.pinning.is_pinned(t):
                return t
            return pool.empty(t.shape, t.dtype).copy_(t)
        with torch.no_grad():
            return trees.map_tensors(stage, tree)

    def run(self, schedule: Schedule, ctx: CallContext, host_store: Store) -> None:
        """Run ``schedule`` on the workers; raise the first failure (as the executor
        reports it). The caller's CPU random state and the device stores are restored."""
        runner = self.runner
        runner.ctx, runner.host_store = ctx, host_store
        runner.timing = self._timing(schedule.plan)
        runner.set_schedule(schedule)
        for shells in self.shells:
            self.ls.set_training(shells)
        rng_state = torch.get_rng_state()
        try:
            self.last_schedule = schedule
            self.executor.run(schedule, runner.run, self.where, runner.chunks,
                              gate=self.config.gate_copies)
        finally:
            torch.set_rng_state(rng_state)
            for store in self.stores:
                store.clear()
            runner.ctx = runner.host_store = None

    def where(self, action) -> str:
        """The stage an action ran, with its layers (for error messages)."""
        s = self.runner.stages.get(action.stage)
        if s is None:
            return action.stage
        layers = f"layer {s.start}" if s.stop - s.start == 1 else \
            f"layers {s.start}-{s.stop - 1}"
        return f"{s.name} ({layers})"

    def last_timeline(self):
        """The last call's actions as a :class:`rotapipe.sim.Timeline` (ms from its
        first action), or ``None`` before the first call."""
        from ..schedule.timeline import RESOURCE, Span, Timeline
        spans = list(self.executor.last_spans)
        schedule = self.last_schedule
        if not spans or schedule is None:
            return None
        t0 = min(s for _, s, _ in spans)
        out = tuple(Span(a, RESOURCE[a.lane], (s - t0) * 1e3, (e - t0) * 1e3)
                    for a, s, e in sorted(spans, key=lambda x: x[1]))
        start: dict[str, float] = {}
        end: dict[str, float] = {}
        for sp in out:          # a chunked copy has a span per chunk
            k = sp.action.key
            start[k] = min(start.get(k, sp.start), sp.start)
            end[k] = max(end.get(k, sp.end), sp.end)
        return Timeline(schedule, out, start, end)

    # -- timed emulation ----------------------------------------------------------------
    def optimizer_cost(self) -> Callable[[list[int]], None] | None:
        """Timed emulation: check it against the model and return the hook that makes
        the host optimizer take its modelled time (``None`` when off)."""
        em = self.config.emulation
        if em is None:
            return None
        n = len(self.ls)
        if len(em.costs.layers) != n:
            raise ConfigError(f"the timed emulation describes {len(em.costs.layers)} layers "
                              f"but the model has {n}: build the model with as many "
                              "layers (TimedEmulation.stand_in() does)")
        if any(d.torch_device.type != "cpu" for d in self.devices):
            raise ConfigError("timed emulation needs emulated workers: pass "
                              "backend='emulated' and no CUDA devices")
        owner: dict[int, int] = {}
        for l, pids in enumerate(self.ls.layer_params):
            for pid in pids:
                owner.setdefault(pid, l)

        def cost(pids) -> None:
            time.sleep(em.optimizer_seconds({owner[p] for p in pids}))
        return cost

    def _timing(self, plan: Plan):
        """Timed emulation: the action durations for ``plan`` (``None`` when off)."""
        em = self.config.emulation
        if em is None:
            return None
        if self._timed is None or self._timed[0] != plan:
            self._timed = (plan, em.action_seconds(plan, self.chunk_bytes))
        return self._timed[1]


def _stages(plan: Plan) -> dict:
    return stage_map(plan)
