"""grpo_lab vs TRL's GRPOTrainer side by side: median s/step and peak RSS, and peak memory against completion length.

Both sides get the same preset: model, nf4 + LoRA, num_generations, lengths, temperature, beta, loss and
micro-batches (TRL's per_device_train_batch_size = grpo.micro_batch_size, gradient accumulation over the step batch;
built by `bench.vs_trl.step_vs_trl.trl_trainer`), HF generation on the CPU.

Every run is its own process (`--worker SIDE`), so peaks never mix. A worker starts a psutil RSS sampler (200 Hz)
right after its imports, loads, runs `--warmup` + `--steps` steps and prints one JSON line on stdout: the wall time
of each step after the warm-up, the process's RSS peak over the whole run, its RSS once loaded, the mean completion
length and, for grpo_lab, each step's per-phase host RSS (start, peak) from `StepResult.memory` (backward included).
The orchestrator (default mode) runs the grpo_lab and TRL workers of each preset `--reps` times, alternating which
goes first every repetition, and reports the median s/step over all kept steps of all repetitions, the median peak
RSS over repetitions and the ratios grpo_lab / TRL.

The length sweep runs one step per (side, completion length) on logits-heavy-cpu with
`--set generator.max_completion_length=L` (peaks only, no timing claims) for three sides: grpo_lab, TRL and
`naive`. `naive` is the grpo_lab worker with a textbook log-prob head swapped in, in that benchmark process only
(`grpo_lab.algo.logprobs.HEADS["chunked"] = naive_head`): `F.linear(hidden, weight, bias).float() / temperature` over
all completion tokens at once, `log_softmax` over the whole vocabulary, `gather` of the targets, so all
[tokens, vocab] float32 logits exist (and are kept for backward). Its peaks show what the chunked head saves.

    .venv/bin/python -m bench.vs_trl.compare_trl                       # both presets (3 reps x 3 steps), then the sweep
    .venv/bin/python -m bench.vs_trl.compare_trl --reps 1 --steps 2 --warmup 1 --lengths 64 128   # a quick look
    .venv/bin/python -m bench.vs_trl.compare_trl --worker trl --config logits-heavy-cpu --steps 1 --warmup 0  # a worker

Writes `--out` (raw data and summary, default bench/results/compare_trl.json), bench/results/compare_trl_lengths.html
(plotly, self-contained) and, screenshotted with the system Chromium (playwright),
docs/img/compare_trl_peak_vs_length.png; prints markdown tables. Set GRPO_LAB_CACHE to reuse the built-in models.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024**2
SIDES = ("grpo_lab", "trl")
SWEEP_PRESET = "logits-heavy-cpu"
NAMES = {"grpo_lab": "grpo_lab (chunked head)", "trl": "TRL GRPOTrainer", "naive": "naive full log-softmax"}


class PeakRSS:
    """This process's RSS peak, sampled at `hz` on a daemon thread."""

    def __init__(self, hz: float = 200):
        import psutil

        self.proc, self.interval = psutil.Process(), 1 / hz
        self.peak = self.now()
        threading.Thread(target=self._run, daemon=True).start()

    def now(self) -> int:
        return self.proc.memory_info().rss

    def _run(self):
        while True:
            self.peak = max(self.peak, self.now())
            time.sleep(self.interval)


def naive_head(hidden, weight, bias, targets, temperature, chunk):
    """Textbook log-probs: every [tokens, vocab] float32 logit at once (chunk ignored)."""
    import torch

    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature  # [tokens, vocab]
    return torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)


def phase_rss(memory: list[dict]) -> dict:
    """{phase: {start, peak}} of the host RSS rows of one StepResult.memory (the worker adds the phase seconds)."""
    return {
        r["phase"]: {"start": r["start"], "peak": r["peak"]}
        for r in memory
        if r.get("metric") == "rss" and not r.get("failed")
    }


