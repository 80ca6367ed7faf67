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

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch

from ..config import PipeConfig
from ..errors import ConfigError, InputError
from ..model import LayerSet, Lookups
from ..plan import Plan, StageKind
from ..schedule import ActionKind as K, Schedule, roundpipe_schedule, validate
from ..schedule.actions import stage_map
from ..schedule.memory import format_bytes
from ..schedule.routes import Routes
from .backend import Device
from .executor import Executor
from .host import CallGrads, HostState
from .kernels import ActionRunner, CallContext, CallState
from .pinning import HostPinning
from .pool import BlockPool
from .store import Store
from . import trees

__all__ = ["Call", "CallRunner", "CallStream", "StepResult", "split_batch",
           "check_stage_budget", "timeline"]


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
        units = [_units(loss_weight(y), m) for m, y in enumerate(lbs)]
    return mbs, lbs, units


def _units(value, microbatch: int) -> float:
    """A number ``loss_weight`` returned (a Python number or a one-element tensor)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and \
            not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"loss_weight returned {_shown(value)} for microbatch "
                         f"{microbatch}: return the number of items the loss averages "
                         "over (an int, a float or a one-element tensor)")
    if not math.isfinite(value):
        raise InputError(f"loss_weight returned {value} for microbatch {microbatch}: "
                         "return a finite number of items")
    return float(value)


def _shown(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{value!r}" if isinstance(value, (str, bool)) else f"a {type(value).__name__}"


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
        reports it). The caller's CPU random state and the device stores are restored."""
        self.begin(0, self.state(schedule, ctx, host_store))
        rng_state = torch.get_rng_state()
        try:
            self.executor.run(schedule, self.runner.run, self.where, self.runner.chunks,
                              gate=self.config.gate_copies)
        finally:
            torch.set_rng_state(rng_state)
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


@dataclass(frozen=True)
class StepResult:
    """What the optimizer step a training call ended did: the learning rate of each
    parameter group, the global gradient norm before clipping (``None`` unless
    clipping is on), and whether it was skipped (overflow under dynamic loss scaling)."""

    lrs: tuple[float, ...]
    grad_norm: float | None
    skipped: bool


class Call:
    """One training call, built from its schedule: the schedule's actions are the
    call's shape (workers, microbatches, stages), nothing else is. ``number`` is the
    pipeline's call counter it runs as (its random streams), ``index`` its place in the
    :class:`CallStream` (its actions' call number). The call changes the pipeline's
    state only at :meth:`commit`: when every gradient of it is in host memory (in the
    last ``O`` action, on the host lane, when calls overlap; otherwise after it)."""

    def __init__(self, number: int, index: int, schedule: Schedule, state: CallState,
                 hook, step: bool, units: float, stages: dict, buffers: Callable[[Store], None],
                 on_host: bool, reduce=None, after_step: Callable[[], StepResult] | None = None):
        self.number, self.index, self.schedule, self.state = number, index, schedule, state
        self.hook, self.step, self.units, self.reduce = hook, step, units, reduce
        self._buffers, self._after_step = buffers, after_step
        self.committed = False
        self.partly: str | None = None
        """Set when the commit failed after changing the state (the hook's
        :attr:`~rotapipe.runtime.stepping.CallHook.changed`: a whole step raising
        part-way): what stays. The failure reports the call as partly stepped."""
        self.result: StepResult | None = None     # of the step it ended
        self.loss: float | None = None
        self.returned = False
        """Whether the caller got the call's loss (``train_step`` returns while the
        call drains): a failure after that must say the call was discarded anyway."""
        tails = [a.key for a in schedule.actions if a.kind is K.DOWNLOAD_GRAD
                 and stages[a.stage].kind is StageKind.TAIL]
        handoffs = [a.key for a in schedule.actions if a.kind is K.OPTIMIZER]
        self.loss_keys = tuple(tails)
        """The actions after which the call's loss is in host memory (empty: the end
        of the call)."""
        self.last_handoff = handoffs[-1] if handoffs and on_host else None
        self.next_store: Callable[[], Store | None] | None = None
        """The host store of the call after this one in the stream, once issued."""

    def rows_first(self, key: str) -> None:
        """An ``OR`` action, before the hand-off ``key`` (host lane): the hook steps
        first the embedding rows the next call of the stream looks up, when that call
        is issued (:meth:`OverlapStep.step_rows`)."""
        step_rows = getattr(self.hook, "step_rows", None)
        if step_rows is not None:
            step_rows(key, self.next_store() if self.next_store is not None else None)

    def handoff(self, key: str) -> None:
        """After an ``O`` action added its gradients (host lane)."""
        self.hook.handoff(key)
        if key == self.last_handoff:
            self.commit()

    def commit(self) -> None:
        if self.committed:
            return
        if self.reduce is not None:
            self.reduce.finish()        # the reduced gradients are in place
        try:
            self.hook.commit()
        except BaseException:
            # Past the merge (a whole step raising part-way) the call has changed the
            # state and nothing can undo it: its forward's buffer updates stay with it.
            self.partly = getattr(self.hook, "changed", None)    # CallHook's, if one
            if self.partly is not None:
                self._buffers(self.state.host_store)
                self._buffers = self._after_step = None
            raise
        self._buffers(self.state.host_store)
        # Committed from here: a failing scheduler (after_step) leaves the step applied,
        # and the failure reports this call as kept.
        self.committed = True
        after, self._buffers, self._after_step = self._after_step, None, None
        if self.step and after is not None:
            self.result = after()

    def read_loss(self) -> float:
        self.loss = float(sum(self.losses()))
        return self.loss

    def losses(self) -> list[float]:
        """Each microbatch's weighted share of the loss (in host memory)."""
        store = self.state.host_store
        return [store.get(("loss", m)).item() for m in range(self.schedule.microbatches)]


