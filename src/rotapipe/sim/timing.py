"""How long each action takes under a :class:`~rotapipe.plan.ModelCosts`, and the
device-memory sizes the same costs imply."""

from __future__ import annotations

from ..errors import ConfigError
from ..plan import ModelCosts, Plan, Stage
from ..schedule import Action, ActionKind as K
from ..schedule.memory import MemorySizes

__all__ = ["ActionTimes", "memory_sizes"]


class ActionTimes:
    """``times(action)`` -> the action's duration in ms, as chunks.

    Compute sums its stage's layers: ``F``/``FK`` forward, ``R`` recompute,
    ``B``/``BK`` backward, ``FT`` forward + backward (no recompute). An activation or
    gradient transfer at boundary ``b`` costs one hop of layer ``b - 1``'s output (a
    model-input upload costs ``input_hop_ms``). A weight upload is one chunk per layer;
    a weight-gradient download takes as long as the upload. Frees, side inputs, buffer
    downloads and optimizer hand-offs take no time.
    """

    def __init__(self, plan: Plan, costs: ModelCosts):
        if len(costs.layers) != plan.num_layers:
            raise ConfigError(f"the costs describe {len(costs.layers)} layers, the plan "
                             f"{plan.num_layers}")
        self.costs = costs
        self.stages: dict[str, Stage] = {s.name: s for s in plan.jobs() + plan.eval_jobs()}
        self._cache: dict[tuple, tuple[float, ...]] = {}

    def __call__(self, a: Action) -> tuple[float, ...]:
        key = (a.kind, a.stage, a.at)
        if key not in self._cache:
            self._cache[key] = self._times(a)
        return self._cache[key]

    def _times(self, a: Action) -> tuple[float, ...]:
        c, s = self.costs, self.stages[a.stage]
        layers = c.layers[s.start:s.stop]
        if a.kind in (K.FORWARD, K.FORWARD_KEEP):
            return (sum(l.forward_ms for l in layers),)
        if a.kind is K.RECOMPUTE:
            return (sum(l.recompute_ms for l in layers),)
        if a.kind in (K.BACKWARD, K.BACKWARD_KEPT):
            return (sum(l.backward_ms for l in layers),)
        if a.kind is K.FUSED:
            return (sum(l.forward_ms + l.backward_ms for l in layers),)
        if a.kind in (K.UPLOAD_ACT, K.UPLOAD_GRAD, K.DOWNLOAD_ACT, K.DOWNLOAD_GRAD):
            return (c.boundary_hop_ms(a.at),)
        if a.kind is K.UPLOAD_WEIGHTS:
            return tuple(l.upload_ms for l in layers)
        if a.kind is K.DOWNLOAD_WGRAD:
            return (sum(l.upload_ms for l in layers),)
        return (0.0,)


def memory_sizes(costs: ModelCosts) -> MemorySizes:
    """The per-layer byte sizes of ``costs`` in the schedule's memory model."""
    return MemorySizes(tuple(l.weight_bytes for l in costs.layers),
                       tuple(l.saved_bytes for l in costs.layers),
                       tuple(l.output_bytes for l in costs.layers), costs.input_bytes)

