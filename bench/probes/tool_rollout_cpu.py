"""Where a tool-calling rollout's CPU time goes: bench/vs_trl/tool_loop.py's grpo_lab side alone (builtin:qwen2-152k,
8 rows, 2 turns, every row's tool call forced in the first), three rollouts per process, each timed by the main
thread's CPU seconds (`time.thread_time`) split by forward hooks and a wrapped logits processor into the LM head, the
decoder body, the decoding step's processors (generation/sampling.py DecodeStep: the sampler and the log-prob
recorder) and the rest of generate() (its float32 copy of the logits where one is made, its argmax, the KV cache's
concatenations, the tool calls); beside them the other threads' CPU seconds (the process's less the main thread's:
the memory sampler) and the minor page faults, the rollout's and each part's. Each `--glibc` setting runs in its own
process: `default` (glibc's own heap), `kept` (GLIBC_TUNABLES mmap threshold 32 MiB, trim threshold 64 MiB: freed
[rows, vocab] blocks stay mapped for the next step). `--sides trl`: TRL's tool loop as the bench runs it, the same
hooks on the same model (its sampling, transformers' softmax and multinomial, falls in the rest of generate()). One
JSON line per rollout.

    OMP_NUM_THREADS=1 python -m bench.probes.tool_rollout_cpu --glibc default
    OMP_NUM_THREADS=1 python -m bench.probes.tool_rollout_cpu --sides trl --glibc default

docs/benchmarks.md "A tool-calling rollout beside TRL's tool loop (CPU)" keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

TUNABLES = {"default": None, "kept": "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=67108864"}


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Clock:
    """Main-thread CPU seconds and the process's minor faults inside labelled spans (spans do not nest here: the head
    and body are siblings)."""

    def __init__(self):
        self.spent: dict[str, float] = {}
        self.faults: dict[str, int] = {}
        self.started: dict[str, tuple[float, int]] = {}

    def begin(self, label: str) -> None:
        self.started[label] = (time.thread_time(), minor_faults())

    def end(self, label: str) -> None:
        began, faulted = self.started.pop(label)
        self.spent[label] = self.spent.get(label, 0.0) + time.thread_time() - began
        self.faults[label] = self.faults.get(label, 0) + minor_faults() - faulted

    def hook(self, module, label: str) -> None:
        module.register_forward_pre_hook(lambda *a: self.begin(label))
        module.register_forward_hook(lambda *a: self.end(label))


def instrument(model, clock: Clock) -> None:
    from grpo_lab.generation import sampling

    clock.hook(model.get_output_embeddings(), "lm_head")
    clock.hook(model.get_base_model().model, "body")
    call = sampling.DecodeStep.__call__

    def timed(self, input_ids, scores):
        clock.begin("decode_step")
        try:
            return call(self, input_ids, scores)
        finally:
            clock.end("decode_step")

    sampling.DecodeStep.__call__ = timed


def ours(ns):
    """(model, the rollout: () -> completion tokens, the forced calls' list) of grpo_lab's side."""
    from bench.probes.turn_cache import force_calls, lookup
    from bench.vs_trl.tool_loop import lab_config, rows
    from grpo_lab import Lab

    lab = Lab(lab_config(ns, "keep"), reward_funcs=["length"], train_dataset=rows(), tools=[lookup]).load()
    return lab.learner.model, lambda: int(lab.rollout().completion_mask.sum()), force_calls(lab.learner.tokenizer, 1)


def theirs(ns, tmp: str):
    """The same of TRL's tool loop, as bench/vs_trl/tool_loop.py's `theirs` runs it (its sampling falls in the rest
    of generate(): transformers' softmax and multinomial)."""
    from bench.vs_trl.tool_loop import force_trl, rows, trl_trainer

    trainer = trl_trainer(ns, tmp)
    made = force_trl(trainer, 1)
    prompts = [r["prompt"] for r in rows() for _ in range(ns.generations)]  # TRL's RepeatSampler's order
    trainer.model.train()
    trainer._sync_tool_dicts = [{t.__name__: t for t in trainer.tools} for _ in prompts]
    trainer._async_tool_dicts = [{} for _ in prompts]
    return trainer.model, lambda: sum(map(len, trainer._generate(prompts)[1])), made


def worker(setting: str, length: int, side: str) -> None:
    import tempfile

    import torch

    from bench.probes.turn_cache import ANSWER_WORDS

    ANSWER_WORDS[0] = 8  # bench/vs_trl/tool_loop.py's --answer-words
    ns = argparse.Namespace(model="builtin:qwen2-152k", length=length, turns=2, generations=4)
    tmp = tempfile.TemporaryDirectory()
    model, rollout, made = ours(ns) if side == "keep" else theirs(ns, tmp.name)
    clock = Clock()
    instrument(model, clock)
    for index in (1, 2, 3):
        made.clear()
        torch.manual_seed(1000 + index)
        clock.spent, clock.faults = {}, {}
        faults = minor_faults()
        thread, process = time.thread_time(), time.process_time()
        tokens = rollout()
        thread, process = time.thread_time() - thread, time.process_time() - process
        parts = {k: round(v, 3) for k, v in clock.spent.items()}
        line = {"side": side, "glibc": setting, "rollout": index, "tokens": tokens,
                "main_thread_cpu_s": round(thread, 3), "parts_cpu_s": parts,
                "rest_of_generate_cpu_s": round(thread - sum(clock.spent.values()), 3),
                "other_threads_cpu_s": round(process - thread, 3), "process_cpu_s": round(process, 3),
                "minor_faults": minor_faults() - faults, "parts_minor_faults": clock.faults,
                "load_average_1min": round(os.getloadavg()[0], 2)}  # fmt: skip
        print(json.dumps(line), flush=True)
    tmp.cleanup()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--glibc", nargs="+", choices=sorted(TUNABLES), default=["default", "kept"])
    parser.add_argument("--length", type=int, default=384)
    parser.add_argument("--sides", nargs="+", choices=["keep", "trl"], default=["keep"])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--side", default="keep", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.length, args.side)
        return 0
    for side, setting in [(side, setting) for side in args.sides for setting in args.glibc]:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if TUNABLES[setting]:
            env["GLIBC_TUNABLES"] = TUNABLES[setting]
        command = [sys.executable, "-m", "bench.probes.tool_rollout_cpu", "--worker", setting, "--length",
                   str(args.length), "--side", side]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise SystemExit(f"worker {side} {setting} failed:\n{done.stderr[-3000:]}")
        print("\n".join(s for s in done.stdout.splitlines() if s.startswith("{")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
