"""Pre-flight memory plan: what each device will hold, computed from config.json and the lab
config before any weight is loaded. Every term is a formula over the model's shape. Items are
resident (weights, optimizer state) or transient in one phase of the step (rollout, logprobs,
backward); a device's peak is its resident total plus its heaviest phase.

Units are bytes. A learner on the CPU lives in host RAM, so "cpu" is planned as "host".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..generation.step_memory import decode_step_bytes
from ..models.shapes import ModelShape

# (the base weights' bytes, imported by their users from here too)
from .quant_bytes import DTYPE_BYTES, base_weight_bytes, base_weight_split, codebook_bytes, nf4_bits  # noqa: F401

GiB = 1024**3
GENERATOR_BITS = {None: None, "awq": 4.25, "gptq": 4.25, "compressed-tensors": 4.25, "fp8": 8.0}
MiB = 1024**2
# Per GPU a process touches, measured on an H100 (torch 2.11, CUDA 13; bench/gpu/gpu_check.py's context probe and its
# grpo_lab runs, docs/benchmarks.md): the CUDA context, which NVML sees and torch's allocator does not (525 MiB), and
# what torch's allocator holds beyond the tensors planned here once a step has run (50 MiB: cuBLAS's workspace, 32 MiB
# measured alone, and runtime buffers)
CUDA_CONTEXT_ONLY, CUDA_WORKSPACE = 525 * MiB, 50 * MiB
CUDA_CONTEXT = CUDA_CONTEXT_ONLY + CUDA_WORKSPACE  # what a process's use of a GPU costs beyond its tensors
OUTSIDE_ALLOCATOR = ("CUDA context",)  # plan lines torch's allocated bytes never include
# A CPU backward's peak over the tensors saved for it: the gradients alive in one layer's backward, while that layer's
# saved tensors are freed, as a share of a layer's saved bytes. Measured from RSS at a pinned heap threshold
# (memory.host_mmap_threshold_mib 0.125, where RSS follows the tensors): 0.27 and 0.28 on builtin:kv-heavy at 3,072 and
# 8,192 tokens, with and without checkpointing
CPU_BACKWARD_GRADIENTS = 0.3
# A checkpointed layer's backward on a GPU: its recomputed saved tensors plus their gradients peak at 1.4x the
# per-layer bytes activation_bytes counts (H100, Qwen2.5-0.5B's shape, micro-batches of 8 at 256 and 1,024 tokens:
# 1.40 and 1.35), where the CPU's heap holds 2x
GPU_LAYER_RECOMPUTE = 1.4
# model.activation_offload: layer inputs on the GPU at once in backward: the one recomputing and the one prefetched
# (models/activation_offload.py); the rest wait in pinned host memory
OFFLOAD_IN_FLIGHT = 2
# Python and the libraries with the one-off state of a first step, by the kind of process that plans: tiny-cpu's RSS
# as its second step starts, less the plan's other lines (bench/probes/process_baseline.py, 2026-12-05, CPU torch
# 2.13): a plain process 571 MiB, `grpo-lab run` 572, a Jupyter kernel 659 (its live plot drawn), a CPU rank 678
# (Ray's worker runtime and gloo too). A CUDA build maps its libraries and context into host RAM too (not measured)
HOST_BASELINE = {"cpu": 572 * MiB, "cuda": 1.0 * GiB}
RANK_BASELINE_CPU = 680 * MiB
# a local Ray's own processes (GCS, raylet, agents, idle workers) beside two CPU ranks after two steps, in the
# driver's process tree: 1,038 MiB (bench/probes/process_baseline.py; notebook 06's cell read 641.5 after one step:
# fewer idle workers); on the machine's plan where placement.ray_address is unset
RAY_PROCESSES = 1040 * MiB
# A Jupyter kernel's own share beside HOST_BASELINE, ipykernel and IPython: a headless kernel read 540.8 MiB where a
# plain process read 520.7 in one run (bench/probes/process_baseline.py); its figures: planner/kernel_share.py
KERNEL_BASELINE = 20 * MiB


def in_kernel() -> bool:
    """Whether this process is a Jupyter kernel (where the plan also counts KERNEL_BASELINE on the host)."""
    import sys

    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


FUSED_HEAD_TILE = (4096, 32768)  # TRL's fused LM head: tokens x vocab per tile
# tiles alive at the head's peak: Triton folds a tile in place (forward buffer + backward tile); the torch fallback on
# CPU makes temporaries of tile size (8.3 measured by bench/plan_accuracy/fused_head_cpu.py; 8.5 keeps a margin)
HEAD_TILES = {"cuda": 2.0, "cpu": 8.5}
# the textbook head ("full"): float32 [rows, vocab] buffers alive at its peak (the log-softmax kept for backward, its
# gradient, the softmax): 12.07 bytes per row x vocab measured on logits-heavy-cpu (2,048 rows x 151,936, 3,583 MiB)
FULL_HEAD_FLOAT32_COPIES = 3
# A CPU learner computing in bf16/fp16 runs its matmuls through oneDNN, whose per-shape primitives and scratchpad stay
# in the process once made. Which kernels it picks is not a function of the shapes planned here, so this is measured,
# not modelled: 24-63 MiB at rest over bench/plan_accuracy/planner_accuracy.py's grid against the float32 baseline
# above.
ONEDNN_CPU_CACHES = 48 * 1024**2
# The log-prob head needs no widening for glibc's own mmap threshold (memory.host_mmap_threshold_mib: null), which
# serves blocks under 32 MiB from its heap: each pass writes every chunk into buffers it holds (algo/head.py), and its
# chunks held 6.1-6.2 bytes of RSS per element there, as pinned (bench/plan_accuracy/head_heap.py, docs/benchmarks.md
# "The rollout's heap holes at glibc's own threshold").
# The holes the plan cannot model at that threshold (the layers' activations between trims): they come and go from run
# to run, so they are said, not planned; measured by bench/plan_accuracy/planner_accuracy.py's grid at null
# (docs/benchmarks.md), before the rollout's log-prob recorder and the head held their buffers (their holes were part
# of those figures)
HEAP_HOLES_CAVEAT = (
    "host: glibc's own mmap threshold (memory.host_mmap_threshold_mib: null) can leave heap holes this "
    "plan does not model (the layers' activations between heap trims); a CPU learner's phases measured "
    "up to 1.19x their plan (the peak up to 1.10x), with one-off spikes to 1.58x, and a wide model's "
    "backward without checkpointing 1.36x (builtin:kv-heavy). 0.125 holds them within 1.1, at 1.2-2.5x "
    "the CPU step time"
)
# vLLM on the CPU, in this process: its modules and engine state beside its weights and the KV cache it reserves
# (generator.cpu_kv_cache_gib, touched at start), measured at rest by bench/plan_accuracy/planner_accuracy.py's vllm
# points.
VLLM_CPU_ENGINE = 272 * 1024**2
# the phases with transients worth planning (phases.PHASES order); "load" only in a sharded plan, where every rank
# loads the whole model before fully_shard keeps its 1/N
PHASES = ("load", "rollout", "rewards", "logprobs", "backward", "optimizer")
VLLM_SPLIT_SHARE = 0.9  # vLLM's default gpu_memory_utilization on a GPU of its own


@dataclass
class Item:
    what: str
    bytes: float
    note: str = ""
    phase: Optional[str] = None  # None: resident for the whole step; else alive only during that phase


@dataclass
class DevicePlan:
    device: str
    capacity: float
    roles: list[str] = field(default_factory=list)
    items: list[Item] = field(default_factory=list)
    split: Optional[object] = None  # a GPU a vLLM engine takes a share of: its split.Split
    # the share of capacity the device may reach: host RAM (or a CPU rank's budget) the host guard's
    # memory.host_threshold, where it stops a phase, a GPU all of it (planner/parts.line_of)
    line: float = 1.0

    def add(self, what: str, nbytes: float, note: str = "", phase: Optional[str] = None) -> None:
        if nbytes:
            self.items.append(Item(what, nbytes, note, phase))

    def add_cuda_runtime(self) -> None:
        """A GPU's lines beyond its tensors (CUDA_CONTEXT_ONLY, CUDA_WORKSPACE)."""
        self.add("CUDA context", CUDA_CONTEXT_ONLY, "measured: NVML, outside torch's allocator")
        self.add("CUDA workspaces", CUDA_WORKSPACE, "measured: cuBLAS's and runtime buffers in torch's allocator")

    @property
    def resident(self) -> float:
        return sum(i.bytes for i in self.items if i.phase is None)

    def phase_peak(self, phase: str) -> float:
        """Planned peak while `phase` runs: the resident items plus that phase's transients."""
        return self.resident + sum(i.bytes for i in self.items if i.phase == phase)

    def allocated_peak(self, phase: str) -> float:
        """phase_peak without the lines outside torch's allocator (the CUDA context): what torch's
        max_memory_allocated is planned to read during `phase`."""
        outside = sum(i.bytes for i in self.items if i.phase is None and i.what in OUTSIDE_ALLOCATOR)
        return self.phase_peak(phase) - outside

    @property
    def peak_phase(self) -> Optional[str]:
        """The phase whose transients are largest (None when the device has none)."""
        phases = [p for p in PHASES if any(i.phase == p for i in self.items)]
        return max(phases, key=self.phase_peak) if phases else None

    @property
    def total(self) -> float:
        """The device's planned peak: resident items plus its heaviest phase (phases never overlap)."""
        return self.phase_peak(self.peak_phase) if self.peak_phase else self.resident

    @property
    def fraction(self) -> float:
        return self.total / self.capacity

    @property
    def line_bytes(self) -> float:
        """What the device may hold: its capacity x its line (the host guard's, or the whole GPU)."""
        return self.capacity * self.line

    @property
    def verdict(self) -> str:
        """Judged against the line, not the capacity: a host peak the guard would stop is not "fits"."""
        if self.split is not None and not self.split.feasible:
            return "does not fit (no vLLM share leaves the learner room)"
        if self.fraction > 1.0:
            return "does not fit"
        if self.fraction > self.line:
            return f"does not fit (over the guard's line, {self.line:.0%} of capacity)"
        return "fits" if self.fraction <= 0.9 * self.line else "tight (<10% margin under its line)"

    @property
    def fits(self) -> bool:
        return self.fraction <= self.line and (self.split is None or self.split.feasible)


