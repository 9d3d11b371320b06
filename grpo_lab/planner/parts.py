"""Plan parts that the one-process plan (plan.py), the sharded one (sharded.py) and the learner's items
(learner_items.py) build from."""

from __future__ import annotations

from ..errors import LabError
from ..generation.registry import sleeps
from ..models.shapes import ModelShape
from .estimate import (
    CUDA_CONTEXT,
    FUSED_HEAD_TILE,
    VLLM_CPU_ENGINE,
    VLLM_SPLIT_SHARE,
    DevicePlan,
    GiB,
    generator_weight_bytes,
    kv_cache_bytes,
)
from .split import Split, auto_share, engine_work_bytes, kv_token_bytes, largest_share


def _home(device: str) -> str:
    return "host" if device == "cpu" else device


def capacity_of(device: str, config) -> float:
    if device == "host":
        from ..memory.readers import HostReader, host_budget

        return host_budget(config) or HostReader().machine
    if config.placement.gpu_memory_gib:
        return config.placement.gpu_memory_gib * GiB
    from ..checks.devices import cuda_device_count

    index = int(device.split(":")[1])
    if index < cuda_device_count():
        import torch

        return torch.cuda.get_device_properties(index).total_memory
    raise LabError(
        f"placement.gpu_memory_gib: {device} is not on this machine; give the capacity (GiB) of the GPUs "
        "you plan for, e.g. --set placement.gpu_memory_gib=40"
    )


def line_of(device: str, config) -> float:
    """The share of `device`'s capacity a plan may fill: host RAM (the host, a CPU rank's share) is held by the host
    guard at memory.host_threshold of its limit, so a peak past it is stopped, not fitted; a GPU to its capacity."""
    return config.memory.host_threshold if device.startswith("host") else 1.0


def head_note(config, shape: ModelShape, on_cpu: bool) -> str:
    if config.grpo.logprob_head == "chunked":
        return (
            f"chunks of {config.grpo.logprob_chunk_size} completion tokens x {shape.vocab} vocab, recomputed in "
            "backward; no [B, L, vocab] logits"
        )
    if config.grpo.logprob_head == "full":
        return f"all [tokens, {shape.vocab}] logits at once in float32, kept for backward (the textbook pass)"
    tiles = f"tiles of {FUSED_HEAD_TILE[0]} tokens x {FUSED_HEAD_TILE[1]} vocab"
    return f"TRL's fused head, {tiles}" + (" (CPU: torch fallback, several tiles alive)" if on_cpu else "")


def add_engine(devices: dict[str, DevicePlan], config, shape: ModelShape, sequences: int) -> None:
    """A generator with weights of its own (vLLM) on each of its devices: its weights and KV cache on the host, or its
    share of a GPU (one process's engine, or a sharded learner's, which lives in the driver), with the split it
    leaves (planner/split.py; `auto`: the largest share beside the learner). Call it after the learner's items."""
    place, gen = config.placement, config.generator
    gens = [devices[_home(d)] for d in place.generator_devices()]
    tp, asleep, auto = len(gens), sleeps(config), gen.gpu_memory_utilization == "auto"
    per_device = generator_weight_bytes(shape, config) / tp
    work = {d.device: engine_work_bytes(shape, config, d.capacity, tp) for d in gens if d.device != "host"}
    largest = {name: largest_share(devices[name], devices[name].capacity, w, asleep) for name, w in work.items()}
    share = auto_share([v[0] for v in largest.values()]) if auto else gen.gpu_memory_utilization or VLLM_SPLIT_SHARE
    for d in gens:
        d.roles.append(f"generator ({gen.backend}, TP {tp})")
        if d.device == "host":  # why resident: vLLM reserves and touches its CPU KV cache at start, whatever it uses
            d.add("generator weights", per_device, gen.quantization or config.model.dtype)
            d.add(
                "generator KV cache (reserved)",
                gen.cpu_kv_cache_gib * GiB,
                f"generator.cpu_kv_cache_gib; {sequences} sequences use "
                f"{kv_cache_bytes(shape, config, sequences) / tp / 2**20:.1f} MiB of it",
            )
            d.add("vLLM engine and modules (CPU)", VLLM_CPU_ENGINE, "measured, not modelled")
            continue
        biggest, peak, phase = largest[d.device]
        beside = any(r.startswith("learner") for r in d.roles)
        d.split = Split(
            d.device,
            d.capacity,
            share,
            auto,
            per_device,
            work[d.device],
            kv_token_bytes(shape, config, tp),
            gen.max_prompt_length + gen.max_completion_length,
            peak if beside else 0.0,
            phase,
            asleep,
            biggest,
        )
        # why at least the minimum: below it vLLM does not start, and the plan shows what it would take
        taken = max(share or 0.0, d.split.minimum)
        engine = taken * d.capacity - CUDA_CONTEXT
        note = f"weights {per_device / GiB:.1f} GiB ({gen.quantization or config.model.dtype}); the rest KV cache"
        name = f"{gen.backend} engine share ({taken:.0%}{', auto' if auto else ''})"
        if asleep:  # why: sleep(level=1) frees the weights and KV cache between rollouts; its working memory stays
            d.add(f"{gen.backend} engine asleep: working memory", work[d.device], "CUDA graphs, buffers; kept asleep")
            d.add(f"{name}, awake", engine - work[d.device], note, phase="rollout")
        else:
            d.add(name, engine, note)
    if asleep:
        # why: sleep(level=1) copies every shard's weights to pinned host RAM between rollouts (KV cache dropped)
        devices["host"].add(
            "generator weights (asleep, sleep level 1)",
            generator_weight_bytes(shape, config),
            f"{gen.quantization or config.model.dtype}; vLLM offloads them between rollouts, pinned",
        )
