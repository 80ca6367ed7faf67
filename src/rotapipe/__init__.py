"""rotapipe: RoundPipe pipeline training with model state in host memory and
stateless, round-robin workers (CUDA GPUs, or emulated CPU workers)."""

from .config import (BackendKind, DataParallelConfig, NonFinite, OptimizerMode,
                     PartitionMode, PinMode, PipeConfig, PrecisionConfig, RecomputeGrain,
                     ShardMode)
from .errors import (ConfigError, DeviceOutOfMemoryError, DistributedError, InputError,
                     NonFiniteError, PipelineClosedError, PlanError, RaceError,
                     RotapipeError, ScheduleError, WorkerError)
from .pipe import RoundPipe
from .plan import Plan, Stage, StageKind, even_plan
from .runtime.rng import layer_seed
from .schedule import Schedule, roundpipe_schedule, validate

__version__ = "0.1.0"

__all__ = [
    "BackendKind", "ConfigError", "DataParallelConfig", "DeviceOutOfMemoryError",
    "DistributedError", "InputError", "NonFinite", "NonFiniteError", "OptimizerMode",
    "PartitionMode", "PinMode", "PipelineClosedError", "Plan", "PipeConfig", "PlanError",
    "PrecisionConfig", "RaceError", "RecomputeGrain", "RotapipeError", "RoundPipe",
    "Schedule", "ScheduleError", "ShardMode", "Stage", "StageKind",
    "WorkerError", "even_plan", "layer_seed", "roundpipe_schedule", "validate",
]
