"""The learner's items, written once for one process and for each rank of a learner sharded over `procs` processes
(P3): 1/procs of every parameter and of AdamW's state (bitsandbytes' quant state stays whole), 1/procs of the batch
rows in log-probs and backward, the whole hf rollout on every rank, and, sharded, the layers FSDP2 gathers whole
during a pass and the layer-at-a-time load. In a world of one each of those is the one-process item.
"""

from __future__ import annotations

from ..models.shapes import ModelShape
from .estimate import (
    DTYPE_BYTES,
    OFFLOAD_IN_FLIGHT,
    ONEDNN_CPU_CACHES,
    RANK_BASELINE_CPU,
    DevicePlan,
    Item,
    activation_bytes,
    base_weight_bytes,
    base_weight_split,
    codebook_bytes,
    compute_bytes,
    generation_step_bytes,
    kv_cache_bytes,
    nf4_bits,
    on_cpu_learner,
    planned_lora,
    rollout_sequences,
    unit_bytes,
)
from .experts_items import add_experts_dequant
from .parts import head_note
from .render import count

# why 2: the layer computing and the next one, which FSDP2 all-gathers ahead of it (backward prefetch; on CUDA the
# all-gather stream also runs ahead in forward)
LAYERS_IN_FLIGHT = 2
# what a released rollout copy leaves on a GPU: its weights get new addresses at every rollout, so torch's CUDA graph
# trees record its decode step again and keep the recording's memory pool. A placeholder until bench/gpu measures it
# (calibrated on a GPU, this figure and its line's note change together)
RELEASED_COPY_GRAPH_POOL = 256 * 2**20


def add_learner(lrn: DevicePlan, host: DevicePlan, ref: DevicePlan, config, shape: ModelShape, procs: int = 1) -> int:
    """The learner's items on its device `lrn` (one process), or on one rank's (`procs` > 1): its state, its hf
    rollout, its log-prob and backward passes; the reference pass runs on `ref` (a copy's device, else `lrn`).
    Returns the micro-batch (rows per log-prob/backward pass)."""
    on_cpu = on_cpu_learner(config)
    add_state(lrn, host, ref, config, shape, procs, on_cpu)
    if procs > 1:
        add_sharded_load(lrn, config, shape, procs)
    if (
        config.generator.own_weights
    ):  # its engine holds weights of its own (parts.add_engine), in this process or the driver
        if procs > 1:
            lrn.roles.append(f"rollout sampled by the driver's {config.generator.backend} engine")
    elif config.generator.backend == "synthetic":  # nothing sampled: no KV cache, no decoding step
        lrn.roles.append("generator (synthetic: fixed full-length completions)")
    else:
        add_hf_rollout(lrn, host, config, shape, procs)
    return add_passes(lrn, ref, host, config, shape, procs, on_cpu)


def add_base(dev: DevicePlan, config, shape: ModelShape, procs: int, label: str, quant_label: str) -> None:
    """A copy of the base model's weights: whole, or a rank's 1/procs shard plus the quant state (never sharded)."""
    weights, fmt = base_weight_bytes(shape, config.model)
    if procs == 1:
        dev.add(label, weights, fmt)
        return
    sharded, whole = base_weight_split(shape, config.model)
    dev.add(f"{label} (1/{procs} shard)", sharded / procs, fmt)
    dev.add(quant_label, whole, "kept on the module, outside the parameters FSDP2 shards")


