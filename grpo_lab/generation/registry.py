"""Generator backends by name. Values are import paths so that naming a backend in a
config never imports it (vLLM is optional and heavy)."""
from __future__ import annotations

import importlib

from ..errors import LabError

BACKENDS: dict[str, str] = {
    "hf": "grpo_lab.generation.hf:HFGenerator",
    "vllm": "",   # planned: configs can name it and `grpo-lab plan` models it; loading says it is not built yet
}

# backends that hold their own copy of the weights (and so a memory share of their GPU)
OWN_WEIGHTS = {"vllm"}


def backend_class(name: str):
    if name not in BACKENDS:
        raise LabError(f"generator.backend: unknown backend {name!r}; use one of {sorted(BACKENDS)}")
    if not BACKENDS[name]:
        raise LabError(f"generator.backend: {name!r} is not built yet; `grpo-lab plan` can plan it, "
                       "but to run use generator.backend: hf")
    module, _, attr = BACKENDS[name].partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as err:
        raise LabError(f"generator.backend: {name!r} needs a package that is not installed ({err.name}); "
                       "install grpo-lab[cpu] on CPU machines or grpo-lab[gpu] on CUDA machines") from None
