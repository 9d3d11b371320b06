"""Every config field the memory plan reads is marked where it is declared (`knob(..., planned=True)`), and only those
(issue 41: a new knob could silently miss the plan). An unmarked field is never read while planning, in any of the
configurations below; a marked field moves the plan (its rendered text) in at least one of them."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Literal, get_args, get_origin

import pytest

from grpo_lab.config.fields import Section
from grpo_lab.config.schema import LabConfig, field_planned, leaf_fields
from grpo_lab.errors import LabError

pytestmark = pytest.mark.usefixtures("tiny_model")

# the suite's model for the CPU presets (the trained one is not built for a plan), the bundled shapes for the GPU ones
BASES = [
    ("tiny-cpu", ["model.name_or_path=builtin:tiny-random"]),
    ("logits-heavy-cpu", []),
    ("qwen2.5-7b-nf4-24gb", []),
    ("p1-qwq32b-nf4-2xa100-40gb", []),
    # a mixture of experts with LoRA on its experts (lora.target_experts, lora.expert_r)
    ("qwen2.5-7b-nf4-24gb", ["model.name_or_path=builtin:qwen3-30b-a3b-random", "lora.target_experts=true"]),
]
VARIANTS = [
    [],
    ["placement.learner_procs=2"],
    ["grpo.beta=0.04"],
    ["reference.strategy=copy", "grpo.beta=0.04"],
    ["placement.learner_procs=2", "grpo.beta=0.04", "reference.strategy=copy"],
    ["placement.optimizer_offload=true"],
    ["generator.backend=vllm"],
    ["generator.backend=vllm", "placement.generator=cpu"],
    ["placement.gpu_memory_gib=1"],
    ["placement.host_memory_gib=0.5"],
    ["generator.backend=vllm", "generator.gpu_memory_utilization=auto"],
    ["generator.hf_decode=merged"],
    ["data.reward_models=[builtin:tiny-reward]"],
    ["data.reward_models=[builtin:tiny-reward]", "placement.reward_model=cpu"],
    ["generator.tools=[my_tools:add]", "generator.max_tool_response_tokens=32"],  # a multi-turn rollout's plan
]
# values no type or context offers
EXTRA = {"lora.target_modules": [["q_proj", "v_proj"]], "generator.environment_factory": ["my_env:Env"]}
SECTIONS = {LabConfig.model_fields[s].annotation: s for s in LabConfig.model_fields}
MARKED = [path for path, _, _ in leaf_fields() if field_planned(path)]


def contexts():
    """Every base x variant the config accepts, as a LabConfig."""
    from grpo_lab.config.loading import load_config

    out = []
    for name, base in BASES:
        for variant in VARIANTS:
            try:
                out.append(load_config(name, base + variant))
            except LabError:  # a variant this base refuses (e.g. ranks on the generator's GPU)
                pass
    return out


@contextmanager
def recorded_reads():
    """The 'section.field' names read through attribute access meanwhile (a config re-validated inside the plan, by
    a candidate fix, reads every field: those reads are not the plan's and are left out)."""
    import grpo_lab.config.loading as loading

    seen, plain, load = set(), Section.__getattribute__, loading.load_config

    def get(self, name):
        value = plain(self, name)
        section = SECTIONS.get(type(self))
        if section and name in type(self).model_fields:
            seen.add(f"{section}.{name}")
        return value

    def unrecorded(*args, **kwargs):
        Section.__getattribute__ = plain
        try:
            return load(*args, **kwargs)
        finally:
            Section.__getattribute__ = get

    loading.load_config, Section.__getattribute__ = unrecorded, get
    try:
        yield seen
    finally:
        Section.__getattribute__, loading.load_config = plain, load


def rendered(cfg) -> str:
    from grpo_lab.planner.plan import plan

    result = plan(cfg)
    return str(result) + repr(result.fixes)


def test_the_plan_reads_only_marked_fields():
    from grpo_lab.planner.plan import plan

    read = set()
    for cfg in contexts():
        with recorded_reads() as seen:
            plan(cfg)
        read |= seen
    unmarked = sorted(read - set(MARKED))
    assert not unmarked, f"the plan reads {unmarked}: mark each knob(..., planned=True) where it is declared"


def candidates(cfg, path: str) -> list:
    """Values to try for a field: its type's other values, scaled numbers, and what other contexts hold."""
    section, _, name = path.partition(".")
    info = LabConfig.model_fields[section].annotation.model_fields[name]
    value = getattr(getattr(cfg, section), name)
    out = []
    for kind in [info.annotation, *get_args(info.annotation)]:
        if get_origin(kind) is Literal:
            out += list(get_args(kind))
    if isinstance(value, bool):
        out.append(not value)
    elif isinstance(value, (int, float)):
        out += [value * 2, value + 1, value / 2, max(1, int(value) // 2)]
    elif value is None:
        out += [1, 2, 16, 0.5, 4.0, "cpu", "cuda:1"]
    return [v for v in out if v != value]


@pytest.mark.parametrize("path", MARKED)
def test_every_marked_field_moves_the_plan(path):
    from grpo_lab.config.loading import load_config

    everywhere = contexts()
    pool = [getattr(getattr(c, path.split(".")[0]), path.split(".")[1]) for c in everywhere]
    for cfg in everywhere:
        before = rendered(cfg)
        for value in candidates(cfg, path) + pool + EXTRA.get(path, []):
            try:  # a value the config refuses, or a plan refused (a device not here, with no capacity given)
                if rendered(load_config(cfg, [f"{path}={json.dumps(value)}"])) != before:
                    return
            except LabError:
                continue
    pytest.fail(f"{path} is marked planned=True but no value moved any plan here; unmark it, or add a context")
