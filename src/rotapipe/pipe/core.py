"""RoundPipe: the training API (wrap layers, forward_backward, step, evaluate, close).

    pipe = rotapipe.RoundPipe(layers, loss_fn, config=rotapipe.PipeConfig(microbatches=4))
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, fused=True)
    pipe.attach_optimizer(opt)
    for x, y in data:
        loss = pipe.forward_backward(x, y)
        pipe.step()            # or: loss = pipe.train_step(x, y) (docs/optimizer.md)

The class is built here (construction, the calls, stepping, evaluation, closing) from
three parts of its own: how a training call is assembled (:mod:`.training`), state in
and out (:mod:`.state`) and what ran (:mod:`.introspect`).
"""

from __future__ import annotations

import operator
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from .._lifecycle import CallLock, claim, close_devices, reentry
from ..config import OptimizerMode, PipeConfig, ShardMode
from ..errors import ConfigError, InputError, PipelineClosedError
from ..model import LayerSet, Lookups
from ..planner.pipeline import PipePlanner
from ..plan import Plan
from ..schedule import Schedule
from ..runtime.allreduce import GradReducer
from ..runtime.backend import Device
from ..runtime.batch import as_tree
from ..runtime.calls import CallRunner, CallStream, StepResult, check_stage_budget
from ..runtime.callstream import deferred_interrupt
from ..runtime.devices import make_devices
from ..runtime.dispatchers import on_worker_thread
from ..runtime.host import HostState, LossScaler
from ..runtime.pinning import HostPinning, resolve_pin
from ..runtime.optimizer import HostOptimizer
from ..runtime.optstate import StatePrecision
from ..runtime.shard import ShardedOptimizer
from ..runtime import trees
from .checks import ModelWatch, check_arguments, check_layers
from .consistency import WeightCheck, fingerprint
from .introspect import Inspection
from .state import StateIO
from .training import TrainCalls

__all__ = ["RoundPipe"]


class RoundPipe(TrainCalls, StateIO, Inspection):
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
        keep_fp32: optional parameters and buffers of the layers (the tensors) kept in
            fp32 on the host and the workers whatever the compute dtype, as Hugging Face
            keeps a router's weight and bias (the layers cast what meets them); the
            wrapped Hugging Face models pass those (``docs/guide.md``, "Mixed precision").
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
                 lookups: Mapping[nn.Module, Callable[[object], torch.Tensor]] | None = None,
                 keep_fp32: Iterable[torch.Tensor] = ()):
        self.config = config = config or PipeConfig()
        self._optimizer_cost: Callable[[list[int]], None] | None = None
        """Called after every optimizer step of a set of parameters (indices into
        ``layerset.params``), on the thread that stepped them; timed emulation sets it
        to sleep for the modeled host optimizer time."""
        check_arguments(loss_fn, config, optimizer, side_inputs=side_inputs,
                        loss_weight=loss_weight, tail_context=tail_context)
        self.layerset = LayerSet(layers, keep_fp32)
        check_layers(self.layerset)
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
        # The same weights and seed on every rank (pipe.consistency).
        self._agree = WeightCheck(self.layerset, self.host, config.seed,
                                  lambda stream=self._stream: stream.next_number)
        # Closures the reducer keeps must not hold the pipeline: a reference cycle would
        # keep a dropped pipeline (and its threads) alive until the cyclic collector runs.
        layerset = self.layerset
        self.data_parallel = GradReducer.create(
            config.data_parallel, group, fingerprint(self),
            {pid: layerset.params[pid].shape for pid in trainable},
            lambda stage: [pid for pid in layerset.stage_params(stages[stage].layers)
                           if pid in trainable], self._agree)
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
        self._lock = CallLock(os.path.dirname(__file__))
        self._lock.owners.update({id(self._calls.executor.dispatchers),
                                  *(id(d) for d in self.devices)})
        self._evals = 0
        self._optimizer_cost = self._calls.optimizer_cost()
        if self.data_parallel is not None and self._planner.refiner is not None:
            raise ConfigError("partition='refine' re-plans from this process's timings, "
                              "but data-parallel ranks must keep one plan: use "
                              "partition='auto' (or pass plan=)")
        self._watch = ModelWatch(self._container)
        self.optimizer = self.scheduler = None
        if optimizer is not None:
            self.attach_optimizer(optimizer if isinstance(optimizer, torch.optim.Optimizer)
                                  else optimizer(self.parameters()))

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
            self._fit_plan(inputs, labels)
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
            self._fit_plan(inputs, labels)
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
            if self._shard is not None:
                self._agree.before_step(self.data_parallel)
            with deferred_interrupt():      # a Ctrl-C waits for the whole step
                stepped = self._host_opt.sync_step(self.optimizer, self._optimizer_cost)
                self._after_step()
            return stepped

    def _need_optimizer(self) -> None:
        if self.optimizer is None:
            raise ConfigError("no optimizer: pass optimizer= to RoundPipe or call "
                              "pipe.attach_optimizer(torch.optim.AdamW(pipe.parameters()))")
        self._groups.check(self.optimizer)     # param groups changed since attached

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
        lrs = tuple(float(g["lr"]) for g in opt.param_groups)   # a tensor lr: its value
        result = StepResult(lrs, self._host_opt.last_norm
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
        joined along dim 0; a further output tensor that is not per sample (0-dim, e.g.
        an auxiliary mean, or a dim 0 that is not one whole multiple of every
        microbatch's batch size) comes back as a list, one value per microbatch."""
        self._check_open()
        inputs = as_tree(inputs)
        with self._lock:
            self._watch.check()
            self._flush()
            self.host.follow_edits()
            M = min(self.config.microbatches, trees.batch_size(inputs, "inputs"))
            self._fit_plan(inputs, None, M, training=False)
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
        return trees.concat(outs, [trees.batch_size(mb, "inputs") for mb in mbs])

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
