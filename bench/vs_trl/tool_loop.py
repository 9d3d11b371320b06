"""A tool-calling rollout: grpo_lab's (generator.turn_cache keep, and prefill as the control) against TRL 1.16's
GRPOTrainer tool loop (`_generate`: `_generate_single_turn` + `_tool_call_loop`, HF generate, its defaults), in one
run: the same model, prompts, rows, seeds and forced turns on every side.

Every row calls the `lookup` tool in each of its first `--turns` - 1 turns (the call's tokens forced by one logits
processor, bench/forced.py ForcedTokens, in the same generate() calls on both sides: the random-weight body never
writes one itself), the tool answering `--answer-words` words, then answers freely to the trajectory budget
(`--length` = max_completion_length, tool tokens included). Each (side, turn count) is its own process (`--worker`),
run one after the other, so peaks never mix; a worker loads, then makes rollouts 1, 2 and 3 (no warm-up: each is
reported), seeds 1000 + rollout before each.

Tokens: the completion tokens a rollout returns, tool-result tokens included (grpo_lab: completion_mask's sum; TRL:
the lengths of `_generate`'s completion_ids), the same count on both sides; tokens/s = tokens / the rollout's wall
seconds (`lab.rollout()`; `trainer._generate(prompts)`), and per CPU second (the process's, `time.process_time`: the
machine is shared, so wall seconds follow its load; the same tokens, so ours / TRL is TRL's CPU seconds / ours).
Peak: this process's RSS (psutil, a daemon thread at 200 Hz) during the rollout less its RSS just before it (after
gc and malloc_trim, both sides). grpo_lab's side also prints
each turn's plan as it ran (planner/turns.py turn_peaks over the rollout's Rollout.turn_shapes, the largest of a
turn's generate() calls, as notebook 07's table does) against that turn's measured peak (the memory sampler's `turn k`
marks at 200 Hz: absolute RSS), planned / measured; and the plan's worst-turn rollout peak (the plan before a run).

    OMP_NUM_THREADS=1 python -m bench.vs_trl.tool_loop --turn-counts 2 --length 384 --out DIR
    OMP_NUM_THREADS=1 python -m bench.vs_trl.tool_loop --turn-counts 4 --length 512 --out DIR

(4 turns need 512 tokens: a forced call and its 8-word result take 141 of the budget per turn.)

docs/benchmarks.md "A tool-calling rollout beside TRL's tool loop" keeps the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.vs_trl.compare_trl import PeakRSS

MiB = 2**20
SIDES = ("trl", "keep", "prefill")  # TRL's GRPOTrainer; grpo_lab with generator.turn_cache keep / prefill
PROMPTS = ["Look up the word 'river' and use it in a sentence.", "What does the word 'lantern' mean? Look it up."]


class RSSPeak(PeakRSS):
    """compare_trl's RSS sampler (a daemon thread at `hz`), with `start()` resetting the peak to the RSS then."""

    def __init__(self, hz: float = 200):
        super().__init__(hz)
        self.base = self.peak

    def start(self) -> None:
        from grpo_lab.memory.heap import trim_host_heap

        gc.collect()
        trim_host_heap()  # why: both sides start each rollout from a trimmed heap, so the rise is the rollout's
        self.base = self.peak = self.now()
        self.cpu = time.process_time()  # (the process's CPU seconds: wall time on a shared machine follows its load)

    def rise(self) -> int:
        return max(self.peak, self.now()) - self.base


def lab_config(args, mode: str) -> dict:
    return {
        "model": {"name_or_path": args.model, "dtype": "float32", "bnb_4bit_compute_dtype": "float32",
                  "chat_template": "trl:qwen2_5"},
        "generator": {"max_completion_length": args.length, "max_prompt_length": 1024, "temperature": 1.0,
                      "max_tool_calling_iterations": args.turns - 1, "turn_cache": mode},
        "grpo": {"num_generations": args.generations, "prompts_per_step": len(PROMPTS), "beta": 0.0},
        "data": {"system_prompt": None},
        "memory": {"sample_hz": 200},  # (each turn's mark peak, as bench/plan_accuracy/turn_plan.py reads it)
    }  # fmt: skip


