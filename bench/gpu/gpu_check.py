"""The GPU check (issue 33): every GPU figure in one command, each part in a process of its own under its own timeout,
printed and appended to OUT/gpu_check.jsonl as it comes (a part that times out loses only itself).

    python -m bench.gpu.gpu_check --out $OUT       # a GPU machine: 374 s on one H100 (2026-11-26), imports included
    python -m bench.gpu.gpu_check --device cpu --model builtin:qwen2-152k --lengths 16 32 --steps 1 --warmup 0 \
        --skip-smoke --out /tmp/check          # a dry run of the plumbing on the CPU (tests/test_gpu_check.py)

On a machine without a GPU, and not asked for the CPU dry run (`--device cpu`), it runs nothing and writes nothing: one
line per part, each saying it is skipped (no GPU here), and exit 0.

On a bare GPU machine here, build the packages it lacks first (`../shared/gpu/site.sh`) and start the command with
the `export PYTHONPATH=... GRPO_LAB_CACHE=... HF_HUB_OFFLINE=1` its header gives.

Parts:
1. smoke: bench/gpu/gpu_smoke.py's paths (learner on cuda:0, NVML by UUID, a real CUDA OOM rolled back, CUDA RNG, ...).
2. side by side: grpo_lab and TRL 1.16's GRPOTrainer at each completion length (`--lengths`, 256 and 1,024), each
   side in its own process (a length's processes run at once: peaks are per process; `--serial` one at a time), on
   a random-weight model of Qwen2.5-0.5B's shape (vocabulary 151,936) in nf4 + LoRA r 8
   on all linear layers, 1 prompt x 8 completions, beta 0, loss grpo, gradient checkpointing, the HF generator.
   Figures: the peak allocated over the whole process (torch's max_memory_allocated, kept across the Lab's own
   per-phase peak resets), seconds per step after `--warmup` steps, and the rollout's tokens per second.
3. the plan: each grpo_lab process's per-phase allocated peaks beside `plan(cfg)`'s per-phase peak on the device.
`--common KEY=VALUE,...` sets overrides for every run, each side's (issue 70: `lora.target_experts=true`); the side
`trl_experts` is TRL given a mixture of experts as it loads one, with LoRA on its experts (bench/gpu/trl_side.py).
`--variant LABEL:KEY=VALUE,...` adds a grpo_lab run with those overrides; on a GPU, by default, the hf rollout's other
decode paths (generator.hf_decode static, compiled and merged: the first compiled rollout compiles, so at 1,024 tokens,
with no warm-up step, its one step includes the compile). Each grpo_lab record has the step's sampler-learner log-prob
mismatch (`logprob_mismatch`, the metric the lab logs), per decode path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024**2
LONG = 256  # completion lengths above this are "long": no warm-up step, --timeout-long, --long-only runs
TRL_SIDES = ("trl", "trl_experts")  # the sides a grpo_lab run's peak is read against
PHASES = ("rollout", "rewards", "advantages", "logprobs", "backward", "optimizer", "sync")


def base_overrides(model: str, device: str, length: int) -> list[str]:
    """The side-by-side config (the module docstring), as --set overrides of the tiny-cpu preset."""
    return [
        f"model.name_or_path={model}",
        "model.load_in_4bit=true",
        "model.dtype=bfloat16",
        "model.bnb_4bit_compute_dtype=bfloat16",
        "model.gradient_checkpointing=true",
        "lora.r=8",
        "lora.lora_alpha=16",
        f"placement.learner={device}",
        "generator.backend=hf",
        "generator.max_prompt_length=128",
        f"generator.max_completion_length={length}",
        "grpo.prompts_per_step=1",
        "grpo.num_generations=8",
        "grpo.micro_batch_size=8",
        "grpo.beta=0.0",
        "grpo.loss_type=grpo",
        "memory.sample_hz=50",
    ]


def cap_card(cfg) -> None:
    """`--cap-gib`: the learner's GPU held to placement.gpu_memory_gib (a 24 GiB card on an 80-141 GiB one): torch's
    allocator refuses past it, as that card would (set_per_process_memory_fraction); the plan reads the same capacity
    from the config. Both sides call it before anything loads."""
    gib, device = cfg.placement.gpu_memory_gib, cfg.placement.learner
    if gib is None or not device.startswith("cuda"):
        return
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), device)


class ProcessPeak:
    """torch's allocated peak over the whole process: the Lab resets the peak at every phase (memory/readers.py), so
    each reset first folds the peak so far into this one."""

    def __init__(self, device: str):
        import torch

        self.device, self.peak, self.on_cuda = device, 0, device.startswith("cuda")
        if not self.on_cuda:
            import psutil

            self.process = psutil.Process()
            return
        reset = torch.cuda.reset_peak_memory_stats

        def folding_reset(dev=None):
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(dev))
            reset(dev)

        torch.cuda.reset_peak_memory_stats = folding_reset

    def read(self) -> int:
        """The peak so far: allocated on a GPU; on the CPU (a dry run), the process's peak RSS (Linux: ru_maxrss)."""
        if self.on_cuda:
            import torch

            return max(self.peak, torch.cuda.max_memory_allocated(self.device))
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def grpo_lab_worker(overrides: list[str], steps: int, warmup: int) -> dict:
    from grpo_lab import Lab, load_config
    from grpo_lab.planner import plan

    cfg = load_config("tiny-cpu", overrides)
    cap_card(cfg)
    device = cfg.placement.learner
    peak = ProcessPeak(device)
    planned = plan(cfg).devices["host" if device == "cpu" else device]
    metric = "rss" if device == "cpu" else "allocated"
    lab = Lab(cfg).load()
    at_load = device_figures(device)  # why: the plan's resident lines (weights, context) against what loading took
    from bench.gpu.trl_side import adapter_facts

    facts = adapter_facts(lab.learner.model)  # what it trains (issue 70: the expert adapters)
    seconds, rollout_tps, phases, every, mismatch = [], [], {}, {}, []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        result = lab.step()
        elapsed = time.perf_counter() - t0
        if i < warmup:
            continue
        seconds.append(elapsed)
        mismatch.append(result.logprob_mismatch)
        tokens = result.completion_length_mean * cfg.grpo.prompts_per_step * cfg.grpo.num_generations
        rollout_tps.append(tokens / max(result.phase_seconds.get("rollout", 0.0), 1e-9))
        for row in result.memory:
            if row["device"] == ("host" if device == "cpu" else device):
                every.setdefault(row["metric"], {})
                every[row["metric"]][row["phase"]] = max(every[row["metric"]].get(row["phase"], 0), row["peak"])
        phases = every.get(metric, {})
    lab.close()
    return {
        "seconds": seconds,
        "peak": peak.read(),
        "rollout_tokens_per_s": rollout_tps,
        "logprob_mismatch": mismatch,
        "phase_peaks": phases,
        "planned": planned_phases(planned, metric, first_step=warmup + steps == 1),
        "planned_total": planned.total,
        "planned_items": [(i.what, i.bytes, i.phase) for i in planned.items],
        "at_load": at_load,
        "phase_peaks_every_metric": every,
        "metric": metric,
        **facts,
    }


