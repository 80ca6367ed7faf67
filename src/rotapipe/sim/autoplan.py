"""The automatic planner: picks the plan, recompute grain and microbatch count with
the fastest simulated step that fits device memory, and says whether host RAM holds it.

The exact cuts and the candidate ranking are in :mod:`rotapipe.plan.partitioner`
(pure arithmetic); this module runs the best candidates through the simulator, which
models what the ranking leaves out (link contention, the priority transfer queue,
chunked weight uploads), and keeps the fastest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ..config import RecomputeGrain
from ..errors import ConfigError, PlanError
from ..plan import ModelCosts, Plan, StageKind
from ..plan.hostmem import HostMemory, host_memory
from ..plan.partitioner import Direction, Footprint, assemble_plan, candidate_plans
from ..schedule import roundpipe_schedule, roundpipe_stale_schedule
from .engine import run
from .report import Report, report
from .timing import ActionTimes

__all__ = ["PlannerConfig", "PlanChoice", "choose_plan", "simulate_plan", "device_need",
           "plan_space", "all_plans", "host_need"]


@dataclass(frozen=True)
class PlannerConfig:
    """What the planner searches and under which limits."""

    workers: int
    """Pipeline workers (devices)."""
    memory_bytes: int
    """Usable device memory per worker (after the CUDA context and fragmentation)."""
    microbatch_counts: tuple[int, ...] = (16,)
    """Microbatch counts to try (each divides the global batch)."""
    stale: bool = False
    """Minimise the steady-state step of the one-step-stale optimizer (overlapping calls)
    instead of one call with the exact optimizer."""
    refine: int = 3
    """Best candidates (by the job-grain estimate) simulated per microbatch count."""
    grains: tuple[RecomputeGrain, ...] = (RecomputeGrain.STAGE, RecomputeGrain.LAYER)
    """Recompute grains in order of preference: a later one is tried only if no plan
    fits with the earlier ones (layer grain saves memory and costs a second recompute)."""
    exhaustive: int = 400
    """Plan-space size (all tails x all forward cuts x all backward cuts) up to which
    every fitting plan is simulated: the result is then the optimum, not a ranking's
    best guess (small models, tests)."""
    grad_bytes: tuple[int, ...] | None = None
    """Device bytes of each layer's weight gradients (None: as large as its weights;
    LoRA: the adapters' only)."""

    def __post_init__(self):
        if self.workers < 1 or self.memory_bytes < 1 or self.refine < 1:
            raise ConfigError(f"workers ({self.workers}), memory_bytes ({self.memory_bytes}) "
                              f"and refine ({self.refine}) must be >= 1")
        if not self.microbatch_counts or min(self.microbatch_counts) < 1:
            raise ConfigError(f"microbatch_counts must be non-empty and >= 1, got "
                              f"{self.microbatch_counts}")


@dataclass(frozen=True)
class PlanChoice:
    """The chosen plan and what the simulator predicts for it."""

    plan: Plan
    microbatches: int
    grain: RecomputeGrain
    costs: ModelCosts
    """Per-layer costs of one microbatch of the chosen size (recompute as the grain
    runs it)."""
    report: Report
    """The simulated step."""
    estimate_ms: float
    device_bytes: int
    """Peak device bytes of the busiest worker by the planner's (sufficient) bound."""
    simulated: int = 0
    """Candidate plans simulated."""
    alternatives: tuple[tuple[int, str, float], ...] = field(default=(), repr=False)
    """(microbatches, grain, simulated step ms) of every simulated candidate."""

    @property
    def step_ms(self) -> float:
        return self.report.step_ms


def plan_space(num_layers: int) -> int:
    """Number of RoundPipe plans of ``num_layers`` layers (every tail length, every
    forward cut, every backward cut)."""
    if num_layers == 1:
        return 1
    return sum(4 ** (num_layers - t - 1) for t in range(1, num_layers))


def all_plans(num_layers: int):
    """Every RoundPipe plan of ``num_layers`` layers (see :func:`plan_space`)."""
    def cuts(n):
        for mask in range(1 << max(0, n - 1)):
            bounds = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
            yield list(zip(bounds, bounds[1:]))
    if num_layers == 1:
        yield assemble_plan(1, [], 0, [])
        return
    for tail in range(1, num_layers):
        body = num_layers - tail
        for fwd in cuts(body):
            for bwd in cuts(body):
                yield assemble_plan(num_layers, fwd, body, bwd)