def unit_bytes(shape: ModelShape, config) -> tuple[float, float]:
    """(one decoder layer, the root) gathered whole: a layer's linear weights (4-bit codes or model.dtype), its two
    norms and its fp32 LoRA; the root's embedding, untied LM head and final norm. layers x layer + root is the
    sharded part of base_weight_split plus the LoRA weights: everything a whole-model gather brings back."""
    e = DTYPE_BYTES[config.model.dtype]
    weights = sum(a * b for _, a, b in shape.linear_layers()) + sum(n for _, n in shape.expert_tensors())
    linear = weights * (0.5 if config.model.load_in_4bit else e) + shape.router_params / shape.layers * e
    lora = planned_lora(shape, config) / shape.layers * 4
    return linear + 2 * shape.hidden * e + lora, (shape.embedding_params + shape.hidden) * e


def planned_lora(shape: ModelShape, config) -> int:
    """LoRA's parameters on this shape: target_modules', and each routed expert's (lora.target_experts)."""
    lora = config.lora
    return shape.lora_params(lora.r, lora.target_modules, (lora.expert_r or lora.r) if lora.target_experts else 0)


def experts_dequant_bytes(shape: ModelShape, config, tokens: Optional[int] = None) -> float:
    """One layer's 4-bit experts dequantized to model.dtype per forward: those `tokens` tokens route to, at worst each
    to experts_per_token others (models/routed_experts.py; expert adapters too); every expert without `tokens`."""
    if not shape.moe or not config.model.load_in_4bit:
        return 0.0
    routed = shape.experts if tokens is None else tokens * shape.experts_per_token
    layer = sum(n for _, n in shape.expert_tensors()) * DTYPE_BYTES[config.model.dtype]
    return layer * min(routed, shape.experts) / shape.experts


