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

import heapq
import math

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from .._enums import RecomputeGrain
from ..errors import ConfigError, PlanError
from ..plan import ModelCosts, Plan, StageKind
from ..plan.hostmem import HostMemory, host_memory
from ..plan.partitioner import (Direction, Footprint, assemble_plan, candidate_plans,
                                candidate_tail_sizes, estimate_step_ms)
from ..schedule import roundpipe_schedule, roundpipe_stale_schedule
from ..sim.engine import run
from .exact import _plan_bound, _Terms, call_lower_bound, exact_search
from ..sim.report import Report, loss_period, report
from ..sim.timing import ActionTimes, host_step_ms

__all__ = ["PlannerConfig", "PlanChoice", "choose_plan", "simulate_plan", "device_need",
           "plan_space", "all_plans", "host_need", "ModeSteps", "optimizer_modes",
           "OPTIMIZER_RATE"]


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
    prefetch: int = 1
    """Stages whose weights a worker uploads ahead of the one it computes
    (``PipeConfig.prefetch``): the memory bound counts each beside every stage."""
    prune: bool = True
    """Skip what lower bounds prove slower than the best plan simulated so far (the
    choice is the same). ``False`` simulates every ranked candidate: the reference
    the tests compare the pruned search with."""

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
    """Candidate plans simulated (the rest were proven slower by a lower bound)."""
    alternatives: tuple[tuple[int, str, float], ...] = field(default=(), repr=False)
    """(microbatches, grain, simulated step ms) of every simulated candidate."""

    @property
    def step_ms(self) -> float:
        return self.report.step_ms


_STALE_EXHAUSTIVE = 21
"""Largest plan space (4 layers) whose every fitting plan is simulated with
overlapping calls: no lower bound prunes those, and each simulation runs several
calls (a 6-layer model's 256 fitting plans took 1-4 s on 2 cores for steps within 5%
of the ranked candidates' best)."""


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
    working set beside ``fp.prefetch`` stages as large as the plan's largest (its
    possible prefetches)."""
    def direction(s):
        return Direction.FORWARD if s.kind is StageKind.FORWARD else Direction.BACKWARD
    cap = max(fp.resident(direction(s), s.start, s.stop) for s in plan.jobs())
    return max(fp.needs(direction(s), s.start, s.stop, cap) for s in plan.jobs())


def simulate_plan(plan: Plan, costs: ModelCosts, workers: int, microbatches: int, *,
                  stale: bool = False, calls: int = 4) -> Report:
    """Simulate one RoundPipe step of ``plan`` (steady state with ``stale``)."""
    s = roundpipe_stale_schedule(plan, workers, microbatches, calls=calls,
                                 frozen=costs.frozen) if stale \
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
    otherwise the best simulated of the top ``config.refine`` ranked candidates of
    every microbatch count, grain and tail split. With the exact optimizer, lower
    bounds skip what cannot win (:func:`_search`): the choice is the one simulating
    every candidate would make."""
    calls = 6 if config.stale else 1
    found, errors, simulated = _search(list(_groups(costs_for, config)), config)
    if not found:   # the fewest tokens per microbatch tried, the first grain
        raise min(errors, key=lambda e: e[0])[1]
    found.sort(key=lambda f: f[0])
    best = None
    for cand in found:   # first of equals: the order above is the preference order
        if best is None or cand[1].step_ms < best[1].step_ms - 1e-9:
            best = cand
    _, rep, g, plan = best
    return PlanChoice(plan, g.M, g.grain, g.costs, rep,
                      estimate_step_ms(plan, g.fp, config.workers, calls),
                      device_need(plan, g.fp), simulated,
                      tuple((f[2].M, f[2].grain.value, f[1].step_ms) for f in found))


@dataclass(frozen=True)
class _Group:
    """The plans of one microbatch count, grain and tail-job count: searched exactly,
    or ranked by :func:`candidate_plans` and the best few simulated."""

    rank: int
    """Preference order among groups (loop order: counts, grains, split tails, then
    the single-job tail)."""
    M: int
    grain: RecomputeGrain
    tail_jobs: int
    costs: ModelCosts
    fp: Footprint
    exact: bool
    bound: float
    """No plan of the group simulates faster (0: unknown, with overlapping calls)."""


