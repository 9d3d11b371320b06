"""Mixture-of-experts models: which families the lab reads, and their experts in 4-bit.

Since transformers 5 a layer's routed experts are fused 3-D parameters (`gate_up_proj` [experts, 2 x width, hidden],
`down_proj` [experts, hidden, width]), not `nn.Linear` layers, and bitsandbytes' 4-bit loading replaces `nn.Linear`
only: the experts, ~95 % of a 30B-A3B model's weights, silently stayed in 16-bit (bitsandbytes#1849, Unsloth#4032).
The lab quantizes them to nf4 with bitsandbytes' own parametrization (`replace_parameter_4bit`): the parameter holds
the 4-bit codes and is dequantized whole, once per forward of its module, when the experts read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import LabError

# the config keys that say a model routes tokens to experts, in any family's spelling
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")
# why these: the planner's dense formulas (q/k/v/o + gate/up/down per layer) are these families' layers
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "olmo", "olmo2", "granite", "gemma", "gemma2")


@dataclass(frozen=True)
class ExpertsLayout:
    """Where a family's config.json keeps its experts' sizes (its experts are fused 3-D parameters in transformers)."""

    count: str  # the number of routed experts per layer
    width: str  # one expert's intermediate width
    shared: Optional[str] = None  # a shared expert's width (one MLP every token goes through), if the family has one


MOE_FAMILIES = {
    "qwen3_moe": ExpertsLayout("num_experts", "moe_intermediate_size"),
    "qwen2_moe": ExpertsLayout("num_experts", "moe_intermediate_size", shared="shared_expert_intermediate_size"),
    "olmoe": ExpertsLayout("num_experts", "intermediate_size"),
    "mixtral": ExpertsLayout("num_local_experts", "intermediate_size"),
}


def is_moe(hf_config: dict) -> bool:
    return any(hf_config.get(k) for k in MOE_KEYS)


def check_family(hf_config: dict, field: str) -> None:
    """One line for an architecture the planner cannot read (why: planned as another, a 30B-A3B model read as a 3B
    dense one and "fit")."""
    kind = hf_config.get("model_type")
    if is_moe(hf_config) and kind not in MOE_FAMILIES:
        experts = next((hf_config[k] for k in MOE_KEYS if hf_config.get(k)), "?")
        raise LabError(
            f"{field}: model_type {kind!r} is a mixture-of-experts model ({experts} experts) the planner cannot "
            f"read; it plans the mixture-of-experts families {sorted(MOE_FAMILIES)} and the dense "
            f"{sorted(DENSE_FAMILIES)}; point it at one of those"
        )
    if kind is not None and not is_moe(hf_config) and kind not in DENSE_FAMILIES:
        raise LabError(
            f"{field}: model_type {kind!r} is not an architecture the planner reads; it plans the dense "
            f"{sorted(DENSE_FAMILIES)} and the mixture-of-experts {sorted(MOE_FAMILIES)}; point it at one of those"
        )


def expert_sizes(hf_config: dict, field: str) -> dict:
    """The experts' sizes of a family in MOE_FAMILIES (ModelShape's fields); every layer must route to experts."""
    kind = hf_config["model_type"]
    layout = MOE_FAMILIES[kind]
    dense = hf_config.get("mlp_only_layers") or []
    step = hf_config.get("decoder_sparse_step", 1)
    if dense or step != 1:
        raise LabError(
            f"{field}: this {kind} model has dense MLP layers among its expert layers (mlp_only_layers {dense}, "
            f"decoder_sparse_step {step}); the planner reads models whose every layer routes to experts"
        )
    wanted = [layout.count, layout.width, "num_experts_per_tok"]
    missing = [k for k in wanted if not isinstance(hf_config.get(k), int) or hf_config[k] <= 0]
    if missing:
        raise LabError(f"{field}: its {kind} config.json has no positive integer {missing[0]!r}; repair the checkpoint")
    return {
        "experts": hf_config[layout.count],
        "experts_per_token": hf_config["num_experts_per_tok"],
        "expert_intermediate": hf_config[layout.width],
        "shared_intermediate": int(hf_config.get(layout.shared) or 0) if layout.shared else 0,
        "family": kind,
    }


# --- loading: the experts in 4-bit ---
EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # transformers' fused expert parameters, [experts, out, in] each


def fused_experts(model, recurse: bool = True) -> list[tuple]:
    """(module, name) of every fused expert parameter of `model` (`recurse`: of its submodules too) still a plain 3-D
    parameter (not yet quantized)."""
    import torch

    return [
        (module, name)
        for module in (model.modules() if recurse else [model])
        for name in EXPERT_PARAMS
        if isinstance(module._parameters.get(name), torch.nn.Parameter) and module._parameters[name].dim() == 3
    ]


def has_experts(model) -> bool:
    """Whether `model` has fused expert parameters, 16-bit or already 4-bit (parametrized)."""
    from torch.nn.utils import parametrize

    return bool(fused_experts(model)) or any(
        parametrize.is_parametrized(m, name) for m in model.modules() for name in EXPERT_PARAMS
    )


def quantize_experts(model, model_cfg, recurse: bool = True) -> int:
    """Every fused expert parameter of `model` to 4-bit, in place, one tensor at a time (its 16-bit bytes freed before
    the next is quantized), with bitsandbytes' own parametrization: model.bnb_4bit_quant_type, double quantization as
    model.bnb_4bit_use_double_quant (`model_cfg`: the model section, or a BitsAndBytesConfig). Returns how many. The
    experts then dequantize whole, once per forward of their module, to the dtype they were read in (model.dtype)."""
    try:
        from bitsandbytes.nn.parametrize import replace_parameter_4bit
    except ImportError:
        raise LabError(
            "model.load_in_4bit: this mixture-of-experts model's experts are quantized with bitsandbytes >= 0.48 "
            "(bitsandbytes.nn.parametrize); pip install -U bitsandbytes, or set model.load_in_4bit: false"
        ) from None
    found = fused_experts(model, recurse)
    for module, name in found:
        replace_parameter_4bit(
            module,
            name,
            compress_statistics=model_cfg.bnb_4bit_use_double_quant,
            quant_type=model_cfg.bnb_4bit_quant_type,
        )
    return len(found)


def check_moe_config(config, shape) -> None:
    """What a mixture-of-experts learner cannot do yet, refused in one line before anything loads."""
    if not shape.moe:
        return
    what = f"{config.model.name_or_path} is a mixture-of-experts model ({shape.family}, {shape.experts} experts)"
    gen, place = config.generator, config.placement
    if gen.backend == "hf" and gen.hf_decode == "merged":
        raise LabError(
            f"generator.hf_decode: merged builds a dense rollout copy, and {what}: its experts would be "
            f"{shape.expert_params * 2 / 2**30:.1f} GiB dense; use dynamic (or auto)"
        )
    if gen.backend == "vllm":
        raise LabError(f"generator.backend: vllm is not wired for mixture-of-experts learners yet ({what}); use hf")
    if place.learner_procs > 1:
        raise LabError(
            f"placement.learner_procs: {place.learner_procs}, but {what}; the sharded load reads dense layers only: "
            "set placement.learner_procs: 1"
        )
