"""The planner: chooses a RoundPipe plan (stage cuts, fused tail and its jobs, recompute
grain, microbatch count) by simulating the best candidates of the partitioner
(:mod:`.autoplan`, exact on small models: :mod:`.exact`), judges whether a run fits a
machine (:mod:`.advise`, ``rotapipe plan``; what it reports: :mod:`.analysis`), gives a pipeline its plan and refines it
from measured stage times (:mod:`.pipeline`, :mod:`.measured`).

It sits above the simulator: ``plan`` (arithmetic) -> ``schedule`` -> ``sim`` ->
``planner``; nothing below imports it."""

from .advise import PlanAnalysis, analyze, longest_sequence
from .autoplan import (ModeSteps, PlanChoice, PlannerConfig, choose_plan, optimizer_modes,
                       simulate_plan)
from .exact import call_lower_bound, exact_search, step_lower_bound
from .measured import MeasuredCosts, Pass, PlanRefiner

__all__ = ["MeasuredCosts", "ModeSteps", "Pass", "PlanAnalysis", "PlanChoice",
           "PlanRefiner", "PlannerConfig", "analyze", "call_lower_bound", "choose_plan",
           "exact_search", "longest_sequence", "optimizer_modes", "simulate_plan",
           "step_lower_bound"]
