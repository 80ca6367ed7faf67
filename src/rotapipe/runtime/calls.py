"""How one pipeline runs a call: schedules, per-call context and host store, the run.

:class:`rotapipe.RoundPipe` is the API (arguments, locking, optimizer, state); a
:class:`CallRunner` is the machinery under it: it builds and caches the schedule of each
call kind, makes the call's :class:`~rotapipe.runtime.callcontext.CallContext` and host
store, and runs a schedule on the workers with the executor (``executor.py``) and the
action bodies (``kernels.py``). Splitting a batch into microbatches and loss weights is
``batch.py``'s; the training calls in flight, ``callstream.py``'s (both importable from
here too). Timed emulation (:class:`rotapipe.runtime.emulation.TimedEmulation`) hooks in
here: the action durations of the current plan, and the modelled host optimizer time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..config import PipeConfig
from ..errors import ConfigError
from ..model import LayerSet, Lookups
from ..plan import Plan
from ..schedule import Schedule, roundpipe_schedule, validate
from ..schedule.actions import stage_map
from ..schedule.memory import format_bytes
from ..schedule.routes import Routes
from .backend import Device
from .batch import split_batch
from .callcontext import CallContext, CallState
from .callstream import Call, CallStream, StepResult, timeline
from .executor import Executor
from .callgrads import CallGrads
from .host import HostState
from .kernels import ActionRunner
from .pinning import HostPinning
from .pool import BlockPool
from .store import Store
from . import trees

__all__ = ["Call", "CallRunner", "CallStream", "StepResult", "split_batch",
           "check_stage_budget", "timeline"]


def check_stage_budget(plan: Plan, layerset: LayerSet, host: HostState,
                       devices: Sequence[Device]) -> None:
    """Fail before any work when one stage's weights alone exceed a worker budget."""
    budgets = [d.budget for d in devices if d.budget is not None]
    if not budgets:
        return
    budget = min(budgets)
    for s in plan.jobs():
        need = sum(host.device_bytes(p) for p in layerset.stage_params(s.layers))
        if need > budget:
            smaller = "use smaller stages (raise forward_stages / backward_stages, lower " \
                "tail_layers) or raise device_memory" if s.stop - s.start > 1 else \
                f"it holds one layer ({s.start}), so no plan can cut it smaller: raise " \
                "device_memory, or lower the layer's weight bytes (a lower-precision " \
                "compute dtype, LoRA or QLoRA)"
            raise ConfigError(
                f"stage {s} needs {format_bytes(need)} for its weights alone, over the "
                f"worker memory budget of {format_bytes(budget)}: {smaller}")