def worker(side: str, preset: str, overrides: list[str], steps: int, warmup: int, threads: int | None) -> dict:
    peak = PeakRSS()
    load_start = os.getloadavg()
    import torch

    from grpo_lab import Lab, load_config

    if threads:
        torch.set_num_threads(threads)

    cfg = load_config(preset, overrides)
    times, lengths, phases = [], [], []
    if side in ("grpo_lab", "naive"):
        if side == "naive":
            import grpo_lab.algo.logprobs

            grpo_lab.algo.logprobs.HEADS["chunked"] = naive_head
        lab = Lab(cfg).load()
        loaded = peak.now()
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            result = lab.step()
            elapsed = time.perf_counter() - t0
            phases.append({**phase_rss(result.memory), "seconds": result.phase_seconds})
            if i >= warmup:
                times.append(elapsed)
                lengths.append(result.completion_length_mean)
        lab.close()
    else:
        import tempfile

        from transformers import TrainerCallback

        from bench.vs_trl.step_vs_trl import trl_trainer
        from grpo_lab.models.source import resolve_model_path

        cfg.update({"model.name_or_path": resolve_model_path(cfg.model.name_or_path)})
        marks = {}

        class Timer(TrainerCallback):
            def on_step_begin(self, args_, state, control, **k):
                marks["t0"] = time.perf_counter()

            def on_step_end(self, args_, state, control, **k):
                if state.global_step > warmup:
                    times.append(time.perf_counter() - marks["t0"])

            def on_log(self, args_, state, control, logs=None, **k):
                if logs and "completions/mean_length" in logs and state.global_step > warmup:
                    lengths.append(logs["completions/mean_length"])

        with tempfile.TemporaryDirectory() as tmp:
            trainer = trl_trainer(cfg, Timer(), warmup + steps, tmp)
            trainer.args.logging_steps = 1
            loaded = peak.now()
            trainer.train()
    backward = [p["backward"] for p in phases[warmup:] if "backward" in p]
    return {
        "side": side,
        "preset": preset,
        "overrides": overrides,
        "steps": steps,
        "warmup": warmup,
        "seconds": times,
        "peak_rss": peak.peak,
        "loaded_rss": loaded,
        "completion_length": statistics.mean(lengths) if lengths else None,
        "backward_peak": max((b["peak"] for b in backward), default=None),
        "backward_above_start": max((b["peak"] - b["start"] for b in backward), default=None),
        "threads": torch.get_num_threads(),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "phases": phases,
    }


def spawn(side: str, preset: str, overrides: list[str], steps: int, warmup: int, threads: int | None) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "bench.vs_trl.compare_trl",
        "--worker",
        side,
        "--config",
        preset,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        *[a for o in overrides for a in ("--set", o)],
    ]
    env = dict(os.environ)
    if threads:
        cmd += ["--threads", str(threads)]
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"side": side, "preset": preset, "overrides": overrides, "failed": f"exit {proc.returncode}: {tail}"}
    return {**json.loads(lines[-1]), "process_seconds": time.perf_counter() - t0}


def describe(run: dict) -> str:
    if "failed" in run:
        return run["failed"]
    seconds = f"{statistics.median(run['seconds']):.2f} s/step, " if run["seconds"] else ""
    return (
        f"{seconds}peak {run['peak_rss'] / MiB:.0f} MiB, loaded {run['loaded_rss'] / MiB:.0f} MiB, "
        f"length {run['completion_length']}, process {run['process_seconds']:.0f} s"
    )