def expert_lora_bytes(shape: ModelShape, config) -> dict[str, float]:
    """lora.target_experts beyond the frozen experts: kept per token and layer (each routed copy's inputs to both fused
    matmuls, for their weights' gradients) and per layer (PEFT's factors), counted with saved_tensors_hooks
    (tests/test_expert_lora.py); one fused tensor's transient (W + B A beside W; its whole gradient in backward)."""
    if not (shape.moe and config.lora.target_experts):
        return {"per token": 0.0, "per layer": 0.0, "transient": 0.0}
    e = DTYPE_BYTES[config.model.dtype]
    rank = config.lora.expert_r or config.lora.r
    return {
        "per token": shape.experts_per_token * (shape.hidden + shape.expert_intermediate) * compute_bytes(config),
        "per layer": shape.expert_lora_params(rank) / shape.layers * e,
        "transient": max(n for _, n in shape.expert_tensors()) * e,
    }


def redequantizes(shape: ModelShape, config) -> bool:
    """Whether the experts' backward dequantizes them again (models/routed_experts.RedequantizedExperts): 4-bit
    experts without gradient checkpointing. It keeps their inputs alone; the routed copies' tensors are remade."""
    return shape.moe and config.model.load_in_4bit and not config.model.gradient_checkpointing


def routed_copy_bytes(shape: ModelShape, e: int) -> float:
    """Per token and layer, what the routed copies keep for backward in grouped_mm: each copy's gathered input (h),
    gate/up output (2m), gated activation (m), three int64 indices and its routing weight."""
    k, h, m = shape.experts_per_token, shape.hidden, shape.expert_intermediate
    return k * ((h + 3 * m) * e + 3 * 8 + 4)


