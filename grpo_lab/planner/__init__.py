"""Pre-flight memory planner: per-device estimates from config.json before any weight is loaded."""
from .plan import Plan, plan
from .shapes import ModelShape, load_shape

__all__ = ["Plan", "plan", "ModelShape", "load_shape"]
