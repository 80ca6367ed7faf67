"""Timed emulation: emulated workers whose kernels and copies take the time a hardware
profile says (``PipeConfig.emulation``), from the simulator's action times."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..errors import ConfigError
from ..plan import ModelCosts, Plan, Stage
from ..schedule import Action
from ..sim.timing import DEFAULT_CHUNK, ActionTimes, host_step_ms

__all__ = ["TimedEmulation", "MIN_ACTION_MS"]

MIN_ACTION_MS = 20.0
"""Real milliseconds the shortest compute action should last under
:meth:`TimedEmulation.calibrated`: on this project's 2-core machine, Llama-3.1-8B's
70-job plan read 5-6% slower than the simulator at 15 ms and 0.4-4% at 20 ms
(docs/performance.md)."""


@dataclass(frozen=True)
class TimedEmulation:
    """Emulated workers that take the time real hardware would (``PipeConfig.emulation``).

    Every compute action lasts at least its simulated duration under :attr:`costs`
    (FLOPs over the device's sustained TFLOPS), every copy holds its host link for its
    bytes over the link bandwidth (per-layer chunks for weights), and the host
    optimizer takes :attr:`optimizer_params_per_s`, all multiplied by
    :attr:`dilation` (> 1 slows everything down so that Python overhead is small
    against it). The real scheduling, events, transfer engine and optimizer code run
    unchanged; the layers themselves may be small stand-ins (:func:`stand_in`) with the
    same layer count, so a 32B model runs without allocating 32B parameters.
    """

    costs: ModelCosts
    """Per-layer times of the emulated model on the emulated hardware (one microbatch),
    e.g. :func:`rotapipe.plan.model_costs` of a Hugging Face config."""
    dilation: float = 1.0
    """Real seconds per emulated second."""
    optimizer_params_per_s: float = 2e9
    """Host optimizer throughput in parameters per second (fused CPU AdamW over fp32
    masters: about 1.8e9 on 2 cores here, several times that on a server's sockets)."""
    trainable: bool = True
    """Whether every layer's weights are trained (optimizer time), else none are."""
    dtype_bytes: int = 2
    """Bytes per parameter in :attr:`costs`' ``weight_bytes`` (the compute dtype)."""

    def __post_init__(self):
        if not self.dilation > 0 or not self.optimizer_params_per_s > 0:
            raise ConfigError(f"TimedEmulation: dilation ({self.dilation}) and "
                              f"optimizer_params_per_s ({self.optimizer_params_per_s}) "
                              "must be > 0")

    @classmethod
    def of(cls, model, hardware, *, seq: int = 2048, microbatch_size: int = 1,
           dilation: float = 1.0, call_tokens: int | None = None, **kw) -> TimedEmulation:
        """Timed emulation of a Hugging Face config (name from
        :data:`rotapipe.plan.KNOWN_MODELS`, path or dict) on a hardware profile (name
        like ``"rtx4090x8"`` or :class:`~rotapipe.plan.Hardware`). ``call_tokens``: the
        embedding moves by the rows of that many tokens per call (run the
        :meth:`stand_in` with ``lookups=``; see :func:`rotapipe.plan.model_costs`)."""
        from ..plan import hardware as named, model_costs
        hw = named(hardware) if isinstance(hardware, str) else hardware
        return cls(model_costs(model, hw, seq=seq, microbatch_size=microbatch_size,
                               call_tokens=call_tokens), dilation, **kw)

    def calibrated(self, plan: Plan, schedule, *, min_action_ms: float = MIN_ACTION_MS,
                   target_s: float = 0.0) -> TimedEmulation:
        """This emulation with the :attr:`dilation` at which the shortest compute action
        of ``schedule`` (run on ``plan`` under :attr:`costs`) takes ``min_action_ms``
        real milliseconds, and one call of it at least ``target_s`` real seconds
        (never below 1). Issuing an action costs a fraction of a millisecond of Python,
        and more on a loaded machine: a fixed dilation that keeps that small on an idle
        machine does not on a busy one, while this one scales with the plan's own
        shortest action (see :data:`MIN_ACTION_MS`)."""
        from ..sim import run
        times = ActionTimes(plan, self.costs)
        compute = [sum(times(a)) for a in schedule.actions if a.lane.value == "compute"]
        shortest = min((ms for ms in compute if ms > 0), default=0.0)
        if shortest <= 0:
            raise ConfigError("TimedEmulation.calibrated: the schedule has no compute "
                              "action with a duration: pass a schedule of this plan")
        dilation = min_action_ms / shortest
        if target_s > 0:
            dilation = max(dilation, target_s * 1e3 / run(schedule, times).makespan)
        return replace(self, dilation=max(1.0, dilation))

    def action_seconds(self, plan: Plan, chunk_bytes: int | None = DEFAULT_CHUNK):
        """``fn(action) -> chunk durations in real seconds`` for ``plan``."""
        times, scale = ActionTimes(plan, self.costs, chunk_bytes), self.dilation / 1e3
        cache: dict[tuple, tuple[float, ...]] = {}

        def seconds(a: Action) -> tuple[float, ...]:
            key = (a.kind, a.stage, a.at)
            if key not in cache:
                cache[key] = tuple(ms * scale for ms in times(a))
            return cache[key]
        return seconds

    def optimizer_ms(self, plan: Plan, whole_step: bool) -> Callable[[Stage], float]:
        """``fn(stage)`` -> emulated ms of the optimizer work a stage's ``O`` action does
        in the runtime (for :class:`~rotapipe.sim.ActionTimes`): its layers' step
        (``overlap``), or with ``whole_step`` (``sync`` and ``stale``) the whole model's
        at the call's last hand-off (:func:`rotapipe.sim.timing.host_step_ms`)."""
        if not self.trainable:
            return lambda stage, rows=False: 0.0
        return host_step_ms(plan, self.costs, self.optimizer_params_per_s,
                            whole_step=whole_step, dtype_bytes=self.dtype_bytes)

    def optimizer_seconds(self, layers, rows: bool = False) -> float:
        """Real seconds the host optimizer takes over the weights of ``layers``;
        ``rows``: an ``OR`` action, which steps first the rows of the embedding table
        (layer 0) the next call looks up, each at
        :data:`~rotapipe.plan.costs.ROWS_FIRST_COST` rows of the
        whole step (the whole table where that is cheaper:
        :meth:`rows_first_pays`, as the runtime decides), and the rest of the layers
        whole (:meth:`rotapipe.plan.ModelCosts.stepped_params`)."""
        if not self.trainable:
            return 0.0
        params = self.costs.stepped_params(layers, self.dtype_bytes, rows)
        return params / self.optimizer_params_per_s * self.dilation

    def rows_first_pays(self) -> bool:
        """Whether stepping first the embedding rows one call looks up (``OR``) costs
        less than stepping the whole table (layer 0), as the runtime decides it."""
        return self.costs.rows_first_pays()

    def stand_in(self, dim: int = 8, vocab: int = 32, seq: int = 16):
        """A tiny GPT-like ``nn.Sequential`` with as many layers as :attr:`costs`
        (embedding, blocks, head) whose real compute is negligible next to the
        emulated times; train it on :func:`rotapipe.model.tiny.stride_batch` data."""
        from ..model.tiny import tiny_gpt
        return tiny_gpt(vocab, dim, len(self.costs.layers) - 2, heads=2, seq=seq)
