"""Pre-flight memory planner: per-device estimates from config.json before any weight is loaded."""

from ..models.shapes import ModelShape, load_shape
from .frontier import Frontier, frontier
from .plan import Plan, engine_share, plan

__all__ = ["Plan", "engine_share", "plan", "Frontier", "frontier", "ModelShape", "load_shape"]
