"""Generator backends by name. Values are import paths so that naming a backend in a
config never imports it (vLLM is optional and heavy)."""

from __future__ import annotations

import importlib

from ..errors import LabError

BACKENDS: dict[str, str] = {
    "hf": "grpo_lab.generation.hf:HFGenerator",
    "vllm": "grpo_lab.generation.vllm_engine:VLLMGenerator",
    # fixed full-length completions, no sampling: the learner's memory frontier (generation/synthetic.py)
    "synthetic": "grpo_lab.generation.synthetic:SyntheticGenerator",
}

# a sharded learner's rank asks the driver's engine instead (sharded/remote.py)
RANK_BACKENDS: dict[str, str] = {"vllm": "grpo_lab.execution.sharded.remote:RemoteVLLM"}

# backends that hold their own copy of the weights (and so a memory share of their GPU)
OWN_WEIGHTS = {"vllm"}


def colocated_on_gpu(config) -> bool:
    """Whether the generator shares a GPU with the learner (where sleeping between rollouts frees memory for it)."""
    devices = config.placement.generator_devices()
    return config.placement.learner in devices and devices != ["cpu"]


def sleeps(config) -> bool:
    """Whether the generator sleeps between rollouts: vllm's sleep_mode, colocated with the learner on a GPU
    (vLLM has no sleep mode on the CPU; a generator on GPUs of its own has no one to give memory to)."""
    return config.generator.sleep_mode and colocated_on_gpu(config)


def backend_class(name: str, on_rank: bool = False):
    """The generator class of backend `name`; `on_rank`: as a sharded learner's rank uses it (the runtime says)."""
    if name not in BACKENDS:
        raise LabError(f"generator.backend: unknown backend {name!r}; use one of {sorted(BACKENDS)}")
    path = (RANK_BACKENDS.get(name) if on_rank else None) or BACKENDS[name]
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as err:
        raise LabError(
            f"generator.backend: {name!r} needs a package that is not installed ({err.name}); "
            "install grpo-lab[cpu] on CPU machines or grpo-lab[gpu] on CUDA machines"
        ) from None