class CallStream:
    """Training calls on one executor session. The caller bounds how many are in flight
    (:meth:`reap`): with two, the next call's actions start on the workers the draining
    call frees (the asynchronous optimizer modes); with one (:meth:`drain` after each)
    every call completes before the next.

    A failure aborts every call in flight. Calls that committed keep their effect; the
    others are undone (:meth:`CallHook.abort`) and reported in the exception, which
    carries ``calls_committed`` (the pipeline's call count after it: the step boundary
    the state is at) and ``calls_discarded`` (the numbers of the calls dropped). A call
    whose commit failed after changing the state (its whole step raising part-way,
    :attr:`Call.partly`) can be neither: it counts in ``calls_committed`` and is listed
    in ``calls_partly_stepped``, and the state is at no step boundary."""

    def __init__(self, runner: CallRunner):
        self.runner = runner
        self.session = None
        self.inflight: list[Call] = []
        self.index = 0              # the next call's index in the session
        self.step_ends: list[int] = []
        self.steps = 0              # calls that ended a step
        self.committed = 0          # the pipeline's committed calls, in total
        self.last_spans: list = []  # the spans of the last call reaped
        self.results: dict[int, StepResult | None] = {}   # call number -> Call.result
        self.history: deque[tuple[Schedule, list]] = deque(maxlen=64)
        """``(schedule, spans)`` of the last calls completed, oldest first."""
        self.host_seconds: Counter[str] = Counter()
        """Seconds the caller's thread spent per phase of the calls, in total
        (:meth:`rotapipe.RoundPipe.host_seconds`)."""

    @property
    def next_number(self) -> int:
        return self.committed + len(self.inflight)

    def submit(self, call: Call) -> None:
        r = self.runner
        if self.session is None:
            self.session = r.executor.open(r.runner.run, r.where, r.runner.chunks,
                                           gate=r.config.gate_copies)
        r.begin(call.index, call.state)
        self.inflight.append(call)
        self.index += 1
        if call.step:
            self.step_ends.append(call.index)
            self.steps += 1
        self.session.submit(call.schedule)

    def wait_loss(self, call: Call) -> float:
        """Block until ``call``'s loss is in host memory and return it."""
        t = time.perf_counter()
        if call.loss_keys:
            self._guarded(lambda: self.session.wait_keys(call.loss_keys))
        else:
            self._guarded(lambda: self.session.wait_call(call.index))
        self.host_seconds["wait for the loss"] += time.perf_counter() - t
        return call.read_loss()

    def reject(self, call: Call, exc: BaseException) -> NoReturn:
        """Fail ``call`` (the newest in flight) with ``exc`` once the calls before it
        completed: it is undone unless it already committed, and ``exc`` reports its
        fate (:meth:`_fail`)."""
        assert self.inflight and self.inflight[-1] is call
        self.reap(1)
        call.loss = None            # read, but never returned to the caller
        self._fail(exc)
        raise exc

    def reap(self, keep: int) -> list[Call]:
        """Complete the oldest calls until at most ``keep`` are in flight (committing
        those that commit after the call); return them."""
        done = []
        while len(self.inflight) > keep:
            c = self.inflight[0]
            t0 = time.perf_counter()
            self._guarded(lambda: self.session.wait_call(c.index))
            t1 = time.perf_counter()
            if not c.committed:
                self._guarded(c.commit)
            self.host_seconds["wait for the rest of the call"] += t1 - t0
            self.host_seconds["check, merge and step"] += time.perf_counter() - t1
            self.committed += 1
            self.inflight.pop(0)
            self.last_spans = [s for s in self.session.spans if s[0].call == c.index]
            self.history.append((c.schedule, self.last_spans))
            self.results[c.number] = c.result
            self.results.pop(c.number - 64, None)
            self.runner.end(c.index)
            # The call's context points back at it (ctx.handoff): break the cycle so
            # the call's host store (activation checkpoints, input gradients) is freed
            # when the caller drops the call, not at some later garbage collection.
            c.state.ctx.handoff = c.state.ctx.rows_first = c.next_store = None
            done.append(c)
        return done

    def drain(self) -> list[Call]:
        """Complete every call in flight and close the session (the next call starts a
        fresh round-robin)."""
        done = self.reap(0)
        if self.session is not None:
            self.session.close()
        self._reset()
        return done

    def _reset(self) -> None:
        # ``steps`` goes on: it picks the compute copies a call uploads (stale keeps two
        # sets, which differ until the optimizer flushes).
        self.session = None
        self.index, self.step_ends = 0, []

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        """Abort the session, keep what committed, undo the rest (newest first)."""
        session = self.session
        if session is not None and session.failure is None:
            session.kill()
        kept = [c for c in self.inflight if c.committed]
        partly = [c for c in self.inflight if not c.committed and c.partly is not None]
        dropped = [c for c in self.inflight if not c.committed and c.partly is None]
        for c in reversed(dropped):
            c.hook.abort()
        for c in partly:
            c.hook.keep_changes()      # the workers have stopped: nothing reads the copies
        for c in self.inflight:
            self.runner.end(c.index)
        for c in kept:
            self.results[c.number] = c.result
        self.committed += len(kept) + len(partly)
        self.inflight = []
        # The next call uploads the compute copies it would have (stale keeps two
        # sets), as if the discarded calls had never run.
        self.steps -= sum(1 for c in dropped if c.step)
        self._reset()
        if kept or partly or dropped:
            note = "calls in flight when it failed: " + self._fates(kept, partly, dropped)
            if exc.args and isinstance(exc.args[0], str):
                exc.args = (exc.args[0] + "\n\n" + note,) + exc.args[1:]
            elif partly and hasattr(exc, "add_note"):      # e.g. KeyboardInterrupt()
                exc.add_note(note)
        exc.calls_committed = self.committed
        exc.calls_discarded = [c.number for c in dropped]
        exc.calls_partly_stepped = [c.number for c in partly]

    def _fates(self, kept: list[Call], partly: list[Call], dropped: list[Call]) -> str:
        """The failure's report of every call in flight, and what to do."""
        order = sorted(kept + partly + dropped, key=lambda c: c.number)
        fates = "; ".join(
            f"call {c.number}: completed, its update is kept" if c.committed else
            f"call {c.number}: partly stepped ({c.partly})" if c.partly is not None else
            f"call {c.number}: discarded" + (" (train_step already returned its loss)"
                                             if c.returned else "")
            for c in order)
        if partly:
            return (fates + f". The state is at no step boundary (pipe.calls = "
                    f"{self.committed} counts call {partly[0].number}): restore a "
                    "checkpoint (pipe.load_state_dict and the optimizer's "
                    "load_state_dict, or resume the training job) and run the batches "
                    "since it again.")
        state = f"that after call {self.committed - 1}" if self.committed else \
            "the one before the first call"
        return (fates + f". The state is {state} (pipe.calls = {self.committed}): run "
                "the discarded calls' batches again.")


def timeline(history: Sequence[tuple[Schedule, list]]):
    """Calls' actions as one :class:`rotapipe.sim.Timeline` (ms from the first action;
    a chunked copy has a span per chunk), or ``None`` without calls."""
    from ..schedule.timeline import RESOURCE, Span, Timeline
    spans = [s for _, sp in history for s in sp]
    if not spans:
        return None
    first = history[0][0]
    actions = tuple(a for sched, _ in history for a in sched.actions)
    schedule = first if len(history) == 1 else \
        Schedule(first.plan, first.workers, first.microbatches, actions, first.name)
    t0 = min(s for _, s, _ in spans)
    out = tuple(Span(a, RESOURCE[a.lane], (s - t0) * 1e3, (e - t0) * 1e3)
                for a, s, e in sorted(spans, key=lambda x: x[1]))
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    for sp in out:
        k = sp.action.key
        start[k] = min(start.get(k, sp.start), sp.start)
        end[k] = max(end.get(k, sp.end), sp.end)
    return Timeline(schedule, out, start, end)
