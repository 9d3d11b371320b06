"""grpo_lab vs TRL's GRPOTrainer side by side: median s/step and peak RSS, and peak memory against completion length.

Both sides get the same preset: model, nf4 + LoRA, num_generations, lengths, temperature, beta, loss, micro-batches
(TRL's per_device_train_batch_size = grpo.micro_batch_size, gradient accumulation over the step batch; built by
bench/step_vs_trl.trl_trainer), HF generation on the CPU. Each run is its own process (so peaks never mix), started
with the sides alternating (which goes first flips every repetition); a process loads, runs `--warmup` + `--steps`
steps, and reports its step times (warm-up left out), its peak RSS over the whole run (psutil, 200 Hz) and its RSS
once loaded. A third side, `naive`, is grpo_lab with a textbook head swapped in for the benchmark only: full
[tokens, vocab] float32 logits, log_softmax over the vocabulary, gather (what a head without chunking holds).

    .venv/bin/python -m bench.compare_trl                         # both presets, then the length sweep
    .venv/bin/python -m bench.compare_trl --reps 1 --steps 1 --lengths 64 128   # a quick look

Writes bench/results/compare_trl.json, bench/results/compare_trl_lengths.html and, with the system Chromium,
docs/img/compare_trl_peak_vs_length.png; prints the markdown tables of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024 ** 2
SIDES = ("grpo_lab", "trl")


class PeakRSS:
    """This process's RSS peak, sampled at `hz` on a daemon thread."""

    def __init__(self, hz: float = 200):
        import psutil

        self.proc, self.interval, self.peak = psutil.Process(), 1 / hz, 0
        threading.Thread(target=self._run, daemon=True).start()

    def now(self) -> int:
        return self.proc.memory_info().rss

    def _run(self):
        while True:
            self.peak = max(self.peak, self.now())
            time.sleep(self.interval)


def naive_head(hidden, weight, bias, targets, temperature, chunk):
    import torch

    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature      # [tokens, vocab]
    return torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)


def worker(side: str, preset: str, overrides: list[str], steps: int, warmup: int) -> dict:
    peak = PeakRSS()
    from grpo_lab import Lab, load_config

    cfg = load_config(preset, overrides + ["memory.sample_hz=0"])
    times, lengths = [], []
    if side in ("grpo_lab", "naive"):
        if side == "naive":
            import grpo_lab.logprobs

            grpo_lab.logprobs.HEADS["chunked"] = naive_head
        lab = Lab(cfg).load()
        loaded = peak.now()
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            result = lab.step()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                lengths.append(result.completion_length_mean)
        lab.close()
    else:
        import tempfile

        from transformers import TrainerCallback

        from bench.step_vs_trl import trl_trainer
        from grpo_lab.tiny import resolve_model_path

        cfg.update({"model.name_or_path": resolve_model_path(cfg.model.name_or_path)})
        marks = {}

        class Timer(TrainerCallback):
            def on_step_begin(self, *a, **k):
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
    return {"side": side, "preset": preset, "overrides": overrides, "seconds": times, "peak_rss": peak.peak,
            "loaded_rss": loaded, "completion_length": statistics.mean(lengths) if lengths else None}


