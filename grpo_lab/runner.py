"""The headless runner: the notebook's calls in a loop. Writes DIR/config.yaml (resolved),
DIR/metrics.jsonl (one object per step, with its per-phase memory table), DIR/memory.csv (every
memory sample), DIR/report.html and DIR/adapter (the LoRA checkpoint). When a step fails (host-RAM
guard, out of memory), the CSV and report still cover every finished step and the last saved
adapter is left as it was."""
from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path
from typing import Optional

from .config import LabConfig, save_config
from .errors import LabError
from .io import append_jsonl
from .paths import check_output_dir
from .lab import Lab, preflight
from .memory import format_compact, peak_rows
from .memory.report import CsvStream, write_report


def resolve_run_dir(config: LabConfig, out: Optional[str]) -> Path:
    """--out, else run.output_dir, else runs/<date-time>; an existing run is never overwritten."""
    path = Path(out or config.run.output_dir or Path("runs") / dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    if (path / "metrics.jsonl").exists() or (path / "config.yaml").exists():
        raise LabError(f"--out: {str(path)!r} already holds a run; choose another directory or remove it")
    return check_output_dir(path, "--out" if out else "run.output_dir")  # why here: refused before any model loads


def check_plan(config: LabConfig) -> None:
    """Refuse a run whose memory plan does not fit (the fix is named), before any weight is loaded."""
    from .planner import plan

    result = plan(config)
    if not result.fits:
        worst = max(result.failing(), key=lambda d: d.fraction)
        fixes = "; ".join(result.fixes) if result.fixes else "a bigger device, a smaller model or shorter sequences"
        raise LabError(f"memory plan: does not fit on {worst.device} ({worst.total / 1024 ** 3:.1f} of "
                       f"{worst.capacity / 1024 ** 3:.1f} GiB); try {fixes}; `grpo-lab plan` shows the table, --force runs anyway")


def run(config: LabConfig, steps: Optional[int] = None, out: Optional[str] = None, progress: bool = True,
        force: bool = False, verbose: bool = False) -> Path:
    """Run `steps` GRPO steps headless; returns the run directory. Prints one line per step, and the
    per-phase memory table once at the end (after every step with `verbose`)."""
    from tqdm.auto import tqdm

    steps = steps or config.run.steps
    run_dir = resolve_run_dir(config, out)
    config = config.model_copy(update={"run": config.run.model_copy(update={"steps": steps, "output_dir": str(run_dir)})})
    preflight(config)
    if not force:
        check_plan(config)
    lab = Lab(config).load()  # why before mkdir: a config that cannot load leaves no run directory behind
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir / "config.yaml")
    metrics = run_dir / "metrics.jsonl"
    samples = CsvStream(run_dir / "memory.csv", lab.memory)
    bar = tqdm(range(steps), desc="grpo", unit="step", disable=not progress, file=sys.stderr)
    try:
        for i in bar:
            result = lab.step()
            append_jsonl(metrics, result.metrics())
            samples.flush()
            bar.write(result.summary(), file=sys.stderr)
            if verbose:
                bar.write(format_compact(result.memory), file=sys.stderr)
            if result.leaks:
                bar.write(f"  leak detector: after-step memory keeps rising on {', '.join(result.leaks)}", file=sys.stderr)
            every = lab.config.run.save_every   # live: read at each step
            if every and (i + 1) % every == 0:
                lab.save_adapter(run_dir / "adapter")
        lab.save_adapter(run_dir / "adapter")
        if progress and lab.history:
            rows = [row for result in lab.history for row in result.memory]
            print(format_compact(peak_rows(rows), f"peak of {len(lab.history)} steps, MiB"), file=sys.stderr)
    finally:
        samples.flush()
        write_report(run_dir / "report.html", lab.memory, lab.history, title=f"grpo_lab run {run_dir}")
        lab.close()
    return run_dir