def mlp_saved_bytes(shape: ModelShape, e: int, redequantize: bool = False) -> float:
    """Bytes per token and layer the MLP keeps for backward. Dense: its four [i] tensors (gate and up outputs, the
    activation, their product). A mixture of experts, as transformers' default experts run it (grouped_mm: the routed
    copies sorted by expert, one grouped matmul each way), per routed copy of the token: its gathered input (h), the
    gate/up output (2m), the gated activation (m), three int64 indices and its routing weight; per token the router's
    float32 probabilities and top-k ids (the router is frozen: its input is not kept); a shared expert as a dense MLP.
    `redequantize`: the experts' input, top-k ids and weights alone. Counted with saved_tensors_hooks on
    builtin:tiny-moe and builtin:tiny-qwen2-moe (tests/test_moe.py)."""
    if not shape.moe:
        return 4 * shape.intermediate * e
    k = shape.experts_per_token
    routed = shape.hidden * e + k * (8 + e) if redequantize else routed_copy_bytes(shape, e)
    router = shape.experts * 4 + k * 8
    return routed + router + 4 * shape.shared_intermediate * e


def compute_bytes(config) -> int:
    return DTYPE_BYTES[config.model.bnb_4bit_compute_dtype if config.model.load_in_4bit else config.model.dtype]


def chunked_head_bytes(rows: int, shape: ModelShape, e: int, chunk: int, on_cpu: bool) -> float:
    """grpo_lab's head (algo/head.py): one chunk of logits in float32 plus the compute-dtype matmul output it is cast
    from, forward or backward (recomputed there), and the compact hidden rows with their gradient."""
    logits = min(chunk, rows) * shape.vocab * (4 + (e if e != 4 else 0))
    return logits + rows * (2 * shape.hidden * e + 12)


