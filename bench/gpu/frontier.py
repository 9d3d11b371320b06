"""The memory frontier at scale (issue 38): the longest completion one GPU trains, grpo_lab (activation offload off and
on) beside TRL 1.16, on a random-weight model of a real 8B shape in nf4 + LoRA r 16 on all linear layers,
micro-batch 1, beta 0, loss grpo, gradient checkpointing. No rollout on either side: full-length synthetic completions
of a fixed content (grpo_lab's `generator.backend: synthetic`, TRL's generation replaced in bench/gpu/trl_synthetic.py),
so both sides do the same learner work. Lengths double until one fails; that one is run anyway (its OOM must be one
line and leave the LoRA and AdamW state bit for bit). Each length is planned first; its per-phase measured/planned is
recorded. `--cap-gib` emulates a smaller card (torch.cuda.set_per_process_memory_fraction; the plan is given the same
capacity). Each side is a process of its own under its own timeout, the sides at once (peaks are per process), every
record appended to OUT/frontier.jsonl as it comes.

    python -m bench.gpu.frontier --out $OUT --cap-gib 24                 # a GPU
    python -m bench.gpu.frontier --device cpu --model builtin:qwen2-152k --dtype float32 --lengths 16 32 \
        --generations 2 --out /tmp/f                                   # the plumbing, on the CPU (a minute)
    python -m bench.gpu.frontier --table OUT/frontier.jsonl              # the markdown table for docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GiB = 1024**3
SIDES = ("grpo_lab", "grpo_lab+offload", "trl")
PHASES = ("rollout", "logprobs", "backward", "optimizer")


def overrides(args, length: int, offload: bool) -> list[str]:
    return [
        f"model.name_or_path={args.model}",
        "model.load_in_4bit=true",
        f"model.dtype={args.dtype}",
        f"model.bnb_4bit_compute_dtype={args.dtype}",
        "model.gradient_checkpointing=true",
        f"model.activation_offload={str(offload).lower()}",
        "lora.r=16",
        "lora.lora_alpha=32",
        f"placement.learner={args.device}",
        "generator.backend=synthetic",
        f"generator.max_prompt_length={args.prompt}",
        f"generator.max_completion_length={length}",
        "grpo.prompts_per_step=1",
        f"grpo.num_generations={args.generations}",
        "grpo.micro_batch_size=1",
        "grpo.beta=0.0",
        "grpo.loss_type=grpo",
        "memory.sample_hz=20",
        *([f"placement.gpu_memory_gib={args.cap_gib}"] if args.cap_gib else []),
    ]


def emit(out: Path, record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    with open(out / "frontier.jsonl", "a") as f:  # one short line per write: appends from the sides do not interleave
        f.write(line + "\n")


def cap_memory(args) -> None:
    """Emulate a card of --cap-gib (allocations beyond it raise torch's OutOfMemoryError, as on that card)."""
    if args.cap_gib and args.device.startswith("cuda"):
        import torch

        total = torch.cuda.get_device_properties(args.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total), args.device)


