"""Assemble the per-device plan, the DataParallel what-if (P1), and the knobs that make a plan fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..errors import LabError
from ..generation.registry import colocated_on_gpu
from ..models.shapes import ModelShape, load_shape
from .estimate import (
    HEAP_HOLES_CAVEAT,
    HOST_BASELINE,
    VLLM_SPLIT_SHARE,
    DevicePlan,
    activation_bytes,
    base_weight_bytes,
    planned_lora,
    rollout_sequences,
)
from .kernel_share import add_kernel_items
from .learner_items import add_learner, parking_buffer_bytes
from .parts import _home, add_engine, capacity_of, line_of
from .reward_items import add_reward_models, reward_device
from .sharded import build_sharded


@dataclass
class Plan:
    config: object
    shape: ModelShape
    devices: dict[str, DevicePlan]
    micro_batch: int
    dataparallel: Optional[dict[str, DevicePlan]] = None  # the same run if the learner were wrapped (P1)
    fixes: list[str] = field(default_factory=list)
    # a sharded learner's ranks (placement.learner_procs > 1): CUDA, the rank devices (also in `devices`); CPU, each
    # rank's share of host RAM (devices["host"] is their sum, what the fit is checked against)
    ranks: dict[str, DevicePlan] = field(default_factory=dict)
    prompts: Optional[str] = None  # how the prompt length was planned when the data was read (planned_prompts)
    turns: Optional[str] = None  # a multi-turn rollout's worst turn and tool-result bound (planner/turns.py)

    @property
    def caveats(self) -> list[str]:
        """What this plan is known to leave out, measured (render prints each as a note)."""
        config = self.config
        if config.placement.learner == "cpu" and config.memory.host_mmap_threshold_mib is None:
            return [HEAP_HOLES_CAVEAT]
        return []

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices.values())

    def failing(self) -> list[DevicePlan]:
        return [d for d in self.devices.values() if not d.fits]

    def __str__(self) -> str:
        from .render import render

        return render(self)

    def __repr__(self) -> str:  # why: the dataclass's repr dumped the whole config and every device's items
        return str(self)

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))

    def _repr_html_(self) -> str:
        from .render import render_html

        return render_html(self)


def build_devices(config, shape: ModelShape) -> tuple[dict[str, DevicePlan], int]:
    """(devices, micro-batch) of a one-process learner: its device, the generator's, a reference copy's, the host."""
    place, gen = config.placement, config.generator
    learner = _home(place.learner)
    names = [learner, *(_home(d) for d in place.generator_devices()), "host"]
    if config.reference_strategy == "copy":
        names.append(_home(config.reference_device))
    if config.data.reward_models:
        names.append(reward_device(config))
    devices = {d: DevicePlan(d, capacity_of(d, config), line=line_of(d, config)) for d in dict.fromkeys(names)}
    for d in devices.values():
        if d.device != "host":
            d.add_cuda_runtime()
    build = "cuda" if any(d != "host" for d in devices) else "cpu"
    devices["host"].add("Python, torch, libraries", HOST_BASELINE[build], f"{build} build of torch")
    add_kernel_items(devices["host"])  # why: a notebook's own process holds IPython and its figures beside the lab
    devices[learner].roles.append("learner")
    ref = devices[_home(config.reference_device)] if config.reference_strategy == "copy" else devices[learner]
    micro = add_learner(devices[learner], devices["host"], ref, config, shape)
    if gen.own_weights:
        add_engine(devices, config, shape, rollout_sequences(config))
    add_reward_models(devices, config)
    return devices, micro


def dataparallel_what_if(config, shape: ModelShape, devices: dict[str, DevicePlan]) -> Optional[dict[str, DevicePlan]]:
    """P1: HF Trainer wraps the learner in DataParallel when it sees more than one GPU; every GPU then
    gets a replica of the learner and a slice of the micro-batch, the generator's GPU included."""
    gpus = [d for d in devices if d != "host"]
    learner = _home(config.placement.learner)
    if len(gpus) < 2 or learner == "host":
        return None
    weights, fmt = base_weight_bytes(shape, config.model)
    lora = planned_lora(shape, config)
    act = activation_bytes(shape, config)
    out = {}
    for name in gpus:
        d = devices[name]
        wrapped = DevicePlan(name, d.capacity, list(d.roles), list(d.items))
        if name != learner:
            wrapped.roles.append("DataParallel replica")
            wrapped.add("learner replica: base weights", weights, fmt)
            wrapped.add("learner replica: LoRA weights", lora * 4)
            wrapped.add(
                "scattered activations",
                act["activations"] / len(gpus),
                f"1/{len(gpus)} of the micro-batch",
                phase="backward",
            )
            wrapped.add("log-prob head", act["log-prob head"] / len(gpus), phase="backward")
        out[name] = wrapped
    return out


