"""Plans (which layers each forward, backward and fused tail stage holds), the cost
model they are balanced with, hardware profiles, the memory-aware partitioner and
host-memory accounting. Pure arithmetic: choosing a plan by simulation is
:mod:`rotapipe.planner`'s."""

from .balance import Recompute, bound_plan, greedy_compute_plan, roundpipe_plan, split_balanced
from .costs import LayerCost, LayerWork, ModelCosts, load_config, model_costs, model_work
from .hardware import DEVICES, DeviceProfile, Hardware, hardware
from .hostmem import HostMemory, host_memory, lora_params
from .partition import Plan, Stage, StageKind, even_plan
from .partitioner import Footprint, candidate_plans, min_max_cut

__all__ = ["DEVICES", "DeviceProfile", "Footprint", "Hardware", "HostMemory", "LayerCost",
           "LayerWork", "ModelCosts", "Plan", "Recompute", "Stage", "StageKind",
           "bound_plan", "candidate_plans", "even_plan",
           "greedy_compute_plan", "hardware", "host_memory", "load_config", "lora_params",
           "min_max_cut", "model_costs", "model_work", "roundpipe_plan", "split_balanced"]
