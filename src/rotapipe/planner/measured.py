"""Measured per-layer costs: an accumulator of online timings that refines a plan as
timings arrive and freezes it once they are stable.

The runtime (or a profiling pass) calls :meth:`MeasuredCosts.record` with each layer's
forward, recompute and backward time of one microbatch; each is smoothed with an
exponential moving average. :meth:`MeasuredCosts.apply` overlays the averages on an
analytic :class:`~rotapipe.plan.ModelCosts` (layers never timed keep their estimate).
:class:`PlanRefiner` re-plans only when some average moved by more than ``tolerance``
since the last plan, and stops re-planning for good once every timed layer has been
stable for ``patience`` consecutive checks, so a run does not re-plan every step.
Pure: no clocks, no threads; the caller owns the object.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..errors import ConfigError
from ..plan.costs import ModelCosts
from ..plan.partition import Plan

__all__ = ["Pass", "MeasuredCosts", "PlanRefiner"]


class Pass(str, enum.Enum):
    """Which timing of a layer; the value is the :class:`LayerCost` field it sets."""

    FORWARD = "forward_ms"
    RECOMPUTE = "recompute_ms"
    BACKWARD = "backward_ms"


@dataclass
class MeasuredCosts:
    """Exponential moving averages of per-layer timings (ms per microbatch)."""

    num_layers: int
    alpha: float = 0.3
    """Weight of a new sample in the average."""
    min_samples: int = 3
    """Samples a (layer, pass) needs before its average is used."""
    _avg: dict[tuple[int, Pass], float] = field(default_factory=dict, repr=False)
    _count: dict[tuple[int, Pass], int] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.num_layers < 1 or not 0 < self.alpha <= 1 or self.min_samples < 1:
            raise ConfigError(f"MeasuredCosts needs num_layers >= 1 (got {self.num_layers}), "
                              f"0 < alpha <= 1 (got {self.alpha}), min_samples >= 1 "
                              f"(got {self.min_samples})")

    def record(self, layer: int, kind: Pass | str, ms: float) -> None:
        """Add one timing of ``layer``'s ``kind`` pass for one microbatch."""
        kind = Pass(kind) if not isinstance(kind, Pass) else kind
        if not 0 <= layer < self.num_layers:
            raise ConfigError(f"layer {layer} is outside 0..{self.num_layers - 1}")
        if ms < 0:
            raise ConfigError(f"layer {layer} {kind.name.lower()} time {ms} ms is negative")
        key = (layer, kind)
        old = self._avg.get(key)
        self._avg[key] = ms if old is None else (1 - self.alpha) * old + self.alpha * ms
        self._count[key] = self._count.get(key, 0) + 1

    def averages(self) -> dict[tuple[int, Pass], float]:
        """The averages that have ``min_samples`` samples."""
        return {k: v for k, v in self._avg.items() if self._count[k] >= self.min_samples}

    def apply(self, base: ModelCosts) -> ModelCosts:
        """``base`` with every sufficiently sampled timing replaced by its average."""
        if len(base.layers) != self.num_layers:
            raise ConfigError(f"measured {self.num_layers} layers, the costs have "
                              f"{len(base.layers)}")
        layers = list(base.layers)
        for (i, kind), v in self.averages().items():
            layers[i] = replace(layers[i], **{kind.value: v})
        return replace(base, layers=tuple(layers))


@dataclass
class PlanRefiner:
    """Re-plans from measured costs when they moved, and freezes once they are stable.

    ``planner(costs) -> Plan`` is any planner (e.g. a closure over
    :func:`rotapipe.planner.choose_plan`)."""

    planner: Callable[[ModelCosts], Plan]
    base: ModelCosts
    plan: Plan
    tolerance: float = 0.05
    """Relative change of an average that counts as a move."""
    patience: int = 3
    """Consecutive checks without a move after which the plan is frozen."""
    replans: int = 0
    frozen: bool = False
    _last: dict = field(default_factory=dict, repr=False)
    _planned_on: dict = field(default_factory=dict, repr=False)
    _quiet: int = 0

    def update(self, measured: MeasuredCosts) -> Plan:
        """Check the averages (call once per step); returns the plan to use."""
        if self.frozen:
            return self.plan
        now = measured.averages()
        if not now:
            return self.plan
        moved = self._moved(now, self._last)
        self._last = dict(now)
        self._quiet = 0 if moved else self._quiet + 1
        if self._moved(now, self._planned_on):
            new = self.planner(measured.apply(self.base))
            self._planned_on = dict(now)
            if new != self.plan:
                self.plan, self.replans = new, self.replans + 1
        if self._quiet >= self.patience:
            self.frozen = True
        return self.plan

    def _moved(self, now: dict, then: dict) -> bool:
        if now.keys() != then.keys():
            return True
        return any(abs(v - then[k]) > self.tolerance * max(abs(then[k]), 1e-9)
                   for k, v in now.items())
