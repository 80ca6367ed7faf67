"""Schedules as data: the action vocabulary, generators and the validator."""

from .actions import HOST, Action, ActionKind, Lane, Schedule
from .roundpipe import roundpipe_schedule
from .validate import validate

__all__ = ["HOST", "Action", "ActionKind", "Lane", "Schedule", "roundpipe_schedule",
           "validate"]
