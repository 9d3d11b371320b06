"""The reward models' plan lines (data.reward_models, models/reward_model.py) on placement.reward_model: each model's
weights, resident (model.dtype, or nf4 with placement.reward_model_4bit), and its scoring micro-batch's activations, a
transient of the rewards phase. A sequence classifier has no LM head: its score head is one row of the hidden size.
"""

from __future__ import annotations

from ..models.shapes import ModelShape, load_shape
from .estimate import DTYPE_BYTES, DevicePlan, nf4_bits
from .parts import capacity_of

FIELD = "data.reward_models"


def reward_device(config) -> str:
    """The plan's name of the reward models' device ('host' for the CPU)."""
    device = config.placement.reward_model_device()
    return "host" if device == "cpu" else device


def reward_weight_bytes(shape: ModelShape, config) -> tuple[float, str]:
    """A reward model's weights: its linear layers in model.dtype or nf4, its embedding, norms and score head (one
    [1, hidden] row; no LM head) in model.dtype."""
    model, e = config.model, DTYPE_BYTES[config.model.dtype]
    dense = (shape.vocab * shape.hidden + (2 * shape.layers + 2) * shape.hidden + shape.router_params) * e
    if config.placement.reward_model_4bit:
        bits = nf4_bits(model.bnb_4bit_use_double_quant)
        return shape.linear_params * bits / 8 + dense, f"{model.bnb_4bit_quant_type} {bits:.2f} bit + embeddings"
    return shape.linear_params * e + dense, model.dtype


# A scoring forward's peak on the CPU, per token, beyond the widths scoring_bytes counts: measured with torch.profiler's
# allocation events on three tiny shapes (hidden 128/256, intermediate 256/512; 4 rows of 229-859 tokens; float32 and
# bfloat16), where the MLP's peak kept 1,170 bytes a token in float32 (half in bfloat16) and the attention's 840 bytes
# in either dtype (SDPA's float32 buffers), as hidden and intermediate grew
MLP_EXTRA, ATTENTION_EXTRA = 1170, 840


def scoring_bytes(shape: ModelShape, config) -> tuple[float, int, int]:
    """(bytes, rows, tokens a row) of one scoring forward in inference mode, grpo.micro_batch_size rows (the batch
    when null) of prompt + completion at their longest. Only one layer's intermediates live at a time, and the padding
    mask over [rows, length, length] (boolean; a batch of completions of varied length always has one) through them
    all. The layer's peak is its MLP's (the residual stream, its normed copy and two more of hidden width beside the
    gate, the up projection and their product) or, on long rows, its attention's, where SDPA holds the mask once more
    in the compute dtype beside the residual stream, its normed copy, the query three times and the key and value
    twice. Measured on the CPU (tests/test_reward_model.py). A 4-bit model also dequantizes its largest weight."""
    grpo, gen = config.grpo, config.generator
    e = DTYPE_BYTES[config.model.bnb_4bit_compute_dtype if config.placement.reward_model_4bit else config.model.dtype]
    rows = grpo.micro_batch_size or grpo.prompts_per_step * grpo.num_generations
    length = gen.max_prompt_length + gen.max_completion_length
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    tokens, square = rows * length, rows * length * length
    mlp = tokens * ((4 * h + 3 * (shape.intermediate or shape.shared_intermediate)) * e + MLP_EXTRA * e / 4) + square
    attention = tokens * ((2 * h + 3 * q + 2 * kv) * e + ATTENTION_EXTRA) + square * (1 + e)
    dequant = shape.largest_weight * e if config.placement.reward_model_4bit else 0
    return max(mlp, attention) + dequant, rows, length


def add_reward_models(devices: dict[str, DevicePlan], config) -> None:
    """Each of data.reward_models on its device (added to `devices` when not there): its weights and its scoring."""
    if not config.data.reward_models:
        return
    device = reward_device(config)
    if device not in devices:  # (a sharded learner's driver on a GPU of its own)
        devices[device] = DevicePlan(device, capacity_of(device, config))
        devices[device].add_cuda_runtime()
    dev, scoring = devices[device], []
    for name in config.data.reward_models:
        shape = load_shape(name, FIELD)
        weights, fmt = reward_weight_bytes(shape, config)
        short = name.rstrip("/").split("/")[-1]
        dev.roles.append(f"reward model {short}")
        dev.add(f"reward model {short}: weights", weights, fmt)
        scoring.append((*scoring_bytes(shape, config), short))
    # why the largest alone: the models score one after another, each forward's activations gone before the next
    nbytes, rows, length, short = max(scoring)
    dev.add(
        f"reward model {short}: scoring" if len(scoring) == 1 else f"reward models: scoring ({short}'s, the largest)",
        nbytes,
        f"{rows} rows x {length} tokens a forward (grpo.micro_batch_size), inference mode",
        phase="rewards",
    )
