"""The routed experts' matmuls run straight from their 4-bit codes at decode, dequantizing none of them.

A decoding step sends each routed expert a handful of tokens: dequantizing its weight (what routed_experts.py does)
writes and reads 2 bytes an element to multiply a few rows. bitsandbytes registers a fused CPU kernel for
`bitsandbytes::gemv_4bit` (nf4/fp4 x bfloat16, any number of rows) where the CPU has AVX512-BF16
(`bitsandbytes.functional.has_avx512bf16`); it reads the codes in its own CPU layout (bitsandbytes'
`_convert_weight_packed_for_cpu`: 32 rows' nibbles interleaved, the scales [in / blocksize, out] in bfloat16). Each
expert's codes are permuted into that layout in place the first time it runs here (a nibble shuffle, lossless and
memory-neutral; the parametrization's `packed` marks which). The routed dequantize (a long prefill, a log-prob pass)
reads its gathered slices back blockwise into its own temporary; a forward with gradients puts the whole parameter
back (unless KERNEL_LAYOUT_KEPT: then it too reads its slices back), and so does any read of the whole parameter
(bitsandbytes' whole dequantize, so a merge or a copy of the weights, and `state_dict`, so a save). A permutation
keeps the codes it moves until they and the mask agree again. The scales stay as
bitsandbytes keeps them (double-quantized too); the routed experts' are dequantized at each step (1/blocksize of the
weights). PEFT's expert adapters (lora.target_experts) run beside the base matmul as their low-rank product,
x A^T B^T, not folded into a weight.
"""

from __future__ import annotations

from functools import cache

import torch

BLOCK_N = 32  # rows whose nibbles bitsandbytes' CPU layout interleaves (its block_n)
# why 256: the fused kernel's time grows with its rows while a dequantize's does not; on one layer of Qwen3-30B-A3B's
# shape (bench/probes/routed_experts.py) the fused matmuls beat dequantize + grouped matmul up to about 300 tokens an
# expert (a 4096-token prefill), so a step whose busiest routed expert has more than 256 (a long prefill) dequantizes
GEMV_TOKENS = 256
# why put back: kept in the kernel's layout (True), a rollout after the first permutes almost nothing (one 30B-A3B
# layer, 4 decoding steps of 8 rows: 0.1-0.2 s against 0.9-1.1 s), but every training read of the routed experts reads
# their slices back into a temporary (about 1.3 s a read of 127 experts there), about what the one put-back and the
# next rollout's permutation cost (2.1-3.1 s) at two reads a micro-batch (forward, and backward's dequantize again or
# checkpointing's forward again), and more with several micro-batches a step (bench/probes/routed_experts_steps.py)
KERNEL_LAYOUT_KEPT = False


def gemv_kernel() -> bool:
    """Whether bitsandbytes' fused CPU kernel is registered (it registers it where the CPU has AVX512-BF16)."""
    from bitsandbytes import functional

    return bool(functional.has_avx512bf16())


def gemv_fits(module, hidden_states: torch.Tensor, local: torch.Tensor, routed: int) -> bool:
    """Whether this forward runs the fused kernel: rollout decode (no gradients, not a pass that scores completions) in
    bfloat16 on a CPU with the kernel, every routed expert given at most GEMV_TOKENS tokens, and each expert's codes in
    whole rows of 32 and blocks."""
    from ..algo.logprobs import SCORING

    if torch.is_grad_enabled() or SCORING.get() or hidden_states.device.type != "cpu":
        return False
    if hidden_states.dtype != torch.bfloat16:
        return False
    if module.is_transposed or not module.has_gate or module.has_bias or not gemv_kernel():
        return False
    for name in ("gate_up_proj", "down_proj"):
        state = module.parametrizations[name][0].quant_state
        out, width = state.shape[1], state.shape[2]
        if state.dtype != torch.bfloat16 or out % BLOCK_N or width % state.blocksize or width % 2:
            return False
    return int(torch.bincount(local.reshape(-1), minlength=routed).max()) <= GEMV_TOKENS


