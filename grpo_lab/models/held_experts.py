"""A small mixture of experts' layers dequantized once a rollout and held for its forwards.

On a model whose experts are small (`builtin:tiny-moe`: 8 experts of width 64 a layer), a decoding step's cost in the
experts is per-call overhead, not bytes: the routed dequantize gathers and dequantizes the routed experts at every
step, the fused kernel (experts_gemv.py) makes two calls a routed expert. The 4-bit base does not change within a
rollout, so where every layer's dequantized experts together fit in HELD_BYTES, a rollout's first forward through a
layer (its prefill) dequantizes the layer's experts whole, PEFT's expert adapters folded in (lora.target_experts), and
its decoding steps run every expert at once from them in a handful of dense ops (dense_forward). The held copy is
checked at each forward against the codes and the adapter factors it was made from (a changed one makes it again),
dropped by a forward with gradients and at the rollout's end (release); the plan counts it in the rollout
(`grpo_lab/planner/experts_items.py`). The load makes a decoding step's matmul kernels (warm), so a process's first
rollout does not. Passes that score completions and training forwards read the routed dequantize.
"""

from __future__ import annotations

import torch

from ..algo.logprobs import SCORING
from .experts import EXPERT_PARAMS
from .experts_found import experts_modules

# why 16 MiB: held, every layer's experts stay dequantized for the rollout, and a decoding step computes every expert
# of a layer (dense_forward: per token, one multiply-add an element of the layer's experts); at 16 MiB in bfloat16 that
# is at most 8M multiply-adds a token over the model, less than the whole-layer dequantize it replaces writes and reads
# a step, and a rounding error beside any plan's budget; above it the routed experts are dequantized (or run fused) a
# step as before, as at Qwen3-30B-A3B (1.1 GiB a layer)
HELD_BYTES = 16 << 20
# why 64: dense_forward computes every expert for every token (experts / top-k times the routed work: 4x on the tiny
# MoE); for more tokens than a decoding step's rows (a prefill), transformers' grouped_mm reads the held experts instead
DENSE_TOKENS = 64
# why 8: a bfloat16 matmul's first call at a new number of rows makes oneDNN's kernel for it (0.5-0.7 ms, against
# 45-50 us a call for dense_forward's two at 1-8 rows alike), and rows leave a rollout as they finish: each decoding
# step's tokens run padded to a power of two of at least MIN_ROWS, so a rollout of 8 rows reads the kernels the load
# made (warm), not one for each count its rows fall through (the plan counts the padded rows: padded_rows)
MIN_ROWS = 8


def padded_rows(tokens: int) -> int:
    """The rows a decoding step's `tokens` run as in dense_forward: the next power of two, at least MIN_ROWS."""
    return max(MIN_ROWS, 1 << (tokens - 1).bit_length())


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
    if torch.is_grad_enabled() or SCORING.get() or not holds(getattr(module, "held_total", HELD_BYTES + 1)):
        return False
    if not dense_layout(module):
        return False
    return all(kind == "factors" for chain in adapters.values() for kind, _, _ in chain)


def dense_layout(module) -> bool:
    """Gated experts without bias in transformers' [experts, out, in] layout: what dense_forward runs."""
    return not module.is_transposed and module.has_gate and not module.has_bias


def ready(module):
    """The held experts where nothing a forward checks has changed since they were made: no gradients, not scoring,
    made without adapters, each parameter's parametrizations the same and its codes too (a decoding step with LoRA on
    attention alone); else None, and routed_experts_forward checks everything (held_weights)."""
    held = getattr(module, "held", None)
    if held is None or held[2] is None or torch.is_grad_enabled() or SCORING.get():
        return None
    chains = module.parametrizations._modules  # why _modules and _parameters: nn.Module's __getattr__ is a layer
    for name, chain, codes, address, version in held[2]:  # call's few % on the tiny MoE
        if chains[name] is not chain or len(chain) != 1 or chain._parameters["original"] is not codes:
            return None
        if codes._version != version or codes.data_ptr() != address:
            return None
    return held[1]


def quick(made: tuple) -> tuple | None:
    """What ready checks, taken once at the making: (name, parametrizations, codes, address, version) a parameter, or
    None where adapters were folded in (their values are compared at each forward, in same)."""
    chains, made_codes, factors = made
    if factors:
        return None
    return tuple((n, c, c._parameters["original"], *a) for n, c, a in zip(EXPERT_PARAMS, chains, made_codes))


def stamp(module, adapters: dict) -> tuple:
    """What the held experts were made from: each parameter's parametrizations, its codes (address, version) and its
    adapter factors (copied: PEFT makes new factor tensors at each forward, so their values are compared)."""
    chains = tuple(module.parametrizations[n] for n in EXPERT_PARAMS)
    factors = [(scaling, *(t.detach().clone() for t in tensors)) for n in EXPERT_PARAMS for _, tensors, scaling in
               adapters[n]]  # fmt: skip
    return chains, codes(module), factors


def codes(module) -> tuple:
    """Each expert parameter's 4-bit codes as (address, version): written in place or replaced, they differ."""
    return tuple((module.parametrizations[n].original.data_ptr(), module.parametrizations[n].original._version) for n in
                 EXPERT_PARAMS)  # fmt: skip


def same(made: tuple, module, adapters: dict) -> bool:
    _, made_codes, factors = made
    chains = [(scaling, *tensors) for n in EXPERT_PARAMS for _, tensors, scaling in adapters[n]]
    if made_codes != codes(module) or len(chains) != len(factors):
        return False
    return all(a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1:], b[1:])) for a, b in zip(factors, chains))