def _groups(costs_for, config: PlannerConfig):
    W, rank = config.workers, 0
    for M in config.microbatch_counts:
        base = costs_for(M)
        L = len(base.layers)
        exact = plan_space(L) <= config.exhaustive and not config.stale
        for grain in config.grains:
            costs = _grain_costs(base, grain)
            fp = Footprint.of(base, M, grain, config.grad_bytes, config.prefetch)
            share = (fp.cost(Direction.FORWARD, 0, L) + fp.cost(Direction.BACKWARD, 0, L)) / W
            # Split the tail only where its job weighs on the step (a large vocabulary's
            # head next to small blocks): at least a quarter of a worker's share.
            heavy = L > 1 and fp.tail_cost(L - 1) >= _HEAVY_TAIL * share
            splits = [k for k in config.tail_jobs if k != 1 and k <= min(W, M) and heavy]
            for k in splits + [1]:
                longest = None if exact and k == 1 else max(
                    candidate_tail_sizes(fp, W, tail_layers=config.tail_layers), default=None)
                bound = 0.0 if config.stale or not config.prune else \
                    call_lower_bound(costs, W, M, tail_jobs=k, max_tail=longest)
                yield _Group(rank, M, grain, k, costs, fp, exact and k == 1, bound)
                rank += 1


def _beaten(bound: float, best: float) -> bool:
    """Whether a step of at least ``bound`` loses to ``best`` (rounding slack: a bound
    may exceed its own step by an ulp or so; an equal step is never skipped)."""
    return bound * (1 - 1e-9) > best + 1e-6


def _search(groups: list[_Group], config: PlannerConfig):
    """Simulate only what can still win, best-first: a queue of groups (by
    :func:`call_lower_bound`) and of their ranked candidates (by their
    :func:`step_lower_bound`), lowest bound first. A group is expanded (ranked, or
    searched exactly) when it comes up; a candidate is simulated. Everything left once the lowest bound exceeds
    the best simulated step is slower than it. Returns (found, errors, plans
    simulated); ``found`` holds (preference key, report, group, plan)."""
    W, memory = config.workers, config.memory_bytes
    found: list[tuple[tuple[int, ...], Report, _Group, Plan]] = []
    errors: list[tuple[tuple[int, int], PlanError]] = []
    best, simulated = math.inf, 0
    # (bound, sequence number, group, candidate index or -1 for the group, plan)
    queue: list[tuple[float, int, _Group, int, Plan | None]] = [
        (g.bound, i, g, -1, None) for i, g in enumerate(groups)]
    heapq.heapify(queue)
    seq = len(queue)
    while queue:
        bound, _, g, i, plan = heapq.heappop(queue)
        if _beaten(bound, best):
            break
        if plan is not None:
            rep = simulate_plan(plan, g.costs, W, g.M, stale=config.stale)
            simulated += 1
            found.append(((1, g.rank, i), rep, g, plan))
            best = min(best, rep.step_ms)
        elif g.exact:
            hit = exact_search(g.costs, g.fp, W, g.M, memory,
                               lambda p, c=g.costs, m=g.M: simulate_plan(p, c, W, m),
                               config.tail_layers)
            if hit is None:
                errors.append(((-g.M, g.rank),
                               _no_fit_error(g.fp, W, memory, config.tail_layers)))
                continue
            simulated += hit[2]
            found.append(((0, g.rank, 0), hit[1], g, hit[0]))
            best = min(best, hit[1].step_ms)
        else:
            try:
                plans = _ranked(g, config)
            except PlanError as exc:
                if g.tail_jobs == 1:    # the single-job tail reports what does not fit
                    errors.append(((-g.M, g.rank), exc))
                continue
            terms = None if config.stale or not config.prune else _Terms(g.costs, g.M)
            for i, p in enumerate(plans):
                heapq.heappush(queue, (0.0 if terms is None else _plan_bound(p, terms, W),
                                       seq, g, i, p))
                seq += 1
    return found, errors, simulated


def _ranked(g: _Group, config: PlannerConfig) -> list[Plan]:
    """The group's candidates to simulate, in ranking order: the best
    ``config.refine`` by the job-grain estimate (and, for a small model with
    overlapping calls, every fitting plan)."""
    cands = candidate_plans(g.fp, config.workers, config.memory_bytes,
                            calls=6 if config.stale else 1, tail_jobs=g.tail_jobs,
                            tail_layers=config.tail_layers, limit=config.refine)
    plans: dict[str, Plan] = {}
    for _, p in cands:
        plans.setdefault(p.to_text(), p)
    L = len(g.costs.layers)
    if g.tail_jobs == 1 and plan_space(L) <= min(config.exhaustive, _STALE_EXHAUSTIVE):
        for p in all_plans(L):     # every fitting plan
            if device_need(p, g.fp) <= config.memory_bytes and config.tail_layers in (
                    None, p.num_layers - p.tail.start):
                plans.setdefault(p.to_text(), p)
    return list(plans.values())


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