def trl_head_bytes(rows: int, shape: ModelShape, e: int, chunk: int, on_cpu: bool) -> float:
    """TRL's fused head on the same compact rows: vocabulary tiles (HEAD_TILES alive), hidden grad, stats."""
    tile = min(rows, FUSED_HEAD_TILE[0]) * min(shape.vocab, FUSED_HEAD_TILE[1]) * e
    return HEAD_TILES["cpu" if on_cpu else "cuda"] * tile + rows * (shape.hidden * 4 + 8 * 4)


def full_head_bytes(rows: int, shape: ModelShape, e: int, chunk: int, on_cpu: bool) -> float:
    """The textbook head: float32 [rows, V] buffers (FULL_HEAD_FLOAT32_COPIES; the compute-dtype matmul output is
    freed before the peak), and the hidden rows with their gradient."""
    return rows * shape.vocab * FULL_HEAD_FLOAT32_COPIES * 4 + rows * shape.hidden * 2 * e


# grpo.logprob_head -> its planned transient
HEAD_BYTES = {"chunked": chunked_head_bytes, "trl": trl_head_bytes, "full": full_head_bytes}


def saved_per_token(shape: ModelShape, config, length: int, on_cpu: bool) -> float:
    """Bytes a training forward keeps for backward per token and layer (`length`: the sequence's tokens)."""
    e = compute_bytes(config)
    h, kv, r = shape.hidden, shape.kv_heads * shape.head_dim, config.lora.r
    q = shape.heads * shape.head_dim  # the query/attention width: the hidden size in most models, not in all
    adapted = len(
        shape.linear_layers()
    )  # LoRA'd linear layers (7 dense; a mixture of experts: 4, or 7 with a shared one)
    if on_cpu:
        # what torch keeps for backward per token and layer on the CPU, counted with saved_tensors_hooks
        # (tests/test_planner_saved.py): the norms' inputs and outputs (4h), four tensors at the query's width (the
        # query, the key and value expanded to it for SDPA, the attention output), the MLP's four (4i), SDPA's float
        # mask row (length) and log-sum-exp (heads), the norms' two scalars, the LoRA A outputs. torch's CPU flash
        # attention keeps no probabilities (an earlier plan counted them, fitting glibc's heap holes instead)
        mlp = mlp_saved_bytes(shape, e, redequantizes(shape, config))
        per_layer = (4 * h + 4 * q + length + shape.heads + 2) * e + mlp + adapted * r * 4
    else:
        # on a GPU, per token and layer: the norms' and MLP's inputs (4h, 4i), the query path (3q: q, its rotated
        # copy, the attention output o_proj reads) and the key/value path (3kv), the LoRA A outputs (fitted to the
        # H100 records of tests/test_long_sequences.py and tests/test_gpu_check.py)
        per_layer = (
            (4 * h + 3 * q + 3 * kv) * e + mlp_saved_bytes(shape, e, redequantizes(shape, config)) + adapted * r * 4
        )
    copies = 0.0 if redequantizes(shape, config) else expert_lora_bytes(shape, config)["per token"]
    return per_layer + copies  # (with lora.target_experts: the routed copies' inputs to both fused matmuls)


