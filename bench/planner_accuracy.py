"""Planner accuracy on the CPU: planned vs measured host memory for a random-weight Qwen2 model.

The tiny test model is too small to measure against process noise, so this builds a larger one
(hidden 1024, 8 layers, vocab 32768: ~0.1B params) with random weights, then compares
- the planned base weights + LoRA against the RSS growth of loading it (sampled at 200 Hz), and
- the planned backward transients (activations + log-prob head tiles + dequant buffer) against the
  measured RSS peak above the backward phase's start, for a few micro-batch sizes.
On a GPU the same comparison uses torch's exact allocator peaks (see docs/benchmarks.md).

    .venv/bin/python bench/planner_accuracy.py
"""
from __future__ import annotations

import argparse
import gc
import tempfile
import time
import warnings
from pathlib import Path

MiB = 1024 ** 2


def build_model(path: Path, hidden: int, layers: int, vocab: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_lab.tiny import _train_tokenizer

    tok = _train_tokenizer(384, 0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(2.75 * hidden), num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
                      max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, dtype="float32")
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)


def main() -> None:
    from grpo_lab import Lab, load_config
    from grpo_lab.memory.probes import HostProbe
    from grpo_lab.planner import plan

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--micro", type=int, nargs="+", default=[2, 8])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), args.hidden, args.layers, args.vocab)
        gc.collect()
        rows = []
        for micro in [args.micro[0], *args.micro]:   # the first load is a warm-up: one-off library initialisation
            cfg = load_config("tiny-cpu", [
                f"model.name_or_path={tmp}", "memory.sample_hz=200", f"grpo.micro_batch_size={micro}",
                "grpo.num_generations=8", "grpo.prompts_per_step=1", "generator.max_completion_length=128",
                "generator.temperature=0", "generator.max_prompt_length=128"])
            planned = plan(cfg).devices["host"]
            items = {i.what: i.bytes for i in planned.items}
            before = HostProbe().read()["rss"]
            lab = Lab(cfg).load()
            time.sleep(0.05)
            loaded = lab.memory.latest("host")["rss"] - before
            result = lab.step()
            back = next(r for r in result.memory if r["phase"] == "backward" and r["metric"] == "rss")
            transient = back["peak"] - back["start"]
            plan_static = items["base weights"] + items["LoRA weights"]
            plan_transient = items["activations (backward peak)"] + items["log-prob head tiles"] + items["4-bit dequant buffer"]
            tokens = micro * (int(result.completion_length_mean) + 128)
            rows.append((micro, plan_static, loaded, plan_transient, transient, tokens))
            lab.close()
            del lab
            gc.collect()
    print(f"model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; nf4 + LoRA r=8, checkpointing on")
    print("| micro-batch | planned weights MiB | measured load RSS MiB | ratio | planned backward transient MiB | "
          "measured backward RSS peak MiB | ratio |")
    for micro, ps, ml, pt, mt, _ in rows[1:]:
        print(f"| {micro} | {ps / MiB:.1f} | {ml / MiB:.1f} | {ml / ps:.2f} | {pt / MiB:.1f} | {mt / MiB:.1f} | "
              f"{mt / pt:.2f} |")


if __name__ == "__main__":
    main()