OPTIMIZER_RATE = 5e9
"""Host optimizer throughput :func:`optimizer_modes` assumes by default, in parameters
per second: fused CPU AdamW over fp32 masters on a server's sockets (the figure the
benchmarks use; this project's 2-core machine does about 1.8e9)."""

_MODE_CALLS = 3
"""Overlapping calls simulated per mode: the period between the last two losses is
already the steady one (within 0.1% of 6 calls' on the paper's five models)."""


@dataclass(frozen=True)
class ModeSteps:
    """A plan's step in each optimizer mode with the host optimizer's time
    (:func:`optimizer_modes`); ms."""

    rate: float
    """Host optimizer throughput assumed, parameters per second."""
    params: float
    """Parameters one step updates."""
    call_ms: float
    """One call alone, without optimizer work."""
    overlap_ms: float | None = None
    """``overlap``: the steady state of pipelined exact calls (``None``: not simulated)."""
    stale_ms: float | None = None
    """``stale``: the steady state of pipelined one-step-stale calls."""
    clip: bool = False
    """Priced as with a global-norm clip that takes effect: the whole step at the last
    hand-off, which ``overlap``'s next call waits for."""

    @property
    def step_ms(self) -> float:
        """One whole step's host optimizer work."""
        return self.params / self.rate * 1e3

    @property
    def sync_ms(self) -> float:
        """``sync``: the call, then the whole step (one call at a time)."""
        return self.call_ms + self.step_ms


def optimizer_modes(choice: PlanChoice, workers: int, rate: float = OPTIMIZER_RATE, *,
                    pipelined: bool = True, clip: bool = False) -> ModeSteps:
    """The step of ``choice``'s plan in each optimizer mode, the host optimizer stepping
    ``rate`` parameters per second (:func:`rotapipe.sim.timing.host_step_ms`; LoRA costs:
    the adapters only). ``sync``: one call, then the whole step. With ``pipelined``,
    ``overlap`` and ``stale`` too: the steady state of overlapping calls
    (:func:`~rotapipe.schedule.roundpipe_stale_schedule`, the schedule the runtime runs,
    each hand-off doing its stages' step, the embedding's rows stepped first where that
    pays; frozen weights uploaded without waiting), measured between losses as the
    runtime's tokens/s are (:func:`rotapipe.sim.report.loss_period`). ``clip``: as with
    ``clip_grad_norm`` when the clip takes effect, step after step: one whole step once
    each call is complete (``whole_step``; ``overlap`` stops speculating after such a
    step, :attr:`rotapipe.runtime.optimizer.HostOptimizer.clipped`). When the norm
    stays below the limit, ``overlap`` steps per stage during the backward and its next
    call waits only for the last of those steps: faster than priced here."""
    if not rate > 0:
        raise ConfigError(f"optimizer rate {rate!r}: use parameters per second, > 0 "
                          "(e.g. 5e9)")
    plan, costs, M = choice.plan, choice.costs, choice.microbatches
    call = choice.report.step_ms if choice.report.calls == 1 else \
        simulate_plan(plan, costs, workers, M).step_ms
    params = costs.stepped_params(range(len(costs.layers)))
    steps = {}
    if pipelined:
        frozen = costs.frozen
        rows = (0,) if costs.rows_first_pays() and 0 not in frozen else ()
        times = ActionTimes(plan, costs,
                            optimizer_ms=host_step_ms(plan, costs, rate, whole_step=clip))
        for mode, staleness in (("overlap_ms", 0), ("stale_ms", 1)):
            s = roundpipe_stale_schedule(plan, workers, M, calls=_MODE_CALLS,
                                         staleness=staleness, whole_step=clip,
                                         frozen=frozen, rows_first=rows)
            steps[mode] = loss_period(run(s, times), plan, _MODE_CALLS - 2)
    return ModeSteps(rate, params, call, clip=clip, **steps)