def build(config, shape: ModelShape) -> tuple[dict[str, DevicePlan], dict[str, DevicePlan], int]:
    """(devices, ranks, micro-batch): one process, or a learner sharded over placement.learner_procs ranks; an hf
    rollout's generator.hf_decode: auto planned as the path it resolves to (rollout_decode), and a merged copy's
    generator.rollout_copy: auto as keep or release (rollout_copy_mode), each said so."""
    if config.placement.learner_procs > 1:
        return build_sharded(config, shape)
    gen = config.generator
    decode = rollout_decode(config, shape)
    resolved = []
    if decode != gen.hf_decode:
        # why park_learner off and rollout_copy auto on another path: they are the merged copy's alone
        other = ["generator.park_learner=false", "generator.rollout_copy=auto"]
        resolved += [f"generator.hf_decode={decode}", *([] if decode == "merged" else other)]
    if decode == "merged" and gen.rollout_copy == "auto":
        resolved.append(f"generator.rollout_copy={rollout_copy_mode(config, shape)}")
    if not resolved:
        devices, micro = build_devices(config, shape)
        return devices, {}, micro
    from ..config.loading import load_config

    devices, micro = build_devices(load_config(config, resolved), shape)
    said = {f"decode {decode}": f"decode {decode} (auto)"} if decode != gen.hf_decode else {}
    if gen.rollout_copy == "auto":
        said.update({f"copy {m}": f"copy {m} (auto)" for m in ("kept", "released")})
    for d in devices.values():
        for old, new in said.items():
            d.roles = [r.replace(old, new) for r in d.roles]
    return devices, {}, micro


def rollout_decode(config, shape: Optional[ModelShape] = None) -> str:
    """The hf rollout's decode path: generator.hf_decode, with auto resolved as the plan allows: merged when the plan
    fits the rollout copy, else compiled on a GPU, else dynamic (a sharded learner, another backend: dynamic)."""
    gen = config.generator
    if gen.hf_decode != "auto":
        return gen.hf_decode
    if gen.backend != "hf" or config.placement.learner_procs > 1:
        return "dynamic"
    from ..config.loading import load_config

    shape = shape or load_shape(config.model.name_or_path)
    if shape.moe:  # why: a dense copy of every expert (models/experts.check_moe_config refuses merged)
        return "compiled" if config.placement.learner.startswith("cuda") else "dynamic"
    merged = load_config(config, ["generator.hf_decode=merged"])
    if all(d.fits for d in build(merged, shape)[0].values()):
        return "merged"
    return "compiled" if config.placement.learner.startswith("cuda") else "dynamic"


def rollout_copy_mode(config, shape: Optional[ModelShape] = None) -> str:
    """generator.rollout_copy with auto resolved: keep where the plan fits the merged copy held for the whole step,
    else release; release where the rollout builds no copy (another decode path)."""
    if rollout_decode(config, shape) != "merged":
        return "release"
    if config.generator.rollout_copy != "auto":
        return config.generator.rollout_copy
    from ..config.loading import load_config

    kept = load_config(config, ["generator.hf_decode=merged", "generator.rollout_copy=keep"])
    return (
        "keep"
        if all(d.fits for d in build(kept, shape or load_shape(config.model.name_or_path))[0].values())
        else "release"
    )


def parking_reserve(config, shape: Optional[ModelShape] = None) -> int:
    """generator.park_learner on a merged rollout: the host buffer's planned bytes, which parking makes once
    (learner_items.parking_buffer_bytes); 0 where nothing is parked."""
    if not config.generator.park_learner or rollout_decode(config, shape) != "merged":
        return 0
    return int(parking_buffer_bytes(shape or load_shape(config.model.name_or_path), config))


def sharding_fixes(config) -> list[tuple[str, list[str]]]:
    """A sharded learner's own knobs: generate layer by layer, then more ranks (fewest first: the first that fits
    is the one shown), each dividing the batch."""
    out = []
    if config.generator.gather_for_generation and not config.generator.own_weights:  # (vllm gathers nothing)
        out.append(("generator.gather_for_generation: false", ["generator.gather_for_generation=false"]))
    batch = config.grpo.prompts_per_step * config.grpo.num_generations
    procs = config.placement.learner_procs * 2
    while procs <= min(batch, 64):
        if batch % procs == 0:
            out.append((f"placement.learner_procs: {procs}", [f"placement.learner_procs={procs}"]))
        procs *= 2
    return out


