"""A mixture of experts' 4-bit experts dequantized for the experts its tokens route to, not all of them.

bitsandbytes' parametrization dequantizes a layer's fused experts whole at every forward (128 experts x 3 matrices
at 30B-A3B, when a decoding step of 8 rows routes to at most 64). Its blockwise codes keep each expert's slice
contiguous (an expert's elements are a whole number of blocks), so the routed experts' codes and scales are
gathered and dequantized with bitsandbytes' own `dequantize_4bit`, PEFT's expert adapters (lora.target_experts) are
folded into those experts alone, and transformers' grouped_mm experts forward runs on them (registered as the
experts implementation ROUTED). Where an expert is not whole blocks, or another parametrization sits on the
parameter, the forward reads the parameter whole as before.

At decode (no gradients, bfloat16, a few tokens an expert, a CPU with bitsandbytes' fused kernel) the routed
experts are not dequantized at all: experts_gemv.py runs their matmuls from their 4-bit codes (EXPERT_PATHS chooses).
A model whose every layer's dequantized experts are small (held_experts.py) holds them for the rollout instead.

Without gradient checkpointing, autograd would keep every layer's dequantized experts for backward (each matmul saves
its weight; 54 GiB at 30B-A3B): `RedequantizedExperts` keeps the experts' inputs alone and dequantizes again in
backward, so a step holds one layer's dequantized experts at a time (bench/probes/experts_backward.py measures it).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.nn.utils import parametrize

from . import experts_gemv, held_experts
from .experts import EXPERT_PARAMS
from .experts_found import experts_modules, marked

ROUTED = "grpo_lab_routed_4bit"  # the name transformers' ExpertsInterface knows this forward by


def use_routed_experts(model, redequantize: bool = False) -> int:
    """The routed-only forward for every 4-bit experts module of `model` (its config's experts implementation);
    `redequantize`: their backward dequantizes again (RedequantizedExperts; without gradient checkpointing, where
    autograd would keep them). Returns how many experts modules read it."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(ROUTED, routed_experts_forward)
    experts = [m for m in model.modules() if all(parametrize.is_parametrized(m, n) for n in EXPERT_PARAMS)]
    total = held_experts.held_total(experts)  # (what holding every layer's experts for a rollout would take)
    for module in experts:
        module.held_total = total
        module.experts_dequantized = 0  # why a count: what the rollout's and a step's forwards dequantized
        module.experts_fused = 0  # and the experts its decoding steps ran from their codes (experts_gemv.py)
        module.redequantize = redequantize
        module.config._experts_implementation = ROUTED
    marked()  # why: a model's experts found before they were marked are searched again (experts_found.py)
    if held_experts.holds(total):  # why at load: a rollout's first decoding step would make its kernels (warm)
        held_experts.warm(experts)
    return len(experts)


def experts_dequantized(model, what: str = "experts_dequantized") -> int:
    """How many experts `model`'s forwards dequantized so far (summed over layers and forwards); `what`:
    "experts_fused", how many they ran from their 4-bit codes instead."""
    return sum(getattr(m, what, 0) for m in experts_modules(model))


def routed_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped_mm experts forward over the routed experts alone, dequantized from their 4-bit slices."""
    held = held_experts.ready(self)
    if held is not None:  # why first: a decoding step skips the checks whose answers have not changed since
        return held_run(self, held, hidden_states, top_k_index, top_k_weights)
    if not all(routable(self, name) for name in EXPERT_PARAMS):  # another parametrization, or not whole blocks
        from transformers.integrations.moe import grouped_mm_experts_forward

        count(self, self.num_experts)
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    adapters = {name: lora_factors(self, name) for name in EXPERT_PARAMS}  # PEFT's proxies, while they are registered
    forward = next(run for fits, run in EXPERT_PATHS.values() if fits(self, hidden_states, top_k_index, adapters))
    return forward(self, hidden_states, top_k_index, top_k_weights, adapters)


def dequantized_forward(self, hidden_states, top_k_index, top_k_weights, adapters: dict):
    """The routed experts dequantized (routed_forward); with gradients and `redequantize`, in RedequantizedExperts."""
    if torch.is_grad_enabled():
        self.held = None  # why: a rollout's held experts (held_experts.py) are not kept through training
    if torch.is_grad_enabled() and not experts_gemv.KERNEL_LAYOUT_KEPT:  # why whole: a step reads them several times
        experts_gemv.blockwise(self)

    def run(hidden, index, weights, factors):
        return routed_forward(self, hidden, index, weights, rebuilt(adapters, factors))

    if getattr(self, "redequantize", False) and torch.is_grad_enabled():
        factors = [t for kind, tensors, _ in sum(adapters.values(), []) for t in tensors]
        return RedequantizedExperts.apply(run, hidden_states, top_k_index, top_k_weights, *factors)
    return routed_forward(self, hidden_states, top_k_index, top_k_weights, adapters)


class RedequantizedExperts(torch.autograd.Function):
    """The routed experts' forward keeping their inputs (and PEFT's expert factors) alone for backward, never their
    dequantized weights: backward runs the forward again (dequantizing the routed experts again) and takes its
    gradients. Why: autograd keeps each matmul's weight, a view of the layer's dequantized experts, until backward."""

    @staticmethod
    def forward(ctx, run, hidden, index, weights, *factors):
        ctx.run, device = run, hidden.device.type
        # why: backward's forward again must run as this one did (a learner's forwards run under torch.autocast)
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.save_for_backward(hidden, index, weights, *factors)
        return run(hidden, index, weights, list(factors))  # (no grad here: nothing it makes is kept)

    @staticmethod
    def backward(ctx, grad):
        hidden, index, weights, *factors = ctx.saved_tensors
        needs = ctx.needs_input_grad[1:]
        inputs = [t.detach().requires_grad_(need) if t.is_floating_point() else t for t, need in
                  zip([hidden, index, weights, *factors], needs)]  # fmt: skip
        device, dtype, enabled = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            out = ctx.run(inputs[0], inputs[1], inputs[2], inputs[3:])  # one layer's experts dequantized again
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (None, *[next(grads) if t.requires_grad else None for t in inputs])


def lora_factors(module, name: str) -> list[tuple]:
    """PEFT's expert adapters on `name` now (lora.target_experts): ("factors", (lhs, rhs), scaling) for one adapter
    (_LoraFactorsProxy), ("delta", (delta,), 1.0) for several (_LoraParameterProxy)."""
    from peft.tuners.lora.layer import _LoraFactorsProxy

    if not parametrize.is_parametrized(module, name):
        return []
    return [
        ("factors", (p.lhs, p.rhs), p.scaling)
        if isinstance(p, _LoraFactorsProxy)
        else ("delta", (p.delta_weight,), 1.0)
        for p in list(module.parametrizations[name])[1:]
    ]


def rebuilt(adapters: dict, factors: list) -> dict:
    """`adapters` (lora_factors by parameter) with their tensors taken in order from `factors`."""
    it = iter(factors)
    return {
        name: [(kind, tuple(next(it) for _ in tensors), scale) for kind, tensors, scale in chain]
        for name, chain in adapters.items()
    }


def gemv_fits(module, hidden_states, top_k_index, adapters: dict) -> bool:
    routed, local = torch.unique(top_k_index, return_inverse=True)
    return experts_gemv.gemv_fits(module, hidden_states, local, routed.numel())


def held_forward(self, hidden_states, top_k_index, top_k_weights, adapters: dict):
    """The layer's experts held for the rollout (held_experts.py), made or made again as `adapters` say."""
    held = held_experts.held_weights(self, adapters, routed_weight)
    return held_run(self, held, hidden_states, top_k_index, top_k_weights)