def rows() -> list[dict]:
    return [{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS]


def line(args, side, index, seconds, tokens, model_tokens, prompt_tokens, turns, rss: RSSPeak) -> dict:
    return {"side": side, "turns": args.turns, "rollout": index, "seconds": round(seconds, 3), "tokens": tokens,
            "model_tokens": model_tokens, "tokens_per_s": round(tokens / seconds, 1), "prompt_tokens": prompt_tokens,
            "turns_mean": turns, "rss_base_mib": round(rss.base / MiB, 1),
            "peak_over_base_mib": round(rss.rise() / MiB, 1), "cpu_seconds": round(time.process_time() - rss.cpu, 3),
            "load_average_1min": round(os.getloadavg()[0], 2)}  # fmt: skip


def turn_peaks(lab) -> dict:
    """Each mark's (turn 1, tools 1, turn 2, ...) peak host RSS in the last rollout, in MiB."""
    return {
        r["mark"]: round(r["peak"] / MiB, 1)
        for r in lab.memory.mark_rows(lab.step_index)
        if r["device"] == "host" and r["metric"] == "rss"
    }


def turn_plans(plan, shapes: list[dict]) -> dict:
    """Each turn's plan as it ran ({"turn k": MiB}): planner/turns.py turn_peaks over the turn's generate() calls'
    shapes (Rollout.turn_shapes), the largest (grpo_lab/ui/story.py ran_peaks_mib's rule)."""
    from grpo_lab.planner.turns import Turn
    from grpo_lab.planner.turns import turn_peaks as planned_turns

    out: dict[str, float] = {}
    for s in shapes:
        turn = Turn(int(s["mark"].split()[1]), s["rows"], s["prefill"], s["context"], s["decode"])
        out[s["mark"]] = max(out.get(s["mark"], 0.0), planned_turns(plan, [turn])[0] / MiB)
    return {mark: round(mib, 1) for mark, mib in out.items()}


def ours(args, rss: RSSPeak) -> None:
    from bench.probes.turn_cache import ANSWER_WORDS, force_calls, lookup
    from grpo_lab import Lab
    from grpo_lab.planner import plan

    ANSWER_WORDS[0] = args.answer_words
    lab = Lab(lab_config(args, args.worker), reward_funcs=["length"], train_dataset=rows(), tools=[lookup]).load()
    made = force_calls(lab.learner.tokenizer, args.turns - 1)
    for index in (1, 2, 3):
        made.clear()
        seed(1000 + index)
        rss.start()
        start = time.perf_counter()
        out = lab.rollout()
        seconds = time.perf_counter() - start
        prompt_lengths = out.prompt_mask.sum(1)
        planned = plan(lab.config, prompt_tokens=int(prompt_lengths.max()), tools=True)
        planned_peak = planned.devices["host"].phase_peak("rollout") / MiB
        peaks, as_run = turn_peaks(lab), turn_plans(planned, out.turn_shapes)
        record = line(args, args.worker, index, seconds, int(out.completion_mask.sum()),
                      int((out.completion_mask * out.tool_mask).sum()), int(prompt_lengths.sum()),
                      sum(out.turns) / len(out.turns), rss)  # fmt: skip
        record |= {"generate_calls": len(made), "turn_peaks_mib": peaks, "turn_plans_mib": as_run,
                   "plan_over_measured": {m: round(as_run[m] / peaks[m], 3) for m in as_run},
                   "planned_rollout_peak_mib": round(planned_peak, 1),
                   "worst_plan_over_measured": {m: round(planned_peak / peaks[m], 3) for m in as_run}}  # fmt: skip
        print(json.dumps(record), flush=True)
    lab.close()


def seed(value: int) -> None:
    import torch

    torch.manual_seed(value)


def trl_trainer(args, out_dir: str):
    """TRL 1.16's GRPOTrainer at its defaults but for what must match grpo_lab's side (model, LoRA, lengths,
    temperature, rows, the tool and its turns): HF generate."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from bench.probes.turn_cache import lookup
    from grpo_lab import load_config
    from grpo_lab.models.learner import load_base, load_tokenizer
    from grpo_lab.models.source import check_model_path
    from grpo_lab.tools.template import template_text

    cfg = load_config(lab_config(args, "keep"))
    tokenizer = load_tokenizer(check_model_path(cfg.model.name_or_path))
    tokenizer.chat_template = template_text(cfg.model.chat_template)
    rows_per_rollout = len(PROMPTS) * args.generations
    config = GRPOConfig(
        output_dir=out_dir, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True, bf16=False,
        per_device_train_batch_size=rows_per_rollout, num_generations=args.generations,
        max_completion_length=args.length, temperature=1.0, beta=0.0,
        max_tool_calling_iterations=args.turns - 1, gradient_checkpointing=cfg.model.gradient_checkpointing,
    )  # fmt: skip
    lora = cfg.lora
    return GRPOTrainer(
        model=load_base(cfg.model, "cpu"),
        args=config,
        train_dataset=Dataset.from_list(rows()),
        processing_class=tokenizer,
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        tools=[lookup],
        peft_config=LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                               target_modules=lora.target_modules, task_type="CAUSAL_LM"),
    )  # fmt: skip


def force_trl(trainer, calls: int) -> list:
    """TRL's generate() call t < `calls` of a rollout writes the tool call in every row (as force_calls does
    grpo_lab's); returns the list of the rollout's calls (cleared before each rollout)."""
    from transformers import LogitsProcessorList

    from bench.forced import ForcedTokens
    from bench.probes.turn_cache import CALL

    ids = trainer.processing_class(CALL, add_special_tokens=False)["input_ids"]
    model, made = trainer.model, []
    original = model.generate

    def generate(*a, **kw):
        made.append(1)
        if len(made) <= calls:
            kw["logits_processor"] = LogitsProcessorList([ForcedTokens(ids)])
        return original(*a, **kw)

    model.generate = generate  # (TRL's unwrap_model_for_generation hands back this very model on one CPU process)
    return made


def theirs(args, rss: RSSPeak) -> None:
    from bench.probes.turn_cache import ANSWER_WORDS

    ANSWER_WORDS[0] = args.answer_words
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trl_trainer(args, tmp)
        made = force_trl(trainer, args.turns - 1)
        prompts = [r["prompt"] for r in rows() for _ in range(args.generations)]  # TRL's RepeatSampler's order
        trainer.model.train()  # as in a training step: TRL generates inside training_step
        # the per-row tool dicts _generate_and_score_completions builds before it calls _generate (standalone tools)
        trainer._sync_tool_dicts = [{t.__name__: t for t in trainer.tools} for _ in prompts]
        trainer._async_tool_dicts = [{} for _ in prompts]
        for index in (1, 2, 3):
            made.clear()
            seed(1000 + index)
            rss.start()
            start = time.perf_counter()
            prompt_ids, completion_ids, tool_mask, completions, *_ = trainer._generate(prompts)
            seconds = time.perf_counter() - start
            turns = [sum(m.get("role") == "assistant" for m in c) for c in completions]
            record = line(args, "trl", index, seconds, sum(map(len, completion_ids)), sum(map(sum, tool_mask)),
                          sum(map(len, prompt_ids)), sum(turns) / len(turns), rss)  # fmt: skip
            print(json.dumps(record | {"generate_calls": len(made)}), flush=True)


def summary(lines: list[dict], turns: int) -> dict:
    """Per side the three rollouts' tokens/s and peaks; ours/TRL per rollout."""
    by = {s: sorted((r for r in lines if r["side"] == s and r["turns"] == turns), key=lambda r: r["rollout"])
          for s in SIDES}  # fmt: skip
    out = {"turns": turns}
    for side in ("keep", "prefill"):
        pairs = list(zip(by[side], by["trl"]))
        out[f"{side}_over_trl_tokens_per_s"] = [round(a["tokens_per_s"] / b["tokens_per_s"], 2) for a, b in pairs]
        out[f"{side}_over_trl_tokens_per_cpu_s"] = [round(b["cpu_seconds"] / a["cpu_seconds"], 2) for a, b in pairs]
        out[f"{side}_over_trl_peak"] = [
            round(a["peak_over_base_mib"] / b["peak_over_base_mib"], 2) if b["peak_over_base_mib"] > 0 else None
            for a, b in pairs
        ]
    out["plan_over_measured_keep"] = [r.get("plan_over_measured") for r in by["keep"]]
    out["same_tokens_count"] = len({r["tokens"] for s in SIDES for r in by[s]}) == 1  # (a free EOS can differ)
    out["turns_made"] = all(r["turns_mean"] == turns for s in SIDES for r in by[s])  # the forced calls took
    return out


def run_worker(args, side: str, turns: int) -> list[dict]:
    command = [sys.executable, "-m", "bench.vs_trl.tool_loop", "--worker", side, "--turns", str(turns),
               "--model", args.model, "--length", str(args.length), "--answer-words", str(args.answer_words),
               "--generations", str(args.generations)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"worker {side} turns={turns} failed:\n{done.stderr[-3000:]}")
    return [json.loads(s) for s in done.stdout.splitlines() if s.startswith("{")]


def orchestrate(args) -> int:
    out = Path(args.out) if args.out else None
    lines, summaries = [], []
    for n, turns in enumerate(args.turn_counts):
        for side in SIDES if n % 2 == 0 else SIDES[::-1]:  # alternated: neither side always runs first
            for record in run_worker(args, side, turns):
                print(json.dumps(record), flush=True)
                lines.append(record)
        summaries.append(summary(lines, turns))
        print(json.dumps(summaries[-1]), flush=True)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        meta = {"command": "python -m bench.vs_trl.tool_loop " + " ".join(sys.argv[1:]), "model": args.model,
                "length": args.length, "rows": len(PROMPTS) * args.generations, "answer_words": args.answer_words,
                "load_average": os.getloadavg()}  # fmt: skip
        name = f"tool_loop_{'_'.join(map(str, args.turn_counts))}turns_len{args.length}.jsonl"
        with open(out / name, "w") as f:
            for record in [meta] + lines + summaries:
                f.write(json.dumps(record) + "\n")
    table(lines, args.turn_counts)
    return 0 if all(s["turns_made"] for s in summaries) else 1


def table(lines: list[dict], turn_counts: list[int]) -> None:
    """The markdown rows of docs/benchmarks.md: per turn count and rollout, each side's tokens/s and peak rise, and
    keep's plan / measured per turn (the turn's plan as it ran)."""
    print(
        "| turns | rollout | tokens/s TRL / keep / prefill | keep / TRL | peak over base MiB TRL / keep / prefill "
        "| keep / TRL | plan / measured per turn (keep) |"
    )
    print("|---|---|---|---|---|---|---|")
    for turns in turn_counts:
        for index in (1, 2, 3):
            r = {x["side"]: x for x in lines if x["turns"] == turns and x["rollout"] == index}
            speed = [r[s]["tokens_per_s"] for s in SIDES]
            peak = [r[s]["peak_over_base_mib"] for s in SIDES]
            ratios = r["keep"]["plan_over_measured"].values()
            print(
                f"| {turns} | {index} | {' / '.join(map(str, speed))} | {speed[1] / speed[0]:.2f} | "
                f"{' / '.join(map(str, peak))} | {peak[1] / peak[0]:.2f} | {min(ratios):.2f}-{max(ratios):.2f} |"
            )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:qwen2-152k")
    parser.add_argument("--turn-counts", type=int, nargs="+", default=[2, 4], help="turns a row makes (calls + 1)")
    parser.add_argument("--length", type=int, default=160, help="max_completion_length, tool tokens included")
    parser.add_argument("--answer-words", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4, help="rows per prompt (2 prompts)")
    parser.add_argument("--out", help="write the raw lines here (a directory)")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--turns", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker:
        return orchestrate(args)
    import warnings

    warnings.filterwarnings("ignore")
    rss = RSSPeak()
    theirs(args, rss) if args.worker == "trl" else ours(args, rss)
    return 0


if __name__ == "__main__":
    sys.exit(main())
