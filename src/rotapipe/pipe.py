"""RoundPipe: the training API (wrap layers, forward_backward, step, evaluate, read back).

    pipe = rotapipe.RoundPipe(layers, loss_fn, config=rotapipe.PipeConfig(microbatches=4))
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, fused=True)
    pipe.attach_optimizer(opt)
    for x, y in data:
        loss = pipe.forward_backward(x, y)
        pipe.step()            # or: loss = pipe.train_step(x, y) (docs/optimizer.md)
"""

from __future__ import annotations

import inspect
import math
import operator
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from ._lifecycle import CallLock, claim, close_devices, reentry
from .config import NonFinite, OptimizerMode, PinMode, PipeConfig, ShardMode
from .errors import (CheckpointError, ConfigError, DistributedError, InputError,
                     NonFiniteError, PipelineClosedError, ScheduleError, WorkerError)
from .model import LayerSet, Lookups
from .planner.pipeline import PipePlanner
from .plan import Plan
from .schedule import Schedule, roundpipe_call, validate
from .schedule.roundpipe import grad_window
from .schedule.validate import check_runnable
from .runtime.allreduce import GradReducer
from .runtime.backend import Device
from .runtime.calls import (Call, CallRunner, CallStream, StepResult, check_stage_budget,
                            split_batch, timeline)
from .runtime.devices import make_devices
from .runtime.dispatchers import on_worker_thread
from .runtime.host import CallGrads, HostState, LossScaler
from .runtime.pinning import HostPinning, resolve_pin
from .runtime.optimizer import HostOptimizer
from .runtime.optstate import StatePrecision
from .runtime.shard import ShardedOptimizer
from .runtime import trees

__all__ = ["RoundPipe"]


