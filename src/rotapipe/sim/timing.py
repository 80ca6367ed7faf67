"""How long each action takes under a :class:`~rotapipe.plan.ModelCosts`, and the
device-memory sizes the same costs imply. (The runtime's timed emulation,
:class:`rotapipe.runtime.emulation.TimedEmulation`, makes emulated workers take these
times.)"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import ConfigError
from ..plan import ModelCosts, Plan, Stage, StageKind
from ..schedule import Action, ActionKind as K
from ..schedule.actions import stage_map
from ..schedule.memory import MemorySizes
from ..plan.hardware import layer_chunks

__all__ = ["ActionTimes", "memory_sizes", "host_step_ms", "DEFAULT_CHUNK"]

DEFAULT_CHUNK = 32 << 20
"""Bytes per weight chunk, as ``PipeConfig.copy_chunk_mb``'s default."""


def host_step_ms(plan: Plan, costs: ModelCosts, params_per_s: float, *,
                 whole_step: bool = False, dtype_bytes: int = 2
                 ) -> Callable[..., float]:
    """``fn(stage, rows=False)`` -> ms of host optimizer work a stage's ``O`` action
    does in the runtime (``ActionTimes(optimizer_ms=...)``), the optimizer stepping
    ``params_per_s`` parameters per second (:meth:`ModelCosts.stepped_params`): its
    layers' step (``overlap``; a layer is stepped at the hand-off of the last job
    holding it, so a split tail's last job steps the head once), or with
    ``whole_step`` (``sync`` and ``stale``, and ``overlap`` when the step needs every
    gradient) the whole model's at the call's last hand-off. ``rows=True``: the
    stage's ``OR`` action (the embedding rows the next call looks up)."""
    updaters = [st for st in plan.jobs() if st.kind is not StageKind.FORWARD]
    last = updaters[-1].name if updaters else None
    every = range(len(costs.layers))
    stepper = {l: st.name for st in updaters for l in st.layers}

    def ms(stage: Stage, rows: bool = False) -> float:
        layers = (every if stage.name == last else ()) if whole_step else \
            [l for l in stage.layers if stepper[l] == stage.name]
        return costs.stepped_params(layers, dtype_bytes, rows) / params_per_s * 1e3
    return ms


class ActionTimes:
    """``times(action)`` -> the action's duration in ms, as chunks.

    Compute sums its stage's layers: ``F``/``FK`` forward, ``R`` recompute,
    ``B``/``BK`` backward, ``FT`` forward + backward (no recompute). An activation or
    gradient transfer at boundary ``b`` costs one hop of layer ``b - 1``'s output (a
    model-input upload costs ``input_hop_ms``). A weight upload moves each layer in
    ``layer_chunks(weight_bytes, chunk_bytes)`` equal chunks (the runtime's gated
    chunks, ``rotapipe.runtime.transfer``); a weight-gradient download takes as long as
    the upload (or the layer's ``grad_ms``: LoRA), in the same chunks; the trained
    part of a split upload (``UT``) as long as its gradients' download (a layer whose
    ``grad_ms`` is ``None`` is all trained: its upload), in chunks of its own bytes
    (``grad_bytes``: one for LoRA's adapters). Frees, side
    inputs, buffer downloads and optimizer hand-offs take no time, unless
    ``optimizer_ms(stage)`` gives the host optimizer work an ``O`` action does
    (:func:`host_step_ms`), and
    ``optimizer_ms(stage, rows=True)`` the work of an ``OR`` (the looked-up rows' step).
    ``chunk_bytes=None``: one chunk per layer.
    """

    def __init__(self, plan: Plan, costs: ModelCosts, chunk_bytes: int | None = DEFAULT_CHUNK,
                 optimizer_ms: Callable[[Stage], float] | None = None):
        if len(costs.layers) != plan.num_layers:
            raise ConfigError(f"the costs describe {len(costs.layers)} layers, the plan "
                             f"{plan.num_layers}")
        self.costs = costs
        self.chunk_bytes = chunk_bytes
        self.optimizer_ms = optimizer_ms
        self.stages: dict[str, Stage] = stage_map(plan)
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
        if a.kind in (K.UPLOAD_WEIGHTS, K.UPLOAD_TRAINED, K.DOWNLOAD_WGRAD):
            out: list[float] = []
            for l in layers:
                nbytes = l.weight_bytes if a.kind is not K.UPLOAD_TRAINED or \
                    l.grad_bytes is None else l.grad_bytes
                k = 1 if self.chunk_bytes is None else layer_chunks(nbytes, self.chunk_bytes)
                # The trained part (adapters) is the size of its gradients; the frozen
                # part of a split upload is the whole upload (LayerCost leaves the
                # adapters out of weight_bytes and upload_ms).
                ms = l.upload_ms if a.kind is K.UPLOAD_WEIGHTS else l.dw_ms
                out += [ms / k] * k
            return tuple(out)
        if a.kind is K.OPTIMIZER and self.optimizer_ms is not None:
            return (self.optimizer_ms(s),)
        if a.kind is K.OPTIMIZER_ROWS and self.optimizer_ms is not None:
            return (self.optimizer_ms(s, rows=True),)
        return (0.0,)


def memory_sizes(costs: ModelCosts) -> MemorySizes:
    """The per-layer byte sizes of ``costs`` in the schedule's memory model (LoRA
    costs: weight gradients of the adapters' size)."""
    lora = any(l.grad_bytes is not None for l in costs.layers)
    return MemorySizes(tuple(l.weight_bytes for l in costs.layers),
                       tuple(l.saved_bytes for l in costs.layers),
                       tuple(l.output_bytes for l in costs.layers), costs.input_bytes,
                       tuple(l.weight_bytes if l.grad_bytes is None else l.grad_bytes
                             for l in costs.layers) if lora else None)
