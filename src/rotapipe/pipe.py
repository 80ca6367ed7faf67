"""RoundPipe: the training API (wrap layers, forward_backward, step, evaluate, read back).

    pipe = rotapipe.RoundPipe(layers, loss_fn, config=rotapipe.PipeConfig(microbatches=4))
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, fused=True)
    pipe.attach_optimizer(opt)
    for x, y in data:
        loss = pipe.forward_backward(x, y)
        pipe.step()            # or: loss = pipe.train_step(x, y) (docs/optimizer.md)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from .config import OptimizerMode, PinMode, PipeConfig
from .errors import ConfigError, DistributedError, InputError, ScheduleError, WorkerError
from .model import LayerSet
from .planner.pipeline import PipePlanner
from .plan import Plan
from .schedule import Schedule, validate
from .schedule.validate import check_runnable
from .runtime.allreduce import GradReducer
from .runtime.backend import Device
from .runtime.calls import CallRunner, check_stage_budget, split_batch
from .runtime.devices import make_devices
from .runtime.host import CallGrads, HostState, LossScaler
from .runtime.pinning import HostPinning, resolve_pin
from .runtime.optimizer import HostOptimizer, OverlapStep
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
        loss_weight: optional ``fn(microbatch_labels) -> number`` of the items
            ``loss_fn`` averages over in that microbatch (e.g. the non-ignored tokens
            of a language-model loss). Default: the microbatch's sample count. Each
            microbatch's loss is weighted by its share of the batch's total, so the
            result is the mean over every item of the batch (and, across accumulated
            calls, over every item since the last step).
        tail_context: optional ``fn(tail_inputs, labels) -> context`` for losses that
            need whole-batch statistics (e.g. an MoE load-balancing loss): called once
            per call with every microbatch's input of the fused tail (host copies) and
            labels; ``loss_fn(output, labels, context)`` then receives it. The tail
            waits until every microbatch's input has reached host memory.
        plan: an explicit :class:`rotapipe.plan.Plan`, validated and kept. Default: the
            planner's (``config.partition``; the rule is in :mod:`rotapipe.planner.pipeline`).
        devices: explicit device objects (tests); default from ``config.backend``.
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
                 process_group=None):
        self.config = config = config or PipeConfig()
        self._optimizer_cost: Callable[[list[int]], None] | None = None
        """Called after every optimizer step of a set of parameters (indices into
        ``layerset.params``), on the thread that stepped them; timed emulation sets it
        to sleep for the modeled host optimizer time."""
        if not callable(loss_fn):
            raise ConfigError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        self.layerset = LayerSet(layers)
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
        self._finalizer = weakref.finalize(self, _close, self.devices) \
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
        # The stale optimizer steps the masters while workers upload the compute copies.
        self.host = HostState(self.layerset, config.precision, self.pinning,
                              separate=config.optimizer is OptimizerMode.STALE)
        check_stage_budget(plan, self.layerset, self.host, self.devices)
        self.scaler = LossScaler(config.precision)
        self._host_opt = HostOptimizer(self.host, self.scaler, config.optimizer,
                                       config.clip_grad_norm)
        self._calls = CallRunner(self.layerset, self.host, loss_fn, self.devices, config,
                                 plan, side_inputs=side_inputs,
                                 tail_context=self.tail_context, pinning=self.pinning)
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
        self._lock = threading.Lock()
        self.calls = 0
        """Successful ``forward_backward`` calls so far; with ``config.seed`` it defines
        the random streams (see :func:`rotapipe.layer_seed`)."""
        self._evals = 0
        self._optimizer_cost = self._calls.optimizer_cost()
        if self.data_parallel is not None and self._planner.refiner is not None:
            raise ConfigError("partition='refine' re-plans from this process's timings, "
                              "but data-parallel ranks must keep one plan: use "
                              "partition='auto' (or pass plan=)")
        self.optimizer = None
        if optimizer is not None:
            self.attach_optimizer(optimizer if isinstance(optimizer, torch.optim.Optimizer)
                                  else optimizer(self.parameters()))

    # -- parameters and optimizer ------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        """The fp32 master weights (trainable parameters only), each once."""
        for pid in self.host.trainable:
            yield self.layerset.params[pid]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, master)`` pairs; names are ``"<layer index>.<path>"``."""
        for pid in self.host.trainable:
            yield self.layerset.param_names[pid], self.layerset.params[pid]

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Use ``optimizer`` in :meth:`step`. It must hold only this model's trainable
        parameters (``fused=True`` AdamW is the fast choice on the CPU)."""
        ours = {id(p) for p in self.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in ours:
                    raise ConfigError("the optimizer holds a parameter that is not a "
                                      "trainable parameter of the wrapped layers: build it "
                                      "over pipe.parameters()")
        self.optimizer = optimizer

    # -- training ----------------------------------------------------------------------
    def forward_backward(self, inputs, labels) -> float:
        """Run forward and backward over one batch; return its mean loss.

        The batch is split along dim 0 into ``config.microbatches`` microbatches. The
        returned loss is the mean of the per-microbatch losses weighted by microbatch
        size (or by ``loss_weight``), i.e. the mean over the whole batch when
        ``loss_fn`` returns a per-sample mean. Gradients accumulate until :meth:`step`:
        after several calls they are the gradient of the mean loss over *every* sample
        since the last step, the same as one call on the concatenated batch. If the
        call fails, no weight, gradient, buffer or optimizer state changes.

        Data parallel (``config.data_parallel``): each rank passes its shard; the weights
        are shares of the global batch, gradients are all-reduced as each stage's land,
        and the returned loss is the global mean. Every rank must make the call.

        With ``config.optimizer="stale"`` the first call after a :meth:`train_step`
        runs that step's optimizer update in the background (docs/optimizer.md).
        """
        with self._lock:
            return self._train_call(inputs, labels)

    def train_step(self, inputs, labels) -> float:
        """:meth:`forward_backward` on the batch, then the optimizer step; returns the
        mean loss. With gradient accumulation call :meth:`forward_backward` for all but
        the last batch of the step, then ``train_step`` on the last.

        ``config.optimizer`` says how the step runs (docs/optimizer.md): ``"sync"``
        after the call (exactly ``forward_backward`` then :meth:`step`); ``"overlap"``
        during the call, each stage's parameters as soon as their gradients are
        complete (exact, same result as ``sync``); ``"stale"`` during the next call,
        so the next call runs on weights one step old (:meth:`flush` applies it now).
        A failed call changes no weight, gradient or optimizer state (``stale``: the
        weights the next call runs on do not change).
        """
        self._need_optimizer()
        with self._lock:
            mode = self.config.optimizer
            if mode is OptimizerMode.OVERLAP:
                return self._train_call(inputs, labels, overlap=True)
            loss = self._train_call(inputs, labels)
            if mode is OptimizerMode.SYNC:
                self._host_opt.sync_step(self.optimizer, self._optimizer_cost)
            else:
                self._host_opt.stash()
            return loss

    def flush(self) -> None:
        """Stale optimizer: apply the pending step now and refresh the weights the
        workers read, so the next call runs on current weights. Reading or replacing
        weights (:meth:`state_dict`, :meth:`load_state_dict`, evaluation,
        :meth:`pipeline_state`, :meth:`close`) flushes first. No-op in other modes."""
        with self._lock:
            self._flush()

    def _train_call(self, inputs, labels, overlap: bool = False) -> float:
        """One training call (under ``self._lock``); ``overlap``: step as gradients land."""
        M = self.config.microbatches
        mbs, lbs, units = split_batch(inputs, labels, M, self.host.dtype, self.loss_weight)
        total = sum(units)
        dp = self.data_parallel
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
        grads = CallGrads(1.0 / self.scaler.scale)
        ctx = self._calls.context(self.calls, True, [u / total for u in units], grads, M,
                                  self.scaler.scale)
        schedule = self._schedule(True)
        reduce = None
        if dp is not None:
            reduce = dp.begin(schedule, grads)
            ctx.handoff, ctx.mb_offset = reduce.handoff, dp.rank * M
            ctx.extra_weight = local / total
        host_store = self._calls.host_store(mbs, lbs)
        # The optimizer work of this call (after ctx: it captured the loss scale).
        stages = self._calls.stages
        hook = self._host_opt.start_call(
            self.optimizer, schedule, lambda name: self.layerset.stage_params(
                stages[name].layers), grads, total, overlap, self._optimizer_cost, reduce)
        if isinstance(hook, OverlapStep):
            ctx.handoff = hook.handoff      # starts the all-reduce first (data parallel)
        try:
            self._run_training(schedule, ctx, host_store)
            losses = [host_store.get(("loss", m)) for m in range(M)]
            loss = float(sum(l.item() for l in losses))   # weighted contributions
            if dp is not None:
                reduce.finish()
                loss = dp.global_sum(loss, "sum of the weighted losses")
        except BaseException:
            if hook is not None:
                hook.abort()
            raise
        if hook is not None:
            hook.finish()
        for bid in range(len(self.layerset.buffers)):
            if host_store.contains(("buf", bid)):
                self.layerset.set_buffer(bid, host_store.get(("buf", bid)))
        if not isinstance(hook, OverlapStep):      # overlap consumed the gradients
            self.host.commit(grads, total)
        self.calls += 1
        self._refine_plan()
        return loss

    def step(self) -> bool:
        """Run the optimizer on the accumulated gradients, refresh the compute-dtype
        weights, and clear the gradients. With dynamic loss scaling, a step whose
        gradients overflowed is skipped (and the scale lowered): returns ``False``.
        Clips to ``config.clip_grad_norm`` first when set. Always synchronous, whatever
        ``config.optimizer`` (stale: after applying the pending step)."""
        self._need_optimizer()
        with self._lock:
            self._flush()
            return self._host_opt.sync_step(self.optimizer, self._optimizer_cost)

    def _need_optimizer(self) -> None:
        if self.optimizer is None:
            raise ConfigError("no optimizer: pass optimizer= to RoundPipe or call "
                              "pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters()))")

    @property
    def last_grad_norm(self) -> float | None:
        """The global L2 gradient norm (before clipping) of the last optimizer step, in
        every optimizer mode, when ``config.clip_grad_norm`` is set (``None`` otherwise).
        In ``stale`` the last step applied is the previous call's."""
        return self._host_opt.last_norm

    def zero_grad(self) -> None:
        """Drop accumulated gradients without stepping."""
        with self._lock:
            self.host.zero_grad()

    @torch.no_grad()
    def __call__(self, inputs):
        """Evaluate without gradients: the last layer's output for the whole batch.

        Runs forward stages only (the layers' train/eval flags apply as set; buffer
        updates made during evaluation are not kept)."""
        M = min(self.config.microbatches, trees.batch_size(inputs, "inputs"))
        mbs = trees.split(trees.cast_floating(inputs, self.host.dtype), M)
        with self._lock:
            self._flush()
            # Evaluation draws from its own streams so that it never shifts training's.
            ctx = self._calls.context(-1 - self._evals, False, [1.0 / M] * M, None, M, 1.0)
            host_store = self._calls.host_store(mbs)
            self._calls.run(self._schedule(False, M), ctx, host_store)
            outs = [host_store.get(("act", self.plan.num_layers, m)) for m in range(M)]
            self._evals += 1
        return trees.concat(outs)

    # -- reading state -----------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Trained weights (fp32 masters, frozen weights) and buffers, keyed like the
        ``state_dict`` of the container passed in (``nn.Sequential(*layers)`` for a
        list). The tensors are the live masters: copy them to keep a snapshot. Stale
        optimizer: applies the pending step first (:meth:`flush`)."""
        self.flush()
        return self._container.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights and buffers (keys as :meth:`state_dict`) into the masters and
        refresh the compute-dtype copies the workers upload."""
        with self._lock:
            self._flush()
            self._container.load_state_dict(state)
            self.host.write_back()

    def pipeline_state(self) -> dict:
        """The pipeline's own counters, for exact resume: training calls and evaluation
        calls (they define the random streams) and the loss scaler. Weights are in
        :meth:`state_dict`, optimizer state in the optimizer's (stale: flushes first)."""
        self.flush()
        return {"calls": self.calls, "evals": self._evals, "scaler": self.scaler.state_dict()}

    def load_pipeline_state(self, state: dict) -> None:
        """Restore what :meth:`pipeline_state` returned."""
        with self._lock:
            self.calls, self._evals = int(state["calls"]), int(state["evals"])
            self.scaler.load_state_dict(state["scaler"])

    def train(self, mode: bool = True) -> RoundPipe:
        """Set the layers' training flag (dropout, BatchNorm), as ``nn.Module.train``."""
        for layer in self.layerset.layers:
            layer.train(mode)
        return self

    def eval(self) -> RoundPipe:
        return self.train(False)

    def schedule(self, training: bool = True) -> Schedule:
        """The schedule a call runs (``Schedule.grid()`` prints it)."""
        return self._schedule(training)

    def use_schedule(self, schedule: Schedule) -> None:
        """Run ``schedule`` instead of the generated one for calls of its kind (training
        when its name does not end in ``-eval``) and microbatch count. It must be for
        this pipeline's plan and worker count; it is validated (a dry run) first, and it
        must move the model state this pipeline keeps in host memory (weight uploads,
        gradient downloads and hand-offs, side inputs, buffers). The baselines run with
        ``offload_optimizer=True``: build the pipeline with ``plan=bound_plan(...)`` and
        pass e.g. ``one_f_one_b_schedule(pipe.plan, workers, microbatches,
        offload_optimizer=True)``."""
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
        training = not schedule.name.endswith("-eval")
        self._calls.schedules[(training, schedule.microbatches)] = schedule
        if self._planner.refiner is not None:   # a schedule of the user's: keep its plan
            self._planner.refiner.frozen = True

    @property
    def pin_mode(self) -> PinMode:
        """The host memory mode of the weights (:class:`rotapipe.PinMode`): the
        configured ``pin``, or what the auto rule chose for ``pin=None``
        (:func:`rotapipe.runtime.pinning.resolve_pin`; docs/host_memory.md).
        ``self.pinning.stats`` counts the bytes of each kind."""
        return self.pinning.mode

    def last_timeline(self):
        """When each action of the last call ran, as a :class:`rotapipe.sim.Timeline`
        (milliseconds from the call's first action), so the simulator's tools apply to
        real runs: ``rotapipe.sim.trace.write_trace`` (Chrome/Perfetto JSON),
        ``rotapipe.sim.gantt.draw_gantt`` (PNG) and ``rotapipe.sim.report.report``
        (bubble). Emulated workers give the times the actions ran; on CUDA the times
        are when their work was issued."""
        return self._calls.last_timeline()

    def peak_memory(self) -> list[int]:
        """Peak accounted device bytes per worker since construction or reset."""
        return [d.peak_memory() for d in self.devices]

    def reset_peak_memory(self) -> None:
        for d in self.devices:
            d.reset_peak()

    def close(self) -> None:
        """Stop the worker threads (emulated backend) and the optimizer thread, after
        applying a pending stale step. The pipeline is unusable after."""
        host_opt = getattr(self, "_host_opt", None)
        if host_opt is not None:
            try:
                if host_opt.pending is not None and hasattr(self, "_lock"):
                    self.flush()
            finally:
                host_opt.close()
        if getattr(self, "data_parallel", None) is not None:
            self.data_parallel.close()
        if self._finalizer is not None:
            self._finalizer()
        if getattr(self, "pinning", None) is not None:
            self.pinning.close()       # after the workers stopped reading the weights

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals -----------------------------------------------------------------------
    def _schedule(self, training: bool, microbatches: int | None = None) -> Schedule:
        return self._calls.schedule(self.plan, training,
                                    microbatches or self.config.microbatches)

    def _flush(self) -> None:
        """Stale: apply the pending step and refresh the compute copies (under the lock)."""
        self._host_opt.flush(self.optimizer, self._optimizer_cost)

    def _run_training(self, schedule: Schedule, ctx, host_store) -> None:
        """``CallRunner.run``; under data parallelism a failure also retires the reducer (the
        ranks' collectives are out of step) and a lost rank surfaces as the
        :class:`DistributedError` itself."""
        try:
            self._calls.run(schedule, ctx, host_store)
        except BaseException as exc:
            if self.data_parallel is not None:
                self.data_parallel.fail(f"{type(exc).__name__} in the schedule")
                if isinstance(exc, WorkerError) and isinstance(exc.cause, DistributedError):
                    raise exc.cause from exc
            raise

    def _fingerprint(self) -> str:
        """What must agree across data-parallel ranks (plan, dtype, parameter shapes)."""
        shapes = [tuple(self.layerset.params[pid].shape) for pid in self.host.trainable]
        return (f"plan {self.plan.to_text()}, compute dtype {self.host.dtype}, "
                f"{len(shapes)} trainable parameters, shapes hash {hash(tuple(shapes))}")

    def _refine_plan(self) -> None:
        """``partition="refine"``: feed this call's stage times to the planner and switch
        to its new plan, if any, before the next call (the schedules are rebuilt; the
        math does not depend on the plan)."""
        if not self._planner.refining:
            return
        new = self._planner.observe(self._calls.executor.last_spans, self._calls.stages,
                                    self.calls)
        if new is None:
            return
        try:
            check_stage_budget(new, self.layerset, self.host, self.devices)
        except ConfigError:            # the planner's bound fits; keep the safe plan
            self._planner.refiner.frozen = True
            return
        self.plan = new
        self._calls.use_plan(new)


def _close(devices) -> None:
    for d in devices:
        d.close()
