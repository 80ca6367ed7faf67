"""The pipeline simulator: runs any schedule on a hardware cost model and reports step
time, tokens/s, bubbles, exposed communication and peak device memory; draws timelines
(PNG) and writes Chrome/Perfetto traces. Pure: no threads, no devices."""

from ..schedule.timeline import Span, Timeline
from .compare import (SCHEDULES, SimConfig, SimResult, build_schedule, compare,
                      schedule_names, simulate)
from .engine import run
from .report import Bubble, Report, report, table
from .timing import ActionTimes, memory_sizes

__all__ = ["SCHEDULES", "ActionTimes", "Bubble", "Report", "SimConfig", "SimResult", "Span",
           "Timeline", "build_schedule", "compare", "memory_sizes", "report", "run",
           "schedule_names", "simulate", "table"]
