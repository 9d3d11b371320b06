"""A random-weight Qwen2 of a chosen shape for the benches (bench/probes/bnb_cpu_layout.py,
bench/probes/vllm_generator.py), built by the project's own builder (models/tiny.py) with the tiny tokenizer."""

from __future__ import annotations

from pathlib import Path


def build_model(path: Path, hidden: int, layers: int, vocab: int) -> Path:
    """`hidden` wide (64-wide heads, one KV head per 256), `layers` deep, `vocab` rows; no EOS boost."""
    from grpo_lab.models.tiny import build_tiny_model

    return build_tiny_model(
        path,
        hidden_size=hidden,
        num_layers=layers,
        vocab_size=vocab,
        intermediate_size=int(2.75 * hidden),
        num_key_value_heads=max(1, hidden // 256),
        eos_probability=None,
        max_positions=2048,
        label=f"bench model {hidden}x{layers}, vocab {vocab}",
    )