def activation_bytes(
    shape: ModelShape, config, on_cpu: bool = False, micro_batch: Optional[int] = None
) -> dict[str, float]:
    """Transients of one log-prob/backward micro-batch (`on_cpu`: the learner runs on the CPU; `micro_batch`: rows
    per pass, default grpo.micro_batch_size or the whole batch)."""
    grpo, gen = config.grpo, config.generator
    e = compute_bytes(config)
    n = micro_batch or grpo.micro_batch_size or grpo.prompts_per_step * grpo.num_generations
    length = gen.max_prompt_length + gen.max_completion_length
    tokens = n * length
    h = shape.hidden
    per_layer = saved_per_token(shape, config, length, on_cpu)
    expert_lora = expert_lora_bytes(shape, config)
    # why completion rows only: the head scores the real completion tokens, never the prompt or padding
    rows = n * gen.max_completion_length
    head = HEAD_BYTES[grpo.logprob_head](rows, shape, e, grpo.logprob_chunk_size, on_cpu)
    if config.model.gradient_checkpointing and on_cpu:
        stored = shape.layers * h * e * tokens + (1 + CPU_BACKWARD_GRADIENTS) * per_layer * tokens  # inputs + one layer
    elif config.model.gradient_checkpointing:
        # why the larger of the head and the layer, not both: on a GPU the head's buffers go back to the caching
        # allocator before the layers' backward reuses them (the CPU's heap keeps them, so there both are planned)
        layer = GPU_LAYER_RECOMPUTE * per_layer * tokens
        inputs = OFFLOAD_IN_FLIGHT if config.model.activation_offload else shape.layers
        stored = inputs * h * e * tokens + max(layer - head, 0.0)
    elif on_cpu:
        stored = (shape.layers + CPU_BACKWARD_GRADIENTS) * per_layer * tokens
    else:
        stored = shape.layers * per_layer * tokens + per_layer * tokens
    dequant = max(a * b for _, a, b in shape.linear_layers()) * e if config.model.load_in_4bit else 0
    # kept by each expert matmul (its weight is a view of the dequantized experts; checkpointing: the recomputed
    experts = experts_dequant_bytes(shape, config, tokens)  # layer's: those its tokens route to), expert LoRA's
    # factors, one fused tensor's gradient
    redo = redequantizes(shape, config)  # (then no layer keeps its experts: backward dequantizes them again)
    kept = (0.0 if redo else experts) + expert_lora["per layer"]
    stored += (1 if config.model.gradient_checkpointing else shape.layers) * kept + expert_lora["transient"]
    if redo:  # backward: one layer's routed experts dequantized again, its routed copies remade
        stored += experts + (routed_copy_bytes(shape, e) + expert_lora["per token"]) * tokens
    # no grad (reference log-probs): one layer's intermediates (and its experts dequantized) and the last hidden states
    forward = per_layer * tokens + h * e * tokens + experts
    return {
        "activations": stored,
        # what a forward without checkpointing keeps for backward
        "saved": shape.layers * (per_layer * tokens + kept),
        # the layer inputs activation offload keeps on the host (pinned), on a GPU learner
        "offloaded inputs": shape.layers * h * e * tokens if config.model.activation_offload and not on_cpu else 0,
        "log-prob head": head,
        "4-bit dequant buffer": dequant,
        "forward activations": forward,
        "micro_batch": n,
        "tokens": tokens,
    }


def rollout_sequences(config) -> int:
    """Sequences in flight per generate call: generator.chunk_size, at most the rollout's rows (prompts_per_step x
    num_generations): a batch smaller than a chunk is one call of its rows (a static cache pads only up to them), so
    the group size moves the rollout's peak."""
    rows = config.grpo.prompts_per_step * config.grpo.num_generations
    return min(config.generator.chunk_size or rows, rows)


def on_cpu_learner(config) -> bool:
    return config.placement.learner == "cpu"


def generation_step_bytes(shape: ModelShape, config, sequences: int) -> float:
    """One decoding step's [sequences, vocab] tensors and buffers (generation/step_memory.py decode_step_bytes)."""
    device = "cpu" if on_cpu_learner(config) else "cuda"
    # why: a rank generating through its sharded model (not gathered whole) reaches its LM head as a DTensor shard,
    # which keeps its own forward (generation/step_logits.py keeps_logits): generate()'s float32 copy is a block too
    kept = config.placement.learner_procs == 1 or config.generator.gather_for_generation
    return decode_step_bytes(sequences, shape.vocab, compute_bytes(config), device, kept)


def kv_cache_bytes(shape: ModelShape, config, sequences: int) -> float:
    e = compute_bytes(config)
    length = config.generator.max_prompt_length + config.generator.max_completion_length
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * e * sequences * length


def generator_weight_bytes(shape: ModelShape, config) -> float:
    bits = GENERATOR_BITS[config.generator.quantization]
    if bits is None:
        return shape.total_params * DTYPE_BYTES[config.model.dtype]
    return shape.linear_params * bits / 8 + shape.embedding_params * DTYPE_BYTES[config.model.dtype]
