"""A mixture of experts' rollout items: the 4-bit experts the prompts' prefill dequantizes
(models/routed_experts.py), or, on a model small enough, every layer's experts held dequantized for the rollout
(models/held_experts.py)."""

from __future__ import annotations

from ..generation.step_memory import PREFILL_CHUNK
from ..models.held_experts import DENSE_TOKENS, holds, padded_rows
from ..models.shapes import ModelShape
from .estimate import DTYPE_BYTES, DevicePlan, expert_lora_bytes, experts_dequant_bytes, on_cpu_learner


def add_experts_dequant(lrn: DevicePlan, config, shape: ModelShape, sequences: int) -> None:
    """At the prompts' prefill, one layer's routed 4-bit experts dequantized (at worst each token routed to others),
    or every layer's held (held_experts.holds: by size); with expert adapters one tensor's of them again,
    W + B A beside W."""
    share = 1.0  # the routed experts' share of a layer's
    held = held_bytes(shape, config, sequences) if shape.moe and config.model.load_in_4bit else 0.0
    if held:
        lrn.add(
            "experts held (every layer)",
            held,
            f"{shape.layers} layers x {shape.experts} experts in {config.model.dtype}, dequantized at the rollout's "
            "first forward and held for its decoding steps (models/held_experts.py: every layer's under "
            "HELD_BYTES), one layer's down_proj again while it is transposed, and a decoding step's every-expert "
            f"activations ({dense_rows(config, sequences)} rows, padded, x {shape.experts} experts x 4 x width, and "
            "the padded hidden states)",
            phase="rollout",
        )
    elif shape.moe and config.model.load_in_4bit:
        # why the prefill: its rows x prompt tokens route to the most experts (a decoding step: one token a row)
        prompt = min(config.generator.max_prompt_length, PREFILL_CHUNK if on_cpu_learner(config) else 1 << 62)
        made = experts_dequant_bytes(shape, config, sequences * prompt)
        share = made / experts_dequant_bytes(shape, config)
        lrn.add(
            "experts dequantized (one layer)",
            made,
            f"{round(share * shape.experts)} of {shape.experts} experts of a layer in {config.model.dtype}, at the "
            f"prompts' prefill ({sequences} rows x {prompt} prompt tokens a forward, top-{shape.experts_per_token}; a "
            f"decoding step's {min(sequences * shape.experts_per_token, shape.experts)}, none on a CPU in bfloat16: "
            "models/experts_gemv.py)",
            phase="rollout",
        )
    if shape.moe and config.lora.target_experts:
        lrn.add(
            "expert LoRA: W + B A beside W",
            expert_lora_bytes(shape, config)["transient"] * share,
            "the expert adapters folded into a copy of one fused tensor at a time (lora.target_experts)",
            phase="rollout",
        )


def held_bytes(shape: ModelShape, config, sequences: int) -> float:
    """Every layer's 4-bit experts dequantized to model.dtype and held for a rollout, where held_experts.holds picks
    it (else 0), with one layer's down_proj again (held_experts.held_weights transposes it) and a decoding step's
    every-expert activations (dense_forward: [rows, E, 2m] up, [rows, E, m] gated and scaled, the hidden states [rows,
    h] padded: dense_rows)."""
    whole = shape.layers * experts_dequant_bytes(shape, config)
    if not whole or not holds(whole):
        return 0.0
    e = DTYPE_BYTES[config.model.dtype]
    rows = dense_rows(config, sequences)
    active = rows * (shape.experts * 4 * shape.expert_intermediate + shape.hidden) * e
    return whole + dict(shape.expert_tensors())["down_proj"] * e + active


def dense_rows(config, sequences: int) -> int:
    """The most rows held_experts.dense_forward runs at once: a forward's tokens (a decoding step's one a row, a
    prefill's rows x prompt tokens) up to DENSE_TOKENS, padded as it pads them (held_experts.padded_rows). Why the
    prefill: one of at most DENSE_TOKENS tokens reads the held experts densely too."""
    return padded_rows(min(sequences * config.generator.max_prompt_length, DENSE_TOKENS))
