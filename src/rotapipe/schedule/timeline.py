"""When a schedule's actions ran: the timeline that the simulator predicts and the
runtime measures (``RoundPipe.last_timeline()``), in one form that the simulator's
report, pictures and traces read."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .actions import Action, Lane, Schedule

__all__ = ["Resource", "RESOURCE", "Span", "Timeline"]


class Resource:
    """What a device runs its lanes on (plain strings, used in spans and traces)."""

    COMPUTE = "compute"
    UP = "upload link"
    DOWN = "download link"
    HOST = "host"


RESOURCE = {Lane.COMPUTE: Resource.COMPUTE, Lane.WEIGHTS: Resource.UP, Lane.TRAINED: Resource.UP,
            Lane.UPLOAD: Resource.UP, Lane.DOWNLOAD: Resource.DOWN,
            Lane.GRADS: Resource.DOWN, Lane.HOST: Resource.HOST}
"""The resource each lane runs on: uploads share the host-to-device link (its copy
engine), downloads the device-to-host link."""


@dataclass(frozen=True)
class Span:
    """One stretch of time an action held a resource (a chunk of it, for weights)."""

    action: Action
    resource: str
    start: float
    end: float

    @property
    def worker(self) -> int:
        return self.action.worker


@dataclass(frozen=True)
class Timeline:
    """When every action of a schedule ran (milliseconds from the call's start)."""

    schedule: Schedule
    spans: tuple[Span, ...]
    start: Mapping[str, float]
    end: Mapping[str, float]

    @property
    def makespan(self) -> float:
        return max(self.end.values(), default=0.0)