def held_run(self, held: dict, hidden_states, top_k_index, top_k_weights):
    """Every held expert at once for a decoding step's few tokens, transformers' grouped_mm over them for more."""
    if hidden_states.shape[0] <= held_experts.DENSE_TOKENS:
        return held_experts.dense_forward(self, held, hidden_states, top_k_index, top_k_weights)
    from transformers.integrations.moe import grouped_mm_experts_forward

    count, hidden = held["experts"], hidden_states.shape[-1]
    gate_up = held["gate_up_proj"].view(count, -1, hidden)
    down = held["down_proj"].view(count, -1, hidden).transpose(1, 2)  # [E, h, m]
    return grouped_mm_experts_forward(experts_view(self, count, gate_up, down), hidden_states, top_k_index,
                                      top_k_weights)  # fmt: skip


# The routed experts' forwards, the first that fits a call runs it: a small model's every layer held dequantized for
# the rollout (held_experts.py: by size, the plan counts it), bitsandbytes' fused 4-bit matmuls at decode
# (experts_gemv.py: nothing dequantized), else the routed experts dequantized (prefill, training, float32, CUDA, a CPU
# without AVX512-BF16)
EXPERT_PATHS = {
    "held": (held_experts.fits, held_forward),
    "gemv": (gemv_fits, experts_gemv.gemv_forward),
    "dequantize": (lambda module, hidden_states, top_k_index, adapters: True, dequantized_forward),
}


