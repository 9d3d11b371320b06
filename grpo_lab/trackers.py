"""`run.report_to`: each finished step's metrics and per-phase memory peaks go to the trackers users
already use (TRL's option name). Names, per step (`step` = the GRPO step):

    train/<metric>                       every finite scalar of StepResult.metrics(): reward_mean, loss, kl,
                                         grad_norm, rewards/<function>/mean, seconds/<phase>, step_seconds, ...
    memory/<device>/<phase>/peak_mib     the device's primary metric (host: RSS; GPU: NVML used, else reserved)
    memory/<device>/<phase>/delta_mib    its change over the phase (end - start)
    memory/<device>/peak_mib             the step's peak over its phases

Trackers (each an optional extra, `pip install 'grpo-lab[NAME]'`), writing under run.output_dir (else "."):
    tensorboard  DIR/tensorboard (torch's SummaryWriter)
    wandb        DIR/wandb, always offline (`wandb sync DIR/wandb/offline-run-*` uploads it later)
    trackio      local SQLite DIR/trackio/grpo_lab.db, unless the environment sets TRACKIO_DIR (trackio reads it
                 once per process, at import: a later Lab with another DIR gets a warning naming where it goes);
                 one trackio run per process at a time (trackio.init finishes the previous one)

A tracker that fails while logging is a warning naming it; the other trackers still get the step.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Optional

from .memory.figures import primary_rows
from .memory.readers import MiB


def step_scalars(result) -> dict[str, float]:
    """What a tracker logs for one finished step: {name: value} (names in the module docstring)."""
    out = {
        f"train/{k}": float(v)
        for k, v in result.metrics().items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and math.isfinite(v)
    }
    rows = [
        r for r in result.memory if not r.get("failed_attempt")
    ]  # why: a retried phase's first try is not the step's
    for r in primary_rows(rows):
        device = r["device"]
        out[f"memory/{device}/{r['phase']}/peak_mib"] = r["peak"] / MiB
        out[f"memory/{device}/{r['phase']}/delta_mib"] = r["delta"] / MiB
        out[f"memory/{device}/peak_mib"] = max(out.get(f"memory/{device}/peak_mib", 0.0), r["peak"] / MiB)
    return out


class TensorBoard:
    package = "tensorboard"

    def __init__(self, config, where: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(where / "tensorboard"))

    def log(self, scalars: dict, step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # why: a killed run keeps every finished step, as metrics.jsonl does

    def close(self) -> None:
        self.writer.close()


class WandB:
    package = "wandb"

    def __init__(self, config, where: Path):
        import wandb

        where.mkdir(parents=True, exist_ok=True)
        # why offline: no network on most training nodes and no account needed; `wandb sync` uploads later
        self.run = wandb.init(
            project="grpo_lab", dir=str(where), mode="offline", config=config.to_dict(), reinit="create_new"
        )

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio:
    package = "trackio"
    dir_set: Optional[Path] = None  # the TRACKIO_DIR grpo_lab set in this process (None: the user's, or not set)

    def __init__(self, config, where: Path):
        wanted = (where / "trackio").resolve()
        if "TRACKIO_DIR" not in os.environ:
            os.environ["TRACKIO_DIR"] = str(wanted)  # why before import: trackio reads it once, at import
            Trackio.dir_set = wanted
        import trackio
        import trackio.utils

        self.dir = Path(trackio.utils.TRACKIO_DIR)
        if Trackio.dir_set is not None and self.dir != wanted:
            warnings.warn(
                f"run.report_to: trackio writes to {self.dir}, not {wanted}: it reads TRACKIO_DIR once per "
                "process; set TRACKIO_DIR before the first Lab, or use a new process",
                stacklevel=2,
            )
        self.trackio = trackio
        # why no auto_log: grpo_lab's sampler already reads memory per phase; trackio's would be a second thread
        self.run = trackio.init(
            project="grpo_lab", config=config.to_dict(), embed=False, auto_log_cpu=False, auto_log_gpu=False
        )

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
        if self.trackio.context_vars.current_run.get() is self.run:
            self.trackio.context_vars.current_run.set(None)  # why: else trackio's atexit finishes it a second time


TRACKERS = {"tensorboard": TensorBoard, "trackio": Trackio, "wandb": WandB}


class Trackers:
    """The trackers of run.report_to, opened at load; `log(result)` after each finished step."""

    def __init__(self, config):
        where = Path(config.run.output_dir or ".")
        self.open: dict[str, object] = {}
        try:
            for name in config.run.report_to:
                self.open[name] = TRACKERS[name](config, where)
        except BaseException:
            self.close()
            raise

    def log(self, result) -> None:
        scalars = step_scalars(result)
        for name, tracker in self.open.items():
            try:
                tracker.log(scalars, result.step)
            except Exception as err:  # why warn, not raise: the step is applied and in history; training goes on
                _warn(f"{name} did not take step {result.step}", err, "the step itself finished")

    def close(self) -> None:
        for name, tracker in self.open.items():
            try:
                tracker.close()
            except Exception as err:  # why warn: closing the Lab must still release the models and the other trackers
                _warn(f"{name} did not close", err, "its files may miss the last steps")
        self.open = {}


def _warn(what: str, err: Exception, outcome: str) -> None:
    first = str(err).splitlines()[0] if str(err) else ""
    warnings.warn(f"run.report_to: {what} ({type(err).__name__}: {first}); {outcome}", stacklevel=4)
