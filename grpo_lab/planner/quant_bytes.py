"""The base weights' bytes: 4-bit codes, their scales and codebooks (bitsandbytes' QuantState), or model.dtype."""

from __future__ import annotations

from ..models.shapes import ModelShape

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def nf4_bits(double_quant: bool) -> float:
    """4-bit codes + one fp32 absmax per 64 weights (double quant: int8 absmax + fp32 per 256 blocks)."""
    return 4 + (8 / 64 + 32 / (64 * 256) if double_quant else 32 / 64)


# a 4-bit weight's quant state beyond its absmax (nf4_bits): the 16-entry nf4 codebook in float32, and with double
# quantization the absmax's 256-entry 8-bit codebook in float32 and its float32 offset (bitsandbytes' QuantState)
NF4_CODE_BYTES, NESTED_STATE_BYTES = 16 * 4, 256 * 4 + 4


def codebook_bytes(model_cfg) -> int:
    """One 4-bit tensor's codebooks (its own, not shared between tensors)."""
    return NF4_CODE_BYTES + (NESTED_STATE_BYTES if model_cfg.bnb_4bit_use_double_quant else 0)


def base_weight_bytes(shape: ModelShape, model_cfg) -> tuple[float, str]:
    e = DTYPE_BYTES[model_cfg.dtype]
    dense = (shape.embedding_params + (2 * shape.layers + 1) * shape.hidden + shape.router_params) * e
    if model_cfg.load_in_4bit:
        bits = nf4_bits(model_cfg.bnb_4bit_use_double_quant)
        # why the codebooks: ~1 KiB a tensor, 5 % of a tiny Qwen2-MoE (its shared expert's four more 4-bit tensors)
        return (
            shape.linear_params * bits / 8 + shape.quantized_tensors * codebook_bytes(model_cfg) + dense,
            f"{model_cfg.bnb_4bit_quant_type} {bits:.2f} bit + embeddings {model_cfg.dtype}",
        )
    return shape.linear_params * e + dense, model_cfg.dtype


def base_weight_split(shape: ModelShape, model_cfg) -> tuple[float, float]:
    """The base weights as FSDP2 holds them: (what it shards on dim 0: 4-bit codes and the dense weights, what every
    rank keeps whole: bitsandbytes' quant state, which lives on the module outside the parameters; docs/fsdp2.md)."""
    total, _ = base_weight_bytes(shape, model_cfg)
    quant_state = 0.0
    if model_cfg.load_in_4bit:
        scales = shape.linear_params * (nf4_bits(model_cfg.bnb_4bit_use_double_quant) - 4) / 8
        quant_state = scales + shape.quantized_tensors * codebook_bytes(model_cfg)
    return total - quant_state, quant_state