def held_weights(module, adapters: dict, build) -> dict:
    """The layer's experts dequantized with their adapters folded in, made by `build` (routed_experts.routed_weight)
    the first time and whenever what they were made from changed: {"experts": E, "gate_up_proj": [E x 2m, h],
    "down_proj": [E x m, h] (its transpose: dense_forward's one matmul)}."""
    held = getattr(module, "held", None)
    if held is None or not same(held[0], module, adapters):
        module.held = None  # why first: the stale copy freed before the new one is made
        every = torch.arange(module.parametrizations[EXPERT_PARAMS[0]][0].quant_state.shape[0])
        gate_up, down = (build(module, name, every, adapters[name]) for name in EXPERT_PARAMS)
        made = {"experts": every.numel(), "gate_up_proj": gate_up.flatten(0, 1)}
        made["gate_up_t"] = made["gate_up_proj"].t()  # (a view: dense_forward's mm, no t or matmul dispatched a call)
        made["down_proj"] = down.transpose(1, 2).flatten(0, 1)  # (a copy: [E, m, h] made contiguous)
        made["gate"] = silu_gate(module)
        made_from = stamp(module, adapters)
        module.held = held = (made_from, made, quick(made_from))
        if hasattr(module, "experts_dequantized"):
            module.experts_dequantized += every.numel()
    return held[1]


def silu_gate(module) -> bool:
    """Whether the experts' gate is transformers' default (the activation of the gate half times the up half) with
    SiLU, which dense_forward computes in place; else it calls the module's own `_apply_gate`."""
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    apply = getattr(type(module)._apply_gate, "__func__", type(module)._apply_gate)
    concatenated = getattr(module, "is_concatenated", True)  # ([gate; up] an expert, as the default gate splits)
    return apply is _default_apply_gate and concatenated and type(module.act_fn) in (SiLUActivation, torch.nn.SiLU)


def dense_forward(module, held: dict, hidden_states, top_k_index, top_k_weights):
    """transformers' grouped_mm experts forward's result from every expert run on every token: the gated up
    projection of all experts in one matmul, each (token, expert)'s activation scaled by its routing weight (0 where
    not routed: a token's top-k experts are distinct), and the down projection summed over the experts in one more;
    the tokens padded with zero rows to padded_rows. Why in place and few ops: a decoding step's layer call is
    per-op overhead beside two small matmuls."""
    tokens, experts = hidden_states.shape[0], held["experts"]
    rows = padded_rows(tokens)  # (zero rows: their routes are 0, their outputs cut off)
    hidden = hidden_states if rows == tokens else torch.nn.functional.pad(hidden_states, (0, 0, 0, rows - tokens))
    up = torch.mm(hidden, held["gate_up_t"]).view(rows, experts, -1)
    weights = top_k_weights if top_k_weights.dtype == up.dtype else top_k_weights.to(up.dtype)
    routes = up.new_zeros(rows, experts)
    (routes if rows == tokens else routes[:tokens]).scatter_(1, top_k_index, weights)
    routes = routes.unsqueeze(-1)
    if held["gate"]:
        gate, up = up.chunk(2, dim=-1)
        scaled = torch.nn.functional.silu(gate).mul_(up).mul_(routes)  # [rows, E, m], 0 where not routed
    else:
        scaled = module._apply_gate(up) * routes
    out = torch.mm(scaled.view(rows, -1), held["down_proj"])
    out = out if rows == tokens else out[:tokens]
    return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)


def warm(modules) -> int:
    """A decoding step of MIN_ROWS rows through dense_forward on zero weights in the held copy's layout, once for each
    distinct layer shape among `modules` (4-bit experts on a CPU that fits holds and dense_forward): oneDNN makes its
    matmul kernels for shapes and strides alone, so a rollout's first step finds them made. Returns the shapes warmed.
    Why at load: a process's first bfloat16 step through them made both kernels and took the first calls of the ops
    around them (1.0-1.3 ms on the tiny MoE, against 0.2 ms a step after), in the rollout's counted time."""
    made = set()
    for module in modules:
        gate_up, down = (module.parametrizations[n][0].quant_state for n in EXPERT_PARAMS)
        key = (tuple(gate_up.shape), tuple(down.shape), gate_up.dtype)
        if key in made or module.parametrizations[EXPERT_PARAMS[0]].original.device.type != "cpu":
            continue
        if not dense_layout(module):  # (what fits reads the held copy for)
            continue
        made.add(key)
        experts, width, hidden = gate_up.shape
        # why zeros the size of one layer's held copy: the kernel is made for its layout, for a moment at load, below
        # the rollout's held copy of every layer that the plan counts (planner/experts_items.held_bytes)
        held = {"experts": experts, "gate": silu_gate(module)}
        held["gate_up_t"] = torch.zeros(experts * width, hidden, dtype=gate_up.dtype).t()
        held["down_proj"] = torch.zeros(experts * down.shape[2], hidden, dtype=down.dtype)
        token = torch.zeros(1, hidden, dtype=gate_up.dtype)  # (padded as any step of up to MIN_ROWS tokens is)
        with torch.no_grad():
            dense_forward(module, held, token, torch.zeros(1, 1, dtype=torch.long), token[:, :1])
    return len(made)


def release(model) -> None:
    """Every held copy of `model`'s experts dropped (a rollout's end)."""
    for module in experts_modules(model):  # why not every module: a phase's end, on a dense model too
        if getattr(module, "held", None) is not None:
            module.held = None
