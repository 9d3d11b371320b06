"""LoRA on a mixture of experts' fused experts (lora.target_experts): PEFT's `target_parameters` on the 4-bit experts.

PEFT 0.21 adapts a 3-D parameter by registering, for each forward, a torch parametrization (`W + B A`, per expert) on
top of bitsandbytes' own (the 4-bit codes dequantized), and nests one `ParamWrapper` per parameter of a module. Three
things fail between the two libraries on the 4-bit experts, and are mended here (mend_expert_wrappers):
- registering a parametrization reads the parameter once (torch's safety check), and the nested wrapper registers
  inside the outer's `parametrize.cached()`: that read cached bitsandbytes' plain dequantized weight, which the
  experts' forward then read instead of `W + B A`, so the nested adapters got no gradient (in bf16 nothing is
  cached: the parameter is a plain tensor). The proxies are now registered without the check (its read also
  dequantized and folded every expert, twice a layer per forward, for nothing);
- PEFT removes its per-expert proxy (`_LoraFactorsProxy`) only when it is the parametrization's sole entry; under
  bitsandbytes' it stayed, and the next forward failed (`requires_grad_` on the uint8 codes);
- each wrapper read its parameter (a whole dequantize) for its dtype and device alone, and held it through the forward.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
from torch.nn.utils import parametrize

from ..errors import LabError
from .experts import EXPERT_PARAMS, has_experts


def expert_targets(base) -> list[str]:
    """Every fused expert parameter of `base`, by full name (`model.layers.0.mlp.experts.gate_up_proj`). Why full
    names: PEFT matches an already-parametrized (4-bit) parameter by its full name only, never by a suffix."""
    return [
        f"{name}.{param}"
        for name, module in base.named_modules()
        for param in EXPERT_PARAMS
        if parametrize.is_parametrized(module, param) or isinstance(module._parameters.get(param), torch.nn.Parameter)
    ]


def expert_lora_kwargs(base, lora) -> dict:
    """LoraConfig's arguments for the experts of `base` (empty unless lora.target_experts): their full names as
    target_parameters, each expert's rank (lora.expert_r, else lora.r) as a rank_pattern entry."""
    if not lora.target_experts:
        return {}
    if not has_experts(base):
        raise LabError(
            "lora.target_experts: this model has no fused routed experts (a dense model, or a family whose experts "
            "are not transformers' gate_up_proj/down_proj); set lora.target_experts: false"
        )
    targets = expert_targets(base)
    rank = lora.expert_r or lora.r
    return {"target_parameters": targets, "rank_pattern": {t: rank for t in targets}}


@contextmanager
def quiet_expert_ranks():
    """Without PEFT's warning that the experts' rank_pattern keys "did not match": it checks them against adapted
    modules only, never target_parameters, and applies them (tests/test_expert_lora.py counts the ranks)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The following rank_pattern keys did not match", RuntimeWarning)
        yield


def check_expert_lora(config, shape) -> None:
    """What expert LoRA cannot do, refused in one line before anything loads."""
    lora = config.lora
    if not lora.target_experts:
        return
    if not shape.moe:
        raise LabError(
            f"lora.target_experts: {config.model.name_or_path} is a dense model (no routed experts to adapt); "
            "set lora.target_experts: false"
        )
    if lora.lora_dropout:
        raise LabError(
            f"lora.lora_dropout: {lora.lora_dropout}, but PEFT's expert adapters (target_parameters) take no dropout "
            "(it cannot be factored out of W + B A); set lora.lora_dropout: 0 or lora.target_experts: false"
        )
    if config.generator.backend == "vllm":
        raise LabError(
            "generator.backend: vllm cannot serve adapters on fused experts here (vLLM 0.32's CPU LoRA kernels have "
            "no fused-MoE path: PunicaWrapperCPU leaves add_lora_fused_moe unimplemented, and grpo_lab's vLLM backend "
            "is not wired for mixture-of-experts learners); use hf or set lora.target_experts: false"
        )


def mend_expert_wrappers(model) -> int:
    """Mend PEFT's wrappers over 4-bit (bitsandbytes-parametrized) experts (the module docstring says what and why).
    Returns how many wrappers were mended."""
    from peft.tuners.lora.layer import ParamWrapper

    wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper)]
    mended = [w for w in wrappers if _is_4bit(w.get_base_layer(), w.parameter_name)]
    for wrapper in mended:
        wrapper.get_param = _shape_only.__get__(wrapper)
        wrapper._activate_lora = _activate_unread.__get__(wrapper)
    return len(mended)


def _is_4bit(module, name: str) -> bool:
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization

    return parametrize.is_parametrized(module, name) and isinstance(
        module.parametrizations[name][0], Bnb4bitParametrization
    )


def _shape_only(wrapper) -> torch.Tensor:
    """The experts' dequantized shape, dtype and device, from one element (what PEFT reads `get_param` for). Why not
    the parameter: reading it dequantizes every expert, and PEFT held that copy through the layer's forward."""
    base = wrapper.get_base_layer()
    chain = base.parametrizations[wrapper.parameter_name]
    state = chain[0].quant_state
    return torch.empty((), dtype=state.dtype, device=chain.original.device).expand(*state.shape)


@contextmanager
def _activate_unread(wrapper, active_adapters: list[str]):
    """PEFT's ParamWrapper._activate_lora (its proxy on the parameter for the forward, in a parametrization cache),
    registered without torch's check, which reads the parameter: every expert dequantized and folded, and inside an
    outer wrapper's cache a stale plain value the experts then read; and its proxy removed whatever its kind (PEFT
    removes its per-expert proxy only when it is the parameter's sole parametrization)."""
    from peft.tuners.lora.layer import _LoraFactorsProxy, _LoraParameterProxy

    adapters = [a for a in active_adapters if a in wrapper.lora_A]
    if not adapters:
        yield
        return
    if len(adapters) == 1 and wrapper.num_experts > 1:  # as PEFT: one adapter folds its factors (no delta tensor)
        proxy = _LoraFactorsProxy(*wrapper.get_delta_factors(adapters[0]))
    else:
        proxy = _LoraParameterProxy(sum(wrapper.get_delta_weight(a) for a in adapters))
    base, name = wrapper.get_base_layer(), wrapper.parameter_name
    parametrize.register_parametrization(base, name, proxy, unsafe=True)  # why unsafe: the check reads it whole
    try:
        with parametrize.cached():
            yield
    finally:
        chain = base.parametrizations[name]
        del chain[next(i for i in reversed(range(len(chain))) if chain[i] is proxy)]
