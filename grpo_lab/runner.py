"""The headless runner: the notebook's calls in a loop. Writes DIR/config.yaml (resolved),
DIR/metrics.jsonl (one object per step) and DIR/adapter (the LoRA checkpoint)."""
from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path
from typing import Optional

from .config import LabConfig, save_config
from .errors import LabError
from .io import append_jsonl
from .lab import Lab, preflight


def resolve_run_dir(config: LabConfig, out: Optional[str]) -> Path:
    """--out, else run.output_dir, else runs/<date-time>; an existing run is never overwritten."""
    path = Path(out or config.run.output_dir or Path("runs") / dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    if (path / "metrics.jsonl").exists() or (path / "config.yaml").exists():
        raise LabError(f"--out: {str(path)!r} already holds a run; choose another directory or remove it")
    if path.exists() and not path.is_dir():
        raise LabError(f"--out: {str(path)!r} is a file, not a directory")
    return path


def run(config: LabConfig, steps: Optional[int] = None, out: Optional[str] = None, progress: bool = True) -> Path:
    """Run `steps` GRPO steps headless; returns the run directory."""
    from tqdm.auto import tqdm

    steps = steps or config.run.steps
    run_dir = resolve_run_dir(config, out)
    config = config.model_copy(update={"run": config.run.model_copy(update={"steps": steps, "output_dir": str(run_dir)})})
    preflight(config)
    lab = Lab(config).load()  # why before mkdir: a config that cannot load leaves no run directory behind
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir / "config.yaml")
    metrics = run_dir / "metrics.jsonl"
    bar = tqdm(range(steps), desc="grpo", unit="step", disable=not progress, file=sys.stderr)
    for i in bar:
        result = lab.step()
        append_jsonl(metrics, result.metrics())
        bar.write(result.summary(), file=sys.stderr)
        if config.run.save_every and (i + 1) % config.run.save_every == 0:
            lab.save_adapter(run_dir / "adapter")
    lab.save_adapter(run_dir / "adapter")
    return run_dir
