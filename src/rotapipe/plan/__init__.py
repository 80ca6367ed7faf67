"""Plans: which layers each forward, backward and fused tail stage holds."""

from .partition import Plan, Stage, StageKind, even_plan

__all__ = ["Plan", "Stage", "StageKind", "even_plan"]
