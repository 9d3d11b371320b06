"""The plan of a learner sharded with FSDP2 over `placement.learner_procs` ranks (P3), per rank: 1/N of every
parameter and of AdamW's state, the root and the layers in flight gathered whole during a pass, the whole rollout
on every rank (the model gathered whole with generator.gather_for_generation, else layer by layer), and 1/N of the
batch rows in log-probs and backward. Departs from the one-process plan in two places: bitsandbytes' quant state
is never sharded, and the load (sharded/meta_load.py) holds, beside the rank's shards, one decoder layer whole and the
float copy of the linear weight being quantized (a "load" phase).

CUDA ranks have a device each; CPU ranks share host RAM, so there the host is the sum of every rank's process.
"""

from __future__ import annotations

from ..models.shapes import ModelShape
from .estimate import (
    DTYPE_BYTES,
    HOST_BASELINE,
    PHASES,
    DevicePlan,
    activation_bytes,
    base_weight_bytes,
    base_weight_split,
    generation_step_bytes,
    kv_cache_bytes,
    unit_bytes,
)
from .parts import _home, add_engine, capacity_of, head_note

# why 2: the layer computing and the next one, which FSDP2 all-gathers ahead of it (backward prefetch; on CUDA the
# all-gather stream also runs ahead in forward)
LAYERS_IN_FLIGHT = 2


def rank_name(learner: str, device: str, k: int) -> str:
    """A rank's row: its GPU, or its share of host RAM ('host (rank k)') for a CPU learner."""
    return f"host (rank {k})" if learner == "cpu" else device


def build_sharded(cfg, shape: ModelShape) -> tuple[dict[str, DevicePlan], dict[str, DevicePlan], int]:
    """(devices, ranks, micro-batch): every device's plan (CUDA: one per rank plus the host; CPU: the host, the sum
    of every rank's process) and every rank's own plan (CUDA: the rank's device; CPU: its share of host RAM)."""
    from ..execution.runtime import rank_devices

    place, procs = cfg.placement, cfg.placement.learner_procs
    on_cpu = place.learner == "cpu"
    host = DevicePlan("host", capacity_of("host", cfg))
    if on_cpu:
        host.roles.append(f"{procs} learner ranks, a process each (their sum)")
    host.add(
        "driver process (ShardedLab)",
        HOST_BASELINE["cpu" if on_cpu else "cuda"],
        "the notebook or grpo-lab run: drives the ranks"
        + (f", runs their {cfg.generator.backend} engine (below)" if cfg.generator.own_weights else ", holds no model"),
    )
    lora = shape.lora_params(cfg.lora.r, cfg.lora.target_modules)
    ranks, micro = {}, 0
    for k, device in enumerate(rank_devices(place.learner, procs)):
        name = rank_name(place.learner, device, k)
        rank = DevicePlan(name, host.capacity if on_cpu else capacity_of(device, cfg))
        rank.roles.append(f"learner rank {k} of {procs} (FSDP2)")
        micro = fill_rank(rank, cfg, shape, on_cpu)
        ranks[name] = rank
        if on_cpu:  # why the sum: every rank is its own process in the same host RAM, all in the same phase at once
            host.add(f"rank {k}", rank.resident, "its process: runtime, shards, rollback copy (rank block above)")
            for phase in PHASES:
                host.add(f"rank {k}", rank.phase_peak(phase) - rank.resident, phase=phase)
        else:
            rollback = lora * 12 / procs
            host.add(
                f"rank {k} process",
                HOST_BASELINE["cuda"] + rollback,
                f"Python, torch, libraries + step rollback copy of its shard ({rollback / 1024**2:.1f} MiB)",
            )
    devices = {"host": host} if on_cpu else {**ranks, "host": host}
    if cfg.generator.own_weights:  # one engine for every rank, in the driver (on its own GPUs, or the host)
        for d in dict.fromkeys(_home(d) for d in place.generator_devices()):
            if d not in devices:
                devices[d] = DevicePlan(d, capacity_of(d, cfg))
                devices[d].add_cuda_runtime()
        add_engine(
            devices, cfg, shape, cfg.generator.chunk_size or cfg.grpo.prompts_per_step * cfg.grpo.num_generations
        )
    return devices, ranks, micro


