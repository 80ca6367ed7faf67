"""Typed exceptions raised by rotapipe, each naming what went wrong and the fix."""

from __future__ import annotations

import functools

__all__ = [
    "RotapipeError",
    "ConfigError",
    "PlanError",
    "ScheduleError",
    "InputError",
    "WorkerError",
    "PipelineClosedError",
    "NonFiniteError",
    "DeviceOutOfMemoryError",
    "RaceError",
    "DistributedError",
    "CheckpointError",
    "worker_error_type",
]


class RotapipeError(Exception):
    """Base class of every error rotapipe raises on purpose."""


class ConfigError(RotapipeError, ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


class PlanError(RotapipeError, ValueError):
    """A forward/backward plan does not cover the model's layers correctly."""


class ScheduleError(RotapipeError, ValueError):
    """A schedule is malformed: unknown dependency, duplicate action, deadlock."""


class InputError(RotapipeError, ValueError):
    """Inputs, labels or the loss do not fit what the pipeline expects."""


class CheckpointError(RotapipeError, RuntimeError):
    """A training checkpoint is damaged (a file missing, truncated or unreadable), or no
    checkpoint can be resumed; the message names the checkpoint and the file."""


class NonFiniteError(RotapipeError, FloatingPointError):
    """A training call's loss or gradient is not finite (``PipeConfig.nonfinite="raise"``);
    the call changed nothing."""


class PipelineClosedError(RotapipeError, RuntimeError):
    """A method of a :class:`rotapipe.RoundPipe` was called after ``close()``."""


class DeviceOutOfMemoryError(RotapipeError, MemoryError):
    """An allocation on a (real or emulated) device would exceed its memory budget."""


class RaceError(RotapipeError, RuntimeError):
    """The stream-race checker saw a read of device or host data without a wait on
    the event that produced it: on a GPU this read could see stale or partial data."""


class DistributedError(RotapipeError, RuntimeError):
    """A collective across data-parallel ranks failed or timed out: a rank died, hung,
    or stopped calling ``forward_backward``. :attr:`lost_ranks` names the ranks found
    lost (empty when none could be identified). The failed call changed nothing, but
    the ranks are out of step: restart the job (from the last checkpoint)."""

    lost_ranks: tuple[int, ...] = ()

    def __init__(self, message: str, *, lost_ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.lost_ranks = tuple(lost_ranks)


class WorkerError(RotapipeError, RuntimeError):
    """An action failed inside a worker.

    The message names the action (stage, layers, microbatch, worker) and shows the
    schedule grid with the failing action marked. The original exception is chained
    as ``__cause__`` and kept in :attr:`cause`. No weight, gradient or optimizer state
    was changed by the failed call.
    """

    def __init__(self, message: str, *, action: str | None = None,
                 worker: int | None = None, cause: BaseException | None = None):
        super().__init__(message)
        self.action = action
        self.worker = worker
        self.cause = cause


@functools.cache
def worker_error_type(cause: type[RotapipeError]) -> type[WorkerError]:
    """A :class:`WorkerError` subclass that is also ``cause`` (e.g. an emulated
    out-of-memory error raised in a worker is both ``WorkerError`` and
    ``DeviceOutOfMemoryError``), so callers can catch either."""
    if issubclass(cause, WorkerError):
        return cause
    return type("Worker" + cause.__name__, (WorkerError, cause), {})
