"""The automatic planner: picks the plan, recompute grain and microbatch count with
the fastest simulated step that fits device memory, and says whether host RAM holds it.

The exact cuts and the candidate ranking are in :mod:`rotapipe.plan.partitioner`
(pure arithmetic); this module runs the best candidates through the simulator, which
models what the ranking leaves out (link contention, the priority transfer queue,
chunked weight uploads), and keeps the fastest. Small models (up to 10 layers by
default) are searched exactly instead: every plan bounded below, the promising ones
simulated (:mod:`rotapipe.planner.exact`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ..config import RecomputeGrain
from ..errors import ConfigError, PlanError
from ..plan import ModelCosts, Plan, StageKind
from ..plan.hostmem import HostMemory, host_memory
from ..plan.partitioner import (Direction, Footprint, assemble_plan, candidate_plans,
                                estimate_step_ms)
from ..schedule import roundpipe_schedule, roundpipe_stale_schedule
from ..sim.engine import run
from .exact import exact_search
from ..sim.report import Report, report
from ..sim.timing import ActionTimes

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
    """Recompute grains to try, in order of preference on equal step times. Layer grain
    costs a second recompute but keeps one layer's activations instead of the stage's,
    so its backward stages can be longer under the same memory (fewer boundaries to
    cross); the fastest simulated plan of any grain wins."""
    exhaustive: int = 100_000
    """Plan-space size (all tails x all forward cuts x all backward cuts,
    :func:`plan_space`) up to which the search is exact: every fitting plan is bounded
    below and simulated best-first (:mod:`rotapipe.planner.exact`), so the result is the
    optimum, not a ranking's best guess. The default covers models of up to 10 layers
    (87,381 plans, about a second); with ``stale`` every fitting plan is simulated, so
    keep it small there."""
    grad_bytes: tuple[int, ...] | None = None
    """Device bytes of each layer's weight gradients (None: as large as its weights;
    LoRA: the adapters' only)."""
    tail_layers: int | None = None
    """Fix the fused tail's length (``None``: the planner chooses it)."""
    tail_jobs: tuple[int, ...] = (1,)
    """Tail job counts to try (:attr:`rotapipe.plan.Plan.tail_jobs`; counts above the
    workers or the microbatches are skipped, and so are all splits when a one-layer
    tail's job is under a quarter of a worker's share of the step). Split tails are
    ranked candidates: the exact search covers single-job tails."""

    def __post_init__(self):
        if self.workers < 1 or self.memory_bytes < 1 or self.refine < 1:
            raise ConfigError(f"workers ({self.workers}), memory_bytes ({self.memory_bytes}) "
                              f"and refine ({self.refine}) must be >= 1")
        if not self.tail_jobs or min(self.tail_jobs) < 1:
            raise ConfigError(f"tail_jobs must be non-empty and >= 1, got {self.tail_jobs}")
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


_STALE_EXHAUSTIVE = 400
"""Largest plan space whose every fitting plan is simulated with overlapping calls
(no lower bound prunes those)."""


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


_HEAVY_TAIL = 0.25
"""A tail job this fraction of a worker's share of the step is worth splitting."""


