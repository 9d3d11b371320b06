"""bitsandbytes 4-bit layers, pinned to one code path on every CPU.

bitsandbytes >= 0.48 repacks a `Linear4bit`'s nf4 weights into an AVX-512-BF16 inference layout
the first time the layer runs in eval mode without gradients on a CPU with that flag; a later
training forward on the packed layout fails in autograd (`result += bias` on a leaf). A learner
runs eval/no-grad forwards every step (HF rollout, old and reference log-probs), so grpo_lab
never lets its 4-bit layers repack. The trade-off, measured in bench/probes/bnb_cpu_layout.py
(docs/benchmarks.md): the packed bf16 kernel makes an HF rollout 1.3x (bf16 compute) to 2x
(float32) faster on an AVX-512-BF16 CPU, but sampler and learner log-probs then differ by ~2e-2
instead of ~2e-6, and restoring the training layout needs bnb's private inverse, which is lossy.
"""

from __future__ import annotations

import logging

# bitsandbytes' CPU backend logs this (a warning on logger bitsandbytes.backends.cpu.ops) once, as `import bitsandbytes`
# runs, wherever its native `has_avx512bf16()` is true: the optional `kernels` package (downloaded from the hub) would
# speed up the packed inference layout, which grpo_lab never uses.
_KERNELS_NOTICE = "Failed to load CPU gemm_4bit_forward"


class DropStartingWith(logging.Filter):
    """Drops a logger's records whose message starts with `prefix`; every other record passes."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def drop_log_lines(logger_name: str, prefix: str) -> None:
    """Keep logger `logger_name`'s records that start with `prefix` out of the user's output; idempotent."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, DropStartingWith) and f.prefix == prefix for f in logger.filters):
        logger.addFilter(DropStartingWith(prefix))


def quiet_bitsandbytes() -> None:
    """Keep bitsandbytes' `pip install kernels` notice out of the user's output (it cannot matter here)."""
    drop_log_lines("bitsandbytes.backends.cpu.ops", _KERNELS_NOTICE)


# why at this module's import, not only in quantization_config: a Lab's load imports peft, which imports bitsandbytes
# before the config is read; the learner imports this module before either
quiet_bitsandbytes()


def pin_training_layout(model) -> int:
    """Keep every bitsandbytes 4-bit layer of `model` in its training layout; returns how many.

    why never repack: the packed layout breaks the next training forward, and sampling on it would
    make sampler log-probs differ from the learner's; the reference copy is pinned too, so its
    log-probs are computed exactly as the policy's are."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return 0
    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    for layer in layers:
        layer.grpo_lab_cpu_flag = bool(getattr(layer, "support_avx512bf16_for_cpu", False))  # what bnb detected
        layer.support_avx512bf16_for_cpu = False
    return len(layers)
