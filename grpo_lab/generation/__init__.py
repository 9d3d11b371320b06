"""Generators: the rollout engines. See `base.Generator` for the interface."""

from .base import GenerationRequest, Generator, chunked
from .registry import BACKENDS, backend_class

__all__ = ["Generator", "GenerationRequest", "chunked", "BACKENDS", "backend_class"]
