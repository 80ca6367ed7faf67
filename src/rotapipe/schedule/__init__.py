"""Schedules as data: the action vocabulary and the facts every schedule shares, generators
(RoundPipe and the bound baselines), the memory model, the validator, the routes the
runtime reads and the timeline form (when actions ran) the simulator and runtime share."""

from ..plan.balance import Recompute
from .actions import HOST, Action, ActionKind, Lane, Schedule, action_key
from .bound import (gpipe_schedule, interleaved_1f1b_schedule, looped_bfs_schedule,
                    mobius_schedule, one_f_one_b_schedule)
from .memory import MemorySizes
from .roundpipe import prefetch_depth, roundpipe_schedule, roundpipe_call, roundpipe_stale_schedule
from .validate import validate

__all__ = ["HOST", "Action", "ActionKind", "Lane", "MemorySizes", "Recompute", "Schedule",
           "action_key",
           "gpipe_schedule", "interleaved_1f1b_schedule", "looped_bfs_schedule",
           "mobius_schedule", "one_f_one_b_schedule", "prefetch_depth", "roundpipe_schedule", "roundpipe_call", "roundpipe_stale_schedule",
           "validate"]
