"""Frozen configuration dataclasses for a pipeline and its parts."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from . import _validate as check
# The closed sets TrainConfig and the command line need, defined without torch so that
# `rotapipe train --help` does not import it; they are this module's names.
from ._enums import (BackendKind, NonFinite, OptimizerMode, PinMode, RecomputeGrain,
                     ShardMode, StateDtype)
from .errors import ConfigError

__all__ = ["RecomputeGrain", "BackendKind", "DataParallelConfig", "NonFinite",
           "OptimizerMode", "PartitionMode", "PinMode", "PipeConfig", "PrecisionConfig",
           "ShardMode", "StateDtype"]


class PartitionMode(str, enum.Enum):
    """How a :class:`rotapipe.RoundPipe` without an explicit ``plan=`` cuts its layers
    into stages (docs/planning.md, "The runtime's plan")."""

    AUTO = "auto"
    """The planner's fastest plan that fits ``device_memory``, from costs the runtime
    knows (each layer's FLOPs and bytes, or the timed emulation's costs); on CUDA GPUs
    without data parallelism it then refines the plan from measured timings, as
    ``"refine"``. ``forward_stages`` / ``backward_stages`` set explicitly switch to the
    even partition."""
    EVEN = "even"
    """Even split into ``forward_stages`` / ``backward_stages`` stages."""
    REFINE = "refine"
    """As ``auto``, then re-planned from measured per-stage times between the first
    training calls, until the timings are stable (then frozen)."""


MAX_WORKERS = 256
"""Most workers a pipeline takes: a server has a handful of GPUs, and an emulated worker
starts one thread per stream (several thousand workers exhaust the process's threads)."""

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(value: torch.dtype | str) -> torch.dtype:
    """Turn ``"bf16"``, ``"float16"``, ``torch.float32``... into a torch dtype."""
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.lower() in _DTYPES:
        dtype = _DTYPES[value.lower()]
    else:
        raise ConfigError(f"compute_dtype={value!r} is not supported: use one of "
                          "'float32', 'bfloat16' or 'float16'")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"compute_dtype={dtype} is not supported: use float32, "
                          "bfloat16 or float16")
    return dtype


@dataclass(frozen=True)
class PrecisionConfig:
    """Compute precision and loss scaling; fp32 master weights always live on the CPU."""

    compute_dtype: torch.dtype | str = torch.float32
    """dtype of the weights the workers compute with (fp32, bf16 or fp16)."""
    loss_scale: str | float | None = None
    """``"dynamic"`` (default for fp16): scale the loss and skip steps whose gradients
    overflow, as ``torch.amp.GradScaler`` does; a number for a fixed scale; ``None``
    for no scaling (default for fp32 and bf16)."""
    init_scale: float = 2.0 ** 16
    """Starting loss scale of dynamic scaling."""
    growth_interval: int = 2000
    """Steps without overflow after which dynamic scaling doubles the scale."""

    def __post_init__(self):
        object.__setattr__(self, "compute_dtype", resolve_dtype(self.compute_dtype))
        ls = self.loss_scale
        if isinstance(ls, str) and ls.strip().lower() == "dynamic":
            ls = "dynamic"
        elif ls is not None:
            ls = check.number("loss_scale", ls, low=0, low_open=True,
                              allowed="'dynamic', a finite number > 0, or None")
        if ls is None and self.compute_dtype == torch.float16:
            ls = "dynamic"
        object.__setattr__(self, "loss_scale", ls)
        check.number("init_scale", self.init_scale, low=0, low_open=True)
        check.integer("growth_interval", self.growth_interval,
                      allowed="a positive int (steps)")