def _grain_costs(costs: ModelCosts, grain: RecomputeGrain) -> ModelCosts:
    """Layer grain runs each layer's forward twice in the backward (once to rebuild
    the per-layer checkpoints, once with autograd)."""
    if grain is RecomputeGrain.STAGE:
        return costs
    return replace(costs, layers=tuple(replace(l, recompute_ms=2 * l.recompute_ms)
                                       for l in costs.layers))


def device_need(plan: Plan, fp: Footprint) -> int:
    """Bytes of the busiest worker by the planner's bound: a stage's resident bytes and
    working set beside the largest resident stage of the plan (its possible prefetch)."""
    def direction(s):
        return Direction.FORWARD if s.kind is StageKind.FORWARD else Direction.BACKWARD
    cap = max(fp.resident(direction(s), s.start, s.stop) for s in plan.jobs())
    return max(fp.needs(direction(s), s.start, s.stop, cap) for s in plan.jobs())


def simulate_plan(plan: Plan, costs: ModelCosts, workers: int, microbatches: int, *,
                  stale: bool = False, calls: int = 4) -> Report:
    """Simulate one RoundPipe step of ``plan`` (steady state with ``stale``)."""
    s = roundpipe_stale_schedule(plan, workers, microbatches, calls=calls) if stale \
        else roundpipe_schedule(plan, workers, microbatches)
    return report(run(s, ActionTimes(plan, costs)), costs.tokens * microbatches)


def choose_plan(costs_for: Callable[[int], ModelCosts], config: PlannerConfig) -> PlanChoice:
    """The fastest fitting plan. ``costs_for(M)`` gives the per-layer costs of one
    microbatch when the global batch is cut into ``M`` microbatches. Raises
    :class:`PlanError` naming the layer and the limit if nothing fits."""
    ranked: list[tuple[float, int, RecomputeGrain, Plan, ModelCosts, Footprint]] = []
    errors: list[tuple[int, int, PlanError]] = []
    calls = 6 if config.stale else 1
    for M in config.microbatch_counts:
        base = costs_for(M)
        for grain in config.grains:
            costs = _grain_costs(base, grain)
            fp = Footprint.of(base, M, grain, config.grad_bytes)
            try:
                cands = candidate_plans(fp, config.workers, config.memory_bytes, calls=calls)
            except PlanError as exc:
                errors.append((M, len(errors), exc))
                continue
            ranked += [(est, M, grain, plan, costs, fp)
                       for est, plan in cands[:config.refine]]
            if plan_space(len(base.layers)) <= config.exhaustive:
                ranked += [(0.0, M, grain, plan, costs, fp) for plan in all_plans(len(base.layers))
                           if device_need(plan, fp) <= config.memory_bytes]
            break
    if not ranked:   # the fewest tokens per microbatch tried, the first grain
        raise min(errors, key=lambda e: (-e[0], e[1]))[2]
    best, alts, seen = None, [], set()
    for est, M, grain, plan, costs, fp in ranked:
        if (M, grain, plan.to_text()) in seen:
            continue
        seen.add((M, grain, plan.to_text()))
        rep = simulate_plan(plan, costs, config.workers, M, stale=config.stale)
        alts.append((M, grain.value, rep.step_ms))
        if best is None or rep.step_ms < best[0].step_ms - 1e-9:
            best = (rep, est, M, grain, plan, costs, fp)
    rep, est, M, grain, plan, costs, fp = best
    return PlanChoice(plan, M, grain, costs, rep, est, device_need(plan, fp), len(seen),
                      tuple(alts))


def host_need(choice: PlanChoice, workers: int,
              trainable_params: Sequence[int] | None = None) -> HostMemory:
    """Host memory of the chosen plan (see :func:`rotapipe.plan.hostmem.host_memory`)."""
    return host_memory(choice.costs, choice.plan, choice.microbatches, workers,
                       trainable_params=trainable_params)
