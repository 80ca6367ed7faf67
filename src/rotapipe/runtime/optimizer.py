"""The host optimizer: its modes, chosen once, and the optimizer hook each call gets.

Three ways to step (``PipeConfig.optimizer_mode``, docs/optimizer.md): ``sync`` steps every
master after the call; ``overlap`` steps each stage's parameters on the host lane as
soon as their gradients are complete (:class:`~rotapipe.runtime.overlapstep.OverlapStep`), and the next call's
weight uploads wait only for the steps of their own layers; ``stale`` steps a
complete call's gradients while the next call runs, on weights one step old
(:class:`~rotapipe.runtime.stepping.WholeStep`); :class:`HostOptimizer` is the mode of a
pipeline.

Stepping a subset of the parameters with the user's optimizer works by giving only
those parameters a ``.grad``: ``torch.optim`` skips parameters whose gradient is
``None``, and optimizers whose state is per parameter (SGD with momentum, Adam, AdamW
and their foreach/fused kernels) then compute exactly what one step over all of them
would. Optimizers that couple parameters (LBFGS, or a global-norm trust ratio inside
``step``) are not exact in ``overlap``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import torch

from ..config import NonFinite, OptimizerMode
from ..errors import CheckpointError, NonFiniteError
from ..schedule import Schedule
from .callgrads import CallGrads
from .host import HostState, LossScaler
from .optstate import StatePrecision
from .overlapstep import OverlapStep
from .stepping import CallHook, Cost, Room, WholeStep, clip

__all__ = ["HostOptimizer"]


class HostOptimizer:
    """The optimizer side of a pipeline in its mode, chosen once at construction.

    A training call gets a :class:`CallHook` (:meth:`call_hook`) that does the mode's
    optimizer work as the call's gradients reach the host: ``sync`` only accumulates
    them, and the call that ends a step steps once it is complete (:class:`WholeStep`); ``overlap`` steps each
    stage's parameters as soon as their gradients are complete (:class:`OverlapStep`);
    ``stale`` steps all of them once the call is complete, into the compute copies
    that the calls two steps later read (:class:`WholeStep`). In the two asynchronous
    modes calls overlap: :meth:`reads` says which earlier call's update a call's weight
    uploads wait for. The optimizer and the cost hook are passed per call: the user may
    attach the optimizer late, timed emulation sets the hook."""

    def __init__(self, host: HostState, scaler: LossScaler, mode: OptimizerMode,
                 max_norm: float | None, nonfinite: NonFinite = NonFinite.RAISE,
                 undo: bool = True, states: StatePrecision | None = None):
        self.host, self.scaler, self.mode, self.max_norm = host, scaler, mode, max_norm
        self.states = states or StatePrecision()
        """``PipeConfig.optimizer_state_dtype``: every step goes through it."""
        self.nonfinite = nonfinite
        self.undo = undo
        """``PipeConfig.undo_steps``: snapshot what each speculative step changes."""
        self.broken: str | None = None
        """Set when a call failed after stepping some stages without snapshots: the
        model is partly stepped and later training calls are refused."""
        self.last_norm: float | None = None
        """Global gradient norm (before clipping) of the last step taken, when
        clipping is on (``None`` otherwise)."""
        self.last_skipped = False
        """Whether the last step was skipped (overflow under dynamic loss scaling, or a
        non-finite gradient with ``nonfinite="skip"``)."""
        self.nonfinite_skips = 0
        """Steps skipped for a non-finite gradient (``nonfinite="skip"``)."""
        self.rows_room = Room()
        """Host buffers the rows stepped first (``OR``) are gathered into, kept
        between steps: fresh allocations of that size each step cost more than the
        gathers (page faults)."""

    def finite(self, grads: Mapping[int, torch.Tensor],
               norms: dict[int, torch.Tensor] | None = None,
               known: Collection[int] = ()) -> bool:
        """Whether every gradient in ``grads`` (parameter index -> gradient; ``norms``:
        their L2 norms where already computed; ``known``: parameters already known to
        be finite, not read) is finite, judged by its norm. If not:
        under dynamic loss scaling it is an fp16 overflow (``False``: skip the step);
        otherwise ``nonfinite="raise"`` raises :class:`NonFiniteError` naming the
        parameters, ``"skip"`` returns ``False`` (the step is skipped)."""
        norms = norms or {}
        bad = [pid for pid in grads if pid not in known and not torch.isfinite(
            norms[pid] if pid in norms else torch.linalg.vector_norm(grads[pid]))]
        if not bad:
            return True
        if self.scaler.dynamic or self.nonfinite is NonFinite.SKIP:
            return False
        names = self.host.layerset.param_names
        kind = "NaN" if any(torch.isnan(grads[pid]).any() for pid in bad) else "infinite"
        raise NonFiniteError(
            f"the gradient of {names[bad[0]]}" + (f" (and {len(bad) - 1} more)"
                                                  if len(bad) > 1 else "") +
            f" is not finite ({kind}); no weight, gradient or optimizer state changed. "
            + (f"The backward ran with a fixed loss scale of {self.scaler.scale:g}, which "
               "can overflow a low-precision gradient: lower "
               "PrecisionConfig(loss_scale=...) or use loss_scale='dynamic'. "
               if self.scaler.scale > 1 else "") +
            "Lower the learning rate, check the data, clip gradients (clip_grad_norm), "
            "or set PipeConfig(nonfinite='skip') to skip such steps")

    def skipped(self, skip: bool) -> None:
        """Record whether the step just finished was skipped (and count a non-finite
        skip); the loss scale follows."""
        self.scaler.update(skip)
        self.last_skipped = skip
        if skip and not self.scaler.dynamic:
            self.nonfinite_skips += 1

    @property
    def clipped(self) -> bool:
        """Whether the last step's clip took effect (its norm was above ``max_norm``:
        ``torch.nn.utils.clip_grad_norm_``'s coefficient below 1). ``overlap`` then
        takes its next step whole once the call is complete instead of speculatively
        per stage (the schedule makes the next call wait for the whole step either way);
        a step whose norm stays below the limit brings the speculation back."""
        return self.max_norm is not None and self.last_norm is not None and \
            self.max_norm / (self.last_norm + 1e-6) < 1.0

    @property
    def overlapping(self) -> bool:
        """Whether this mode lets the next call start while this one drains."""
        return self.mode is not OptimizerMode.SYNC

    def reads(self, step_ends: list[int]) -> int | None:
        """The earlier call (index in the stream) whose update the next call's weight
        uploads must wait for, given the stream's calls that ended a step so far:
        ``overlap`` reads the last step (exact), ``stale`` the one before (the calls of
        step ``t`` run on the weights after step ``t - 2``); ``None``: none."""
        if self.mode is OptimizerMode.OVERLAP and step_ends:
            return step_ends[-1]
        if self.mode is OptimizerMode.STALE and len(step_ends) >= 2:
            return step_ends[-2]
        return None

    @property
    def rows_first(self) -> bool:
        """Whether this mode steps first the embedding rows the next call looks up
        (``OR`` actions): ``overlap`` with per-stage steps, a non-finite gradient
        failing the call (``nonfinite="raise"``: a skipped step would have to undo
        rows the next call already read)."""
        return self.mode is OptimizerMode.OVERLAP and not self.whole_step \
            and self.nonfinite is NonFinite.RAISE

    @property
    def reads_whole_step(self) -> bool:
        """Whether the next call's weight uploads wait for every hand-off of the step
        they read (the schedule's ``whole_step``): when the step needs every gradient
        (:attr:`whole_step`), and in ``overlap`` with ``nonfinite="skip"``, whose step
        is skipped (its speculative per-stage steps undone) when a stage handing off
        late brings a non-finite gradient: the next call must not have read the
        deeper stages' steps by then."""
        return self.whole_step or (self.mode is OptimizerMode.OVERLAP
                                   and self.nonfinite is NonFinite.SKIP)

    @property
    def whole_step(self) -> bool:
        """Whether a step needs the whole call's gradients before it updates any
        weight (``sync``; clipping to a global norm or dynamic loss scaling, whose
        step depends on every gradient). Otherwise ``overlap`` and ``stale`` step each
        stage's parameters as soon as their gradients are complete."""
        return self.mode is OptimizerMode.SYNC or self.max_norm is not None \
            or self.scaler.dynamic

    def view(self, steps: int) -> int:
        """Which set of compute copies the calls of step ``steps`` (counted in the
        stream) upload (``stale`` keeps two: :attr:`HostState.views`)."""
        return steps % len(self.host.views)

    def call_hook(self, optimizer, schedule: Schedule, stage_pids: Callable[[str], list[int]],
                  grads: CallGrads, units: float, step: bool, cost: Cost, reduce=None,
                  view: int = 0) -> CallHook:
        """The optimizer work of one training call (``step``: the call ends a step;
        ``reduce``: its data-parallel all-reduce)."""
        if self.broken is not None:
            raise CheckpointError(self.broken)
        stale = self.mode is OptimizerMode.STALE
        if step and self.mode is OptimizerMode.OVERLAP and self.whole_step and \
                (not self.undo or self.clipped):
            # Lean layout with clipping (or dynamic scaling): no speculative steps to
            # undo; one exact whole step once the call is complete (not overlapped).
            # The same after a step whose clip took effect: the next one likely clips
            # too, and its speculative steps would only be undone and redone.
            return WholeStep(self, optimizer, grads, units, cost, None, reduce, schedule,
                             stage_pids)
        if step and (self.mode is OptimizerMode.OVERLAP or stale and not self.whole_step):
            return OverlapStep(self, optimizer, schedule, stage_pids, grads, units, cost,
                               reduce, view=view if stale else None)
        if step:
            # sync: every set of compute copies; stale: the set two steps ahead reads.
            return WholeStep(self, optimizer, grads, units, cost,
                             view if self.mode is OptimizerMode.STALE else None, reduce,
                             schedule, stage_pids)
        return CallHook(self.host, grads, units, reduce, self, schedule, stage_pids)

    def sync_step(self, optimizer: torch.optim.Optimizer, cost: Cost,
                  view: int | None = None) -> bool:
        """Step every master on its ``.grad`` now; ``False``: skipped (overflow).
        Refreshes the compute copies of ``view`` (default: all)."""
        host = self.host
        params = host.layerset.params
        # With nonfinite="raise" every call's gradients were checked at its commit, and
        # the accumulated ones are a convex combination of them: finite, no second pass.
        checked = self.nonfinite is NonFinite.RAISE and not self.scaler.dynamic
        overflow = not checked and not self.finite(
            {pid: params[pid].grad for pid in host.trainable if params[pid].grad is not None})
        if not overflow:
            self.last_norm = clip((params[pid] for pid in host.trainable), self.max_norm)
            try:
                self.states.step(optimizer, [params[pid] for pid in host.trainable])
            except Exception as exc:
                # No snapshot in a synchronous step: what the optimizer updated before
                # it raised stays updated. Keep the workers' copies on the masters
                # (consistent) and say so.
                host.write_back(view=view)
                if hasattr(exc, "add_note"):      # Python 3.11+
                    exc.add_note(
                        "rotapipe: the optimizer's step() raised; a synchronous step keeps "
                        "no snapshot, so parameters it updated before raising keep their "
                        "update (the workers' copies follow them; the gradients are kept, "
                        "not cleared): restore a checkpoint (pipe.load_state_dict and the "
                        "optimizer's load_state_dict) before stepping again")
                raise
            host.write_back(view=view)
            if cost is not None:
                cost(list(host.trainable))
        self.skipped(overflow)
        host.zero_grad()
        return not overflow

    def flush(self) -> None:
        """After the calls in flight completed: every set of compute copies follows
        the masters (``stale``: the next call runs on the current weights)."""
        if len(self.host.views) > 1:
            self.host.write_back()
