"""rotapipe: RoundPipe pipeline training with model state in host memory and
stateless, round-robin workers (CUDA GPUs, or emulated CPU workers).

The names below are imported on first use (PEP 562), so ``import rotapipe`` (and the
``rotapipe`` command's ``--help`` and ``--version``) does not load torch; the
subpackages (``rotapipe.adapters``, ``rotapipe.train``, ...) load the same way."""

from __future__ import annotations

import importlib
import typing

__version__ = "0.1.0"

_FROM = {
    ".config": ("BackendKind", "DataParallelConfig", "NonFinite", "OptimizerMode",
                "PartitionMode", "PinMode", "PipeConfig", "PrecisionConfig", "RecomputeGrain",
                "ShardMode", "StateDtype"),
    ".errors": ("CheckpointError", "ConfigError", "DeviceOutOfMemoryError", "DistributedError", "InputError",
                "NonFiniteError", "PipelineClosedError", "PlanError", "RaceError",
                "RotapipeError", "ScheduleError", "WorkerError"),
    ".pipe": ("RoundPipe",),
    ".plan": ("Plan", "Stage", "StageKind", "even_plan"),
    ".runtime.rng": ("layer_seed",),
    ".schedule": ("Schedule", "roundpipe_schedule", "validate"),
}
_WHERE = {name: module for module, names in _FROM.items() for name in names}
_SUBPACKAGES = ("adapters", "cli", "config", "data", "distributed", "errors", "model",
                "pipe", "plan", "planner", "runtime", "schedule", "sim", "train")

__all__ = sorted(_WHERE, key=str.lower)

if typing.TYPE_CHECKING:      # what the lazy names are, for type checkers and IDEs
    from .config import (BackendKind, DataParallelConfig, NonFinite, OptimizerMode,
                         PartitionMode, PinMode, PipeConfig, PrecisionConfig,
                         RecomputeGrain, ShardMode, StateDtype)
    from .errors import (CheckpointError, ConfigError, DeviceOutOfMemoryError,
                         DistributedError, InputError, NonFiniteError, PipelineClosedError,
                         PlanError, RaceError, RotapipeError, ScheduleError, WorkerError)
    from .pipe import RoundPipe
    from .plan import Plan, Stage, StageKind, even_plan
    from .runtime.rng import layer_seed
    from .schedule import Schedule, roundpipe_schedule, validate


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module("." + name, __name__)
    else:
        raise AttributeError(f"module 'rotapipe' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE) | set(_SUBPACKAGES))
