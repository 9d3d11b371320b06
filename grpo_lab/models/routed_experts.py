"""A mixture of experts' 4-bit experts dequantized for the experts its tokens route to, not all of them.

bitsandbytes' parametrization dequantizes a layer's fused experts whole at every forward (128 experts x 3 matrices
at 30B-A3B, when a decoding step of 8 rows routes to at most 64). Its blockwise codes keep each expert's slice
contiguous (an expert's elements are a whole number of blocks), so the routed experts' codes and scales are
gathered and dequantized with bitsandbytes' own `dequantize_4bit`, PEFT's expert adapters (lora.target_experts) are
folded into those experts alone, and transformers' grouped_mm experts forward runs on them (registered as the
experts implementation ROUTED). Where an expert is not whole blocks, or another parametrization sits on the
parameter, the forward reads the parameter whole as before.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.nn.utils import parametrize

from .experts import EXPERT_PARAMS

ROUTED = "grpo_lab_routed_4bit"  # the name transformers' ExpertsInterface knows this forward by


def use_routed_experts(model) -> int:
    """The routed-only forward for every 4-bit experts module of `model` (its config's experts implementation).
    Returns how many experts modules read it."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(ROUTED, routed_experts_forward)
    experts = [m for m in model.modules() if all(parametrize.is_parametrized(m, n) for n in EXPERT_PARAMS)]
    for module in experts:
        module.experts_dequantized = 0  # why a count: what the rollout's and a step's forwards dequantized
        module.config._experts_implementation = ROUTED
    return len(experts)


def experts_dequantized(model) -> int:
    """How many experts `model`'s forwards dequantized so far (summed over layers and forwards)."""
    return sum(getattr(m, "experts_dequantized", 0) for m in model.modules())


def routed_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped_mm experts forward over the routed experts alone, dequantized from their 4-bit slices."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    if not all(routable(self, name) for name in EXPERT_PARAMS):  # another parametrization, or not whole blocks
        count(self, self.num_experts)
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    routed, local = torch.unique(top_k_index, return_inverse=True)  # [k] expert ids; [tokens, top_k] their places
    count(self, routed.numel())
    view = SimpleNamespace(
        num_experts=routed.numel(),
        gate_up_proj=routed_weight(self, "gate_up_proj", routed),  # [k, 2m, h]
        down_proj=routed_weight(self, "down_proj", routed),  # [k, h, m]
        has_gate=self.has_gate,
        has_bias=self.has_bias,
        is_transposed=self.is_transposed,
        _is_expert_parallel=False,
        act_fn=self.act_fn,
    )
    view._apply_gate = lambda out: self._apply_gate(out)
    return grouped_mm_experts_forward(view, hidden_states, local, top_k_weights)


def count(module, experts: int) -> None:
    if hasattr(module, "experts_dequantized"):  # (set on the 4-bit experts by use_routed_experts)
        module.experts_dequantized += experts


def routed_weight(module, name: str, experts: torch.Tensor) -> torch.Tensor:
    """The routed experts' weight as the parameter's parametrizations make the whole one: dequantized, then PEFT's
    expert adapters (lora.target_experts) folded in for those experts alone (W + B A per expert, as its proxies do)."""
    from peft.tuners.lora.layer import _LoraFactorsProxy

    weight = dequantize_experts(module, name, experts)
    for proxy in list(module.parametrizations[name])[1:]:
        if isinstance(proxy, _LoraFactorsProxy):  # one adapter: its factors, [E, out, r] and [E, r, in]
            with torch.autocast(device_type=weight.device.type, enabled=False):  # (as PEFT's proxy: in W's dtype)
                weight = torch.baddbmm(weight, proxy.lhs[experts], proxy.rhs[experts], alpha=proxy.scaling)
        else:  # _LoraParameterProxy: its whole delta [E, out, in] (several adapters), the routed rows of it
            weight = weight + proxy.delta_weight[experts]
    return weight


def routable(module, name: str) -> bool:
    """Whether `name`'s routed experts can be dequantized alone: bitsandbytes' parametrization first, PEFT's LoRA
    proxies alone above it, and each expert a whole number of blocks."""
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization
    from peft.tuners.lora.layer import _LoraFactorsProxy, _LoraParameterProxy

    if not parametrize.is_parametrized(module, name):
        return False
    chain = module.parametrizations[name]
    if not isinstance(chain[0], Bnb4bitParametrization):  # (a LoRA proxy alone, over experts that are not 4-bit)
        return False
    if not all(isinstance(p, (_LoraFactorsProxy, _LoraParameterProxy)) for p in list(chain)[1:]):
        return False
    state = chain[0].quant_state
    per_expert = state.shape[1:].numel()
    return per_expert % state.blocksize == 0 and per_expert % 2 == 0


@torch.no_grad()
def dequantize_experts(module, name: str, experts: torch.Tensor) -> torch.Tensor:
    """The experts `experts` (ids) of `module`'s 4-bit `name`, dequantized to its dtype: [len(experts), out, in].
    Their codes and scales are gathered from the blockwise layout, then bitsandbytes dequantizes just those."""
    from bitsandbytes.functional import QuantState, dequantize_4bit, dequantize_blockwise

    chain = module.parametrizations[name]
    state, codes = chain[0].quant_state, chain.original
    count = state.shape[0]
    picked = gather_rows(codes.view(count, -1), experts).reshape(-1, 1)  # two 4-bit codes a byte, per expert
    absmax = state.absmax.view(count, -1)[experts].reshape(-1)
    if state.nested and (absmax.numel() // experts.numel()) % state.state2.blocksize == 0:
        # the scales are themselves 8-bit blockwise, each expert's a whole number of their blocks: gathered alike
        inner = state.state2
        scales = inner.absmax.view(count, -1)[experts].reshape(-1)
        nested = QuantState(absmax=scales, code=inner.code, blocksize=inner.blocksize, dtype=torch.float32)
        absmax = dequantize_blockwise(absmax, nested) + state.offset
    elif state.nested:  # why whole: an expert's scales straddle their blocks; they are 1/blocksize of the codes
        absmax = (dequantize_blockwise(state.absmax, state.state2) + state.offset).view(count, -1)[experts].reshape(-1)
    sliced = QuantState(
        absmax=absmax.float(),
        shape=torch.Size([experts.numel(), *state.shape[1:]]),
        code=state.code,
        blocksize=state.blocksize,
        quant_type=state.quant_type,
        dtype=state.dtype,
    )
    return dequantize_4bit(picked, sliced)


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows[index] of a uint8 [n, bytes] tensor, copied 8 bytes at a time where a row allows (about 3x faster on the
    CPU than byte-wise indexing)."""
    wide = rows.view(torch.int64) if rows.shape[1] % 8 == 0 and rows.is_contiguous() else rows
    return torch.index_select(wide, 0, index).view(torch.uint8)