def add_state(lrn: DevicePlan, host: DevicePlan, ref: DevicePlan, config, shape: ModelShape, procs: int, on_cpu: bool):
    """What the learner holds for the whole step: weights, LoRA, gradients, AdamW, the rollback copy, a reference
    copy."""
    lora = planned_lora(shape, config)
    part = "" if procs == 1 else f" (1/{procs})"
    if procs > 1 and on_cpu:  # a CPU rank is a process of its own in host RAM
        lrn.add("Python, torch, libraries", RANK_BASELINE_CPU, "this rank's own process: Ray's worker and gloo too")
    elif procs > 1:
        lrn.add_cuda_runtime()
    if procs == 1 and on_cpu and compute_bytes(config) == 2:  # why: oneDNN's kernel caches (estimate.ONEDNN_CPU_CACHES)
        lrn.add(
            "oneDNN kernel caches (CPU, 16-bit compute)",
            ONEDNN_CPU_CACHES,
            "per-shape primitives, scratchpad; measured, not modelled",
        )
    add_base(lrn, config, shape, procs, "base weights", "4-bit quant state (whole on every rank)")
    add_experts_load(lrn, host, config, shape)
    lrn.add(f"LoRA weights{part}", lora * 4 / procs, f"{count(lora)} params{' in all' if procs > 1 else ''}, fp32")
    lrn.add(f"LoRA gradients{part}", lora * 4 / procs, "fp32" if procs == 1 else "fp32, reduce-scattered")
    if config.placement.optimizer_offload:  # (one process only: the config refuses it for a sharded learner)
        host.add("AdamW master weights + moments (offloaded)", lora * 12, "fp32")
    else:
        lrn.add(f"AdamW moments{part}", lora * 8 / procs, "2 x fp32")
        if (
            procs == 1 and not on_cpu
        ):  # why: torch's AdamW on a GPU steps all tensors at once (foreach), with temporaries
            lrn.add("AdamW step temporaries", lora * 8, "foreach: 2 x fp32, measured", phase="optimizer")
    # why a copy: steps are all-or-nothing; a CUDA rank's copy is in its process' host row (sharded.build_sharded)
    if procs == 1:
        host.add("step rollback copy", lora * 12, "LoRA + AdamW state, all-or-nothing steps")
    elif on_cpu:
        lrn.add("step rollback copy", lora * 12 / procs, "its shard of LoRA + AdamW state")
    if config.reference_strategy == "copy":
        ref.roles.append("reference copy" if procs == 1 else "reference copy (sharded like the policy)")
        add_base(ref, config, shape, procs, "reference weights", "reference quant state (whole on every rank)")


def add_experts_load(lrn: DevicePlan, host: DevicePlan, config, shape: ModelShape) -> None:
    """A mixture of experts' checkpoint is read a decoder layer at a time (models/experts.load_experts_checkpoint):
    one layer's experts in model.dtype twice in host memory (the per-expert tensors read, and their fused stack),
    and once on a GPU learner's card, before they are quantized. A built-in random shape draws and quantizes them a
    layer at a time too (models/random_shapes.py)."""
    from ..models.experts import MOE_FAMILIES
    from ..models.random_shapes import parse_random

    if not (shape.moe and config.model.load_in_4bit) or parse_random(config.model.name_or_path):
        return
    e = DTYPE_BYTES[config.model.dtype]
    if not MOE_FAMILIES[shape.family].read_by_layer:  # from_pretrained reads every expert whole, quantized after
        lrn.add(
            "experts whole before nf4",
            shape.expert_params * (e - nf4_bits(config.model.bnb_4bit_use_double_quant) / 8),
            f"{count(shape.expert_params)} expert weights read in {config.model.dtype} by from_pretrained",
            phase="load",
        )
        return
    layer = sum(n for _, n in shape.expert_tensors()) * e
    why = f"read per expert and fused in {config.model.dtype}, quantized before the next layer is read"
    host.add("one layer's experts read (files)", 2 * layer, why, phase="load")
    if lrn is not host:
        lrn.add("one layer's experts before nf4", layer, why, phase="load")


def add_sharded_load(rank: DevicePlan, config, shape: ModelShape, procs: int) -> None:
    """A rank's load: beyond its resident shards, one layer whole and its largest weight in float."""
    layer, _ = unit_bytes(shape, config)
    # why: a rank materialises one decoder layer at a time (models/meta_load.py), quantizing each weight
    # from a float copy in model.dtype, and fully_shards it before the next; the root is read as its rows only (AdamW
    # and gradients, not there yet: pessimistic)
    rank.add(
        "one layer whole before fully_shard",
        layer + load_float_bytes(shape, config),
        f"read and quantized layer by layer, then 1/{procs} kept; + its largest weight as read",
        phase="load",
    )


