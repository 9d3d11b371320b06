"""Measured points on the fit frontier (`grpo-lab plan --frontier --measured FILE`): the records of a frontier run
(bench/gpu/frontier.py's JSON lines: side, model, length, G, and a peak or the failure) marked on the planned grid, so
the page shows the measured edge beside the planned one. Only records of this config's model and side (activation
offload on or off; TRL's are not grpo_lab's plan) count, on the grid's micro-batch 1 cells; a later record of the
same point wins (a rerun)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..errors import LabError


def read_records(path: str, what: str = "--measured") -> list[dict]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise LabError(
            f"{what}: cannot read {path!r} ({err.strerror}); give a frontier.jsonl of bench/gpu/frontier.py"
        ) from None
    try:
        return [json.loads(line) for line in lines if line.strip()]
    except json.JSONDecodeError as err:
        raise LabError(
            f"{what}: {path!r} is not JSON lines ({err.msg}); give a frontier.jsonl of bench/gpu/frontier.py"
        ) from None


def mark(front, records: list[dict]):
    """`front` with each cell a record measured marked: 'ran, peak X GiB' or the one-line failure."""
    config = front.config
    side = "grpo_lab+offload" if config.model.activation_offload else "grpo_lab"
    seen = {}
    for r in records:
        if r.get("side") == side and r.get("model") == config.model.name_or_path and "length" in r:
            outcome = f"ran, peak {r['peak'] / 1024**3:.2f} GiB" if "phases" in r else "out of memory"
            seen[(r["length"], r["G"], 1)] = outcome
    cells = [replace(c, measured=seen.get(c.point)) for c in front.cells]
    return replace(front, cells=cells)


def edges(front) -> list[str]:
    """Per num_generations with a measured point, at micro-batch 1: the longest length planned to fit, the longest
    measured to run and the first measured to fail."""
    lines = []
    for g in front.generations:
        row = [c for c in front.cells if c.generations == g and c.micro_batch == 1]
        ran = [c.length for c in row if c.measured and c.measured.startswith("ran")]
        failed = [c.length for c in row if c.measured and not c.measured.startswith("ran")]
        if not ran and not failed:
            continue
        planned = max([c.length for c in row if c.fits], default=None)
        lines.append(
            f"G {g}, micro-batch 1: planned edge {planned or 'none'}; measured: ran up to {max(ran, default='none')}"
            f", first failure {min(failed, default='none')}"
        )
    return lines