@torch.no_grad()
def gemv_forward(module, hidden_states, top_k_index, top_k_weights, adapters: dict):
    """transformers' grouped_mm experts forward (the same order of its sums), each routed expert's two matmuls by
    bitsandbytes' gemv_4bit on its 4-bit codes; `adapters`: PEFT's expert adapters (routed_experts.lora_factors)."""
    routed, local = torch.unique(top_k_index, return_inverse=True)
    top_k = top_k_index.shape[-1]
    pairs = local.reshape(-1)  # (token, slot) pairs, token-major as grouped_mm orders them
    weights = {name: pack(module, name, routed) for name in ("gate_up_proj", "down_proj")}
    scales = {name: kernel_scales(module, name, routed_absmax(module, name, routed)) for name in weights}
    out = hidden_states.new_empty(pairs.numel(), hidden_states.shape[-1])
    module.experts_fused = getattr(module, "experts_fused", 0) + routed.numel()
    for j, expert in enumerate(routed.tolist()):
        at = (pairs == j).nonzero().squeeze(1)
        x = hidden_states[at // top_k]
        up = expert_matmul(module, "gate_up_proj", expert, x, weights, scales["gate_up_proj"][j], adapters)
        out[at] = expert_matmul(module, "down_proj", expert, module._apply_gate(up), weights, scales["down_proj"][j],
                                adapters)  # fmt: skip
    weighted = out * top_k_weights.reshape(-1, 1)
    return weighted.view(-1, top_k, out.shape[-1]).sum(dim=1).to(hidden_states.dtype)


def expert_matmul(module, name: str, expert: int, x, weights: dict, scales, adapters: dict):
    """x W^T for one expert's `name`, from its codes, with PEFT's adapters (W + s B A, as its proxies)."""
    from bitsandbytes.functional import gemv_4bit

    state = module.parametrizations[name][0].quant_state
    out = gemv_4bit(x, weights[name][expert], state=kernel_state(state, scales))
    for kind, tensors, scaling in adapters[name]:
        if kind == "factors":  # one adapter: lhs [E, out, r], rhs [E, r, in]
            lhs, rhs = (t[expert].to(x.dtype) for t in tensors)
            out = out + scaling * (x @ rhs.T) @ lhs.T
        else:  # several adapters: their whole delta [E, out, in]
            out = out + x @ tensors[0][expert].to(x.dtype).T
    return out


def kernel_state(state, scales):
    """bitsandbytes' QuantState for one expert's codes in its CPU layout (`scales`: [in / blocksize, out])."""
    from bitsandbytes.functional import QuantState

    shape = torch.Size(state.shape[1:])
    return QuantState(absmax=scales, shape=shape, code=state.code, blocksize=state.blocksize,
                      quant_type=state.quant_type, dtype=torch.bfloat16)  # fmt: skip


def kernel_scales(module, name: str, absmax: torch.Tensor) -> torch.Tensor:
    """The routed experts' scales [k, out x in / blocksize] as the kernel reads them: [k, in / blocksize, out] bf16."""
    out = module.parametrizations[name][0].quant_state.shape[1]
    return absmax.view(absmax.shape[0], out, -1).transpose(1, 2).to(torch.bfloat16).contiguous()


@torch.no_grad()
def routed_absmax(module, name: str, experts: torch.Tensor) -> torch.Tensor:
    """The blockwise scales of the experts `experts` of `module`'s 4-bit `name`, float32 [len(experts), blocks]."""
    from bitsandbytes.functional import QuantState, dequantize_blockwise

    state = module.parametrizations[name][0].quant_state
    count = state.shape[0]
    absmax = state.absmax.view(count, -1)[experts].reshape(-1)
    if state.nested and (absmax.numel() // experts.numel()) % state.state2.blocksize == 0:
        # the scales are themselves 8-bit blockwise, each expert's a whole number of their blocks: gathered alike
        inner = state.state2
        scales = inner.absmax.view(count, -1)[experts].reshape(-1)
        nested = QuantState(absmax=scales, code=inner.code, blocksize=inner.blocksize, dtype=torch.float32)
        absmax = dequantize_blockwise(absmax, nested) + state.offset
    elif state.nested:  # why whole: an expert's scales straddle their blocks; they are 1/blocksize of the codes
        absmax = (dequantize_blockwise(state.absmax, state.state2) + state.offset).view(count, -1)[experts].reshape(-1)
    return absmax.float().view(experts.numel(), -1)


# --- the codes' layout: bitsandbytes' blockwise one, or its CPU kernel's, per expert ---
def codes(module, name: str) -> torch.Tensor:
    """The 4-bit codes of `name` as [experts, out, in / 2] bytes (a view of the parameter's storage)."""
    chain = module.parametrizations[name]
    return chain.original.view(chain[0].quant_state.shape[0], chain[0].quant_state.shape[1], -1)


def pack(module, name: str, experts: torch.Tensor) -> torch.Tensor:
    """The codes of `name` with `experts` in the kernel's layout (permuted in place the first time)."""
    param = module.parametrizations[name][0]
    if packed(param) is None:  # (the first fused forward: its blockwise readers guarded from now on)
        with torch.inference_mode(False):  # why: a mask made under inference_mode could not be cleared outside it
            param.__class__, param.packed = kernel_layout(), torch.zeros(param.quant_state.shape[0], dtype=torch.bool)
        if not hasattr(module, "_gemv_state_dict_hook"):
            module._gemv_state_dict_hook = module.register_state_dict_pre_hook(lambda m, prefix, keep: blockwise(m))
    fresh = experts[~param.packed[experts]]
    every = codes(module, name)
    if fresh.numel():
        permute_experts(every, fresh, to_kernel_layout, lambda: param.packed.index_fill_(0, fresh, True))
    return every


def blockwise(module) -> None:
    """Every expert of `module` back in bitsandbytes' blockwise layout (before anything reads the codes whole)."""
    for name in ("gate_up_proj", "down_proj"):
        param = module.parametrizations[name][0]
        if packed(param) is not None:
            param.restore(module.parametrizations[name].original)


def unpacked_slices(module, name: str, experts: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """`picked`: the codes of `experts` gathered [k, bytes] (a copy, written here); those in the kernel's layout put
    back blockwise."""
    param = module.parametrizations[name][0]
    if packed(param) is None or not param.packed[experts].any():
        return picked
    mine, shaped = param.packed[experts], picked.view(experts.numel(), param.quant_state.shape[1], -1)
    if mine.all():  # (a training forward after a rollout: its routed experts ran fused; about 1.7x faster unmasked)
        return to_blockwise_layout(shaped).view(picked.shape)
    ids, rows = mine.nonzero().squeeze(1), param.quant_state.shape[1]
    wide = picked.view(torch.int64) if picked.shape[1] % 8 == 0 else picked  # (8 bytes at a time, as permute_experts)
    mixed = wide.index_select(0, ids).view(torch.uint8).view(ids.numel(), rows, -1)
    wide.index_copy_(0, ids, to_blockwise_layout(mixed).view(ids.numel(), -1).view(wide.dtype))
    return picked


def packed(param):
    """Which experts' codes are in the kernel's layout (bool [experts]); None: none ever were (blockwise)."""
    return getattr(param, "packed", None)


@cache
def kernel_layout() -> type:
    """bitsandbytes' parametrization over experts' codes some of which (`packed`, per expert) are in its CPU kernel's
    layout: put back blockwise before it dequantizes the whole parameter (a fused forward makes it this class).
    Why made here: bitsandbytes is imported when a model is quantized, not when grpo_lab is."""
    from bitsandbytes.nn.parametrize import Bnb4bitParametrization

    class KernelLayout(Bnb4bitParametrization):
        packed: torch.Tensor

        @torch.no_grad()
        def forward(self, quantized_param: torch.Tensor) -> torch.Tensor:
            self.restore(quantized_param)
            return super().forward(quantized_param)

        @torch.no_grad()
        def restore(self, quantized_param: torch.Tensor) -> None:
            if self.packed.any():
                ids = self.packed.nonzero().squeeze(1)
                every = quantized_param.view(self.quant_state.shape[0], self.quant_state.shape[1], -1)
                permute_experts(every, ids, to_blockwise_layout, self.packed.zero_)

    return KernelLayout


def permute_experts(every: torch.Tensor, ids: torch.Tensor, layout, mark) -> None:
    """every[ids] = layout(every[ids]) for [experts, out, in / 2] codes, in place, then `mark()` (the mask saying
    which layout they are in), copied 8 bytes at a time where an expert's bytes allow (index_select / index_copy_ on
    bytes run about 2x slower on the CPU). A failure anywhere leaves the codes and the mask as they were."""
    count, shape = every.shape[0], every.shape[1:]
    wide = every.view(count, -1).view(torch.int64) if shape.numel() % 8 == 0 else every.view(count, -1)
    before = wide.index_select(0, ids)  # why kept until marked: the codes go back if the write or the mark fails
    moved = layout(before.view(torch.uint8).view(ids.numel(), *shape)).view(ids.numel(), -1).view(wide.dtype)
    try:
        wide.index_copy_(0, ids, moved)
        mark()
    except BaseException:
        wide.index_copy_(0, ids, before)
        raise


def to_kernel_layout(blocks: torch.Tensor) -> torch.Tensor:
    """[E, out, in/2] blockwise codes (a byte: element 2i's nibble high, 2i+1's low) to bitsandbytes' CPU layout: per
    32 rows and byte column, 32 bytes whose 2r-th holds (row 16+r, row r) of the even element, 2r+1-th of the odd."""
    experts, rows, half = blocks.shape
    split = blocks.view(experts, rows // BLOCK_N, 2, BLOCK_N // 2, half).transpose(-1, -2)
    low, high = split[:, :, 0], split[:, :, 1]  # rows r and 16 + r of each 32
    out = torch.empty(experts, rows // BLOCK_N, half, BLOCK_N // 2, 2, dtype=torch.uint8)
    torch.bitwise_or(high & 0xF0, low >> 4, out=out[..., 0])
    torch.bitwise_or(high << 4, low & 0x0F, out=out[..., 1])
    return out.view(experts, rows, half)


def to_blockwise_layout(kernel: torch.Tensor) -> torch.Tensor:
    """to_kernel_layout's inverse."""
    experts, rows, half = kernel.shape
    split = kernel.view(experts, rows // BLOCK_N, half, BLOCK_N // 2, 2)
    even, odd = split[..., 0], split[..., 1]
    out = torch.empty(experts, rows // BLOCK_N, 2, BLOCK_N // 2, half, dtype=torch.uint8)
    torch.bitwise_or(even << 4, odd & 0x0F, out=out[:, :, 0].transpose(-1, -2))
    torch.bitwise_or(even & 0xF0, odd >> 4, out=out[:, :, 1].transpose(-1, -2))
    return out.view(experts, rows, half)
