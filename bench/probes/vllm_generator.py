"""vLLM generator: grpo_lab's backend vs raw `LLM.generate`, and adapter sync vs generation time.

1. Overhead: the same engine, the same requests (token ids, sampling params, per-request seeds,
   LoRA request), alternated: grpo_lab's `generator.generate` (tokenize, repeat, chunk, merge, pad,
   decode) against a bare `llm.generate` on prepared TokensPrompts. Goal: ratio <= 1.05.
2. Per step on the tiny model and on a larger random-weight Qwen2: seconds to sync the LoRA
   adapter into the engine and seconds to generate the step's rollout.

    .venv/bin/python bench/probes/vllm_generator.py --rounds 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def lab_for(model_path: str, steps_overrides: list[str]):
    from grpo_lab import Lab, load_config

    cfg = load_config(
        "tiny-cpu",
        [f"model.name_or_path={model_path}", "generator.backend=vllm", "memory.sample_hz=0", *steps_overrides],
    )
    return Lab(cfg).load()


def overhead(lab, rounds: int) -> tuple[float, float, float]:
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from grpo_lab.generation.base import GenerationRequest

    gen, cfg = lab.generator, lab.config
    request = GenerationRequest(cfg.generator.max_completion_length, cfg.generator.temperature)
    ours, raw = [], []
    for _ in range(rounds):
        batch = lab.prompts.next_batch(cfg.grpo.prompts_per_step)
        g = cfg.grpo.num_generations
        torch.manual_seed(1)
        t0 = time.perf_counter()
        gen.generate(batch, g, request)
        ours.append(time.perf_counter() - t0)
        # the identical requests, prepared outside the timing
        torch.manual_seed(1)
        seeds = torch.randint(0, 2**31 - 1, (len(batch) * g,)).tolist()
        prompts = [
            TokensPrompt(prompt_token_ids=p)
            for p in gen.encode_prompts(batch.prompts, cfg.generator.max_prompt_length)
            for _ in range(g)
        ]
        params = [
            SamplingParams(
                temperature=request.temperature,
                max_tokens=request.max_completion_length,
                logprobs=0,
                seed=s,
                stop_token_ids=gen.eos_token_ids,
            )
            for s in seeds
        ]
        t0 = time.perf_counter()
        gen.llm.generate(prompts, params, lora_request=gen.lora_request, use_tqdm=False)
        raw.append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(ours, raw)]
    return statistics.median(ours), statistics.median(raw), statistics.median(ratios)


def per_step(lab, steps: int) -> tuple[float, float]:
    results = lab.run(steps)[1:]  # the first step includes engine warm-up
    return (
        statistics.median(r.sync_seconds for r in results),
        statistics.median(r.phase_seconds["rollout"] for r in results),
    )


def main() -> None:
    from bench.shapes import build_model
    from grpo_lab.models.tiny import ensure_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    tiny = str(ensure_tiny_model(".cache/tiny-qwen2"))
    lab = lab_for(tiny, [])
    ours, raw, ratio = overhead(lab, args.rounds)
    print(f"| overhead | tiny | {args.rounds} | {ours:.4f} | {raw:.4f} | {ratio:.3f} |")
    sync, rollout = per_step(lab, args.steps)
    print(
        f"| per step | tiny (0.5M params, LoRA r=8) | {args.steps - 1} | sync {sync:.4f} s | rollout {rollout:.4f} s |"
    )
    lab.close()
    del lab
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), 1024, 8, 32768)
        big = lab_for(tmp, [])
        sync, rollout = per_step(big, args.steps)
        print(
            f"| per step | random Qwen2 hidden 1024 x 8 layers (0.17B, LoRA r=8) | {args.steps - 1} | "
            f"sync {sync:.4f} s | rollout {rollout:.4f} s |"
        )
        big.close()


if __name__ == "__main__":
    main()