def choose_plan(costs_for: Callable[[int], ModelCosts], config: PlannerConfig) -> PlanChoice:
    """The fastest fitting plan. ``costs_for(M)`` gives the per-layer costs of one
    microbatch when the global batch is cut into ``M`` microbatches. Raises
    :class:`PlanError` naming the layer and the limit if nothing fits.

    Exact (the fastest simulated step of every fitting plan) when the plan space is at
    most ``config.exhaustive`` plans and calls do not overlap (:mod:`.exact`);
    otherwise the best simulated of the top ``config.refine`` ranked candidates."""
    ranked: list[tuple[float, int, RecomputeGrain, Plan, ModelCosts, Footprint]] = []
    found: list[tuple[Report, int, RecomputeGrain, Plan, ModelCosts, Footprint]] = []
    errors: list[tuple[int, int, PlanError]] = []
    calls = 6 if config.stale else 1
    W, memory = config.workers, config.memory_bytes
    simulated = 0
    for M in config.microbatch_counts:
        base = costs_for(M)
        space = plan_space(len(base.layers))
        for grain in config.grains:
            costs = _grain_costs(base, grain)
            fp = Footprint.of(base, M, grain, config.grad_bytes)
            L = len(base.layers)
            share = (fp.cost(Direction.FORWARD, 0, L) + fp.cost(Direction.BACKWARD, 0, L)) / W
            # Split the tail only where its job weighs on the step (a large vocabulary's
            # head next to small blocks): at least a quarter of a worker's share.
            heavy = L > 1 and fp.tail_cost(L - 1) >= _HEAVY_TAIL * share
            for k in config.tail_jobs:
                if k == 1 or k > min(W, M) or not heavy:
                    continue
                try:
                    cands = candidate_plans(fp, W, memory, calls=calls, tail_jobs=k,
                                            tail_layers=config.tail_layers)
                except PlanError:
                    continue            # the single-job tail reports what does not fit
                ranked += [(est, M, grain, plan, costs, fp)
                           for est, plan in cands[:config.refine]]
            if space <= config.exhaustive and not config.stale:
                hit = exact_search(costs, fp, W, M, memory,
                                   lambda p, c=costs, m=M: simulate_plan(p, c, W, m),
                                   config.tail_layers)
                if hit is None:
                    errors.append((M, len(errors),
                                   _no_fit_error(fp, W, memory, config.tail_layers)))
                    continue
                plan, rep, n = hit
                simulated += n
                found.append((rep, M, grain, plan, costs, fp))
                continue
            try:
                cands = candidate_plans(fp, W, memory, calls=calls,
                                        tail_layers=config.tail_layers)
            except PlanError as exc:
                errors.append((M, len(errors), exc))
                continue
            ranked += [(est, M, grain, plan, costs, fp)
                       for est, plan in cands[:config.refine]]
            if space <= min(config.exhaustive, _STALE_EXHAUSTIVE):   # every fitting plan
                ranked += [(0.0, M, grain, plan, costs, fp) for plan in all_plans(len(base.layers))
                           if device_need(plan, fp) <= memory and config.tail_layers in
                           (None, plan.num_layers - plan.tail.start)]
    if not ranked and not found:   # the fewest tokens per microbatch tried, the first grain
        raise min(errors, key=lambda e: (-e[0], e[1]))[2]
    seen = set()
    for est, M, grain, plan, costs, fp in ranked:
        if (M, grain, plan.to_text()) in seen:
            continue
        seen.add((M, grain, plan.to_text()))
        found.append((simulate_plan(plan, costs, W, M, stale=config.stale), M, grain, plan,
                      costs, fp))
    best = None
    for cand in found:   # first of equals: the order above is the preference order
        if best is None or cand[0].step_ms < best[0].step_ms - 1e-9:
            best = cand
    rep, M, grain, plan, costs, fp = best
    return PlanChoice(plan, M, grain, costs, rep, estimate_step_ms(plan, fp, W, calls),
                      device_need(plan, fp), simulated + len(seen),
                      tuple((m, g.value, r.step_ms) for r, m, g, *_ in found))


def _no_fit_error(fp: Footprint, workers: int, memory: int,
                  tail_layers: int | None) -> PlanError:
    """The error :func:`candidate_plans` gives (it names the layer that cannot fit)."""
    try:
        candidate_plans(fp, workers, memory, tail_layers=tail_layers)
    except PlanError as exc:
        return exc
    return PlanError(f"no plan fits {memory:,} bytes of device memory")   # not reached


def host_need(choice: PlanChoice, workers: int,
              trainable_params: Sequence[int] | None = None) -> HostMemory:
    """Host memory of the chosen plan (see :func:`rotapipe.plan.hostmem.host_memory`)."""
    return host_memory(choice.costs, choice.plan, choice.microbatches, workers,
                       trainable_params=trainable_params)