class RoundPipe:
    """Trains an ordered list of layers with the RoundPipe schedule.

    Args:
        layers: an ``nn.Sequential`` or a list of modules, on the CPU. Layer 0 receives
            the inputs, every later layer the previous layer's output (any pytree).
        loss_fn: ``loss_fn(output_of_last_layer, labels) -> scalar tensor``, the mean
            loss over the microbatch it is given.
        config: how to split, schedule and run (:class:`PipeConfig`).
        optimizer: a ``torch.optim.Optimizer`` over the layers' parameters (may be
            built before wrapping), or a callable ``params -> Optimizer``. Optional
            here; :meth:`attach_optimizer` sets it later.
        side_inputs: optional ``fn(microbatch_inputs) -> dict`` of tensors every layer
            reads (masks, rotary tables); computed on the host once per microbatch,
            uploaded once per microbatch per worker, passed as ``layer(x, **side)``.
            If it has a ``for_batch(microbatches)`` method, each call uses the function
            that returns instead (side inputs that depend on the whole batch).
        loss_weight: optional ``fn(microbatch_labels) -> number`` of the items
            ``loss_fn`` averages over in that microbatch (e.g. the non-ignored tokens
            of a language-model loss). Default: the microbatch's sample count. Each
            microbatch's loss is weighted by its share of the batch's total, so the
            result is the mean over every item of the batch (and, across accumulated
            calls, over every item since the last step).
        tail_context: optional ``fn(tail_inputs, labels) -> context`` for losses that
            need whole-batch statistics (e.g. an MoE load-balancing loss): called once
            per call with every microbatch's input of the fused tail (host copies) and
            labels; ``loss_fn(output, labels, context)`` then receives it, and may
            return ``(loss, term)``: ``term`` already normalised over the whole batch,
            added once per microbatch unweighted (without a tail context, ``loss_fn``
            returns one scalar tensor). The tail waits until every microbatch's input
            has reached host memory.
        plan: an explicit :class:`rotapipe.plan.Plan`, validated and kept. Default: the
            planner's (``config.partition``; the rule is in :mod:`rotapipe.planner.pipeline`).
        devices: explicit device objects (tests); default from ``config.backend``.
        lookups: optional ``{embedding module: fn(microbatch_inputs) -> index tensor}``:
            a stage that uses an ``nn.Embedding``'s table only through these lookups
            uploads only the rows the call looks up and downloads only their gradients
            (``docs/performance.md``, "Embedding tables by rows"). The wrapped Hugging
            Face models pass their token embedding.
        process_group: the ``torch.distributed`` group to be data parallel over
            (default: the default group, when ``config.data_parallel`` turns it on).
            Each rank passes its own shard of the global batch
            (:func:`rotapipe.distributed.shard_batch`); losses and gradients are the
            global means. Building the pipeline is then a collective: every rank must
            build it, with the same model, plan and precision.
    """

    def __init__(self, layers: nn.Sequential | Sequence[nn.Module],
                 loss_fn: Callable[[object, object], torch.Tensor], *,
                 config: PipeConfig | None = None, optimizer=None,
                 side_inputs: Callable[[object], dict] | None = None,
                 loss_weight: Callable[[object], float] | None = None,
                 tail_context: Callable[[list, list], object] | None = None,
                 plan: Plan | None = None, devices: Sequence[Device] | None = None,
                 process_group=None,
                 lookups: Mapping[nn.Module, Callable[[object], torch.Tensor]] | None = None):
        self.config = config = config or PipeConfig()
        self._optimizer_cost: Callable[[list[int]], None] | None = None
        """Called after every optimizer step of a set of parameters (indices into
        ``layerset.params``), on the thread that stepped them; timed emulation sets it
        to sleep for the modeled host optimizer time."""
        if not callable(loss_fn):
            raise ConfigError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if config is not None and not isinstance(config, PipeConfig):
            raise ConfigError(f"config must be a rotapipe.PipeConfig, got {_kind(config)}: "
                              "build one, e.g. config=rotapipe.PipeConfig(microbatches=4)")
        for name, fn in (("side_inputs", side_inputs), ("loss_weight", loss_weight),
                         ("tail_context", tail_context)):
            if fn is not None and not callable(fn):
                raise ConfigError(f"{name} must be callable (or None), got {_kind(fn)}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) \
                and (not callable(optimizer) or isinstance(optimizer, type)
                     and not issubclass(optimizer, torch.optim.Optimizer)):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer or a callable "
                              f"params -> Optimizer, got {_kind(optimizer)}: e.g. "
                              "optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4)")
        self.layerset = LayerSet(layers)
        self.lookups = Lookups(self.layerset, lookups)
        claim(self)
        # state_dict keys follow the user's container (named nn.Sequential keeps names).
        self._container = layers if isinstance(layers, nn.Module) else \
            nn.Sequential(*self.layerset.layers)
        self.loss_fn = loss_fn
        self.side_inputs = side_inputs
        self.loss_weight = loss_weight
        self.tail_context = tail_context
        self.devices = devices if devices is not None else make_devices(config)
        # Devices we created are closed (their threads joined) when the pipeline is
        # closed or garbage collected, or the constructor fails; devices passed in
        # belong to the caller.
        self._stream: CallStream | None = None
        self._streams: list[CallStream] = []      # for the finalizer (no reference to self)
        self._closed = False
        self._finalizer = weakref.finalize(self, close_devices, self.devices, self._streams) \
            if devices is None else None
        try:
            self._build(layers, loss_fn, config, optimizer, side_inputs, plan, process_group)
        except BaseException:
            self.close()
            raise

    def _build(self, layers, loss_fn, config, optimizer, side_inputs, plan, group) -> None:
        self._planner = PipePlanner.for_pipeline(config, self.layerset, self.devices,
                                                 self.tail_context is not None)
        self.plan = plan = self._planner.initial(plan)
        cuda = bool(self.devices) and self.devices[0].torch_device.type == "cuda"
        self.pinning = HostPinning(resolve_pin(config.pin, cuda, self.layerset,
                                               dtype=config.precision.compute_dtype), cuda)
        # The stale optimizer writes one step's weights while workers upload the
        # previous step's: two sets of compute copies.
        self.host = HostState(self.layerset, config.precision, self.pinning,
                              views=2 if config.optimizer_mode is OptimizerMode.STALE else 1)
        check_stage_budget(plan, self.layerset, self.host, self.devices)
        self.scaler = LossScaler(config.precision)
        self._host_opt = HostOptimizer(self.host, self.scaler, config.optimizer_mode,
                                       config.clip_grad_norm, config.nonfinite,
                                       undo=config.undo_steps,
                                       states=StatePrecision(config.optimizer_state_dtype))
        self._calls = CallRunner(self.layerset, self.host, loss_fn, self.devices, config,
                                 plan, side_inputs=side_inputs,
                                 tail_context=self.tail_context, pinning=self.pinning,
                                 lookups=self.lookups)
        self._stream = CallStream(self._calls)
        self._streams.append(self._stream)
        self._user_schedules: dict[bool, Schedule] = {}
        # Layers sharing a parameter (a tied embedding and head): a stage's weights
        # wait for the update of every stage holding one of them.
        holders: dict[int, set[int]] = {}
        for l, pids in enumerate(self.layerset.layer_params):
            for pid in pids:
                holders.setdefault(pid, set()).add(l)
        self._ties = sorted({frozenset(ls) for ls in holders.values() if len(ls) > 1},
                            key=sorted)
        # Layers holding frozen weights (a LoRA base): overlapping calls upload them
        # without waiting for the optimizer (rotapipe.schedule.roundpipe).
        trained = set(self.host.trainable)
        self._frozen = tuple(l for l, pids in enumerate(self.layerset.layer_params)
                             if any(pid not in trained for pid in pids))
        # Layers looking up a trained embedding table by rows: in exact overlapping
        # calls the rows the next call looks up are stepped first (OR actions); under
        # timed emulation only where that pays for the emulated model, as simulated.
        em = config.emulation
        self._rows_first = tuple(l for l in range(len(self.layerset))
                                 if self.lookups.stage_pids(range(l, l + 1)) & trained) \
            if self._host_opt.rows_first and (em is None or em.rows_first_pays()) else ()
        stages = self._calls.stages
        self.data_parallel = None
        """The data-parallel gradient reducer (``None`` when off); ``.last`` holds the
        all-reduce timing of the last call."""
        trainable = set(self.host.trainable)
        self.data_parallel = GradReducer.create(
            config.data_parallel, group, self._fingerprint(),
            {pid: self.layerset.params[pid].shape for pid in trainable},
            lambda stage: [pid for pid in self.layerset.stage_params(stages[stage].layers)
                           if pid in trainable])
        if self.data_parallel is not None:
            # Backpressure (allreduce.InFlight): two stages per worker may wait for the
            # host lane (the planner's gradient staging); a failed call frees waiters.
            self.data_parallel.stage_limit = 2 * len(self.devices)
            stream = self._stream
            self.data_parallel.aborted = lambda: (stream.session is not None and
                                                  stream.session.abort.is_set())
        self._shard: ShardedOptimizer | None = None
        """The sharded host optimizer (``data_parallel.shard`` not ``"none"``)."""
        dpc = config.data_parallel
        if dpc.shard is not ShardMode.NONE:
            if self.data_parallel is None:
                raise ConfigError(f"data_parallel.shard={dpc.shard.value!r} needs data "
                                  "parallelism: launch with torchrun (more than one rank) "
                                  "and call rotapipe.distributed.init_from_env() first, or "
                                  "set shard='none'")
            self._shard = self._host_opt = ShardedOptimizer(
                self.host, self.scaler, config.optimizer_mode, config.clip_grad_norm,
                self.data_parallel, dpc.shard, dpc.grad_dtype, dpc.bucket_mb,
                config.nonfinite)
        self._lock = CallLock(__file__)
        self._lock.owners.update({id(self._calls.executor.dispatchers),
                                  *(id(d) for d in self.devices)})
        self._evals = 0
        self._optimizer_cost = self._calls.optimizer_cost()
        if self.data_parallel is not None and self._planner.refiner is not None:
            raise ConfigError("partition='refine' re-plans from this process's timings, "
                              "but data-parallel ranks must keep one plan: use "
                              "partition='auto' (or pass plan=)")
        self.optimizer = self.scheduler = None
        if optimizer is not None:
            self.attach_optimizer(optimizer if isinstance(optimizer, torch.optim.Optimizer)
                                  else optimizer(self.parameters()))

    # -- parameters and optimizer ------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        """The fp32 master weights (trainable parameters only), each once, after the
        calls in flight completed (:meth:`flush`)."""
        self._check_open()
        self.flush()
        if self._shard is not None:     # this rank's pieces of the fp32 masters
            return iter(self._shard.parameters())
        return iter([self.layerset.params[pid] for pid in self.host.trainable])

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, master)`` pairs; names are ``"<layer index>.<path>"`` (after
        :meth:`flush`)."""
        self._check_open()
        self.flush()
        if self._shard is not None:
            return iter(self._shard.named_parameters())
        return iter([(self.layerset.param_names[pid], self.layerset.params[pid])
                     for pid in self.host.trainable])

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, scheduler=None) -> None:
        """Use ``optimizer`` in :meth:`step`. It must hold only this model's trainable
        parameters (``fused=True`` AdamW is the fast choice on the CPU).

        ``scheduler``: a ``torch.optim.lr_scheduler`` over ``optimizer``, stepped by the
        pipeline right after every optimizer step it takes, on the thread that took
        it. With ``optimizer_mode="overlap"`` or ``"stale"`` a step is still under way when
        :meth:`train_step` returns, so a scheduler stepped by the caller would change
        the learning rate of that step: pass it here instead
        (:meth:`step_result` gives the learning rate each step used)."""
        self._check_open()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"attach_optimizer takes a torch.optim.Optimizer instance, got "
                              f"{_kind(optimizer)}: build one over the pipeline's "
                              "parameters, e.g. torch.optim.AdamW(pipe.parameters())")
        if scheduler is not None and getattr(scheduler, "optimizer", None) is not optimizer:
            raise ConfigError("the scheduler does not drive this optimizer: build it over "
                              "the optimizer passed to attach_optimizer")
        if scheduler is not None:
            _check_scheduler(scheduler)
        _check_optimizer_step(optimizer)
        ours = {id(p) for p in self.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in ours:
                    raise ConfigError("the optimizer holds a parameter that is not a "
                                      "trainable parameter of the wrapped layers: build it "
                                      "over pipe.parameters()")
        with self._lock:
            self._flush()
            # PipeConfig.optimizer_state_dtype: checked here, state narrowed (now and
            # after every load_state_dict of the optimizer).
            if self._shard is None:
                self._host_opt.states.attach(optimizer)
            self.optimizer, self.scheduler = optimizer, scheduler

    # -- training ----------------------------------------------------------------------
    @property
    def calls(self) -> int:
        """Training calls that returned so far (those still draining included; a
        failure rolls it back to the calls that completed); with ``config.seed`` it
        defines the random streams (see :func:`rotapipe.layer_seed`)."""
        return self._stream.next_number

    @calls.setter
    def calls(self, value: int) -> None:
        self._check_open()
        try:
            number = operator.index(value)
        except TypeError:
            number = None
        if number is None or isinstance(value, bool) or number < 0:
            raise ConfigError(f"pipe.calls = {value!r}: the call counter is a whole number "
                              ">= 0 (the training calls made so far, e.g. restored from a "
                              "checkpoint); negative numbers are evaluation calls' streams")
        with self._lock:
            self._stream.drain()
            self._stream.committed = number

    def forward_backward(self, inputs, labels) -> float:
        """Run forward and backward over one batch; return its mean loss.

        The batch is split along dim 0 into the schedule's microbatches
        (``config.microbatches``, or those of a schedule set with :meth:`use_schedule`).
        The returned loss is the mean of the per-microbatch losses weighted by
        microbatch size (or by ``loss_weight``), i.e. the mean over the whole batch when
        ``loss_fn`` returns a per-sample mean. Gradients accumulate until :meth:`step`:
        after several calls they are the gradient of the mean loss over *every* sample
        since the last step, the same as one call on the concatenated batch. If the
        call fails, no weight, gradient, buffer or optimizer state changes.

        Data parallel (``config.data_parallel``): each rank passes its shard; the weights
        are shares of the global batch, gradients are all-reduced as each stage's land,
        and the returned loss is the global mean. Every rank must make the call.

        With ``config.optimizer_mode="overlap"`` or ``"stale"`` the call returns once its
        loss is known, while its backward still drains (docs/optimizer.md).
        """
        self._check_open()
        with self._lock:
            return self._train_call(inputs, labels, step=False)

    def train_step(self, inputs, labels) -> float:
        """:meth:`forward_backward` on the batch, then the optimizer step; returns the
        mean loss. With gradient accumulation call :meth:`forward_backward` for all but
        the last batch of the step, then ``train_step`` on the last.

        ``config.optimizer_mode`` says how the step runs (docs/optimizer.md): ``"sync"``
        after the call (exactly ``forward_backward`` then :meth:`step`); ``"overlap"``
        during the call, each stage's parameters as soon as their gradients are
        complete, and the next call starts while this one drains, each of its stages
        waiting only for the update of its own layers (exact, same result as
        ``sync``); ``"stale"`` once the call is complete, while the next call runs on
        the weights one step old. In both of these the call returns once its loss is
        known. A failed call changes no weight, gradient or optimizer state; a failure
        of a call still draining is raised by the next call (or :meth:`flush`), with
        the fate of every call in flight (docs/optimizer.md, "Failures").
        """
        self._check_open()
        self._need_optimizer()
        with self._lock:
            return self._train_call(inputs, labels, step=True)

    def flush(self) -> None:
        """Wait for the calls in flight to complete (raising a failure of theirs) and
        make the weights the workers read current: with ``stale`` the next call then
        runs on the weights of the last step. Reading or replacing weights
        (:meth:`state_dict`, :meth:`load_state_dict`, evaluation,
        :meth:`pipeline_state`, :meth:`step`, :meth:`close`) flushes first."""
        self._check_open()
        with self._lock:
            self._flush()

    def _overlapping(self) -> bool:
        """Whether training calls may overlap: an asynchronous optimizer mode, on the
        generated schedule, without data parallelism (collectives run in the caller's
        order), without dynamic loss scaling (a call's scale depends on the previous
        call's overflow) and without layers that update buffers in forward (the next
        call's forward would read them before this call keeps them)."""
        return (self._host_opt.overlapping and self.data_parallel is None
                and not self.scaler.dynamic and True not in self._user_schedules
                and not self.layerset.buffer_layers())

    def _train_call(self, inputs, labels, step: bool) -> float:
        """One training call (under ``self._lock``); ``step``: it ends an optimizer
        step (the mode's hook steps, or the caller does in ``sync``)."""
        stream, dp = self._stream, self.data_parallel
        overlap = self._overlapping()
        self._reaped(stream.reap(1) if overlap else stream.drain())
        if not stream.inflight:
            self.host.follow_edits()        # weights edited in place since the last call
        schedule = self._schedule(True)
        M = schedule.microbatches
        mbs, lbs, units = split_batch(inputs, labels, M, self.host.dtype, self.loss_weight)
        total = sum(units)
        if any(u < 0 for u in units) or not (total > 0 or dp is not None):
            raise InputError(f"loss_weight gave {units} for the microbatches: the items "
                             "the loss averages over must be >= 0 and not all 0 (are all "
                             "labels ignored?)")
        if dp is not None:
            # Every rank weights its microbatches by their share of the global batch.
            local, total = total, dp.global_sum(total, "sum of the loss units")
            if not total > 0:
                raise InputError("loss_weight gave 0 items on every rank: are all "
                                 "labels ignored?")
        opt = self._host_opt
        index = stream.index
        if overlap:
            cfg = self.config
            schedule = Schedule(self.plan, len(self.devices), M, roundpipe_call(
                self.plan, len(self.devices), M, index, reads=opt.reads(stream.step_ends),
                whole_step=opt.reads_whole_step, ties=self._ties,
                side_inputs=self.side_inputs is not None,
                tail_barrier=self.tail_context is not None, prefetch=cfg.prefetch,
                grad_window=grad_window(cfg.prefetch), frozen=self._frozen,
                rows_first=self._rows_first), "roundpipe-stale")
        # A call's gradients wait for its commit in fp32 when nothing else will hold
        # gradients by then: they become ``param.grad`` as they are, and widening them
        # on arrival (host lane, while the workers compute) takes that pass and its
        # page faults off the end of the call. A call that accumulates, or one behind
        # a call not yet committed, keeps them in the compute dtype: a second fp32
        # copy beside ``param.grad`` would double the gradients' bytes
        # (docs/memory.md). Data parallelism's all-reduce works on fp32 staged ones.
        # The storages of a call that starts a step come back from the last step's
        # when calls do not overlap (the asynchronous modes widen on arrival only their
        # first call, whose storages no later call would reuse: the pool would keep them
        # for good); a data-parallel call that accumulates stages fp32 beside .grad and
        # frees it at the merge, which an idle pooled copy would not.
        accumulates = self.host.samples > 0 or any(not c.committed for c in stream.inflight)
        grads = CallGrads(1.0 / self.scaler.scale, keep_dtype=dp is None and accumulates,
                          pool=None if overlap or accumulates else self.host.grad_pool,
                          bounds=dp is None and self.config.nonfinite is NonFinite.RAISE
                          and not self.scaler.dynamic)
        ctx = self._calls.context(stream.next_number, True, [u / total for u in units],
                                  grads, M, self.scaler.scale)
        reduce = None
        if dp is not None:
            reduce = dp.begin(schedule, grads) if self._shard is None else None
            ctx.mb_offset, ctx.extra_weight = dp.rank * M, local / total
        view = opt.view(stream.steps)
        # What the call keeps refers to the pipeline only through the two callbacks it
        # drops at its commit: a pipeline dropped with calls in flight is collected once
        # they have committed (the finalizer holds the streams, and so these calls).
        stages, layerset, runner = self._calls.stages, self.layerset, self._calls
        hook = opt.call_hook(self.optimizer, schedule, lambda name: layerset.stage_params(
            stages[name].layers), grads, total, step, self._optimizer_cost, reduce, view)
        state = self._calls.state(schedule, ctx, self._calls.host_store(mbs, lbs), view)
        call = Call(stream.next_number, index, schedule, state, hook, step, total, stages,
                    self._keep_buffers, on_host=overlap, reduce=reduce,
                    after_step=self._after_step)
        ctx.handoff, ctx.rows_first = call.handoff, call.rows_first
        call.next_store = lambda: runner.host_store_of(index + 1)
        gate = getattr(reduce if reduce is not None else hook, "gate", None)
        if gate is not None:            # data parallel: backpressure (allreduce.InFlight)
            ctx.grad_gate = gate.enter
        try:
            stream.submit(call)
            loss = stream.wait_loss(call)
            # Data parallel: ranks see different local losses and must decide alike;
            # the check of the reduced gradients (identical on every rank) decides.
            # Dynamic loss scaling: an inf loss is an fp16 overflow, the scaler's to skip.
            if not math.isfinite(loss) and self.config.nonfinite is NonFinite.RAISE \
                    and dp is None and not self.scaler.dynamic:
                # Its older calls complete first: only this one is discarded.
                stream.reject(call, NonFiniteError(
                    f"the loss of training call {call.number} is {loss} ("
                    f"microbatch losses {call.losses()}): the call was discarded and "
                    "changed nothing. Check the data and the learning rate, clip "
                    "gradients (clip_grad_norm), or set PipeConfig(nonfinite='skip') to "
                    "skip such steps"))
            if not overlap:
                self._reaped(stream.drain())
        except BaseException as exc:
            if dp is not None:
                dp.fail(f"{type(exc).__name__} in the schedule")
                if isinstance(exc, WorkerError) and isinstance(exc.cause, DistributedError):
                    raise exc.cause from exc
            raise
        if dp is not None:
            loss = dp.global_sum(loss, "sum of the weighted losses")
        call.returned = True
        return loss

    def _keep_buffers(self, host_store) -> None:
        """A committing call's buffer updates become the layers' buffers."""
        for bid in range(len(self.layerset.buffers)):
            if host_store.contains(("buf", bid)):
                self.layerset.set_buffer(bid, host_store.get(("buf", bid)))

    def _reaped(self, calls: list[Call]) -> None:
        """Calls that completed: ``partition="refine"`` learns from their timings."""
        t = time.perf_counter()
        for call in calls:
            self._refine_plan(call)
        self._stream.host_seconds["re-plan"] += time.perf_counter() - t

    def host_seconds(self) -> dict[str, float]:
        """Seconds the caller's thread has spent in each phase of the training calls
        since construction: ``"wait for the loss"``, ``"wait for the rest of the call"``
        (a call that returns before its backward drained waits here at the next
        call), ``"check, merge and step"`` (what the caller does once every gradient is
        in: the finiteness check, the merge into ``.grad`` and, for a call that ends a
        ``sync`` step, the optimizer step; the asynchronous modes do it on the host
        lane instead), ``"re-plan"`` (``partition="refine"``) and ``"zero_grad"``.
        Differences over a few calls say where a slow step goes on the host side
        (docs/gpu_check.md)."""
        return dict(self._stream.host_seconds)

    def step(self) -> bool:
        """Run the optimizer on the accumulated gradients, refresh the compute-dtype
        weights, and clear the gradients. With dynamic loss scaling, a step whose
        gradients overflowed is skipped (and the scale lowered): returns ``False``.
        Clips to ``config.clip_grad_norm`` first when set. Always synchronous, whatever
        ``config.optimizer_mode`` (after the calls in flight completed)."""
        self._check_open()
        self._need_optimizer()
        with self._lock:
            self._flush()
            stepped = self._host_opt.sync_step(self.optimizer, self._optimizer_cost)
            self._after_step()
            return stepped

    def _need_optimizer(self) -> None:
        if self.optimizer is None:
            raise ConfigError("no optimizer: pass optimizer= to RoundPipe or call "
                              "pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters()))")

    def step_result(self, call: int) -> StepResult | None:
        """What the optimizer step ended by training call ``call`` (its :attr:`calls`
        number, ``train_step``) did: :class:`~rotapipe.runtime.calls.StepResult` with
        the learning rates, the gradient norm (clipping on) and whether it was skipped;
        ``None`` for a call that ended no step. Waits for that call to complete; the
        last 64 calls are kept."""
        self._check_open()
        with self._lock:
            stream = self._stream
            while any(c.number <= call for c in stream.inflight):
                self._reaped(stream.reap(len(stream.inflight) - 1))
            if call not in stream.results:
                raise ConfigError(f"training call {call} is not among the last calls "
                                  f"completed ({sorted(stream.results)})")
            return stream.results[call]

    def _after_step(self) -> StepResult:
        """Right after a call's optimizer step (on its thread): what it did, then the
        scheduler's step."""
        opt = self.optimizer
        result = StepResult(tuple(g["lr"] for g in opt.param_groups), self._host_opt.last_norm
                            if self.config.clip_grad_norm is not None else None,
                            self._host_opt.last_skipped)
        if self.scheduler is not None:
            try:
                with warnings.catch_warnings():
                    # A skipped step (fp16 overflow) did not call optimizer.step().
                    warnings.filterwarnings("ignore",
                                            "Detected call of `lr_scheduler.step()`")
                    self.scheduler.step()
            except Exception as exc:
                raise ConfigError(
                    f"the scheduler's step() failed ({type(exc).__name__}: {exc}) after "
                    "the optimizer step, which is applied and kept: fix the scheduler, "
                    "or step it yourself after pipe.step() / pipe.flush()") from exc
        return result

    @property
    def nonfinite_skips(self) -> int:
        """Optimizer steps skipped so far because a gradient was not finite
        (``config.nonfinite="skip"``; fp16 overflows under dynamic loss scaling are not
        counted here). ``step_result(call).skipped`` tells each step's fate."""
        return self._host_opt.nonfinite_skips

    @property
    def last_grad_norm(self) -> float | None:
        """The global L2 gradient norm (before clipping) of the last optimizer step, in
        every optimizer mode, when ``config.clip_grad_norm`` is set (``None`` otherwise).
        In ``stale`` the last step applied is the previous call's."""
        return self._host_opt.last_norm

    def zero_grad(self) -> None:
        """Drop accumulated gradients without stepping (after the calls in flight)."""
        self._check_open()
        with self._lock:
            self._flush()
            t = time.perf_counter()
            self.host.zero_grad()
            if self._shard is not None:
                self._shard.zero_grad()
            self._stream.host_seconds["zero_grad"] += time.perf_counter() - t

    @torch.no_grad()
    def __call__(self, inputs):
        """Evaluate without gradients: the last layer's output for the whole batch.

        Runs forward stages only (the layers' train/eval flags apply as set; buffer
        updates made during evaluation are not kept). The microbatches' outputs are
        joined along dim 0; a further output tensor that cannot be (0-dim, e.g. an
        auxiliary mean) comes back as a list, one value per microbatch."""
        self._check_open()
        with self._lock:
            self._flush()
            self.host.follow_edits()
            M = min(self.config.microbatches, trees.batch_size(inputs, "inputs"))
            schedule = self._schedule(False, M)
            M = schedule.microbatches
            if trees.batch_size(inputs, "inputs") < M:
                raise InputError(f"the evaluation schedule set with use_schedule has {M} "
                                 f"microbatches but the batch has "
                                 f"{trees.batch_size(inputs, 'inputs')} samples")
            mbs = trees.split(trees.cast_floating(inputs, self.host.dtype), M)
            # Evaluation draws from its own streams so that it never shifts training's.
            ctx = self._calls.context(-1 - self._evals, False, [1.0 / M] * M, None, M, 1.0)
            host_store = self._calls.host_store(mbs)
            self._calls.run(schedule, ctx, host_store)
            outs = [host_store.get(("act", self.plan.num_layers, m)) for m in range(M)]
            self._evals += 1
        return trees.concat(outs)

    # -- reading state -----------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Trained weights (fp32 masters, frozen weights) and buffers, keyed like the
        ``state_dict`` of the container passed in (``nn.Sequential(*layers)`` for a
        list). The tensors are the live masters: copy them to keep a snapshot. Stale
        optimizer: applies the pending step first (:meth:`flush`)."""
        self._check_open()
        self.flush()
        return self._container.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load weights and buffers (keys as :meth:`state_dict`) into the masters and
        refresh the compute-dtype copies the workers upload (every set of them).

        All or nothing: keys (with ``strict``: none missing, none unexpected), shapes
        and dtype kinds (floating point or not) are checked before any tensor is
        written; a mismatch raises :class:`~rotapipe.errors.ConfigError` naming every
        offending key, and changes nothing. Values are copied in place, cast to each
        tensor's dtype, as ``nn.Module.load_state_dict`` does."""
        self._check_open()
        with self._lock:
            self._flush()
            own = self._container.state_dict(keep_vars=True)
            if not isinstance(state, dict):
                raise ConfigError(f"load_state_dict takes a dict of tensors (as "
                                  f"state_dict() returns), got {type(state).__name__}")
            problems = []
            if strict:
                problems += [f"missing key {k!r}" for k in own if k not in state]
            problems += [f"unexpected key {k!r}" for k in state if k not in own and strict]
            for k, v in state.items():
                if k not in own:
                    continue
                mine = own[k]
                if not isinstance(v, torch.Tensor):
                    problems.append(f"{k!r} is a {type(v).__name__}, not a tensor")
                elif v.shape != mine.shape:
                    problems.append(f"{k!r} has shape {tuple(v.shape)}, the model's is "
                                    f"{tuple(mine.shape)}")
                elif v.is_floating_point() != mine.is_floating_point():
                    problems.append(f"{k!r} has dtype {v.dtype}, the model's is "
                                    f"{mine.dtype}")
                elif v.layout is not torch.strided or v.is_meta:
                    problems.append(f"{k!r} is a {'meta' if v.is_meta else str(v.layout)} "
                                    "tensor, which holds no dense values: pass dense "
                                    "tensors (.to_dense(), or load real weights)")
            if problems:
                shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more"
                                                  if len(problems) > 8 else "")
                raise ConfigError(f"load_state_dict: {shown}. Nothing was loaded: pass "
                                  "a state_dict of this model (strict=False skips missing "
                                  "and unexpected keys)")
            if self._shard is not None:
                self._load_sharded(state)
                return
            try:
                with torch.no_grad():
                    for k, v in state.items():
                        if k in own:
                            own[k].copy_(v)
            finally:
                self.host.write_back()

    def _load_sharded(self, state: dict[str, torch.Tensor]) -> None:
        """Masters from the fp32 tensors themselves (the module's parameters hold only
        the compute dtype), then the rest of the container."""
        names = dict(self._container.named_parameters(remove_duplicate=False))
        by_id = {id(p): pid for pid, p in enumerate(self.layerset.params)}
        full = {}
        for key, value in state.items():
            p = names.get(key)
            if p is not None and id(p) in by_id and by_id[id(p)] in self.host.trainable:
                full[by_id[id(p)]] = value.float()
        self._container.load_state_dict(state)
        self._shard.load_full(full)

    def pipeline_state(self) -> dict:
        """The pipeline's own counters, for exact resume: training calls and evaluation
        calls (they define the random streams) and the loss scaler. Weights are in
        :meth:`state_dict`, optimizer state in the optimizer's (stale: flushes first)."""
        self._check_open()
        self.flush()
        return {"calls": self.calls, "evals": self._evals, "scaler": self.scaler.state_dict(),
                "optimizer_state_dtype": self.config.optimizer_state_dtype.value}

    def load_pipeline_state(self, state: dict) -> None:
        """Restore what :meth:`pipeline_state` returned. Everything is checked before
        anything changes (:class:`~rotapipe.errors.CheckpointError` naming the key)."""
        self._check_open()
        calls, evals, scale, good = _pipeline_state(state)
        saved = state.get("optimizer_state_dtype", "fp32")
        ours = self.config.optimizer_state_dtype.value
        if saved != ours:
            raise CheckpointError(
                f"the checkpoint's optimizer state was kept as {saved!r}, this pipeline "
                f"keeps it as {ours!r}: build the pipeline with PipeConfig("
                f"optimizer_state_dtype={saved!r}) (rotapipe train: --optimizer-state "
                f"{saved}) to resume it")
        with self._lock:
            self._flush()
            self._stream.committed, self._evals = calls, evals
            self.scaler.load_state_dict({"scale": scale, "good_steps": good})

    def train(self, mode: bool = True) -> RoundPipe:
        """Set the layers' training flag (dropout, BatchNorm), as ``nn.Module.train``."""
        self._check_open()
        for layer in self.layerset.layers:
            layer.train(mode)
        return self

    def eval(self) -> RoundPipe:
        return self.train(False)

    def schedule(self, training: bool = True) -> Schedule:
        """The schedule a call runs (``Schedule.grid()`` prints it)."""
        self._check_open()
        return self._schedule(training)

    def use_schedule(self, schedule: Schedule) -> None:
        """Run ``schedule`` instead of the generated one for calls of its kind (training
        when its name does not end in ``-eval``), as given: its microbatch count splits
        the batch (it may differ from ``config.microbatches``); such calls run one at a
        time. It must be for this pipeline's plan and worker count (an error names
        both counts otherwise); it is validated (a dry run) first, and it
        must move the model state this pipeline keeps in host memory (weight uploads,
        gradient downloads and hand-offs, side inputs, buffers). The baselines run with
        ``offload_optimizer=True``: build the pipeline with ``plan=bound_plan(...)`` and
        pass e.g. ``one_f_one_b_schedule(pipe.plan, workers, microbatches,
        offload_optimizer=True)``."""
        self._check_open()
        if not isinstance(schedule, Schedule):
            raise ConfigError(f"use_schedule takes a rotapipe Schedule, got "
                              f"{type(schedule).__name__}")
        if schedule.plan != self.plan or schedule.workers != len(self.devices):
            raise ConfigError(f"the schedule is for {schedule.workers} workers and plan "
                              f"{schedule.plan.to_text()}; this pipeline has "
                              f"{len(self.devices)} workers and plan {self.plan.to_text()}")
        validate(schedule)
        try:
            check_runnable(schedule, side_inputs=self.side_inputs is not None,
                           buffer_layers=self.layerset.buffer_layers(),
                           tail_context=self.tail_context is not None)
        except ScheduleError as exc:
            raise ConfigError(str(exc)) from None
        if schedule.calls > 1:
            raise ConfigError(f"the schedule spans {schedule.calls} calls; use_schedule "
                              "takes the schedule of one call (overlapping calls are "
                              "config.optimizer_mode='overlap' or 'stale')")
        training = not schedule.name.endswith("-eval")
        with self._lock:
            self._flush()
            self._user_schedules[training] = schedule
        if self._planner.refiner is not None:   # a schedule of the user's: keep its plan
            self._planner.refiner.frozen = True

    @property
    def pin_mode(self) -> PinMode:
        """The host memory mode of the weights (:class:`rotapipe.PinMode`): the
        configured ``pin``, or what the auto rule chose for ``pin=None``
        (:func:`rotapipe.runtime.pinning.resolve_pin`; docs/host_memory.md).
        ``self.pinning.stats`` counts the bytes of each kind."""
        return self.pinning.mode

    def last_timeline(self, calls: int = 1):
        """When each action of the last training call (or the last ``calls`` calls, as
        one timeline) ran, as a :class:`rotapipe.sim.Timeline` (milliseconds from the
        first action), so the simulator's tools apply to real runs:
        ``rotapipe.sim.trace.write_trace`` (Chrome/Perfetto JSON),
        ``rotapipe.sim.gantt.draw_gantt`` (PNG) and ``rotapipe.sim.report.report``
        (bubble). Calls still in flight are left out (:meth:`flush` completes them).
        Compute actions give the times the device ran them (timing events around
        them); copies and host work the times their bodies ran (on CUDA, when a copy
        was issued). With overlapping calls the timeline's schedule is what
        ran: :func:`rotapipe.schedule.roundpipe_stale_schedule`'s calls."""
        self._check_open()
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
            raise ConfigError(f"last_timeline(calls={calls!r}): use an int >= 1 (the "
                              "last 64 calls are kept)")
        history = list(self._stream.history)[-calls:]
        return timeline(history)

    def peak_memory(self) -> list[int]:
        """Peak accounted device bytes per worker since construction or reset."""
        self._check_open()
        return [d.peak_memory() for d in self.devices]

    def reset_peak_memory(self) -> None:
        self._check_open()
        for d in self.devices:
            d.reset_peak()

    def close(self) -> None:
        """Wait for the calls in flight (a failure of theirs is raised after the
        pipeline is closed), then stop the worker threads (emulated backend) and
        release pinned memory. The pipeline is unusable after: every method raises
        :class:`~rotapipe.errors.PipelineClosedError` at once (the trained weights stay
        in the model passed in). Bounded: a worker stuck in an action after a timeout
        retired the pipeline is abandoned with a warning (its daemon thread ends with
        the process). Closing twice does nothing."""
        if self._closed:
            return
        if on_worker_thread(self._lock.owners if hasattr(self, "_lock") else ()):
            raise reentry("close")
        error = None
        stream = getattr(self, "_stream", None)
        if stream is not None and stream.inflight and hasattr(self, "_lock"):
            try:
                self.flush()
            except BaseException as exc:  # noqa: BLE001 - raised once closed
                error = exc
        self._closed = True
        if getattr(self, "data_parallel", None) is not None:
            self.data_parallel.close()
        if self._finalizer is not None:
            self._finalizer()
        if getattr(self, "_calls", None) is not None:
            self._calls.executor.close()      # the idle dispatcher threads
        if getattr(self, "pinning", None) is not None:
            self.pinning.close()       # after the workers stopped reading the weights
        if error is not None:
            raise error

    def _check_open(self) -> None:
        if self._closed:
            raise PipelineClosedError(
                "this RoundPipe was closed (close(), or the end of its with-block): "
                "build a new one to go on; the trained weights are in the model you "
                "wrapped (model.state_dict())")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.close()
        except BaseException:
            if exc[0] is None:       # never mask the exception already propagating
                raise

    # -- internals -----------------------------------------------------------------------
    def _schedule(self, training: bool, microbatches: int | None = None) -> Schedule:
        """The schedule of one call of a kind: the user's (:meth:`use_schedule`) or the
        generated one for ``microbatches`` (default ``config.microbatches``)."""
        if training in self._user_schedules:
            return self._user_schedules[training]
        return self._calls.schedule(self.plan, training,
                                    microbatches or self.config.microbatches)

    def _flush(self) -> None:
        """Complete the calls in flight and make every set of compute copies follow the
        masters (under the lock)."""
        self._reaped(self._stream.drain())
        self._host_opt.flush()

    def _fingerprint(self) -> str:
        """What must agree across data-parallel ranks (plan, dtype, parameter shapes)."""
        shapes = [tuple(self.layerset.params[pid].shape) for pid in self.host.trainable]
        dpc = self.config.data_parallel
        shard = "" if dpc.shard is ShardMode.NONE else \
            f", shard {dpc.shard.value} (gradients in {dpc.grad_dtype})"
        return (f"plan {self.plan.to_text()}, compute dtype {self.host.dtype}, "
                f"{len(shapes)} trainable parameters, shapes hash {hash(tuple(shapes))}"
                f"{shard}")

    def _refine_plan(self, call: Call) -> None:
        """``partition="refine"``: feed a completed call's stage times to the planner
        and switch to its new plan, if any, before the next call (calls in flight
        complete first; the schedules are rebuilt; the math does not depend on the
        plan)."""
        if not self._planner.refining:
            return
        new = self._planner.observe(self._stream.last_spans, self._calls.stages,
                                    call.number + 1)
        if new is None:
            return
        try:
            check_stage_budget(new, self.layerset, self.host, self.devices)
        except ConfigError:            # the planner's bound fits; keep the safe plan
            self._planner.refiner.frozen = True
            return
        self._stream.drain()
        self.plan = new
        self._calls.use_plan(new)


