"""How much of a rollout's width its forwards and decoding steps work over at once (no torch here: the planner reads
these without it).

A fresh prefill on a CPU learner runs in chunks of PREFILL_CHUNK tokens (transformers' `prefill_chunk_size`): only
the last position's logits are kept (generate()'s `logits_to_keep=1`), so a chunk's activations and padding mask are
the prefill's working memory, not the whole prompt's (planner/turns.py prefill_bytes follows). Why: at 8 rows x 647
prompt tokens the one-forward prefill's [rows, tokens, intermediate] activations were the rollout's largest live set
(41 MiB on builtin:qwen2-152k, docs/benchmarks.md "A tool-calling rollout beside TRL's tool loop"); a GPU learner
prefills in one forward (its kernels' launches, not its activations, are what it pays for)."""

from __future__ import annotations

from typing import Optional

# tokens per prefill forward: the MLP's [8, 128, intermediate] float32 activations of the tiny body are 1 MiB each
PREFILL_CHUNK = 128


def prefill_chunk(device_type: str, cache, first_turn: bool = True) -> Optional[int]:
    """The generate() call's `prefill_chunk_size`: PREFILL_CHUNK for a CPU learner's prefill of the prompts (a
    rollout's, or a tool loop's first turn); None (one forward) on a GPU, going on from `cache` (transformers' chunks
    start at position 0, so a call continuing a kept cache, generation/turn_cache.py, or a static one prefills in one
    forward), or at a tool loop's later turn: its fresh prefill of the whole conversation (TRL's loop, turn_cache
    prefill, and keep's past the planned KV length) is one forward as TRL's loop makes it, the control the benches
    compare with (and notebook 07's tool result that grows over the line)."""
    return PREFILL_CHUNK if device_type == "cpu" and cache is None and first_turn else None


# a decoding step's block of rows (generation/sampling.py), its float64 CDF at most this many bytes: one row of
# Qwen2.5's vocabulary (1.2 MiB), many of a small one
BLOCK_BYTES = 2**20


def block_rows(vocab: int, device_type: str = "cpu") -> Optional[int]:
    """Rows a decoding step processes at once: on a CPU, its [block, vocab] buffers' float64 CDF within BLOCK_BYTES;
    on a GPU every row (None): a kernel per row would cost launches for bytes the card does not miss."""
    return max(1, BLOCK_BYTES // (8 * vocab)) if device_type == "cpu" else None


def decode_step_bytes(rows: int, vocab: int, logits_bytes: int, device_type: str = "cpu", kept: bool = True) -> int:
    """One decoding step's [rows, vocab] tensors: the LM head's logits (`logits_bytes` an element) and generate()'s
    float32 copy of them (the sampler writes its choice over it; the last step's is let go once generate() has chosen:
    generation/sampling.py DecodeStep.release), and the step's held [block, vocab] buffers: a block of rows' float32
    softmax / recorded log-softmax and float64 CDF. On a CPU the copy is a view of the kept logits where they are
    float32 (generation/step_logits.py), so a float32 step holds one [rows, vocab] block, not two; `kept`: whether
    the LM head keeps its logits there (not a sharded head that is a DTensor at generate time: its own forward)."""
    copy = 0 if device_type == "cpu" and kept and logits_bytes == 4 else 4
    return rows * vocab * (logits_bytes + copy) + min(block_rows(vocab, device_type) or rows, rows) * vocab * (4 + 8)
