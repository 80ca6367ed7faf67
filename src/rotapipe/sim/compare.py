"""Build the seven schedules for one model and machine, simulate each, compare them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

from .._validate import integer
from ..errors import ConfigError, PlanError
from ..plan import ModelCosts, Plan, Recompute, bound_plan
from ..plan.balance import roundpipe_plans
from ..plan.partitioner import Footprint, candidate_plans
from ..schedule import (Schedule, gpipe_schedule, interleaved_1f1b_schedule,
                        looped_bfs_schedule, mobius_schedule, one_f_one_b_schedule,
                        roundpipe_schedule, roundpipe_stale_schedule)
from ..schedule.timeline import Timeline
from .engine import run
from .report import Report, report
from .timing import ActionTimes, memory_sizes

__all__ = ["SCHEDULES", "SimConfig", "SimResult", "build_schedule", "simulate", "compare",
           "schedule_names"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "mobius", "roundpipe",
             "roundpipe-stale")
"""Every schedule the simulator compares, in table order."""

_ALIASES = MappingProxyType({"interleaved": "interleaved-1f1b", "bfs": "looped-bfs",
                             "roundpipe-exact": "roundpipe", "exact": "roundpipe",
                             "stale": "roundpipe-stale", "all": "all"})


@dataclass(frozen=True)
class SimConfig:
    """How to run the schedules being compared."""

    devices: int
    microbatches: int
    virtual_stages: int = 2
    """Chunks per device of interleaved 1F1B, looped BFS and Mobius."""
    recompute: Recompute | str | bool = Recompute.OFF
    """Whether and how the baselines recompute their forward in the backward instead of
    keeping activations on the device (:class:`~rotapipe.plan.Recompute`: ``"off"``,
    ``"ahead"`` ours, ``"after-grad"`` the paper's; ``True`` is ``"ahead"``). Mobius
    always recomputes (``"ahead"`` when this is off). RoundPipe always recomputes every
    backward stage but the tail, ahead of the gradient."""
    calls: int = 4
    """Overlapping calls simulated for RoundPipe with the stale optimizer."""
    refine: int = 4
    """RoundPipe plans simulated to pick the best: this many of the partitioner's and
    of the compute-only search's candidates each, by their job-grain estimates; 1 takes
    the partitioner's best as is."""
    memory_limit: int | None = None
    """Device memory in bytes, to flag schedules that do not fit (None: no check)."""

    def __post_init__(self):
        try:
            object.__setattr__(self, "recompute", Recompute.of(self.recompute))
        except PlanError as exc:
            raise ConfigError(str(exc)) from None
        # The ranges of `rotapipe simulate`'s flags: beyond them a run is a typo (a
        # million devices simulated for two minutes), and a float count a TypeError.
        integer("devices", self.devices, maximum=1024)
        integer("microbatches", self.microbatches, maximum=4096)
        integer("virtual_stages", self.virtual_stages, maximum=64)
        integer("calls", self.calls, minimum=2, maximum=64,
                allowed="an int in [2, 64] (at least 2 to measure a steady state)")
        integer("refine", self.refine, maximum=1000)
        integer("memory_limit", self.memory_limit, optional=True,
                allowed="device memory in bytes, a positive int")


@dataclass(frozen=True)
class SimResult:
    """A schedule, when each of its actions ran, and what that means."""

    schedule: Schedule
    timeline: Timeline
    report: Report


def schedule_names(text: str) -> tuple[str, ...]:
    """Parse ``gpipe,1f1b,...`` (aliases: interleaved, bfs, exact, stale, all)."""
    names: list[str] = []
    for raw in text.split(","):
        name = _ALIASES.get(raw.strip().lower(), raw.strip().lower())
        if name == "all":
            names.extend(SCHEDULES)
        elif name in SCHEDULES:
            names.append(name)
        elif name:
            raise ConfigError(f"unknown schedule {raw.strip()!r}: use any of "
                              f"{', '.join(SCHEDULES)} (comma-separated)")
    return tuple(dict.fromkeys(names))


def build_schedule(name: str, costs: ModelCosts, config: SimConfig,
                   plan: Plan | None = None) -> Schedule:
    """Schedule ``name`` for ``costs`` on ``config.devices`` devices. Without ``plan``
    the baselines get the best contiguous partition (:func:`bound_plan`) and RoundPipe
    the fastest in simulation of the ``config.refine`` best candidates of the
    memory-aware partitioner (:func:`~rotapipe.plan.partitioner.candidate_plans`,
    under ``config.memory_limit``) and of the compute-only search
    (:func:`~rotapipe.plan.balance.roundpipe_plans`) that fits ``config.memory_limit``
    (the fastest of all when none fits); ``refine=1`` takes the partitioner's best as
    is."""
    p, M, L = config.devices, config.microbatches, len(costs.layers)
    if name in ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "mobius"):
        chunks = p if name in ("gpipe", "1f1b") else p * config.virtual_stages
        if chunks > L:
            raise ConfigError(f"{name} needs {chunks} chunks of at least one layer but the "
                              f"model has {L} layers: use fewer devices or virtual stages")
        recompute = config.recompute
        if name == "mobius" and recompute is Recompute.OFF:
            recompute = Recompute.AHEAD     # always recomputes; weights swapped from the host
        plan = plan or bound_plan(costs, chunks, devices=p, recompute=recompute)
        if name == "mobius":
            return mobius_schedule(plan, p, M, recompute=recompute)
        make = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule,
                "interleaved-1f1b": interleaved_1f1b_schedule,
                "looped-bfs": looped_bfs_schedule}[name]
        return make(plan, p, M, recompute=recompute)
    if name not in ("roundpipe", "roundpipe-stale"):
        raise ConfigError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)}")
    stale = name == "roundpipe-stale"

    def make(plan: Plan) -> Schedule:
        if stale:
            return roundpipe_stale_schedule(plan, p, M, calls=config.calls,
                                            frozen=costs.frozen)
        return roundpipe_schedule(plan, p, M)

    if plan is not None:
        return make(plan)
    # The memory-aware planner's best candidates, and (for the rare case its job-grain
    # ranking misses) the best of the compute-only search; the simulator picks.
    limit = config.memory_limit or 2**62
    fp = Footprint.of(costs, M)
    try:
        ours = [plan for _, plan in candidate_plans(fp, p, limit, calls=6 if stale else 1)]
    except PlanError:
        ours = []   # nothing fits: fall back to the compute-only plans (flagged OOM)
    plans = ours[:config.refine] + roundpipe_plans(costs, p, M, overlap=stale)[:config.refine]
    if config.refine == 1:
        plans = plans[:1]
    candidates = [make(c) for c in {c.to_text(): c for c in plans}.values()]
    if len(candidates) == 1:
        return candidates[0]
    tokens = costs.tokens * M
    sizes = memory_sizes(costs) if config.memory_limit else None

    def rank(s: Schedule) -> tuple[bool, float]:
        # A candidate that fits the memory limit beats any that does not (the
        # compute-only plans know no memory).
        rep = report(run(s, ActionTimes(s.plan, costs)), tokens, sizes, config.memory_limit)
        return rep.fits is False, rep.step_ms
    return min(candidates, key=rank)


def simulate(schedule: Schedule, costs: ModelCosts, *,
             memory_limit: int | None = None) -> SimResult:
    """Run ``schedule`` on ``costs`` and measure it."""
    timeline = run(schedule, ActionTimes(schedule.plan, costs))
    rep = report(timeline, costs.tokens * schedule.microbatches, memory_sizes(costs),
                 memory_limit)
    return SimResult(schedule, timeline, rep)


def compare(costs: ModelCosts, config: SimConfig,
            names: Sequence[str] = SCHEDULES) -> list[SimResult]:
    """Build and simulate each schedule of ``names`` (see :func:`build_schedule`)."""
    return [simulate(build_schedule(n, costs, config), costs,
                     memory_limit=config.memory_limit) for n in names]