def _kind(value) -> str:
    """How an error names a value of the wrong kind: a class as 'the class X'."""
    if value is None:
        return "None"
    if isinstance(value, type):
        return f"the class {value.__name__}"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _required_args(fn, skip: int = 0) -> list[str]:
    """The positional parameters ``fn`` needs (after the first ``skip``); none when
    it has no signature (a builtin: let it run)."""
    try:
        params = list(inspect.signature(fn).parameters.values())[skip:]
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _check_optimizer_step(optimizer) -> None:
    """Refuse an optimizer whose ``step()`` needs a closure (``LBFGS``): the pipeline
    steps it with none, on its own thread, after the gradients are in."""
    # The class's method, less ``self`` (an instance may hold a patched step).
    needed = _required_args(type(optimizer).step, skip=1)
    if needed:
        raise ConfigError(
            f"{type(optimizer).__name__}.step() needs {', '.join(needed)} (it re-evaluates "
            "the loss itself), and the pipeline steps the optimizer once per step with "
            "none: use an optimizer that steps from the gradients alone (SGD, Adam, "
            "AdamW, ...)")


def _check_scheduler(scheduler) -> None:
    """Refuse a scheduler whose ``step()`` needs arguments (``ReduceLROnPlateau``
    takes the metric): the pipeline steps it after each optimizer step with none."""
    step = getattr(scheduler, "step", None)
    if not callable(step):
        raise ConfigError(f"the scheduler ({type(scheduler).__name__}) has no step() "
                          "method: pass a torch.optim.lr_scheduler over the optimizer")
    needed = _required_args(step)
    if needed:
        raise ConfigError(
            f"{type(scheduler).__name__}.step() needs {', '.join(needed)}, and the pipeline "
            "steps the scheduler after each optimizer step with no arguments: step it "
            "yourself after pipe.step() (after pipe.flush() with optimizer_mode 'overlap' "
            "or 'stale'), and leave it out of attach_optimizer")


