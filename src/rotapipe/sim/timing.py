"""How long each action takes under a :class:`~rotapipe.plan.ModelCosts`, and the
device-memory sizes the same costs imply."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ConfigError
from ..plan import ModelCosts, Plan, Stage, StageKind
from ..schedule import Action, ActionKind as K
from ..schedule.memory import MemorySizes
from ..plan.hardware import layer_chunks

__all__ = ["ActionTimes", "TimedEmulation", "memory_sizes", "DEFAULT_CHUNK"]

DEFAULT_CHUNK = 32 << 20
"""Bytes per weight chunk, as ``PipeConfig.copy_chunk_mb``'s default."""


class ActionTimes:
    """``times(action)`` -> the action's duration in ms, as chunks.

    Compute sums its stage's layers: ``F``/``FK`` forward, ``R`` recompute,
    ``B``/``BK`` backward, ``FT`` forward + backward (no recompute). An activation or
    gradient transfer at boundary ``b`` costs one hop of layer ``b - 1``'s output (a
    model-input upload costs ``input_hop_ms``). A weight upload moves each layer in
    ``layer_chunks(weight_bytes, chunk_bytes)`` equal chunks (the runtime's gated
    chunks, ``rotapipe.runtime.transfer``); a weight-gradient download takes as long as
    the upload, in the same chunks. Frees, side inputs, buffer downloads and optimizer
    hand-offs take no time, unless ``optimizer_ms(stage)`` gives the host optimizer
    work an ``O`` action does (:meth:`TimedEmulation.optimizer_ms`). ``chunk_bytes=None``:
    one chunk per layer.
    """

    def __init__(self, plan: Plan, costs: ModelCosts, chunk_bytes: int | None = DEFAULT_CHUNK,
                 optimizer_ms: Callable[[Stage], float] | None = None):
        if len(costs.layers) != plan.num_layers:
            raise ConfigError(f"the costs describe {len(costs.layers)} layers, the plan "
                             f"{plan.num_layers}")
        self.costs = costs
        self.chunk_bytes = chunk_bytes
        self.optimizer_ms = optimizer_ms
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
        if a.kind in (K.UPLOAD_WEIGHTS, K.DOWNLOAD_WGRAD):
            out: list[float] = []
            for l in layers:
                k = 1 if self.chunk_bytes is None else \
                    layer_chunks(l.weight_bytes, self.chunk_bytes)
                out += [l.upload_ms / k] * k
            return tuple(out)
        if a.kind is K.OPTIMIZER and self.optimizer_ms is not None:
            return (self.optimizer_ms(s),)
        return (0.0,)


def memory_sizes(costs: ModelCosts) -> MemorySizes:
    """The per-layer byte sizes of ``costs`` in the schedule's memory model."""
    return MemorySizes(tuple(l.weight_bytes for l in costs.layers),
                       tuple(l.saved_bytes for l in costs.layers),
                       tuple(l.output_bytes for l in costs.layers), costs.input_bytes)



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
           dilation: float = 1.0, **kw) -> TimedEmulation:
        """Timed emulation of a Hugging Face config (name from
        :data:`rotapipe.plan.KNOWN_MODELS`, path or dict) on a hardware profile (name
        like ``"rtx4090x8"`` or :class:`~rotapipe.plan.Hardware`)."""
        from ..plan import hardware as named, model_costs
        hw = named(hardware) if isinstance(hardware, str) else hardware
        return cls(model_costs(model, hw, seq=seq, microbatch_size=microbatch_size),
                   dilation, **kw)

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
        in the runtime: its layers' step (``overlap``), or with ``whole_step`` (``sync``
        and ``stale``) the whole model's at the call's last hand-off."""
        updaters = [st for st in plan.jobs() if st.kind is not StageKind.FORWARD]
        last = updaters[-1].name if updaters else None
        every = range(len(self.costs.layers))

        def ms(stage: Stage) -> float:
            layers = (every if stage.name == last else ()) if whole_step else stage.layers
            return self.optimizer_seconds(layers) / self.dilation * 1e3
        return ms

    def optimizer_seconds(self, layers) -> float:
        """Real seconds the host optimizer takes over the weights of ``layers``."""
        if not self.trainable:
            return 0.0
        params = sum(self.costs.layers[l].weight_bytes for l in layers) / self.dtype_bytes
        return params / self.optimizer_params_per_s * self.dilation

    def stand_in(self, dim: int = 8, vocab: int = 32, seq: int = 16):
        """A tiny GPT-like ``nn.Sequential`` with as many layers as :attr:`costs`
        (embedding, blocks, head) whose real compute is negligible next to the
        emulated times; train it on :func:`rotapipe.model.tiny.stride_batch` data."""
        from ..model.tiny import tiny_gpt
        return tiny_gpt(vocab, dim, len(self.costs.layers) - 2, heads=2, seq=seq)