@dataclass(frozen=True)
class DataParallelConfig:
    """Data parallelism across ``torch.distributed`` ranks (one process per server, each
    driving all its workers); see ``docs/distributed.md``."""

    enabled: bool | None = None
    """``None``: on when a ``torch.distributed`` process group is initialized with more
    than one rank; ``True``: require one; ``False``: off (each process trains alone)."""
    bucket_mb: float = 25.0
    """Gradients of a stage are all-reduced in flat fp32 buckets of at most this many
    MiB (one bucket per stage when smaller)."""
    timeout_s: float = 300.0
    """A collective that has not completed this long after the caller started waiting
    for it fails the call with :class:`rotapipe.DistributedError` naming the lost rank.
    Keep it at most the process group's own timeout, and longer than the slowest thing
    one rank does alone between calls (rank 0 writing a checkpoint)."""
    heartbeat_s: float = 0.5
    """Interval of the liveness heartbeat each rank writes to the rendezvous store; it
    tells a dead rank from a hung one when a collective fails."""
    shard: ShardMode | str = ShardMode.NONE
    """``"none"``, ``"optimizer"`` or ``"gradients"`` (:class:`ShardMode`): whether the
    fp32 masters, optimizer state (and accumulated gradients) are split across the
    ranks."""
    grad_dtype: torch.dtype | str = torch.float32
    """dtype gradients travel in when sharded: ``float32`` (exact) or ``bfloat16`` (half
    the bytes; the owner sums the ranks' contributions and steps in fp32, but each
    contribution is rounded to bf16 first: an approximation)."""

    inflight_mb: float | None = None
    """Backpressure: MiB of collective buffers a rank keeps in flight (the send and
    receive buffers of the sharded modes' reduce-scatters and all-gathers, the flat
    buckets of the all-reduce). When the next bucket would pass it, the host lane first
    waits for the oldest, and the workers' backward waits once ``2 x workers`` stages
    are queued behind the host lane: a link slower than the backward costs step time,
    not host memory (docs/distributed.md, "Backpressure"). ``None``: ``4 x bucket_mb``.
    A bucket larger than this still goes, alone."""

    @property
    def inflight_bytes(self) -> int:
        """:attr:`inflight_mb` in bytes (its default filled in)."""
        mb = self.inflight_mb if self.inflight_mb is not None else 4 * self.bucket_mb
        return int(mb * 2**20)

    def __post_init__(self):
        if self.enabled not in (None, True, False):
            raise ConfigError(f"data_parallel.enabled={self.enabled!r}: use None (auto), "
                              "True or False")
        check.number("data_parallel.inflight_mb", self.inflight_mb, low=0, low_open=True,
                     unit="MiB", optional=True)
        check.number("data_parallel.bucket_mb", self.bucket_mb, low=0, low_open=True,
                     unit="MiB")
        check.number("data_parallel.timeout_s", self.timeout_s, low=0, low_open=True,
                     unit="seconds")
        check.number("data_parallel.heartbeat_s", self.heartbeat_s, low=0, low_open=True,
                     unit="seconds")
        object.__setattr__(self, "shard", check.choice(ShardMode, "data_parallel.shard",
                                                       self.shard))
        dtype = self.grad_dtype
        if isinstance(dtype, str):
            dtype = _DTYPES.get(dtype.lower(), dtype)
        if dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"data_parallel.grad_dtype={self.grad_dtype!r}: use "
                              "'float32' or 'bfloat16'")
        if dtype == torch.bfloat16 and self.shard is ShardMode.NONE:
            raise ConfigError("data_parallel.grad_dtype='bfloat16' needs a sharded mode (the "
                              "owner sums the bf16 contributions in fp32): set "
                              "shard='optimizer' or 'gradients', or keep grad_dtype='float32'")
        object.__setattr__(self, "grad_dtype", dtype)


