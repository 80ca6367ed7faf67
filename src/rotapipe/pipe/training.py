"""One training call of a RoundPipe, assembled: split the batch, weight the microbatches,
pick the call's schedule (overlapping calls get theirs from the stream's position),
stage its gradients, hook the optimizer mode in, submit it and wait for its loss
(:class:`TrainCalls`)."""

from __future__ import annotations

import math
import time

import torch

from ..config import NonFinite
from ..errors import ConfigError, DistributedError, InputError, NonFiniteError, WorkerError
from ..runtime.batch import as_tree
from ..runtime.calls import Call, check_stage_budget, split_batch
from ..runtime.callgrads import CallGrads
from ..schedule import Schedule, roundpipe_call
from ..schedule.roundpipe import grad_window

__all__ = ["TrainCalls"]


class TrainCalls:
    """How :class:`~rotapipe.pipe.RoundPipe` runs a training call (under its lock)."""

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
        self._watch.check()                 # parameters replaced since wrapping
        if overlap and stream.inflight and self._calls.layers_changed():
            # model.train()/eval() or an attribute set on the user's own model: the
            # calls in flight finish as they began, this one begins as the model is now.
            self._reaped(stream.drain())
        self._reaped(stream.reap(1) if overlap else stream.drain())
        if not stream.inflight:
            self.host.follow_edits()        # weights edited or stepped since the last call
            if self._shard is None:
                self.host.follow_grads()    # gradients cleared by optimizer.zero_grad()
        schedule = self._schedule(True)
        M = schedule.microbatches
        mbs, lbs, units = split_batch(inputs, labels, M, self.host.dtype, self.loss_weight)
        total = sum(units)
        if any(u < 0 for u in units) or not (total > 0 or dp is not None):
            raise InputError(f"loss_weight gave {units} for the microbatches: the items "
                             "the loss averages over must be >= 0 and not all 0 (are all "
                             "labels ignored? such a batch adds nothing to the mean: skip "
                             "it)")
        if dp is not None:
            # Every rank weights its microbatches by their share of the global batch;
            # the same all-reduce tells whether any rank loaded weights since the ranks
            # last compared them (pipe.consistency).
            local = total
            total, loads = dp.global_sum([total, self._agree.loads], "sum of the loss units")
            self._agree.compare_if_loaded(dp, loads)
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
        if self.scheduler is None and hasattr(hook, "pin_hyper"):
            hook.pin_hyper()            # the caller's lr as the call is issued
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
        """A committing call's buffer updates become the layers' buffers. A buffer the
        workers held in a lower compute dtype and the call left unchanged keeps the
        user's value: writing its rounded copy back would change the model (an fp32
        buffer the forward only reads, 1 + 2^-12, would become 1.0 in bf16)."""
        for bid in range(len(self.layerset.buffers)):
            if host_store.contains(("buf", bid)):
                new, old = host_store.get(("buf", bid)), self.layerset.buffer_value(bid)
                if new.dtype != old.dtype and new.shape == old.shape and \
                        torch.equal(new, old.to(new.dtype)):
                    continue
                self.layerset.set_buffer(bid, new)

    def _fit_plan(self, inputs, labels, microbatches: int | None = None,
                  training: bool = True) -> None:
        """Room for this call's activations (docs/planning.md, "The runtime's plan");
        not with a schedule of the user's, nor data parallel (ranks keep one plan)."""
        if self.data_parallel is None and (labels is not None) not in self._user_schedules:
            new = self._planner.fit_call(
                self.plan, self.layerset, as_tree(inputs), labels if labels is None else
                as_tree(labels), microbatches or self.config.microbatches, self.host.dtype,
                self.side_inputs, self.loss_fn if self.tail_context is None else None,
                training)
            if new is not None:
                self._reaped(self._stream.drain())      # may refine it further
                refiner = self._planner.refiner
                self.plan = new = new if refiner is None else refiner.plan
                self._calls.use_plan(new)

    def _reaped(self, calls: list[Call]) -> None:
        """Calls that completed: ``partition="refine"`` learns from their timings."""
        t = time.perf_counter()
        for call in calls:
            self._refine_plan(call)
        self._stream.host_seconds["re-plan"] += time.perf_counter() - t

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