class CallRunner:
    """Runs one pipeline's calls on its workers (see the module docstring)."""

    def __init__(self, layerset: LayerSet, host: HostState, loss_fn, devices: list[Device],
                 config: PipeConfig, plan: Plan, *, side_inputs, tail_context,
                 pinning: HostPinning | None = None, lookups: Lookups | None = None):
        self.ls, self.host, self.devices, self.config = layerset, host, devices, config
        # User inputs, labels and side inputs are staged into page-locked blocks, reused
        # across calls, so that no upload reads pageable memory (None: no staging).
        self._staging = BlockPool(pinning=pinning) if pinning is not None else None
        self.side_inputs, self.tail_context = side_inputs, tail_context
        self.check = config.check_races and devices[0].torch_device.type == "cpu"
        self.shells = [layerset.make_shells() for _ in devices]
        self.chunk_bytes = max(1, int(config.copy_chunk_mb * 2**20))
        pinning = getattr(host, "pinning", None)
        self.runner = ActionRunner(
            layerset, host, loss_fn, devices, self.shells, _stages(plan),
            chunk_bytes=self.chunk_bytes,
            pinned=getattr(host, "is_pinned", lambda pid: True),
            pinned_empty=None if pinning is None else
            (lambda n: pinning.empty((n,), torch.uint8)))
        self.lookups = self.runner.lookups = lookups
        if config.emulation is not None:
            layers = config.emulation.costs.layers
            self.runner.copies.layer_bytes = [l.weight_bytes for l in layers]
            self.runner.copies.trained_bytes = [
                l.weight_bytes if l.grad_bytes is None else l.grad_bytes for l in layers]
        self.executor = Executor(devices, config.timeout_s)
        self._plan = plan
        self.schedules: dict[tuple[bool, int], Schedule] = {}
        self._timed: tuple[Plan, dict] | None = None

    @property
    def stages(self):
        """Stage name -> :class:`~rotapipe.plan.Stage` of the current plan."""
        return self.runner.stages

    def use_plan(self, plan: Plan) -> None:
        """Run later calls with ``plan`` (the cached schedules are dropped)."""
        self.schedules = {}
        self._plan = plan
        # A new dict (not mutated): a pending stale step keeps the stages it started with.
        self.runner.stages = _stages(plan)

    def schedule(self, plan: Plan, training: bool, microbatches: int) -> Schedule:
        """The (cached) RoundPipe schedule of a call kind, or the one set by
        ``schedules[(training, microbatches)]``."""
        key = (training, microbatches)
        if key not in self.schedules:
            s = roundpipe_schedule(plan, len(self.devices), microbatches,
                                   side_inputs=self.side_inputs is not None,
                                   buffer_layers={l: self.ls.layer_buffers[l]
                                                  for l in self.ls.buffer_layers()},
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
        if self.lookups:
            # The rows each embedding table moves by (checked here, in the caller's
            # thread: an index outside a table is the caller's error).
            for pid, rows in self.lookups.call_rows(mbs).items():
                store.put(("rows", pid), self._stage(rows))
        side = self.side_inputs
        if side is not None and hasattr(side, "for_batch"):
            side = side.for_batch(mbs)      # side inputs that depend on the whole batch
        for m, x in enumerate(mbs):
            store.put(("act", 0, m), self._stage(x))
            if lbs is not None:
                store.put(("labels", m), self._stage(lbs[m]))
            if side is not None:
                store.put(("side", m), self._stage(side(x)))
        return store

    def _stage(self, tree):
        """``tree`` with every CPU tensor leaf copied into a page-locked block. Pinned
        ones too: a pipelined call returns before its backward re-reads its inputs, and
        a loader may refill its pinned buffer by then (the caller owns it again)."""
        pool = self._staging
        if pool is None:
            return tree

        def stage(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != "cpu":
                return t
            return pool.empty(t.shape, t.dtype).copy_(t)
        with torch.no_grad():
            return trees.map_tensors(stage, tree)

    def state(self, schedule: Schedule, ctx: CallContext, host_store: Store,
              view: int = 0) -> CallState:
        """The data of a call running ``schedule`` (its actions), uploading the compute
        copies of ``host.views[view]``."""
        stores = [Store(f"worker {d.index}", d, self.check) for d in self.devices]
        return CallState(ctx, host_store, stores, Routes.of(schedule, self.runner.stages),
                         self.host.views[view])

    def begin(self, call: int, state: CallState) -> None:
        """Make ``state`` the data of the actions numbered ``call``."""
        runner = self.runner
        if not runner.states:
            runner.timing = self._timing(self._plan)
            for shells in self.shells:
                self.ls.set_training(shells)
        runner.states[call] = state

    def layers_changed(self) -> bool:
        """Whether a layer's train/eval flag or attributes changed since the workers'
        copies took them (at the last call that began with none in flight):
        ``model.eval()``, ``dropout.p = 0.2`` or a hook on the user's own model between
        overlapping calls. The next call must then wait for the calls in flight, or it
        would run as they do. Every worker's copies took the same: one set is read."""
        return any(shell.stale() for shell in self.shells[0])

    def host_store_of(self, call: int) -> Store | None:
        """The host store of the running call numbered ``call`` (``None``: none)."""
        state = self.runner.states.get(call)
        return None if state is None else state.host_store

    def end(self, call: int) -> None:
        """Forget a finished (or abandoned) call's data; free what its stores hold."""
        state = self.runner.states.pop(call, None)
        if state is not None:
            for store in state.stores:
                store.clear()

    def run(self, schedule: Schedule, ctx: CallContext, host_store: Store) -> None:
        """Run ``schedule`` on the workers; raise the first failure (as the executor
        reports it); the device stores are cleared. The process's CPU generator is left
        alone: workers draw from streams of their own, and restoring it here rewound the
        draws another thread of the caller's made meanwhile."""
        self.begin(0, self.state(schedule, ctx, host_store))
        try:
            self.executor.run(schedule, self.runner.run, self.where, self.runner.chunks,
                              gate=self.config.gate_copies)
        finally:
            self.end(0)

    def where(self, action) -> str:
        """The stage an action ran, with its layers (for error messages)."""
        s = self.runner.stages.get(action.stage)
        if s is None:
            return action.stage
        layers = f"layer {s.start}" if s.stop - s.start == 1 else \
            f"layers {s.start}-{s.stop - 1}"
        return f"{s.name} ({layers})"

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
        # A parameter's step is charged as its layer's. In a layer holding an embedding
        # table moved by rows, the modelled layer is the table: its other parameters (a
        # stand-in's position embedding) cost nothing, so that stepping them apart from
        # the table (an OR) does not charge the layer twice.
        tables = set(self.lookups.ids) if self.lookups else set()
        owner: dict[int, int] = {}
        for l, pids in enumerate(self.ls.layer_params):
            has_table = bool(tables & set(pids))
            for pid in pids:
                if pid in tables or not has_table:
                    owner.setdefault(pid, l)

        return _EmulatedOptimizer(em, owner)

    def _timing(self, plan: Plan):
        """Timed emulation: the action durations for ``plan`` (``None`` when off)."""
        em = self.config.emulation
        if em is None:
            return None
        if self._timed is None or self._timed[0] != plan:
            self._timed = (plan, em.action_seconds(plan, self.chunk_bytes))
        return self._timed[1]


class _EmulatedOptimizer:
    """Timed emulation's host optimizer time: called with the parameters a step just
    stepped (``rows``: the rows the next call looks up, an ``OR``), it sleeps the
    modelled time of their layers."""

    def __init__(self, em, owner: dict[int, int]):
        self.em, self.owner = em, owner

    def __call__(self, pids, rows: bool = False) -> None:
        time.sleep(self.em.optimizer_seconds({self.owner[p] for p in pids
                                              if p in self.owner}, rows))

    def rows_first_pays(self) -> bool:
        """Whether stepping a call's rows first is cheaper than the whole table, for
        the emulated model (its rows and table, not the stand-in's)."""
        return self.em.rows_first_pays()


def _stages(plan: Plan) -> dict:
    return stage_map(plan)
