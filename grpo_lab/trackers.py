"""`run.report_to`: each finished step's metrics and per-phase memory peaks go to the trackers users
already use (TRL's option name). Names, per step (`step` = the GRPO step):

    train/<metric>                       every finite scalar of StepResult.metrics(): reward_mean, loss, kl,
                                         grad_norm, reward/<function>, seconds/<phase>, step_seconds, ...
    memory/<device>/<phase>/peak_mib     the device's primary metric (host: RSS; GPU: NVML used, else reserved)
    memory/<device>/<phase>/delta_mib    its change over the phase (end - start)
    memory/<device>/peak_mib             the step's peak over its phases

Trackers (each an optional extra, `pip install 'grpo-lab[NAME]'`), writing under run.output_dir (else "."):
    tensorboard  DIR/tensorboard (torch's SummaryWriter)
    wandb        DIR/wandb, always offline (`wandb sync DIR/wandb/offline-run-*` uploads it later)
    trackio      local SQLite in TRACKIO_DIR (set to DIR/trackio unless the environment sets it)
"""
from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

from .memory.figures import primary_metric
from .memory.probes import MiB


def step_scalars(result) -> dict[str, float]:
    """What a tracker logs for one finished step: {name: value} (names in the module docstring)."""
    out = {f"train/{k}": float(v) for k, v in result.metrics().items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and math.isfinite(v)}
    rows = [r for r in result.memory if not r.get("failed_attempt")]   # why: a retried phase's first try is not the step's
    metrics_of: dict[str, set] = {}
    for r in rows:
        metrics_of.setdefault(r["device"], set()).add(r["metric"])
    for r in rows:
        device = r["device"]
        if r["metric"] != primary_metric(device, metrics_of[device]):
            continue
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
        self.writer.flush()   # why: a killed run keeps every finished step, as metrics.jsonl does

    def close(self) -> None:
        self.writer.close()


class WandB:
    package = "wandb"

    def __init__(self, config, where: Path):
        import wandb

        where.mkdir(parents=True, exist_ok=True)
        # why offline: no network on most training nodes and no account needed; `wandb sync` uploads later
        self.run = wandb.init(project="grpo_lab", dir=str(where), mode="offline", config=config.to_dict(),
                              reinit="create_new")

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackio:
    package = "trackio"

    def __init__(self, config, where: Path):
        os.environ.setdefault("TRACKIO_DIR", str(where / "trackio"))   # why before import: trackio reads it then
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project="grpo_lab", config=config.to_dict(), embed=False)

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


TRACKERS = {"tensorboard": TensorBoard, "trackio": Trackio, "wandb": WandB}


def installed(name: str) -> bool:
    """Whether a tracker's package can be imported (looked up, not imported: wandb takes seconds)."""
    try:
        return importlib.util.find_spec(TRACKERS[name].package) is not None
    except ValueError:   # why: a module set to None in sys.modules (how a test hides one) raises here
        return False


def resolve(value) -> list[str]:
    """run.report_to as TRL takes it: a name, a list of names, "none" (= []) or "all" (= every installed one).
    Raises ValueError (one line, for the config) for an unknown name or a tracker that is not installed."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return value   # why: pydantic then names the wrong type
    if names in (["none"], []):
        return []
    if names == ["all"]:
        found = [n for n in TRACKERS if installed(n)]
        if not found:
            raise ValueError(f"'all', but no tracker is installed; pip install 'grpo-lab[trackers]' (or one of "
                             f"{sorted(TRACKERS)})")
        return found
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"unknown tracker {name!r}; use some of {sorted(TRACKERS)}, 'all' or 'none'")
        if not installed(name):
            raise ValueError(f"{name!r} needs the {TRACKERS[name].package} package; pip install 'grpo-lab[{name}]'")
    return list(dict.fromkeys(names))


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
        for tracker in self.open.values():
            tracker.log(scalars, result.step)

    def close(self) -> None:
        for tracker in self.open.values():
            tracker.close()
        self.open = {}