def compare(presets, reps, steps, warmup, threads) -> list[dict]:
    rows = []
    for preset in presets:
        for rep in range(reps):
            for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
                run = spawn(side, preset, [], steps, warmup, threads)
                print(f"  {preset} rep {rep} {side}: {describe(run)}", file=sys.stderr, flush=True)
                rows.append({**run, "rep": rep})
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        s = {}
        for side in SIDES:
            runs = [r for r in rows if r["preset"] == preset and r["side"] == side and "failed" not in r]
            if not runs:
                s[side] = None
                continue
            seconds = [t for r in runs for t in r["seconds"]]
            s[side] = {
                "s_per_step": statistics.median(seconds) if seconds else float("nan"),
                "peak_rss": statistics.median([r["peak_rss"] for r in runs]),
                "loaded_rss": statistics.median([r["loaded_rss"] for r in runs]),
                "length": statistics.mean(
                    [r["completion_length"] for r in runs if r["completion_length"] is not None] or [float("nan")]
                ),
                "steps": len(seconds),
                "runs": len(runs),
            }
        if not all(s.values()):
            out.append({"preset": preset, **s, "time_ratio": None, "peak_ratio": None})
            continue
        out.append(
            {
                "preset": preset,
                **s,
                "time_ratio": s["grpo_lab"]["s_per_step"] / s["trl"]["s_per_step"],
                "peak_ratio": s["grpo_lab"]["peak_rss"] / s["trl"]["peak_rss"],
            }
        )
    return out


def sweep(lengths, sides, limit_gib: float, threads) -> list[dict]:
    """Peak RSS of one step per (completion length, side) on logits-heavy-cpu (the sides rotate at each length).
    A side whose peak, extrapolated linearly from its last two lengths, would pass `limit_gib` is skipped (and
    says so) rather than run. grpo_lab's own memory sampler runs at 200 Hz here for its backward-phase peak."""
    rows, done = [], {side: [] for side in sides}
    for i, length in enumerate(lengths):
        for side in sides[i % len(sides) :] + sides[: i % len(sides)]:
            if len(done[side]) >= 2:
                (l1, p1), (l2, p2) = done[side][-2:]
                predicted = p2 + (p2 - p1) / (l2 - l1) * (length - l2)
                if predicted > limit_gib * 1024 * MiB:
                    rows.append(
                        {"side": side, "length": length, "skipped": f"predicted {predicted / 1024 / MiB:.1f} GiB"}
                    )
                    print(f"  {side} {length}: skipped, predicted {predicted / 1024 / MiB:.1f} GiB", file=sys.stderr)
                    continue
            overrides = [f"generator.max_completion_length={length}"]
            if side != "trl":
                overrides.append("memory.sample_hz=200")
            run = spawn(side, SWEEP_PRESET, overrides, 1, 0, threads)
            rows.append({**run, "length": length})
            if "failed" not in run:
                done[side].append((length, run["peak_rss"]))
            print(f"  {side} {length}: {describe(run)}", file=sys.stderr, flush=True)
    return rows


def fit(points: list[tuple[float, float]]) -> dict | None:
    """Least-squares line y = a + b x and its R^2."""
    if len(points) < 2:
        return None
    xs, ys = zip(*points)
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    a = my - b * mx
    ss = sum((y - my) ** 2 for y in ys)
    r2 = 1 - sum((y - a - b * x) ** 2 for x, y in points) / ss if ss else 1.0
    return {"intercept": a, "slope": b, "r2": r2}


def sweep_summary(rows: list[dict]) -> dict:
    out = {}
    for side in dict.fromkeys(r["side"] for r in rows):
        ok = sorted((r for r in rows if r["side"] == side and "peak_rss" in r), key=lambda r: r["length"])
        entry = {"peak_rss_fit_mib": fit([(r["length"], r["peak_rss"] / MiB) for r in ok])}
        back = [(r["length"], r["backward_above_start"] / MiB) for r in ok if r.get("backward_above_start") is not None]
        if back:
            entry["backward_above_start_fit_mib"] = fit(back)
            entry["backward_above_start_rise_mib"] = back[-1][1] - back[0][1]
        out[side] = entry
    return out