def spawn(side: str, preset: str, overrides: list[str], steps: int, warmup: int) -> dict:
    cmd = [sys.executable, "-m", "bench.compare_trl", "--worker", side, "--presets", preset, "--steps", str(steps),
           "--warmup", str(warmup), *[a for o in overrides for a in ("--set", o)]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"side": side, "preset": preset, "overrides": overrides, "failed": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def describe(run: dict) -> str:
    if "failed" in run:
        return run["failed"]
    seconds = f"{statistics.median(run['seconds']):.2f} s/step, " if run["seconds"] else ""
    return f"{seconds}peak {run['peak_rss'] / MiB:.0f} MiB"


def compare(presets, reps, steps, warmup) -> list[dict]:
    rows = []
    for preset in presets:
        for rep in range(reps):
            for side in (SIDES if rep % 2 == 0 else SIDES[::-1]):
                run = spawn(side, preset, [], steps, warmup)
                print(f"  {preset} rep {rep} {side}: {describe(run)}", file=sys.stderr)
                rows.append({**run, "rep": rep})
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        s = {}
        for side in SIDES:
            runs = [r for r in rows if r["preset"] == preset and r["side"] == side and "failed" not in r]
            s[side] = {"s_per_step": statistics.median([t for r in runs for t in r["seconds"]]),
                       "peak_rss": statistics.median([r["peak_rss"] for r in runs]),
                       "loaded_rss": statistics.median([r["loaded_rss"] for r in runs]),
                       "length": statistics.mean([r["completion_length"] for r in runs]),
                       "steps": sum(len(r["seconds"]) for r in runs), "runs": len(runs)}
        out.append({"preset": preset, **s, "time_ratio": s["grpo_lab"]["s_per_step"] / s["trl"]["s_per_step"],
                    "peak_ratio": s["grpo_lab"]["peak_rss"] / s["trl"]["peak_rss"]})
    return out


def sweep(lengths, limit_gib: float, sides=("grpo_lab", "trl", "naive")) -> list[dict]:
    """Peak RSS of one step per (side, completion length) on logits-heavy-cpu; a side whose peak, extrapolated
    linearly from its last two lengths, would pass `limit_gib` is skipped (and says so) rather than run."""
    rows = []
    for side in sides:
        done = []
        for length in lengths:
            if len(done) >= 2:
                (l1, p1), (l2, p2) = done[-2:]
                predicted = p2 + (p2 - p1) / (l2 - l1) * (length - l2)
                if predicted > limit_gib * 1024 * MiB:
                    rows.append({"side": side, "length": length, "skipped": f"predicted {predicted / 1024 / MiB:.1f} GiB"})
                    print(f"  {side} {length}: skipped, predicted {predicted / 1024 / MiB:.1f} GiB", file=sys.stderr)
                    continue
            run = spawn(side, "logits-heavy-cpu", [f"generator.max_completion_length={length}"], 1, 0)
            rows.append({**run, "length": length})
            if "failed" not in run:
                done.append((length, run["peak_rss"]))
            print(f"  {side} {length}: {describe(run)}", file=sys.stderr)
    return rows


def plot(rows: list[dict], html: Path, png: Path) -> None:
    import plotly.graph_objects as go

    fig = go.Figure()
    names = {"grpo_lab": "grpo_lab (chunked head)", "trl": "TRL GRPOTrainer", "naive": "naive full log-softmax"}
    for side, name in names.items():
        ok = [r for r in rows if r["side"] == side and "peak_rss" in r]
        fig.add_trace(go.Scatter(x=[r["length"] for r in ok], y=[r["peak_rss"] / MiB for r in ok], name=name,
                                 mode="lines+markers"))
    fig.update_layout(title="Peak RSS of one GRPO step vs completion length (logits-heavy-cpu: vocab 151,936, "
                            "8 completions, one micro-batch)", xaxis_title="completion length (tokens)",
                      yaxis_title="peak RSS (MiB)", width=1000, height=560, template="plotly_white")
    fig.update_xaxes(type="log", tickvals=sorted({r["length"] for r in rows}))
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
        page = browser.new_page(viewport={"width": 1020, "height": 580})
        page.goto(html.resolve().as_uri())
        page.wait_for_selector(".main-svg")
        page.screenshot(path=str(png))
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=("grpo_lab", "trl", "naive"), help=argparse.SUPPRESS)
    parser.add_argument("--presets", nargs="+", default=["tiny-cpu", "logits-heavy-cpu"])
    parser.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--lengths", type=int, nargs="*", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--limit-gib", type=float, default=16.0, help="skip sweep runs predicted above this peak")
    parser.add_argument("--sweep-sides", nargs="+", default=["grpo_lab", "trl", "naive"],
                        choices=("grpo_lab", "trl", "naive"))
    parser.add_argument("--reuse-sweep", help="a compare_trl.json whose sweep rows stand for the sides not swept now")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.worker:
        print(json.dumps(worker(args.worker, args.presets[0], args.set, args.steps, args.warmup)))
        return
    out = Path(args.out)
    rows = compare(args.presets, args.reps, args.steps, args.warmup) if args.reps else []
    table = summarise(rows) if rows else []
    lengths = sweep(args.lengths, args.limit_gib, args.sweep_sides) if args.lengths else []
    if args.reuse_sweep:
        lengths += [r for r in json.loads(Path(args.reuse_sweep).read_text())["sweep"] if r["side"] not in args.sweep_sides]
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare_trl.json").write_text(json.dumps({"compare": rows, "summary": table, "sweep": lengths}, indent=1))
    if lengths:
        plot(lengths, out / "compare_trl_lengths.html", ROOT / "docs" / "img" / "compare_trl_peak_vs_length.png")
    print("| preset | grpo_lab s/step | TRL s/step | ratio | grpo_lab peak RSS MiB | TRL peak RSS MiB | ratio | "
          "completion length (grpo_lab / TRL) | steps per side |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in table:
        g, r = t["grpo_lab"], t["trl"]
        print(f"| {t['preset']} | {g['s_per_step']:.2f} | {r['s_per_step']:.2f} | **{t['time_ratio']:.2f}** | "
              f"{g['peak_rss'] / MiB:.0f} | {r['peak_rss'] / MiB:.0f} | **{t['peak_ratio']:.2f}** | "
              f"{g['length']:.0f} / {r['length']:.0f} | {g['steps']} |")
    if lengths:
        print("\n| completion length | grpo_lab peak MiB | TRL peak MiB | naive peak MiB |")
        print("|---|---|---|---|")
        for length in args.lengths:
            cell = {r["side"]: (f"{r['peak_rss'] / MiB:.0f}" if "peak_rss" in r else r.get("skipped") or r["failed"])
                    for r in lengths if r["length"] == length}
            print(f"| {length} | {cell.get('grpo_lab')} | {cell.get('trl')} | {cell.get('naive')} |")


if __name__ == "__main__":
    main()