def routed_forward(module, hidden_states, top_k_index, top_k_weights, adapters: dict):
    """transformers' grouped_mm experts forward over the routed experts of `module`, with `adapters` folded in."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    routed, local = torch.unique(top_k_index, return_inverse=True)  # [k] expert ids; [tokens, top_k] their places
    count(module, routed.numel())
    gate_up = routed_weight(module, "gate_up_proj", routed, adapters["gate_up_proj"])  # [k, 2m, h]
    down = routed_weight(module, "down_proj", routed, adapters["down_proj"])  # [k, h, m]
    return grouped_mm_experts_forward(experts_view(module, routed.numel(), gate_up, down), hidden_states, local,
                                      top_k_weights)  # fmt: skip


def experts_view(module, count: int, gate_up: torch.Tensor, down: torch.Tensor) -> SimpleNamespace:
    """What transformers' grouped_mm experts forward reads of `module`, over `count` experts' weights."""
    view = SimpleNamespace(
        num_experts=count,
        gate_up_proj=gate_up,
        down_proj=down,
        has_gate=module.has_gate,
        has_bias=module.has_bias,
        is_transposed=module.is_transposed,
        _is_expert_parallel=False,
        act_fn=module.act_fn,
    )
    view._apply_gate = lambda out: module._apply_gate(out)
    return view


def count(module, experts: int) -> None:
    if hasattr(module, "experts_dequantized"):  # (set on the 4-bit experts by use_routed_experts)
        module.experts_dequantized += experts


def routed_weight(module, name: str, experts: torch.Tensor, adapters: list) -> torch.Tensor:
    """The routed experts' weight as the parameter's parametrizations make the whole one: dequantized, then PEFT's
    expert adapters (lora_factors) folded in for those experts alone (W + B A per expert, as its proxies do)."""
    weight = dequantize_experts(module, name, experts)
    for kind, tensors, scaling in adapters:
        if kind == "factors":  # one adapter: its factors, [E, out, r] and [E, r, in]
            lhs, rhs = tensors
            with torch.autocast(device_type=weight.device.type, enabled=False):  # (as PEFT's proxy: in W's dtype)
                weight = torch.baddbmm(weight, lhs[experts], rhs[experts], alpha=scaling)
        else:  # several adapters: their whole delta [E, out, in], the routed rows of it
            weight = weight + tensors[0][experts]
    return weight


def routable(module, name: str) -> bool:
    """Whether `name`'s routed experts can be dequantized alone: bitsandbytes' parametrization first, PEFT's LoRA
    proxies alone above it, and each expert a whole number of blocks (remembered for the chain's kinds: PEFT makes
    new proxies at each forward, of the same kinds)."""
    if not parametrize.is_parametrized(module, name):
        return False
    chain = module.parametrizations[name]
    kinds, known = tuple(map(type, chain)), getattr(module, "_routable", {})
    if known.get(name, (None,))[0] != kinds:
        module._routable = {**known, name: (kinds, chain_routable(chain))}
    return module._routable[name][1]


def chain_routable(chain) -> bool:
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization
    from peft.tuners.lora.layer import _LoraFactorsProxy, _LoraParameterProxy

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
    from bitsandbytes.functional import QuantState, dequantize_4bit

    chain = module.parametrizations[name]
    state, codes = chain[0].quant_state, chain.original
    layout = experts_gemv.packed(chain[0])
    if experts.numel() == state.shape[0] and (layout is None or not layout.any()):  # (every id: torch.unique, sorted)
        return dequantize_4bit(codes, state)  # why whole: gathering every expert's codes and scales is a copy of all
    picked = gather_rows(codes.view(state.shape[0], -1), experts)  # two 4-bit codes a byte, per expert
    picked = experts_gemv.unpacked_slices(module, name, experts, picked).reshape(-1, 1)  # (if decode permuted them)
    sliced = QuantState(
        absmax=experts_gemv.routed_absmax(module, name, experts).reshape(-1),
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
