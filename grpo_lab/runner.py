"""The headless runner: the notebook's calls in a loop. Writes DIR/config.yaml (resolved),
DIR/metrics.jsonl (one object per step, with its per-phase memory table), DIR/memory.csv (every
memory sample), DIR/report.html, DIR/checkpoint (what a resume needs, every run.save_every steps
and at the end), DIR/adapter (the final LoRA adapter) and DIR/run.json (running, failed, finished).
When a step fails (host-RAM guard, out of memory) or the process is killed, the files cover every
finished step and the last checkpoint is left as it was: `run(..., resume=DIR)` continues from it."""

from __future__ import annotations

import datetime as dt
import sys
from pathlib import Path
from typing import Optional

from .algo.containers import StepResult
from .checks.paths import check_output_dir
from .config.loading import save_config
from .config.schema import LabConfig
from .errors import LabError
from .files import append_jsonl
from .lab import Lab, preflight
from .memory import format_compact, peak_rows
from .memory.report import CsvStream, write_report
from .recovery.rundir import (
    CHECKPOINT,
    CONFIG,
    METRICS,
    RunLock,
    RunState,
    is_locked,
    read_state,
    rewind_metrics,
    write_status,
)


def resolve_run_dir(config: LabConfig, out: Optional[str]) -> Path:
    """--out, else run.output_dir, else runs/<date-time>; an existing run is never overwritten."""
    field = "--out" if out else "run.output_dir"
    path = Path(out or config.run.output_dir or Path("runs") / dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    if is_locked(path):  # why first: reading a run's state puts back its interrupted checkpoint writes
        raise LabError(
            f"{field}: {str(path)!r} is in use by another grpo-lab run that is still going; choose another directory"
        )
    state = read_state(path)
    if state.status != "new":
        how = (
            "continue it with `grpo-lab run --resume DIR --steps N`"
            if state.status == "finished"
            else "resume it with `grpo-lab run --resume DIR`"
        )
        raise LabError(
            f"{field}: {str(path)!r} holds {'a finished' if state.status == 'finished' else 'an unfinished'} "
            f"run ({state.describe()}); {how}, or choose another directory"
        )
    return check_output_dir(path, field)  # why here: refused before any model loads


def resume_config(run_dir: Path, given: Optional[LabConfig], steps: Optional[int]) -> tuple[LabConfig, RunState]:
    """The run's own config with the changes `given` makes to it (only those a loaded Lab accepts: a resumed
    run continues the same Lab), and its state. `steps` is the run's new target (default: its own)."""
    from .config.loading import load_config
    from .config.schema import field_when, leaf_fields

    state = read_state(run_dir)
    if state.status == "new":
        raise LabError(
            f"--resume: {str(run_dir)!r} holds no grpo_lab run (no {CONFIG} or {METRICS}); "
            "give the directory a `grpo-lab run` wrote"
        )
    config = load_config(run_dir / CONFIG)
    if given is not None:
        mine, theirs = config.to_dict(), given.to_dict()
        changes = {
            path: theirs[s][f]
            for path, s, f in leaf_fields()
            if path not in ("run.steps", "run.output_dir") and mine[s][f] != theirs[s][f]
        }
        fixed = next((path for path in changes if field_when(path) == "load"), None)
        if fixed:
            section, name = fixed.split(".")
            raise LabError(
                f"--resume: {fixed} is {mine[section][name]!r} in the run and {changes[fixed]!r} here; a "
                "resumed run keeps its load-time settings (model, LoRA, placement, engine, seed); drop the "
                "change or start a new run"
            )
        config.update(changes)
    target = steps or config.run.steps
    start = state.checkpoint or 0
    if state.status == "finished" and target <= state.done:
        raise LabError(
            f"--resume: {str(run_dir)!r} finished all its {state.done} steps; pass --steps N with N > "
            f"{state.done} to continue it"
        )
    if target <= start:
        raise LabError(f"--steps: {target}, but the run's checkpoint is at step {start}; give more than {start}")
    config.update({"run.steps": target})
    return config, state


def check_plan(config: LabConfig) -> None:
    """Refuse a run whose memory plan does not fit (the fix is named), before any weight is loaded."""
    from .planner import plan

    result = plan(config)
    if not result.fits:
        worst = max(result.failing(), key=lambda d: d.fraction)
        fixes = "; ".join(result.fixes) if result.fixes else "a bigger device, a smaller model or shorter sequences"
        gib = 1024**3
        line = f", the guard's line: {worst.line:.0%} of {worst.capacity / gib:.1f} GiB" if worst.line < 1 else ""
        raise LabError(
            f"memory plan: does not fit on {worst.device} ({worst.total / gib:.1f} of {worst.line_bytes / gib:.1f} "
            f"GiB{line}); try {fixes}; `grpo-lab plan` shows the table, --force runs anyway"
        )


def run(
    config: Optional[LabConfig],
    steps: Optional[int] = None,
    out: Optional[str] = None,
    progress: bool = True,
    force: bool = False,
    verbose: bool = False,
    resume: Optional[str] = None,
) -> Path:
    """Run GRPO steps headless until the run has `steps` (default run.steps); returns the run directory.
    Prints one line per step, and the per-phase memory table once at the end (after every step with
    `verbose`). Checkpoints every run.save_every steps and at the end; `resume` continues the run in
    that directory from its last checkpoint (`config`, if given, may change what a loaded Lab may)."""
    if resume is not None:
        run_dir = Path(resume)
        if not run_dir.is_dir():
            raise LabError(
                f"--resume: {str(run_dir)!r} holds no grpo_lab run (no such directory); give the directory "
                "a `grpo-lab run` wrote"
            )
        with RunLock(run_dir, "--resume"):
            config, state = resume_config(run_dir, config, steps)
            return _run(
                config, run_dir, state.checkpoint or 0, progress, verbose, load_lab(config, force), resumed=True
            )
    config = config.model_copy(update={"run": config.run.model_copy(update={"steps": steps or config.run.steps})})
    run_dir = resolve_run_dir(config, out)
    config.update({"run.output_dir": str(run_dir)})
    lab = load_lab(config, force)  # why before mkdir: a config that cannot load leaves no run directory behind
    try:
        lock = RunLock(run_dir, "--out" if out else "run.output_dir").acquire()
    except BaseException:
        lab.close()
        raise
    with lock:
        return _run(config, run_dir, 0, progress, verbose, lab)


def say_decode(config: LabConfig) -> None:
    """generator.hf_decode: auto and a merged copy's generator.rollout_copy: auto, as resolved (planner.rollout_decode,
    planner.rollout_copy_mode), once at the start of a run."""
    gen = config.generator
    if gen.backend != "hf" or (gen.hf_decode != "auto" and gen.rollout_copy != "auto"):
        return
    from .planner.plan import rollout_copy_mode, rollout_decode

    decode = rollout_decode(config)
    if gen.hf_decode == "auto":
        why = "the plan fits the rollout copy" if decode == "merged" else "the plan does not fit the rollout copy"
        print(f"rollout: hf decode {decode} (generator.hf_decode: auto; {why})", file=sys.stderr)
    if decode == "merged" and gen.rollout_copy == "auto":
        kept = rollout_copy_mode(config) == "keep"
        why = "the plan fits it beside the learner's phases" if kept else "the plan fits it in the rollout alone"
        held = "kept between rollouts" if kept else "released after each rollout"
        print(f"rollout: the merged copy {held} (generator.rollout_copy: auto; {why})", file=sys.stderr)


def load_lab(config: LabConfig, force: bool) -> Lab:
    """Pre-flight checks and the memory plan (unless `force`), then the loaded Lab."""
    preflight(config)
    if not force:
        check_plan(config)
    return Lab(config).load()


def _run(
    config: LabConfig, run_dir: Path, start: int, progress: bool, verbose: bool, lab: Lab, resumed: bool = False
) -> Path:
    """Steps `start`..run.steps-1 of the loaded `lab` in `run_dir` (locked by the caller); closes the Lab."""
    from tqdm.auto import tqdm

    steps = config.run.steps
    earlier: list[StepResult] = []
    try:
        if start:
            lab.restore_checkpoint(run_dir / CHECKPOINT)
        if resumed:
            print(
                f"resuming {run_dir} at step {start} of {steps}"
                + ("" if start else " (no checkpoint: from the start)"),
                file=sys.stderr,
            )
        save_config(lab.config, run_dir / CONFIG)
        earlier = [StepResult.from_metrics(m) for m in rewind_metrics(run_dir / METRICS, start)]
        samples = CsvStream(run_dir / "memory.csv", lab.memory, keep_before=start if resumed else None)
        write_status(run_dir, "running", steps)
        say_decode(config)
    except BaseException:
        lab.close()
        raise
    bar = tqdm(
        range(start, steps), desc="grpo", unit="step", disable=not progress, file=sys.stderr, initial=start, total=steps
    )
    try:
        for i in bar:
            result = lab.step()
            append_jsonl(run_dir / METRICS, result.metrics())
            samples.flush()
            bar.write(result.summary(), file=sys.stderr)
            if verbose:
                bar.write(format_compact(result.memory), file=sys.stderr)
            if result.leaks:
                bar.write(
                    f"  leak detector: after-step memory keeps rising on {', '.join(result.leaks)}", file=sys.stderr
                )
            every = lab.config.run.save_every  # live: read at each step
            if every and (i + 1) % every == 0 and i + 1 < steps:
                lab.save_checkpoint(run_dir / CHECKPOINT)
        lab.save_checkpoint(run_dir / CHECKPOINT)
        lab.save_adapter(run_dir / "adapter")
        write_status(run_dir, "finished", steps)
        if progress and lab.history:
            rows = [row for result in lab.history for row in result.memory]
            print(format_compact(peak_rows(rows), f"peak of {len(lab.history)} steps, MiB"), file=sys.stderr)
    except BaseException as err:
        write_status(run_dir, "failed", steps, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        raise
    finally:
        samples.flush()
        title = f"grpo_lab run {run_dir}" + (
            f" (resumed at step {start}: the timeline shows steps {start}-)" if resumed else ""
        )
        write_report(run_dir / "report.html", lab.memory, earlier + lab.history, title=title, config=config.to_dict())
        lab.close()
    return run_dir
