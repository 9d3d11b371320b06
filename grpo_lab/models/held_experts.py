"""A small mixture of experts' layers dequantized once a rollout and held for its forwards.

On a model whose experts are small (`builtin:tiny-moe`: 8 experts of width 64 a layer), a decoding step's cost in the
experts is per-call overhead, not bytes: the routed dequantize gathers and dequantizes the routed experts at every
step, the fused kernel (experts_gemv.py) makes two calls a routed expert. The 4-bit base does not change within a
rollout, so where every layer's dequantized experts together fit in HELD_BYTES, a rollout's first forward through a
layer (its prefill) dequantizes the layer's experts whole, PEFT's expert adapters folded in (lora.target_experts), and
its decoding steps run every expert at once from them in a handful of dense ops (dense_forward). The held copy is
checked at each forward against the codes and the adapter factors it was made from (a changed one makes it again),
dropped by a forward with gradients and at the rollout's end (release); the plan counts it in the rollout
(`grpo_lab/planner/experts_items.py`). Passes that score completions and training forwards read the routed dequantize.
"""

from __future__ import annotations

import torch

from .experts import EXPERT_PARAMS

# why 16 MiB: held, every layer's experts stay dequantized for the rollout, and a decoding step computes every expert
# of a layer (dense_forward: per token, one multiply-add an element of the layer's experts); at 16 MiB in bfloat16 that
# is at most 8M multiply-adds a token over the model, less than the whole-layer dequantize it replaces writes and reads
# a step, and a rounding error beside any plan's budget; above it the routed experts are dequantized (or run fused) a
# step as before, as at Qwen3-30B-A3B (1.1 GiB a layer)
HELD_BYTES = 16 << 20
# why 64: dense_forward computes every expert for every token (experts / top-k times the routed work: 4x on the tiny
# MoE); for more tokens than a decoding step's rows (a prefill), transformers' grouped_mm reads the held experts instead
DENSE_TOKENS = 64


def held_total(modules) -> int:
    """Bytes of every 4-bit experts module's experts dequantized to their dtype (the copy held, over layers)."""
    total = 0
    for module in modules:
        for name in EXPERT_PARAMS:
            state = module.parametrizations[name][0].quant_state
            total += state.shape.numel() * state.dtype.itemsize
    return total


def holds(total: int) -> bool:
    """Whether a model whose every layer's dequantized experts take `total` bytes holds them for a rollout."""
    return total <= HELD_BYTES


def fits(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, adapters: dict) -> bool:
    """Whether this forward reads the held experts: a rollout's (no gradients, not a pass that scores completions) on a
    model small enough (holds), gated experts without bias in transformers' [experts, out, in] layout, with one
    adapter at most (PEFT's factors: several arrive as a whole delta, not checked cheaply)."""
    from ..algo.logprobs import SCORING

    if torch.is_grad_enabled() or SCORING.get() or not holds(getattr(module, "held_total", HELD_BYTES + 1)):
        return False
    if module.is_transposed or not module.has_gate or module.has_bias:
        return False
    return all(kind == "factors" for chain in adapters.values() for kind, _, _ in chain)


def stamp(module, adapters: dict) -> tuple:
    """What the held experts were made from: each parameter's codes (address, version) and its adapter factors
    (copied: PEFT makes new factor tensors at each forward, so their values are compared)."""
    codes = [(module.parametrizations[n].original.data_ptr(), module.parametrizations[n].original._version) for n in
             EXPERT_PARAMS]  # fmt: skip
    factors = [(scaling, *(t.detach().clone() for t in tensors)) for n in EXPERT_PARAMS for _, tensors, scaling in
               adapters[n]]  # fmt: skip
    return codes, factors


def same(made: tuple, module, adapters: dict) -> bool:
    codes, factors = made
    now = [(module.parametrizations[n].original.data_ptr(), module.parametrizations[n].original._version) for n in
           EXPERT_PARAMS]  # fmt: skip
    chains = [(scaling, *tensors) for n in EXPERT_PARAMS for _, tensors, scaling in adapters[n]]
    if codes != now or len(chains) != len(factors):
        return False
    return all(a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1:], b[1:])) for a, b in zip(factors, chains))


def held_weights(module, adapters: dict, build) -> dict:
    """The layer's experts dequantized with their adapters folded in (gate_up_proj [E, 2m, h], down_proj [E, m, h]: its
    transpose), made by `build`
    (routed_experts.routed_weight) the first time and whenever what they were made from changed."""
    held = getattr(module, "held", None)
    if held is None or not same(held[0], module, adapters):
        module.held = None  # why first: the stale copy freed before the new one is made
        every = torch.arange(module.parametrizations[EXPERT_PARAMS[0]][0].quant_state.shape[0])
        made = {name: build(module, name, every, adapters[name]) for name in EXPERT_PARAMS}
        made["down_proj"] = made["down_proj"].transpose(1, 2).contiguous()  # [E, m, h]: dense_forward's one matmul
        module.held = held = (stamp(module, adapters), made)
        if hasattr(module, "experts_dequantized"):
            module.experts_dequantized += every.numel()
    return held[1]


def dense_forward(module, held: dict, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped_mm experts forward's result from every expert run on every token: the gated up
    projection of all experts in one matmul, each (token, expert)'s activation scaled by its routing weight (0 where
    not routed), and the down projection summed over the experts in one more (held["down_proj"]: [E, m, h])."""
    gate_up, down = held["gate_up_proj"], held["down_proj"]  # [E, 2m, h], [E, m, h]
    tokens, count = hidden_states.shape[0], gate_up.shape[0]
    up = torch.nn.functional.linear(hidden_states, gate_up.view(-1, gate_up.shape[-1])).view(tokens, count, -1)
    routes = up.new_zeros(tokens, count).scatter_add_(1, top_k_index, top_k_weights.to(up.dtype))  # [tokens, E]
    scaled = module._apply_gate(up) * routes.unsqueeze(-1)  # [tokens, E, m]
    return (scaled.view(tokens, -1) @ down.view(-1, down.shape[-1])).to(hidden_states.dtype)


def release(model) -> None:
    """Every held copy of `model`'s experts dropped (a rollout's end)."""
    for module in model.modules():
        if getattr(module, "held", None) is not None:
            module.held = None
