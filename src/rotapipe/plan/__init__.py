"""Plans (which layers each forward, backward and fused tail stage holds), the cost
model they are balanced with, and hardware profiles."""

from .balance import bound_plan, roundpipe_plan, split_balanced
from .costs import LayerCost, ModelCosts, load_config, model_costs, model_work
from .hardware import DEVICES, DeviceProfile, Hardware, hardware
from .partition import Plan, Stage, StageKind, even_plan

__all__ = ["DEVICES", "DeviceProfile", "Hardware", "LayerCost", "ModelCosts", "Plan",
           "Stage", "StageKind", "bound_plan", "even_plan", "hardware", "load_config",
           "model_costs", "model_work", "roundpipe_plan", "split_balanced"]