def plot(rows: list[dict], chunk_mib: float, html: Path, png: Path) -> None:
    import plotly.graph_objects as go

    fig = go.Figure()
    for side, name in NAMES.items():
        ok = sorted((r for r in rows if r["side"] == side and "peak_rss" in r), key=lambda r: r["length"])
        if ok:
            fig.add_trace(
                go.Scatter(
                    x=[r["length"] for r in ok],
                    y=[r["peak_rss"] / MiB for r in ok],
                    name=f"{name}: process peak RSS",
                    mode="lines+markers",
                )
            )
    for side in ("grpo_lab", "naive"):
        ok = sorted(
            (r for r in rows if r["side"] == side and r.get("backward_above_start") is not None),
            key=lambda r: r["length"],
        )
        if ok:
            fig.add_trace(
                go.Scatter(
                    x=[r["length"] for r in ok],
                    y=[r["backward_above_start"] / MiB for r in ok],
                    name=f"{NAMES[side]}: backward phase, peak above its start",
                    mode="lines+markers",
                    line={"dash": "dash"},
                )
            )
    lengths = sorted({r["length"] for r in rows})
    fig.add_trace(
        go.Scatter(
            x=[lengths[0], lengths[-1]],
            y=[chunk_mib, chunk_mib],
            mode="lines",
            name=f"one chunk of float32 logits ({chunk_mib:.0f} MiB)",
            line={"dash": "dot", "color": "gray"},
        )
    )
    fig.update_layout(
        title=f"One GRPO step's memory vs completion length ({SWEEP_PRESET}: vocab 151,936, "
        "8 completions, one micro-batch)",
        xaxis_title="completion length (tokens)",
        yaxis_title="MiB",
        width=1100,
        height=680,
        template="plotly_white",
        legend={"orientation": "h", "x": 0, "y": -0.15, "yanchor": "top"},
    )
    fig.update_xaxes(tickvals=lengths)
    html.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(html, include_plotlyjs=True)
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        print(f"no Chromium: {png} not written (the HTML is)", file=sys.stderr)
        return
    from playwright.sync_api import sync_playwright

    png.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        page = browser.new_page(viewport={"width": 1120, "height": 700})
        page.goto(html.resolve().as_uri())
        page.wait_for_selector(".main-svg")
        page.screenshot(path=str(png))
        browser.close()


def chunk_bytes() -> int:
    from grpo_lab import load_config

    cfg = load_config(SWEEP_PRESET, [])
    return cfg.grpo.logprob_chunk_size * 151_936 * 4


def environment() -> dict:
    """The machine and the library versions (recorded in the JSON)."""
    from importlib.metadata import version

    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            None,
        )
        if Path("/proc/cpuinfo").exists()
        else None
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        **{pkg: version(pkg) for pkg in ("torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate")},
    }