def load_float_bytes(shape: ModelShape, config) -> float:
    """The float copy of the largest linear weight a 4-bit load quantizes (none when the weights stay in model.dtype:
    the layer itself holds them)."""
    if not config.model.load_in_4bit:
        return 0.0
    return shape.largest_weight * DTYPE_BYTES[config.model.dtype]


def rollout_copy_bytes(shape: ModelShape, config) -> float:
    """generator.hf_decode: merged: every linear layer dense in the compute dtype (the rest is the learner's own
    tensors, shared)."""
    return shape.linear_params * compute_bytes(config)


def merge_temporary_bytes(shape: ModelShape) -> float:
    """What one layer's merge holds beside the copy (generation/rollout_copy.merged_float): its largest weight in
    float32 twice, dequantized and then + scaling * B @ A (the dequantized 16-bit read counted as a second float32)."""
    return 2 * 4 * max(a * b for _, a, b in shape.linear_layers())


def compute_dtype(config) -> str:
    return config.model.bnb_4bit_compute_dtype if config.model.load_in_4bit else config.model.dtype


def parked_state_bytes(shape: ModelShape, config) -> float:
    """generator.park_learner: what waits in host memory while the rollout copy decodes (models/park.py): the 4-bit
    bases with their quant state, LoRA, and AdamW's moments and step counts where they are the learner's (not
    offloaded)."""
    lora = planned_lora(shape, config)
    model = config.model
    base = 0.0
    if model.load_in_4bit:
        codebooks = codebook_bytes(model)
        base = (
            shape.linear_params * nf4_bits(model.bnb_4bit_use_double_quant) / 8 + quantized_weights(shape) * codebooks
        )
    adamw = 0.0 if config.placement.optimizer_offload else lora * 8 + lora_tensors(shape, config) * 4
    return base + lora * 4 + adamw


def quantized_weights(shape: ModelShape) -> int:
    return shape.layers * len(shape.linear_layers())


def lora_tensors(shape: ModelShape, config) -> int:
    """LoRA's weight tensors: A and B of each adapted linear layer and fused expert tensor (lora.target_experts)."""
    targets = config.lora.target_modules
    adapted = [n for n, _, _ in shape.linear_layers() if targets == "all-linear" or n in targets]
    experts = len(shape.expert_tensors()) if config.lora.target_experts else 0
    return 2 * shape.layers * (len(adapted) + experts)


def parking_buffer_bytes(shape: ModelShape, config) -> float:
    """The one host buffer parking fills (models/park.py: sized from this figure, kept for the Lab's life): the parked
    state, each tensor's slot rounded up to SLOT_ALIGN bytes (counted as a whole SLOT_ALIGN per tensor)."""
    from ..models.park import SLOT_ALIGN

    double = config.model.bnb_4bit_use_double_quant
    per_weight = (6 if double else 3) if config.model.load_in_4bit else 0  # codes, absmax, code (+ offset, state2's 2)
    adamw = 0 if config.placement.optimizer_offload else 3  # exp_avg, exp_avg_sq, step per LoRA tensor
    tensors = quantized_weights(shape) * per_weight + lora_tensors(shape, config) * (1 + adamw)
    return parked_state_bytes(shape, config) + tensors * SLOT_ALIGN