def _pipeline_state(state) -> tuple[int, int, float, int]:
    """``(calls, evals, scale, good_steps)`` of a :meth:`RoundPipe.pipeline_state` dict,
    checked: counts are ints >= 0 (training calls number from 0; evaluation uses -1,
    -2, ...), the scale a finite float > 0."""
    fix = "pass what pipe.pipeline_state() returned (the checkpoint is damaged otherwise)"
    if not isinstance(state, dict):
        raise CheckpointError(f"load_pipeline_state takes a dict, got {_kind(state)}: {fix}")
    scaler = state.get("scaler")
    if not isinstance(scaler, dict):
        raise CheckpointError(f"the pipeline state's 'scaler' is "
                              f"{'missing' if scaler is None else _kind(scaler)}, not a "
                              f"dict: {fix}")
    out = []
    for where, key in ((state, "calls"), (state, "evals"), (scaler, "good_steps")):
        v = where.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise CheckpointError(f"the pipeline state's {key!r} is "
                                  f"{'missing' if v is None else repr(v)}: it must be an "
                                  f"int >= 0; {fix}")
        out.append(v)
    scale = scaler.get("scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or \
            not math.isfinite(scale) or scale <= 0:
        raise CheckpointError(f"the pipeline state's scaler 'scale' is {scale!r}: it must "
                              f"be a finite number > 0; {fix}")
    return out[0], out[1], float(scale), out[2]