def print_tables(table: list[dict], lengths: list[dict], sweep_fit: dict) -> None:
    if table:
        print(
            "| preset | grpo_lab s/step | TRL s/step | ratio | grpo_lab peak RSS MiB | TRL peak RSS MiB | ratio | "
            "loaded RSS MiB (grpo_lab / TRL) | completion length (grpo_lab / TRL) | timed steps per side |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for t in table:
            g, r = t["grpo_lab"], t["trl"]
            if not (g and r):
                print(f"| {t['preset']} | failed: see the JSON |")
                continue
            print(
                f"| {t['preset']} | {g['s_per_step']:.2f} | {r['s_per_step']:.2f} | **{t['time_ratio']:.2f}** | "
                f"{g['peak_rss'] / MiB:.0f} | {r['peak_rss'] / MiB:.0f} | **{t['peak_ratio']:.2f}** | "
                f"{g['loaded_rss'] / MiB:.0f} / {r['loaded_rss'] / MiB:.0f} | "
                f"{g['length']:.0f} / {r['length']:.0f} | {g['steps']} / {r['steps']} |"
            )
    if lengths:

        def cell(r, key="peak_rss"):
            if r is None:
                return ""
            if key in r and r[key] is not None:
                return f"{r[key] / MiB:.0f}"
            return r.get("skipped") or r.get("failed") or ""

        print(
            "\n| completion length | grpo_lab peak MiB | TRL peak MiB | naive peak MiB | grpo_lab backward "
            "above start MiB | naive backward above start MiB | mean completion length (grpo_lab / TRL / naive) |"
        )
        print("|---|---|---|---|---|---|---|")
        for length in sorted({r["length"] for r in lengths}):
            by = {r["side"]: r for r in lengths if r["length"] == length}
            lens = " / ".join(
                f"{by[s]['completion_length']:.0f}" if by.get(s, {}).get("completion_length") is not None else "-"
                for s in ("grpo_lab", "trl", "naive")
            )
            print(
                f"| {length} | {cell(by.get('grpo_lab'))} | {cell(by.get('trl'))} | {cell(by.get('naive'))} | "
                f"{cell(by.get('grpo_lab'), 'backward_above_start')} | {cell(by.get('naive'), 'backward_above_start')} "
                f"| {lens} |"
            )
        print("\nlinear fits, MiB = a + b * length:")
        for side, entry in sweep_fit.items():
            for key, f in entry.items():
                if isinstance(f, dict):
                    print(f"  {side} {key}: a {f['intercept']:.0f}, b {f['slope']:.3f} MiB/token, R^2 {f['r2']:.3f}")
                elif f is not None:
                    print(f"  {side} {key}: {f:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--worker",
        choices=("grpo_lab", "trl", "naive"),
        help="run one side in this process and print its JSON line (used by the orchestrator)",
    )
    parser.add_argument("--config", default="logits-heavy-cpu", help="worker: the preset")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="worker: config override")
    parser.add_argument("--presets", nargs="+", default=["tiny-cpu", "logits-heavy-cpu"])
    parser.add_argument("--reps", type=int, default=3, help="processes per side and preset")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=1, help="leading steps per process left out of the timings")
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="*",
        default=[64, 128, 256, 512, 1024],
        help="completion lengths of the sweep (logits-heavy-cpu, one step per process)",
    )
    parser.add_argument(
        "--sweep-sides", nargs="+", default=["grpo_lab", "trl", "naive"], choices=("grpo_lab", "trl", "naive")
    )
    parser.add_argument("--limit-gib", type=float, default=16.0, help="skip sweep runs predicted to peak above this")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch/OpenMP threads per worker (default: torch's); 1 avoids "
        "oversubscription when other work shares the cores",
    )
    parser.add_argument("--skip-compare", action="store_true")
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "compare_trl.json"))
    parser.add_argument("--html", default=str(ROOT / "bench" / "results" / "compare_trl_lengths.html"))
    parser.add_argument("--png", default=str(ROOT / "docs" / "img" / "compare_trl_peak_vs_length.png"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.worker:
        stdout = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):  # only the JSON line goes to stdout
            result = worker(args.worker, args.config, args.set, args.steps, args.warmup, args.threads)
        print(json.dumps(result), file=stdout, flush=True)
        return
    started = time.time()
    rows = [] if args.skip_compare else compare(args.presets, args.reps, args.steps, args.warmup, args.threads)
    table = summarise(rows) if rows else []
    lengths = (
        []
        if args.skip_sweep or not args.lengths
        else sweep(args.lengths, list(args.sweep_sides), args.limit_gib, args.threads)
    )
    sweep_fit = sweep_summary(lengths) if lengths else {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "environment": environment(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
                "wall_seconds": time.time() - started,
                "compare": rows,
                "summary": table,
                "sweep": lengths,
                "sweep_fit": sweep_fit,
            },
            indent=1,
        )
    )
    if lengths:
        plot(lengths, chunk_bytes() / MiB, Path(args.html), Path(args.png))
    print_tables(table, lengths, sweep_fit)


if __name__ == "__main__":
    main()