def add_hf_rollout(lrn: DevicePlan, host: DevicePlan, config, shape: ModelShape, procs: int) -> None:
    """The hf backend's rollout with the learner's own weights: the whole batch (on every rank), through the model
    gathered whole or layer by layer when sharded."""
    gen = config.generator
    decode = gen.hf_decode if procs == 1 else "dynamic"  # (auto arrives resolved: plan.build)
    if procs == 1:
        copy = f", copy {'kept' if gen.rollout_copy == 'keep' else 'released'}" if decode == "merged" else ""
        lrn.roles.append(f"generator ({gen.backend}, shares learner weights; decode {decode}{copy})")
    else:
        lrn.roles.append("generator (hf, the whole rollout on every rank)")
        layer, root = unit_bytes(shape, config)
        if gen.gather_for_generation:
            lrn.add(
                "generation gather: whole model",
                shape.layers * layer + root,
                "generator.gather_for_generation: true; every layer and the root, for the whole rollout",
                phase="rollout",
            )
        else:
            lrn.add(
                "generation gather: layer by layer",
                root + LAYERS_IN_FLIGHT * layer,
                f"generator.gather_for_generation: false; root + {LAYERS_IN_FLIGHT} layers whole at a time, at "
                "every decoding step (slow)",
                phase="rollout",
            )
    kept = procs == 1 and decode == "merged" and gen.rollout_copy == "keep"  # (auto arrives resolved: plan.build)
    if procs == 1 and decode == "merged":
        add_rollout_copy(lrn, config, shape, kept)
    if procs == 1 and decode == "merged" and gen.park_learner:
        add_parking(lrn, host, config, shape)
    sequences = rollout_sequences(config)  # why not chunk_size alone: a smaller batch is one call of its rows
    every = ", the same on every rank" if procs > 1 else ""
    add_experts_dequant(lrn, config, shape, sequences)
    # why resident beside a kept copy on a GPU: its one StaticCache stays too, at one address (generation/hf.py)
    kept_cache = kept and not on_cpu_learner(config)
    lrn.add(
        "generation KV cache",
        kv_cache_bytes(shape, config, sequences),
        f"{sequences} sequences per call{every}" + (", kept with the copy between rollouts" if kept_cache else ""),
        phase=None if kept_cache else "rollout",
    )
    lrn.add(
        "generation logits step",
        generation_step_bytes(shape, config, sequences),
        "one decoding step: logits, their float32 copy (a view of float32 logits on a CPU, not through a sharded "
        "head left ungathered), a block of rows' softmax and CDF",
        phase="rollout",
    )


def add_parking(lrn: DevicePlan, host: DevicePlan, config, shape: ModelShape) -> None:
    """generator.park_learner: the learner's state off its device while the copy decodes, into one host buffer."""
    parked = parked_state_bytes(shape, config)
    # why both sides: the card is freed of it for the rollout, and one host buffer holds it then, kept for the
    # Lab's life (models/park.py: made once, reused every rollout)
    lrn.add(
        "learner state parked",
        -parked,
        "4-bit base, LoRA, AdamW in host memory (generator.park_learner)",
        "rollout",
    )
    host.add(
        "parking buffer",
        parking_buffer_bytes(shape, config),
        "one host buffer per Lab (pinned from a GPU), reused every rollout: the learner's 4-bit base, LoRA and "
        "AdamW while the copy decodes",
    )


def add_rollout_copy(lrn: DevicePlan, config, shape: ModelShape, kept: bool) -> None:
    """generator.hf_decode: merged: the copy's dense weights, for the whole step when kept (generator.rollout_copy),
    else the rollout's alone; and one layer's merge temporaries while the copy is refreshed."""
    gen = config.generator
    what = f"{count(shape.linear_params)} linear weights dequantized to {compute_dtype(config)} with the LoRA merged in"
    if kept:
        held = "one per Lab, kept between rollouts, each refresh written into its storage"
    else:
        held = "one per Lab, refreshed at each rollout, released after it"
    lrn.add(
        "rollout copy (LoRA merged)",
        rollout_copy_bytes(shape, config),
        f"{what}; {held} (generator.hf_decode: {gen.hf_decode}, generator.rollout_copy: {gen.rollout_copy})",
        phase=None if kept else "rollout",
    )
    if not kept:
        add_graph_pool(lrn, config)
    lrn.add(
        "rollout copy merge temporaries",
        merge_temporary_bytes(shape),
        "one layer's largest weight in float32 twice while it merges (dequantized, + B @ A), layer by layer",
        phase="rollout",
    )