def digest(model, optimizer) -> str:
    """The LoRA weights and the optimizer state, bit for bit."""
    import torch

    h = hashlib.sha256()
    tensors = [p for p in model.parameters() if p.requires_grad]
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def grpo_lab_side(args, offload: bool) -> None:
    import torch

    from bench.gpu.gpu_check import ProcessPeak, planned_phases
    from grpo_lab import Lab, load_config
    from grpo_lab.errors import LabError
    from grpo_lab.planner import plan

    side, out = ("grpo_lab+offload" if offload else "grpo_lab"), Path(args.out)
    cap_memory(args)
    peak = ProcessPeak(args.device)
    lab = Lab(load_config("tiny-cpu", overrides(args, args.lengths[0], offload))).load()
    metric = "allocated" if args.device.startswith("cuda") else "rss"
    where = args.device if args.device.startswith("cuda") else "host"
    for i, length in enumerate(args.lengths):
        lab.configure({"generator.max_completion_length": length})
        planned_devices = plan(lab.config).devices
        device_plan = planned_devices[where]
        planned = planned_phases(device_plan, metric, first_step=i == 0)
        record = {"side": side, "model": args.model, "length": length, "G": args.generations, "cap_gib": args.cap_gib}
        record["alloc"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        record["planned_peak"], record["plan_fits"] = max(planned.values()), device_plan.fits
        host = planned_devices["host"]
        record["planned_host_offload"] = sum(it.bytes for it in host.items if it.what.startswith("offloaded"))
        before = digest(lab.learner.model, lab.learner.optimizer)
        peak.peak = 0
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats(args.device)
        t0 = time.perf_counter()
        try:
            result = lab.step()
        except LabError as err:
            record.update(failed=str(err), one_line="\n" not in str(err))
            record["state_unchanged"] = digest(lab.learner.model, lab.learner.optimizer) == before
            emit(out, record)
            break
        record["seconds"] = round(time.perf_counter() - t0, 2)
        record["peak"] = peak.read()
        measured = {}
        for row in result.memory:
            if row["device"] == where and row["metric"] == metric:
                measured[row["phase"]] = max(measured.get(row["phase"], 0), row["peak"])
        record["phases"] = {p: [measured.get(p), planned.get(p)] for p in PHASES}
        offloaded = getattr(lab.learner.model, "grpo_lab_activation_offload", None)
        record["host_offloaded"] = offloaded.offloaded_bytes if offloaded else 0
        record["attn"] = lab.learner.model.config._attn_implementation
        emit(out, record)
    lab.close()


def trl_side(args) -> None:
    import gc
    import tempfile

    import torch

    from bench.gpu.trl_synthetic import trl_step_peak
    from grpo_lab import load_config
    from grpo_lab.models.learner import load_base, load_tokenizer
    from grpo_lab.models.source import resolve_model_path

    out = Path(args.out)
    cap_memory(args)
    for length in args.lengths:
        cfg = load_config("tiny-cpu", overrides(args, length, False))
        base = load_base(cfg.model, args.device, cfg.run.seed)  # the same seeded weights as grpo_lab's
        record = {"side": "trl", "model": args.model, "length": length, "G": args.generations, "cap_gib": args.cap_gib}
        record["alloc"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        with tempfile.TemporaryDirectory() as tmp:
            try:
                figures = trl_step_peak(
                    base,
                    load_tokenizer(resolve_model_path(cfg.model.name_or_path)),
                    prompt_tokens=args.prompt,
                    completion_tokens=length,
                    num_generations=args.generations,
                    lora_r=cfg.lora.r,
                    lora_alpha=cfg.lora.lora_alpha,
                    bf16=args.dtype == "bfloat16",
                    device=args.device,
                    out_dir=tmp,
                )
            except Exception as err:  # why so broad: a side that fails records why, in one line
                figures = {"failed": f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"}
        record.update(figures)
        emit(out, record)
        del base  # why: the next length builds its own base; two 8B models would not fit the capped card
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()  # why: the next length starts from an empty cache, as its own process would
        if "oom" in figures or "failed" in figures:
            break


def run_sides(args) -> None:
    """Each side in a process of its own, all at once, each under --timeout."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-m", "bench.gpu.frontier", "--side"]
    rest = sys.argv[1:]
    procs = {}
    for side in args.sides:
        log = open(out / f"frontier-{side}.log", "w")
        cmd = ["timeout", str(args.timeout), *base, side, *rest]
        procs[side] = (subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log)
    for side, (proc, log) in procs.items():
        code = proc.wait()
        log.close()
        if code:
            tail = (out / f"frontier-{side}.log").read_text().strip().splitlines()[-1:] or ["(no output)"]
            emit(out, {"side": side, "exit": code, "tail": tail[0][:300]})


def table(path: str) -> str:
    """The frontier records as a markdown table: per length, each side's peak (or its one-line failure), the plan,
    and grpo_lab's measured/planned per phase."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    lines = [
        "| side | length | peak GiB | planned GiB | plan fits | s/step | measured/planned: logprobs, backward, "
        "optimizer |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "length" not in r:
            continue
        gib = lambda b: f"{b / GiB:.2f}" if b else "-"  # noqa: E731
        if "failed" in r or "oom" in r:
            why = (r.get("failed") or r.get("oom"))[:90]
            kept = {True: "; LoRA+AdamW unchanged", False: "; STATE CHANGED", None: ""}[r.get("state_unchanged")]
            peak = f"**OOM** ({why}{kept})"
        else:
            peak = gib(r["peak"])
        ratios = ", ".join(
            f"{m / p:.2f}" if m and p else "-"
            for m, p in (r.get("phases", {}).get(ph, [None, None]) for ph in PHASES[1:])
        )
        planned = gib(r.get("planned_peak"))
        fits = {True: "fits", False: "no", None: "-"}[r.get("plan_fits")]
        lines.append(
            f"| {r['side']} | {r['length']:,} | {peak} | {planned} | {fits} | {r.get('seconds', '-')} | {ratios} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:qwen3-8b-random")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--generations", type=int, default=8, help="grpo.num_generations (micro-batch 1 either way)")
    parser.add_argument("--dtype", default="bfloat16", help="model.dtype and the 4-bit compute dtype")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--cap-gib", type=float, default=None, help="emulate a card of this many GiB")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--timeout", type=int, default=420, help="seconds per side")
    parser.add_argument("--out", default="frontier-out")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--table", help="print the markdown table of a frontier.jsonl and exit")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
    elif args.side == "trl":
        trl_side(args)
    elif args.side:
        grpo_lab_side(args, offload=args.side == "grpo_lab+offload")
    else:
        run_sides(args)


if __name__ == "__main__":
    main()