# a Lab's first step has no AdamW moments before its optimizer phase and no gradients before its backward
NOT_YET = {p: ("LoRA gradients", "AdamW moments") for p in ("rollout", "rewards", "advantages", "logprobs")}


def planned_phases(device_plan, metric: str, first_step: bool) -> dict:
    """Each phase's planned peak in `metric`'s terms: torch's allocated bytes leave out the CUDA context
    (DevicePlan.allocated_peak); a run of one step is its first, so the lines it cannot hold yet are left out."""
    peak = device_plan.allocated_peak if metric == "allocated" else device_plan.phase_peak
    out = {}
    for phase in PHASES:
        missing = NOT_YET.get(phase, ()) if first_step else ()
        out[phase] = peak(phase) - sum(i.bytes for i in device_plan.items if i.phase is None and i.what in missing)
    return out


def replan(record: dict, model: str, device: str, gpu_gib: float = 80.0) -> dict:
    """A recorded run's per-phase plan from today's planner (the same overrides; the capacity given, so a machine
    without the GPU plans for it): how a change to the plan's GPU terms reads against measured figures."""
    from grpo_lab.planner import plan

    cfg = replan_config(record, model, device, gpu_gib)
    first = len(record.get("seconds", [])) == 1 and record["length"] > LONG  # a long run's one step is its first
    return planned_phases(plan(cfg).devices[device], record.get("metric", "allocated"), first)


def replan_config(record: dict, model: str, device: str, gpu_gib: float = 80.0):
    """The config a recorded run ran with (its length and overrides) for `model` on `device` of `gpu_gib` GiB."""
    from grpo_lab import load_config

    overrides = base_overrides(model, device, record["length"]) + record.get("common", []) + record.get("overrides", [])
    return load_config("tiny-cpu", overrides + [f"placement.gpu_memory_gib={gpu_gib}"])