def candidate_fixes(config) -> list[tuple[str, list[str]]]:
    """Config changes worth trying, as (description, overrides)."""
    out = sharding_fixes(config) if config.placement.learner_procs > 1 else []
    if config.grpo.logprob_head != "chunked":  # at most one chunk of [tokens, vocab] logits, recomputed in backward
        out.append(("grpo.logprob_head: chunked", ["grpo.logprob_head=chunked"]))
    if not config.model.gradient_checkpointing:
        out.append(("turn on gradient checkpointing", ["model.gradient_checkpointing=true"]))
    micro = config.grpo.micro_batch_size or config.grpo.prompts_per_step * config.grpo.num_generations
    while micro > 1:
        micro //= 2
        out.append((f"grpo.micro_batch_size: {micro}", [f"grpo.micro_batch_size={micro}"]))
    if not config.generator.own_weights:
        seqs = rollout_sequences(config)
        while seqs > 1:
            seqs //= 2
            out.append((f"generator.chunk_size: {seqs}", [f"generator.chunk_size={seqs}"]))
    if config.generator.own_weights and not config.generator.sleep_mode and colocated_on_gpu(config):
        # asleep, the engine leaves the learner's phases its weights and KV cache
        out.append(("generator.sleep_mode: true", ["generator.sleep_mode=true"]))
    gpu = config.placement.learner != "cpu"
    if gpu and config.model.gradient_checkpointing and not config.model.activation_offload:
        # the layer inputs leave the GPU: the term that grows fastest with completion length (the 8B frontier's)
        out.append(("model.activation_offload: true", ["model.activation_offload=true"]))
    if gpu and not config.placement.optimizer_offload:
        out.append(("placement.optimizer_offload: true", ["placement.optimizer_offload=true"]))
    if config.reference_strategy == "copy":
        out.append(("reference.strategy: adapter-disabled (no copy)", ["reference.strategy=adapter-disabled"]))
    if config.data.reward_models and not config.placement.reward_model_4bit:
        out.append(("placement.reward_model_4bit: true", ["placement.reward_model_4bit=true"]))
    if config.model.dtype == "float32":
        out.append(("model.dtype: bfloat16", ["model.dtype=bfloat16", "model.bnb_4bit_compute_dtype=bfloat16"]))
    return out


def planned_prompts(config, prompt_tokens: Optional[int]) -> tuple[object, Optional[str]]:
    """The config to plan, given the data's longest prompt in tokens (data/lengths.py; None: not read): planned at
    that length where it is below generator.max_prompt_length (why: a rollout pads to its batch's longest prompt, never
    to the limit), and the plan's line saying so."""
    from ..config.loading import load_config

    limit = config.generator.max_prompt_length
    if prompt_tokens is None:
        return config, None
    if prompt_tokens >= limit:
        return config, f"prompts: planned at generator.max_prompt_length={limit} (the data's longest: {prompt_tokens})"
    line = f"prompts: planned at the data's longest, {prompt_tokens} tokens (generator.max_prompt_length={limit})"
    return load_config(config, [f"generator.max_prompt_length={max(prompt_tokens, 1)}"]), line


def plan(config, shape: Optional[ModelShape] = None, prompt_tokens: Optional[int] = None, tools=None) -> Plan:
    """The memory plan of `config`: per device, the DataParallel what-if, and fixes when it does not fit.
    `prompt_tokens`: the data's longest prompt, when read (planned_prompts); `tools`: whether the rollout calls tools
    (None: the config's generator.tools or environment_factory say)."""
    from ..config.loading import load_config
    from .turns import add_turn_items, turns_line

    config, prompts_line = planned_prompts(config, prompt_tokens)
    shape = shape or load_shape(config.model.name_or_path)
    devices, ranks, micro = build(config, shape)
    # why no what-if for a sharded learner: FSDP2 is the chosen wrapping, and its ranks are planned above
    what_if = None if ranks else dataparallel_what_if(config, shape, devices)
    result = Plan(config, shape, devices, micro, what_if, ranks=ranks, prompts=prompts_line)
    result.turns = turns_line(config, tools)
    add_turn_items(result, tools)
    if not result.fits:
        fixed = set()  # knobs with a fix already: each knob's values come best first, so the first that fits is shown
        for description, overrides in candidate_fixes(config):
            knob = description.split(":")[0]
            if knob in fixed:
                continue
            try:  # a change the config refuses, or more ranks than GPUs here without placement.gpu_memory_gib
                trial = load_config(config, overrides)
                tried = Plan(trial, shape, build(trial, shape)[0], micro)
                add_turn_items(tried, tools)  # (a tool loop's lines, as the plan's own)
                fits = tried.fits
            except LabError:
                continue
            if fits:
                result.fixes.append(description)
                fixed.add(knob)
    return result


def engine_share(config) -> float:
    """The gpu_memory_utilization a vLLM engine on GPUs starts with: the number set, 0.9 when unset, or auto's share
    as the plan prints it (refused in one line, with the fixes that would fit, when no share leaves room)."""
    share = config.generator.gpu_memory_utilization
    if share != "auto":
        return share or VLLM_SPLIT_SHARE
    result = plan(config)
    splits = [d.split for d in result.devices.values() if d.split is not None]
    bad = [s for s in splits if not s.feasible]
    if bad:
        fixes = "; ".join(result.fixes) or (
            "none of grpo_lab's knobs: a bigger GPU, a quantized generator.model, or shorter sequences"
        )
        raise LabError(
            f"generator.gpu_memory_utilization: auto: {bad[0].describe()}; each of these alone would fit: {fixes}"
        )
    return splits[0].share
