"""generator.turn_cache keep against prefill (TRL's loop: every turn prefills the conversation again), side by side in
one process: each rollout samples the same rows with the same seeds, keep and prefill in alternating order after one
warm-up rollout each, `--repeats` times, so both see the same machine. Every row calls a tool in each of its first
`--turns` - 1 turns (the call forced by a logits processor: the tiny bodies never write one), the tool answering
`--answer-words` words, then answers freely to the trajectory budget. Prints one JSON line per rollout (seconds,
completion tokens, the model's tokens per second, the tokens the model was fed) and a summary line per turn count
with the medians and their ratio; the sampled tokens must be equal (checked, else exit 1).

    OMP_NUM_THREADS=1 python -m bench.probes.turn_cache --model builtin:qwen2-152k --turns 2 4 --repeats 2

docs/benchmarks.md "A tool loop's turns go on from their KV cache" keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.forced import ForcedTokens

CALL = '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call><|im_end|>'
ANSWER_WORDS = [40]


def lookup(q: str) -> str:
    """Look a word up.

    Args:
        q: the word
    """
    return "word " * ANSWER_WORDS[0]


def force_calls(tokenizer, calls: int) -> list:
    """A rollout's generate() call t < `calls` (one per turn) writes the tool call in every row; later ones are free.
    Returns the list of the rollout's calls (cleared before each rollout)."""
    import grpo_lab.generation.hf as hf

    ids = tokenizer(CALL, add_special_tokens=False)["input_ids"]
    original, made = hf.sampling_processors, []

    def processors(request):
        made.append(request)
        return original(request) + ([ForcedTokens(ids)] if len(made) <= calls else [])

    hf.sampling_processors = processors
    return made


def rollout(lab, made: list, mode: str, repeat: int, turns: int) -> tuple[dict, torch.Tensor]:
    """One timed rollout: its JSON line and its tokens."""
    fed = []
    made.clear()
    embed = lab.learner.model.get_base_model().get_input_embeddings()
    hook = embed.register_forward_hook(lambda _, args, out: fed.append(args[0].numel()))
    lab.configure({"generator.turn_cache": mode})
    torch.manual_seed(repeat)  # the rows' seeds: the same rollout both ways
    try:
        start = time.perf_counter()
        out = lab.rollout()
        seconds = time.perf_counter() - start
    finally:
        hook.remove()
    model_tokens = int((out.completion_mask * out.tool_mask).sum())
    line = {"turns": turns, "repeat": repeat, "turn_cache": mode, "seconds": round(seconds, 3),
            "completion_tokens": int(out.completion_mask.sum()), "model_tokens": model_tokens,
            "model_tokens_per_s": round(model_tokens / seconds, 1), "fed_tokens": sum(fed),
            "turns_mean": sum(out.turns) / len(out.turns)}  # fmt: skip
    return line, out.completion_ids


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:qwen2-152k")
    parser.add_argument("--turns", type=int, nargs="+", default=[2, 4], help="turns a row makes (tool calls + 1)")
    parser.add_argument("--length", type=int, default=512, help="generator.max_completion_length")
    parser.add_argument("--answer-words", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    ANSWER_WORDS[0] = args.answer_words
    from grpo_lab import Lab

    same = True
    for turns in args.turns:
        lab = Lab(
            {
                "model": {
                    "name_or_path": args.model,
                    "dtype": "float32",
                    "bnb_4bit_compute_dtype": "float32",
                    "chat_template": "trl:qwen2_5",
                },
                "generator": {
                    "max_completion_length": args.length,
                    "max_prompt_length": 1024,
                    "temperature": 1.0,
                    "max_tool_calling_iterations": turns - 1,
                },
                "grpo": {"num_generations": args.generations, "prompts_per_step": args.prompts, "beta": 0.0},
            },  # fmt: skip
            reward_funcs=["length"],
            tools=[lookup],
        ).load()
        made = force_calls(lab.learner.tokenizer, turns - 1)
        times, tokens = {"keep": [], "prefill": []}, {}
        try:
            for mode in ("keep", "prefill"):  # warm-up: the first rollout's one-off costs are neither side's
                rollout(lab, made, mode, 0, turns)
            for repeat in range(args.repeats):
                for mode in ("keep", "prefill") if repeat % 2 == 0 else ("prefill", "keep"):
                    line, ids = rollout(lab, made, mode, repeat, turns)
                    print(json.dumps(line), flush=True)
                    times[mode].append(line["seconds"])
                    tokens.setdefault(repeat, []).append(ids)
        finally:
            lab.close()
        equal = all(torch.equal(a, b) for a, b in tokens.values())
        same = same and equal
        keep, prefill = statistics.median(times["keep"]), statistics.median(times["prefill"])
        print(json.dumps({"model": args.model, "turns": turns, "rows": args.prompts * args.generations,
                          "length": args.length, "median_s_keep": keep, "median_s_prefill": prefill,
                          "speedup": round(prefill / keep, 2), "same_tokens": equal}), flush=True)  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