def device_figures(device: str) -> dict:
    """torch's allocated and reserved bytes on `device`, and NVML's used bytes for the whole GPU (the CUDA context and
    every other process's memory included); {} off CUDA."""
    if not device.startswith("cuda"):
        return {}
    import torch

    from grpo_lab.runtime import nvml_handle

    figures = {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device)}
    try:
        import pynvml

        figures["nvml_used"] = int(pynvml.nvmlDeviceGetMemoryInfo(nvml_handle(torch.device(device).index)).used)
    except Exception as err:  # why so broad: a figure that cannot be read must not lose the others
        figures["nvml_error"] = str(err)[:200]
    return figures


def context_worker(overrides: list[str], steps: int, warmup: int) -> dict:
    """The plan's GPU terms outside the model, alone on the GPU: NVML's used bytes before CUDA starts, after
    (the context), torch's allocated bytes after a 16-bit and a float32 matmul (cuBLAS's workspaces come from torch's
    allocator), and after a 4-bit matmul (bitsandbytes' dequantization)."""
    import pynvml
    import torch

    from grpo_lab.runtime import nvml_handle

    pynvml.nvmlInit()
    first = pynvml.nvmlDeviceGetHandleByIndex(0)
    used = lambda: int(pynvml.nvmlDeviceGetMemoryInfo(first).used)  # noqa: E731
    figures = {"nvml_before": used()}
    torch.cuda.init()
    torch.empty(1, device="cuda:0")
    figures["nvml_context"] = used()
    figures["same_gpu"] = nvml_handle(0) is not None
    a = torch.randn(1024, 1024, device="cuda:0", dtype=torch.bfloat16)
    base = torch.cuda.memory_allocated(0)
    (a @ a).sum().item()
    figures["after_bf16_matmul"] = torch.cuda.memory_allocated(0) - base
    b = a.float()
    base = torch.cuda.memory_allocated(0)
    (b @ b).sum().item()
    figures["after_fp32_matmul"] = torch.cuda.memory_allocated(0) - base
    x = torch.randn(2, 1024, 1024, device="cuda:0", dtype=torch.bfloat16, requires_grad=True)
    (x @ a).float().sum().backward()  # a batched matmul and its backward: cuBLASLt's workspace, if it takes one
    figures["after_backward"] = torch.cuda.memory_allocated(0) - base
    try:
        import bitsandbytes as bnb

        layer = bnb.nn.Linear4bit(1024, 1024, compute_dtype=torch.bfloat16, quant_type="nf4").cuda()
        base = torch.cuda.memory_allocated(0)
        torch.cuda.reset_peak_memory_stats(0)
        layer(torch.randn(64, 1024, device="cuda:0", dtype=torch.bfloat16)).sum().item()
        figures["nf4_matmul_peak_over_base"] = torch.cuda.max_memory_allocated(0) - base
    except Exception as err:  # why so broad: a figure that cannot be read must not lose the others
        figures["nf4_error"] = str(err)[:200]
    figures["nvml_end"] = used()
    figures["reserved_end"] = torch.cuda.memory_reserved(0)
    figures["allocated_end"] = torch.cuda.memory_allocated(0)
    return figures


from bench.gpu.trl_side import trl_experts_worker, trl_worker  # noqa: E402 (after ProcessPeak and cap_card, it reads)

WORKERS = {"grpo_lab": grpo_lab_worker, "trl": trl_worker, "trl_experts": trl_experts_worker, "context": context_worker}