def fill_rank(rank: DevicePlan, cfg, shape: ModelShape, on_cpu: bool) -> int:
    """One rank's items; returns its micro-batch (rows per log-prob/backward pass)."""
    gen, grpo, procs = cfg.generator, cfg.grpo, cfg.placement.learner_procs
    sharded, whole = base_weight_split(shape, cfg.model)
    _, fmt = base_weight_bytes(shape, cfg.model)
    layer, root = unit_bytes(shape, cfg)
    lora = shape.lora_params(cfg.lora.r, cfg.lora.target_modules)
    if on_cpu:
        rank.add("Python, torch, libraries", HOST_BASELINE["cpu"], "this rank's own process")
        rank.add("step rollback copy", lora * 12 / procs, "its shard of LoRA + AdamW state")
    else:
        rank.add_cuda_runtime()
    rank.add(f"base weights (1/{procs} shard)", sharded / procs, fmt)
    rank.add(
        "4-bit quant state (whole on every rank)", whole, "kept on the module, outside the parameters FSDP2 shards"
    )
    rank.add(f"LoRA weights (1/{procs})", lora * 4 / procs, f"{lora / 1e6:.1f}M params in all, fp32")
    rank.add(f"LoRA gradients (1/{procs})", lora * 4 / procs, "fp32, reduce-scattered")
    rank.add(f"AdamW moments (1/{procs})", lora * 8 / procs, "2 x fp32")
    if cfg.reference_strategy == "copy":
        rank.roles.append("reference copy (sharded like the policy)")
        rank.add(f"reference weights (1/{procs} shard)", sharded / procs, fmt)
        rank.add("reference quant state (whole on every rank)", whole)
    # why: a rank materialises one decoder layer at a time (execution/sharded/meta_load.py), quantizing each weight
    # from a float copy in model.dtype, and fully_shards it before the next; the root is read as its rows only. So
    # beyond the resident shards: one layer whole and its largest weight in float (AdamW and gradients, not there yet:
    # pessimistic)
    rank.add(
        "one layer whole before fully_shard",
        layer + load_float_bytes(shape, cfg),
        f"read and quantized layer by layer, then 1/{procs} kept; + its largest weight as read",
        phase="load",
    )

    if gen.own_weights:  # the rank's rollout is the driver engine's answer: no weights gathered for it
        rank.roles.append(f"rollout sampled by the driver's {gen.backend} engine")
    else:
        fill_hf_rollout(rank, cfg, shape, layer, root)

    rows = grpo.prompts_per_step * grpo.num_generations // procs
    act = activation_bytes(shape, cfg, on_cpu=on_cpu, micro_batch=min(grpo.micro_batch_size or rows, rows))
    gather_note = f"root + {LAYERS_IN_FLIGHT} layers whole at a time"
    shape_note = f"micro-batch {act['micro_batch']} of its {rows} rows x {act['tokens'] // act['micro_batch']} tokens"
    if grpo.beta > 0:  # the reference pass: the policy with its adapter off, or the sharded copy, gathered the same way
        rank.add("layer gather", root + LAYERS_IN_FLIGHT * layer, gather_note, phase="logprobs")
        rank.add(
            "reference forward (no grad)",
            act["forward activations"],
            f"{shape_note}, one layer at a time",
            phase="logprobs",
        )
        rank.add(
            "log-prob head", act["log-prob head"], head_note(cfg, shape, on_cpu, act["head in heap"]), phase="logprobs"
        )
    ckpt = "checkpointing on" if cfg.model.gradient_checkpointing else "checkpointing off"
    rank.add(
        "layer gather",
        root + LAYERS_IN_FLIGHT * layer + lora * 4 / shape.layers,
        f"{gather_note}, + a layer's LoRA gradient before reduce-scatter",
        phase="backward",
    )
    rank.add("activations (backward peak)", act["activations"], f"{shape_note}, {ckpt}", phase="backward")
    rank.add(
        "log-prob head", act["log-prob head"], head_note(cfg, shape, on_cpu, act["head in heap"]), phase="backward"
    )
    rank.add("4-bit dequant buffer", act["4-bit dequant buffer"], "largest layer, transient", phase="backward")
    return act["micro_batch"]


def load_float_bytes(shape: ModelShape, cfg) -> float:
    """The float copy of the largest linear weight a 4-bit load quantizes (none when the weights stay in model.dtype:
    the layer itself holds them)."""
    if not cfg.model.load_in_4bit:
        return 0.0
    return max(a * b for _, a, b in shape.linear_layers()) * DTYPE_BYTES[cfg.model.dtype]


def fill_hf_rollout(rank: DevicePlan, cfg, shape: ModelShape, layer: float, root: float) -> None:
    """The hf backend's rollout on a rank: the whole batch, through the model gathered whole or layer by layer."""
    gen, grpo = cfg.generator, cfg.grpo
    rank.roles.append("generator (hf, the whole rollout on every rank)")
    if gen.gather_for_generation:
        rank.add(
            "generation gather: whole model",
            shape.layers * layer + root,
            "generator.gather_for_generation: true; every layer and the root, for the whole rollout",
            phase="rollout",
        )
    else:
        rank.add(
            "generation gather: layer by layer",
            root + LAYERS_IN_FLIGHT * layer,
            f"generator.gather_for_generation: false; root + {LAYERS_IN_FLIGHT} layers whole at a time, at every "
            "decoding step (slow)",
            phase="rollout",
        )
    sequences = gen.chunk_size or grpo.prompts_per_step * grpo.num_generations
    rank.add(
        "generation KV cache",
        kv_cache_bytes(shape, cfg, sequences),
        f"{sequences} sequences per call, the same on every rank",
        phase="rollout",
    )
    rank.add(
        "generation logits step",
        generation_step_bytes(shape, cfg, sequences),
        "one decoding step: logits, float32 copy, recorded log-softmax, softmax, CDF",
        phase="rollout",
    )
