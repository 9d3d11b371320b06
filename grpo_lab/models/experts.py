"""Mixture-of-experts models: which families the lab reads, and their experts in 4-bit.

Since transformers 5 a layer's routed experts are fused 3-D parameters (`gate_up_proj` [experts, 2 x width, hidden],
`down_proj` [experts, hidden, width]), not `nn.Linear` layers, and bitsandbytes' 4-bit loading replaces `nn.Linear`
only: the experts, ~95 % of a 30B-A3B model's weights, silently stayed in 16-bit (bitsandbytes#1849, Unsloth#4032).
The lab quantizes them to nf4 with bitsandbytes' own parametrization (`replace_parameter_4bit`): the parameter holds
the 4-bit codes, and a forward dequantizes the experts its tokens route to (routed_experts.py).
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

    width: str  # one expert's intermediate width
    shared: Optional[str] = None  # a shared expert's width (one MLP every token goes through), if the family has one
    # whether its checkpoints hold `mlp.experts.{j}.{gate,up,down}_proj.weight`, which the lab reads a layer at a
    # time (load_experts_checkpoint); else from_pretrained reads every expert in 16-bit first
    read_by_layer: bool = True


# the number of routed experts per layer: the hub's spelling, and transformers 5's (its configs save
# num_local_experts for every family, mapping num_experts to it)
COUNT_KEYS = ("num_experts", "num_local_experts")
MOE_FAMILIES = {
    "qwen3_moe": ExpertsLayout("moe_intermediate_size"),
    "qwen2_moe": ExpertsLayout("moe_intermediate_size", shared="shared_expert_intermediate_size"),
    "olmoe": ExpertsLayout("intermediate_size"),
    "mixtral": ExpertsLayout("intermediate_size", read_by_layer=False),  # (its files: w1/w3/w2 per expert)
}


def is_moe(hf_config: dict) -> bool:
    return any(hf_config.get(k) for k in MOE_KEYS)


def read_by_layer(hf_config: dict) -> bool:
    """Whether a checkpoint of this config is read a decoder layer at a time (load_experts_checkpoint)."""
    layout = MOE_FAMILIES.get(hf_config.get("model_type"))
    return is_moe(hf_config) and layout is not None and layout.read_by_layer


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
    count = next((k for k in COUNT_KEYS if hf_config.get(k)), COUNT_KEYS[0])
    wanted = [count, layout.width, "num_experts_per_tok"]
    missing = [k for k in wanted if not isinstance(hf_config.get(k), int) or hf_config[k] <= 0]
    if missing:
        raise LabError(f"{field}: its {kind} config.json has no positive integer {missing[0]!r}; repair the checkpoint")
    return {
        "experts": hf_config[count],
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


def load_experts_checkpoint(path, model_cfg, device: str, quantization_config):
    """A mixture-of-experts checkpoint on `device` with its experts in 4-bit, never more than one layer's experts in
    model.dtype: built on the meta device (the 4-bit layer swap as from_pretrained makes it, models/meta_load.py),
    then each decoder layer read from the safetensors files, its linear weights quantized as from_pretrained does,
    its experts fused from the per-expert tensors the files hold (transformers 5 saves them as v4 did:
    `experts.{j}.gate_proj.weight`, ...) and quantized before the next layer is read. Why not from_pretrained:
    it reads every expert whole in 16-bit first (56 GiB at 30B-A3B), and only then could they be quantized."""
    from pathlib import Path

    import torch

    from .meta_load import Checkpoint, _params_by_unit, materialise, meta_model

    dtype = getattr(torch, model_cfg.dtype)
    lm = meta_model(Path(path), dtype, quantization_config, torch.device(device))
    per_layer, root = _params_by_unit(lm)
    checkpoint = Checkpoint(Path(path))
    for entries in per_layer:
        materialise([e for e in entries if e[1] not in EXPERT_PARAMS], checkpoint, device)
        experts = [e for e in entries if e[1] in EXPERT_PARAMS]
        for module, attr, key in experts:
            value = fused_expert_tensor(checkpoint, key, attr, module.num_experts).to(device=device, dtype=dtype)
            module._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
        for module in {id(m): m for m, _, _ in experts}.values():  # why now: the layer's 16-bit experts go before
            quantize_experts(module, model_cfg, recurse=False)  # the next layer is read
    materialise(root, checkpoint, device)
    lm.tie_weights()  # why again: the root's read gave the embedding a new parameter; a tied head must share it
    return lm


def fused_expert_tensor(checkpoint, key: str, attr: str, experts: int):
    """One layer's fused expert parameter (`key`: `...mlp.experts.gate_up_proj` or `.down_proj`), as transformers
    5 fuses it at load: gate_up_proj[j] is expert j's gate_proj then up_proj weight (the forward chunks its output
    in that order), down_proj[j] its down_proj weight. A checkpoint that holds it fused already is read as it is."""
    import torch

    if checkpoint.has(key):
        return checkpoint.tensor(key)
    prefix = key.rsplit(".", 1)[0]
    parts = ("gate_proj", "up_proj") if attr == "gate_up_proj" else ("down_proj",)
    return torch.stack(
        [torch.cat([checkpoint.tensor(f"{prefix}.{j}.{part}.weight") for part in parts]) for j in range(experts)]
    )