def run_part(out: Path, part: dict, cmd: list[str], timeout: int) -> dict:
    """One part in a process of its own; its record (the worker's JSON line, or why not) is printed and appended."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            tail = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or ["(no output)"])[-1]
            record = {**part, "failed": f"exit {proc.returncode}: {tail[:300]}", "stdout": proc.stdout[-2000:]}
        else:
            record = {**part, **json.loads(lines[-1])}
    except subprocess.TimeoutExpired as err:
        record = {**part, "failed": f"timed out after {timeout} s", "stdout": (err.stdout or b"")[-2000:].decode()}
    record["process_seconds"] = round(time.perf_counter() - t0, 1)
    with open(out / "gpu_check.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    print(describe(record), flush=True)
    return record


def describe(r: dict) -> str:
    name = f"{r['part']}" + (f" {r['side']} L={r['length']}" if "side" in r else "")
    if "failed" in r:
        return f"{name:<34} FAILED {r['failed']} ({r['process_seconds']} s)"
    if r["part"] == "context":
        return f"{name:<34} measured ({r['process_seconds']} s)"
    if r["part"] == "smoke":
        return f"{name:<34} {r['summary']} ({r['process_seconds']} s)"
    secs = f"{statistics.median(r['seconds']):.2f} s/step" if r.get("seconds") else "no timed step"
    return f"{name:<34} peak {r['peak'] / MiB:,.0f} MiB, {secs} ({r['process_seconds']} s)"


def smoke(out: Path, timeout: int) -> dict:
    """bench/gpu/gpu_smoke.py in a process of its own: its lines, printed and kept."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.gpu.gpu_smoke"], cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
        record = {"part": "smoke", "summary": f"exit {proc.returncode}", "lines": proc.stdout.splitlines()}
        if proc.returncode and not proc.stdout.strip():
            record["failed"] = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
    except subprocess.TimeoutExpired:
        record = {"part": "smoke", "failed": f"timed out after {timeout} s", "lines": []}
    record["process_seconds"] = round(time.perf_counter() - t0, 1)
    with open(out / "gpu_check.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    print(describe(record), flush=True)
    for line in record["lines"]:
        print("    " + line, flush=True)
    return record


def table(records: list[dict]) -> str:
    """Markdown: each length's grpo_lab and TRL peaks and s/step, their ratio; then per-phase measured vs planned."""
    rows = [
        "| length | side | peak (MiB) | s/step | rollout tok/s | peak / TRL | log-prob mismatch |",
        "|---|---|---|---|---|---|---|",
    ]
    trl = {r["length"]: r for r in records if r.get("side") in TRL_SIDES and "failed" not in r}
    for r in records:
        if "side" not in r:
            continue
        if "failed" in r:
            rows.append(f"| {r['length']} | {r['side']} | {r['failed']} | | | | |")
            continue
        ratio = f"{r['peak'] / trl[r['length']]['peak']:.2f}" if r["length"] in trl else ""
        secs = f"{statistics.median(r['seconds']):.2f}" if r["seconds"] else ""
        tps = f"{statistics.median(r['rollout_tokens_per_s']):.0f}" if r.get("rollout_tokens_per_s") else ""
        mismatch = f"{statistics.median(r['logprob_mismatch']):.2e}" if r.get("logprob_mismatch") else ""
        rows.append(f"| {r['length']} | {r['side']} | {r['peak'] / MiB:,.0f} | {secs} | {tps} | {ratio} | {mismatch} |")
    rows += [
        "",
        "| length | side | phase | measured (MiB) | planned (MiB) | measured / planned |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        for phase, measured in sorted(r.get("phase_peaks", {}).items(), key=lambda kv: PHASES.index(kv[0])):
            planned = r["planned"].get(phase) or 0
            ratio = f"{measured / planned:.2f}" if planned else ""
            rows.append(
                f"| {r['length']} | {r['side']} | {phase} | {measured / MiB:,.0f} | {planned / MiB:,.0f} | {ratio} |"
            )
    return "\n".join(rows)


def side_by_side_runs(args) -> list[tuple[str, str, list[str]]]:
    """(label, side, extra overrides) of each side-by-side process at a length: the sides, then the `--variant`s (on a
    GPU, by default, the hf rollout's other decode paths)."""
    runs = [(side, side, []) for side in args.sides]
    if not args.variant and not args.no_variants and args.device.startswith("cuda") and "grpo_lab" in args.sides:
        # the hf rollout's decode paths (generator.hf_decode), measured beside today's: issue 33's "choose and say why"
        args.variant = [
            "static:generator.hf_decode=static",
            "compiled:generator.hf_decode=compiled",
            "merged:generator.hf_decode=merged",  # issue 39: the rollout copy (LoRA merged, 16-bit), CUDA graphs on it
            "trl_head:grpo.logprob_head=trl",
        ]
    for spec in args.variant:
        label, _, sets = spec.partition(":")
        runs.append((label, "grpo_lab", [s for s in sets.split(",") if s]))
    return runs


def skipped_parts(args, runs: list[tuple[str, str, list[str]]]) -> list[str]:
    """On a machine without a GPU (and no `--device cpu`): a line for the check, then one per part it would have run,
    each saying what it skipped and why; nothing is run or written."""
    parts = [("context", "the CUDA context's NVML and allocated bytes, alone on the GPU")]
    if not args.skip_smoke:
        parts.append(("smoke", "bench/gpu/gpu_smoke.py's CUDA paths"))
    for length in args.lengths:
        for label, side, _ in runs:
            if not (label in args.long_only and length <= LONG):
                parts.append((f"side_by_side {label} L={length}", f"{side}'s peak allocated, s/step, rollout tokens/s"))
    if any(side == "grpo_lab" for _, side, _ in runs):
        parts.append(("plan", "each grpo_lab process's per-phase allocated peaks beside plan(cfg)"))
    head = f"gpu_check: {args.device} asked, torch.cuda.is_available() is False: nothing run, nothing written"
    return [f"{head} (a dry run on the CPU: --device cpu)"] + [
        f"{name:<34} skipped: {what} (no GPU here)" for name, what in parts
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results" / "gpu_check")))
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--model", default="builtin:qwen2.5-0.5b-random")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=1, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=1, help="steps per process before the timed ones")
    parser.add_argument("--timeout", type=int, default=170, help="seconds per side-by-side process at <= 256 tokens")
    parser.add_argument("--timeout-long", type=int, default=260, help="seconds per side-by-side process, longer")
    parser.add_argument("--smoke-timeout", type=int, default=200, help="seconds for the smoke's paths")
    parser.add_argument("--skip-smoke", action="store_true")
    parser.add_argument("--sides", nargs="+", default=["grpo_lab", "trl"], choices=sorted(WORKERS))
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL:KEY=VALUE,...")
    parser.add_argument("--long-only", nargs="*", default=[], metavar="LABEL", help="runs only above 256 tokens")
    parser.add_argument("--serial", dest="parallel", action="store_false", help="one side's process at a time")
    parser.add_argument("--no-variants", action="store_true", help="the sides only, not the default decode paths")
    parser.add_argument("--cap-gib", type=float, help="hold the learner's GPU to this many GiB (a smaller card)")
    parser.add_argument(
        "--common", action="append", default=[], metavar="KEY=VALUE,...", help="overrides for every run, each side's"
    )
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args.set, args.steps, args.warmup)), flush=True)
        return 0
    runs = side_by_side_runs(args)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("\n".join(skipped_parts(args, runs)), flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (a dry run)"
    print(f"gpu_check: {card}; torch {torch.__version__}; results -> {out / 'gpu_check.jsonl'}", flush=True)
    with open(out / "gpu_check.jsonl", "a") as f:
        f.write(json.dumps({"part": "machine", "card": card, "torch": torch.__version__, "time": time.time()}) + "\n")
    from grpo_lab.models.source import resolve_model_path

    t0 = time.perf_counter()
    resolve_model_path(args.model)  # why here: built once, before any timed process, in GRPO_LAB_CACHE
    print(f"model {args.model} ready ({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.device.startswith("cuda"):  # alone, before any other process holds the GPU: NVML's deltas are its own
        cmd = [sys.executable, "-m", "bench.gpu.gpu_check", "--worker", "context"]
        print(json.dumps(run_part(out, {"part": "context"}, cmd, 120)), flush=True)
    # why the smoke beside the first length: its paths use the tiny model and little of the GPU, and the check must fit
    # one device call
    background = ThreadPoolExecutor(1)
    smoke_done = None if args.skip_smoke else background.submit(smoke, out, args.smoke_timeout)
    records = []
    common = [s for spec in args.common for s in spec.split(",") if s]  # e.g. lora.target_experts=true, both sides
    for length in args.lengths:
        # why at once: each side is a process of its own (torch's peaks are per process), HF decoding leaves the GPU
        # mostly idle and the CPUs serve every process; one after another would not fit the check in 8 minutes
        warmup = args.warmup if length <= LONG else 0  # why: a long rollout's one step is the budget
        parts = []
        for label, side, extra in runs:
            if label in args.long_only and length <= LONG:
                continue
            overrides = base_overrides(args.model, args.device, length) + common + extra
            if args.cap_gib:
                overrides.append(f"placement.gpu_memory_gib={args.cap_gib}")
            cmd = [
                sys.executable,
                "-m",
                "bench.gpu.gpu_check",
                "--worker",
                side,
                "--steps",
                str(args.steps),
                "--warmup",
                str(warmup),
                *[a for o in overrides for a in ("--set", o)],
            ]
            part = {"part": "side_by_side", "side": label, "length": length, "overrides": extra, "common": common}
            parts.append((part, cmd))
        with ThreadPoolExecutor(len(parts) if args.parallel else 1) as pool:
            timeout = args.timeout if length <= LONG else args.timeout_long
            records += list(pool.map(lambda pc, t=timeout: run_part(out, pc[0], pc[1], t), parts))
    if smoke_done is not None:
        records.insert(0, smoke_done.result())
    background.shutdown()
    summary = table(records)
    (out / "gpu_check.md").write_text(f"{card}\n\n{summary}\n")
    print(summary, flush=True)
    return 1 if any("failed" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