@dataclass(frozen=True)
class PipeConfig:
    """How a :class:`rotapipe.RoundPipe` splits, schedules and runs a model."""

    workers: int | None = None
    """Number of workers. ``None``: every CUDA GPU, or 2 emulated workers without one."""
    microbatches: int = 4
    """Microbatches each ``forward_backward`` call splits its batch into."""
    grain: RecomputeGrain | str = RecomputeGrain.STAGE
    """Recompute grain of backward stages: ``"stage"`` (fast) or ``"layer"`` (least
    device memory)."""
    partition: PartitionMode | str = PartitionMode.AUTO
    """``"auto"`` (the planner), ``"even"`` or ``"refine"`` (the planner, then measured
    timings): see :class:`PartitionMode`. An explicit ``RoundPipe(plan=...)`` wins."""
    forward_stages: int | None = None
    """Number of forward stages. Setting it (or ``backward_stages``) selects the even
    partition. ``None``: the planner's choice, or ``2 x workers`` for an even
    partition, capped by the number of layers before the tail."""
    backward_stages: int | None = None
    """Number of backward stages (setting it selects the even partition). ``None``: the
    planner's choice, or ``3 x forward_stages`` for an even partition (backward costs
    about 3x forward, so backward stages hold about a third of the layers)."""
    tail_layers: int = 1
    """Layers in the fused tail stage (forward, loss and backward without recompute).
    The runtime's planner keeps it too: the tail keeps all its activations, whose size
    it does not know before the first call (``rotapipe plan`` chooses it)."""
    backend: BackendKind | str = BackendKind.AUTO
    """``"auto"``, ``"cuda"`` or ``"emulated"``."""
    device_memory: int | None = None
    """Per-worker memory budget in bytes for emulated workers (``None``: unlimited).
    Allocations beyond it raise :class:`rotapipe.DeviceOutOfMemoryError`."""
    check_races: bool = True
    """Emulated backend: raise :class:`rotapipe.RaceError` when data is read on a
    stream that has not waited for the event that produced it."""
    seed: int = 0
    """Base of the per-(call, microbatch, layer) random streams (dropout)."""
    precision: PrecisionConfig | torch.dtype | str = field(default_factory=PrecisionConfig)
    """Compute dtype and loss scaling (:class:`PrecisionConfig`; a dtype such as
    ``"bf16"`` is shorthand for its ``compute_dtype``)."""
    data_parallel: DataParallelConfig | bool | None = None
    """Data parallelism across ``torch.distributed`` ranks (:class:`DataParallelConfig`;
    a bool or ``None`` is shorthand for its ``enabled``). Default: on exactly when a
    process group with more than one rank is initialized."""
    optimizer_mode: OptimizerMode | str = OptimizerMode.SYNC
    """When :meth:`~rotapipe.RoundPipe.train_step` steps the optimizer, and whether
    training calls overlap: ``"sync"``, ``"overlap"`` or ``"stale"``
    (:class:`OptimizerMode`, docs/optimizer.md). (The optimizer algorithm itself is the
    ``torch.optim.Optimizer`` you attach.)"""
    clip_grad_norm: float | None = None
    """Clip gradients to this global L2 norm before every step, as
    ``torch.nn.utils.clip_grad_norm_`` over all trainable parameters (``None``: off)."""
    nonfinite: NonFinite | str = NonFinite.RAISE
    """A non-finite loss or gradient: ``"raise"`` (the call fails, nothing changes) or
    ``"skip"`` (the step is skipped and counted): :class:`NonFinite`."""
    undo_steps: bool = True
    """``overlap`` and ``stale``: copy each stage's weights and optimizer state just
    before stepping them, so that a call that fails after some stages stepped is undone
    exactly (the copies live until the call completes: 12 bytes per trained parameter
    with Adam, more than its gradients). ``False``, the lean host layout
    (docs/memory.md): no copies; a call that fails after a stage stepped leaves the
    model partly stepped, and the pipeline then refuses further training calls until
    a checkpoint is loaded into a new pipeline. Clipping under ``overlap`` still redoes
    the step exactly: it needs no copy of the weights then (the step waits for the
    global norm)."""
    optimizer_state_dtype: StateDtype | str = StateDtype.FP32
    """How the optimizer state is kept between steps: ``"fp32"`` (exact), ``"bf16"``
    (half the bytes; torch.optim Adam/AdamW/SGD) or ``"int8"`` (a bitsandbytes 8-bit
    optimizer): :class:`StateDtype`, docs/optimizer.md. Approximations except fp32."""
    timeout_s: float = 600.0
    """A call whose workers make no progress for this long fails instead of hanging;
    a worker still stuck in an action this long after a failure retires the pipeline
    (later calls raise at once) rather than blocking the caller."""
    prefetch: int = 1
    """How many stage jobs ahead a worker's weight upload may run (1: the next stage's
    weights load while the current stage computes; deeper prefetch hides uploads of
    PCIe-bound stages at the cost of holding more stages' weights; pick it within the
    device memory with :func:`rotapipe.schedule.prefetch_depth`)."""
    pin: PinMode | str | None = None
    """Host memory mode of the weights (:class:`PinMode`): ``"copy"``, ``"register"`` or
    ``"off"``. ``None``: ``"register"`` on CUDA where the driver allows it (else
    ``"copy"``), ``"copy"`` on emulated workers; a memory-mapped frozen base
    (:func:`rotapipe.adapters.load_hf`) whose pinning would not fit in RAM: ``"off"``."""
    copy_chunk_mb: float = 32.0
    """Weight uploads and weight-gradient downloads move in chunks of at most this many
    MiB (a chunk never spans two layers): a critical copy waits behind at most one
    chunk (docs/performance.md, "Copy engines and gating")."""
    gate_copies: bool = True
    """Issue a weight or weight-gradient chunk only when no critical copy (activation,
    gradient, side input) waits for the same copy engine, and one chunk at a time.
    ``False`` (an ablation): issue every chunk at once, as a plain copy would; a critical
    copy issued during a weight prefetch then waits for all of it."""
    emulation: object = None
    """Timed emulation (:class:`rotapipe.runtime.emulation.TimedEmulation`): emulated workers whose
    kernels and copies take the time a hardware profile says. Needs the emulated
    backend. ``None``: they run as fast as the CPU does."""

    def __post_init__(self):
        enums = {"grain": RecomputeGrain, "backend": BackendKind, "optimizer_mode": OptimizerMode,
                 "partition": PartitionMode, "nonfinite": NonFinite,
                 "optimizer_state_dtype": StateDtype}
        for name, kind in enums.items():
            object.__setattr__(self, name, check.choice(kind, name, getattr(self, name)))
        if self.pin is not None:
            object.__setattr__(self, "pin", check.choice(PinMode, "pin", self.pin))
        check.integer("workers", self.workers, maximum=MAX_WORKERS, optional=True,
                      allowed=f"an int in [1, {MAX_WORKERS}] (one worker per GPU; an "
                      "emulated worker runs a thread per stream)")
        check.integer("microbatches", self.microbatches, maximum=check.MAX_MICROBATCHES)
        check.integer("forward_stages", self.forward_stages, optional=True)
        check.integer("backward_stages", self.backward_stages, optional=True)
        check.integer("tail_layers", self.tail_layers,
                      allowed="a positive int: the fused tail needs at least one layer")
        check.integer("prefetch", self.prefetch, allowed="an int >= 1 (stage jobs a "
                      "worker's weight upload may run ahead)")
        check.integer("seed", self.seed, minimum=0)
        mem = check.number("device_memory", self.device_memory, low=0, low_open=True,
                           optional=True, allowed="a whole number of bytes > 0 "
                           "(e.g. 8 * 2**30)")
        if mem is not None:
            if mem != int(mem):
                raise ConfigError(f"device_memory={mem!r}: use a whole number of bytes")
            object.__setattr__(self, "device_memory", int(mem))
        check.number("timeout_s", self.timeout_s, low=0, low_open=True, unit="seconds")
        check.number("clip_grad_norm", self.clip_grad_norm, low=0, low_open=True,
                     optional=True, allowed="a finite norm > 0, or None to turn "
                     "clipping off")
        check.number("copy_chunk_mb", self.copy_chunk_mb, low=0, low_open=True,
                     allowed="a chunk size in MiB > 0 (e.g. 32)")
        check.boolean("check_races", self.check_races)
        check.boolean("gate_copies", self.gate_copies)
        check.boolean("undo_steps", self.undo_steps)
        prec = self.precision
        if isinstance(prec, (str, torch.dtype)):      # shorthand for its compute_dtype
            object.__setattr__(self, "precision", PrecisionConfig(compute_dtype=prec))
        elif not isinstance(prec, PrecisionConfig):
            raise ConfigError(f"precision={prec!r}: use a PrecisionConfig, or a compute "
                              "dtype ('float32', 'bfloat16', 'float16') as shorthand")
        if self.emulation is not None:
            # Checked by what the runtime calls (config sits below the runtime).
            if not all(callable(getattr(self.emulation, m, None))
                       for m in ("action_seconds", "optimizer_seconds")) \
                    or not hasattr(self.emulation, "costs"):
                raise ConfigError(f"emulation={self.emulation!r}: use a "
                                  "rotapipe.runtime.emulation.TimedEmulation or None")
            if self.backend is BackendKind.CUDA:
                raise ConfigError("emulation (timed emulation) runs on emulated workers, "
                                  "but backend='cuda': use backend='emulated'")
        dp = self.data_parallel
        if not isinstance(dp, DataParallelConfig):
            if dp not in (None, True, False):
                raise ConfigError(f"data_parallel={dp!r}: use a DataParallelConfig, "
                                  "True, False or None (auto)")
            object.__setattr__(self, "data_parallel", DataParallelConfig(enabled=dp))
        if self.optimizer_state_dtype is not StateDtype.FP32 \
                and self.data_parallel.shard is not ShardMode.NONE:
            raise ConfigError(
                f"optimizer_state_dtype={self.optimizer_state_dtype.value!r} with "
                f"data_parallel.shard={self.data_parallel.shard.value!r}: the sharded "
                "optimizer keeps its shards' state in fp32 (sharding already divides it "
                "by the ranks); use optimizer_state_dtype='fp32' or shard='none'")