def add_graph_pool(lrn: DevicePlan, config) -> None:
    """What a released copy leaves between rollouts: on a GPU the CUDA graph pool of its re-recorded decode step
    (RELEASED_COPY_GRAPH_POOL, uncalibrated); on the CPU nothing, and the line says why (it reads 0)."""
    if on_cpu_learner(config):
        # why a line of 0 bytes (DevicePlan.add drops those): the plan says what a released copy leaves on every device
        note = "0 on the CPU: merged decodes with the growing cache there, no CUDA graphs, so nothing is recorded"
        lrn.items.append(Item("released copy: CUDA graph pool", 0.0, note))
        return
    lrn.add(
        "released copy: CUDA graph pool",
        RELEASED_COPY_GRAPH_POOL,
        "torch's CUDA graph trees record the copy's decode step again at each rollout (new weight addresses) and keep "
        "its memory pool; a placeholder, to be calibrated on a GPU (bench/gpu/fast_path_and_moe.sh)",
    )


def add_passes(
    lrn: DevicePlan, ref: DevicePlan, host: DevicePlan, config, shape: ModelShape, procs: int, on_cpu: bool
) -> int:
    """The reference pass (beta > 0) and backward over this process' rows, a micro-batch at a time, with the layers
    gathered whole when sharded. Returns the micro-batch."""
    grpo, lora = config.grpo, planned_lora(shape, config)
    rows = grpo.prompts_per_step * grpo.num_generations // procs
    act = activation_bytes(shape, config, on_cpu=on_cpu, micro_batch=min(grpo.micro_batch_size or rows, rows))
    tokens = act["tokens"] // act["micro_batch"]
    of_rows = f" of its {rows} rows" if procs > 1 else ""
    shape_note = f"micro-batch {act['micro_batch']}{of_rows} x {tokens} tokens"
    layer, root = unit_bytes(shape, config)
    gather_note = f"root + {LAYERS_IN_FLIGHT} layers whole at a time"
    if grpo.beta > 0:  # why: the logprobs phase runs only for reference log-probs, without a graph
        ref_on_cpu = ref.device == "host" if procs == 1 else on_cpu
        # its own kernel path when the copy is on another device
        ref_act = act if ref is lrn else activation_bytes(shape, config, on_cpu=ref_on_cpu)
        if procs > 1:  # the policy with its adapter off, or the sharded copy, gathered the same way
            ref.add("layer gather", root + LAYERS_IN_FLIGHT * layer, gather_note, phase="logprobs")
        ref.add(
            "reference forward (no grad)",
            ref_act["forward activations"],
            f"{shape_note}, one layer at a time",
            phase="logprobs",
        )
        head = head_note(config, shape, ref_on_cpu)
        ref.add("log-prob head", ref_act["log-prob head"], head, phase="logprobs")
    if procs > 1:
        lrn.add(
            "layer gather",
            root + LAYERS_IN_FLIGHT * layer + lora * 4 / shape.layers,
            f"{gather_note}, + a layer's LoRA gradient before reduce-scatter",
            phase="backward",
        )
    ckpt = "checkpointing on" if config.model.gradient_checkpointing else "checkpointing off"
    if act["offloaded inputs"]:
        ckpt += f", layer inputs on the host ({OFFLOAD_IN_FLIGHT} in flight)"
        # why resident: torch's pinned-memory allocator keeps the blocks for the next step's copies
        host.add("offloaded layer inputs (pinned)", act["offloaded inputs"] * procs, f"{shape_note} x {shape.layers}")
    lrn.add("activations (backward peak)", act["activations"], f"{shape_note}, {ckpt}", phase="backward")
    head = head_note(config, shape, on_cpu)
    lrn.add("log-prob head", act["log-prob head"], head, phase="backward")
    lrn.add("4-bit dequant buffer", act["4-bit dequant buffer"], "largest layer, transient", phase="backward")
    return act["micro_batch"]
