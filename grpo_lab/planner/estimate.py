"""Pre-flight memory plan: what each device will hold, computed from config.json and the lab
config before any weight is loaded. Every term is a formula over the model's shape; the
dominant transient (the backward micro-batch) is taken as the step's peak.

Units are bytes. A learner on the CPU lives in host RAM, so "cpu" is planned as "host".
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .shapes import ModelShape

GiB = 1024 ** 3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
GENERATOR_BITS = {None: None, "awq": 4.25, "gptq": 4.25, "compressed-tensors": 4.25, "fp8": 8.0}
CUDA_CONTEXT = 0.5 * GiB         # CUDA context + cuBLAS workspace per GPU a process touches
HOST_BASELINE = 1.0 * GiB        # Python, torch and libraries
FUSED_HEAD_TILE = (4096, 32768)  # TRL's fused LM head: tokens x vocab per tile
# tiles alive at the head's peak: Triton folds a tile in place (forward buffer + backward tile); the torch
# fallback on CPU makes temporaries of tile size (8.3 measured by bench/fused_head_cpu.py; 8.5 keeps a margin)
HEAD_TILES = {"cuda": 2.0, "cpu": 8.5}
VLLM_SPLIT_SHARE = 0.9           # vLLM's default gpu_memory_utilization on a GPU of its own


@dataclass
class Item:
    what: str
    bytes: float
    note: str = ""


@dataclass
class DevicePlan:
    device: str
    capacity: float
    roles: list[str] = field(default_factory=list)
    items: list[Item] = field(default_factory=list)

    def add(self, what: str, nbytes: float, note: str = "") -> None:
        if nbytes:
            self.items.append(Item(what, nbytes, note))

    @property
    def total(self) -> float:
        return sum(i.bytes for i in self.items)

    @property
    def fraction(self) -> float:
        return self.total / self.capacity

    @property
    def verdict(self) -> str:
        return "fits" if self.fraction <= 0.9 else "tight (<10% margin)" if self.fraction <= 1.0 else "does not fit"

    @property
    def fits(self) -> bool:
        return self.fraction <= 1.0


def nf4_bits(double_quant: bool) -> float:
    """4-bit codes + one fp32 absmax per 64 weights (double quant: int8 absmax + fp32 per 256 blocks)."""
    return 4 + (8 / 64 + 32 / (64 * 256) if double_quant else 32 / 64)


def base_weight_bytes(shape: ModelShape, model_cfg) -> tuple[float, str]:
    e = DTYPE_BYTES[model_cfg.dtype]
    dense = (shape.embedding_params + (2 * shape.layers + 1) * shape.hidden) * e
    if model_cfg.load_in_4bit:
        bits = nf4_bits(model_cfg.bnb_4bit_use_double_quant)
        return shape.linear_params * bits / 8 + dense, f"{model_cfg.bnb_4bit_quant_type} {bits:.2f} bit + embeddings {model_cfg.dtype}"
    return shape.linear_params * e + dense, model_cfg.dtype


def activation_bytes(shape: ModelShape, cfg, on_cpu: bool = False) -> dict[str, float]:
    """Peak transients of one log-prob/backward micro-batch (`on_cpu`: the learner runs on the CPU)."""
    grpo, gen = cfg.grpo, cfg.generator
    e = DTYPE_BYTES[cfg.model.bnb_4bit_compute_dtype if cfg.model.load_in_4bit else cfg.model.dtype]
    n = grpo.micro_batch_size or grpo.prompts_per_step * grpo.num_generations
    length = gen.max_prompt_length + gen.max_completion_length
    tokens = n * length
    h, kv, i, r = shape.hidden, shape.kv_heads * shape.head_dim, shape.intermediate, cfg.lora.r
    per_layer = (7 * h + 3 * kv + 4 * i) * e + 7 * r * 4      # saved for backward, per token and layer
    if cfg.model.gradient_checkpointing:
        stored = shape.layers * h * e * tokens + 2 * per_layer * tokens   # layer inputs + one layer recomputed
    else:
        stored = shape.layers * per_layer * tokens + per_layer * tokens
    # with Triton only completion positions reach the head; the CPU fallback scores every position
    scored = tokens if on_cpu else n * gen.max_completion_length
    tile = min(scored, FUSED_HEAD_TILE[0]) * min(shape.vocab, FUSED_HEAD_TILE[1]) * e
    head = HEAD_TILES["cpu" if on_cpu else "cuda"] * tile + scored * (h * 4 + 8 * 4)   # tiles, hidden grad, stats
    dequant = max(a * b for _, a, b in shape.linear_layers()) * e if cfg.model.load_in_4bit else 0
    return {"activations": stored, "log-prob head tiles": head, "4-bit dequant buffer": dequant,
            "micro_batch": n, "tokens": tokens}


def kv_cache_bytes(shape: ModelShape, cfg, sequences: int) -> float:
    e = DTYPE_BYTES[cfg.model.bnb_4bit_compute_dtype if cfg.model.load_in_4bit else cfg.model.dtype]
    length = cfg.generator.max_prompt_length + cfg.generator.max_completion_length
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * e * sequences * length


def generator_weight_bytes(shape: ModelShape, cfg) -> float:
    bits = GENERATOR_BITS[cfg.generator.quantization]
    if bits is None:
        return shape.total_params * DTYPE_BYTES[cfg.model.dtype]
    return shape.linear_params * bits / 8 + shape.embedding_params * DTYPE_BYTES[cfg.model.dtype]
