"""The guided notebooks' trials (notebooks/03-05; 02's story is a plan and a refusal, asserted by
tests/test_notebook_stories.py) on this machine: each executed under papermill with its defaults,
and its facts (the JSON its last cell prints) read back: the failing setting's peak against the budget's line, the
fix's, and where each peak was. Also the textbook head's measured bytes per logit (the planner's
FULL_HEAD_FLOAT32_COPIES), from one backward of logits-heavy-cpu.

    python -m bench.probes.notebook_stories [--out DIR] [--only 04]

Prints one line per notebook and writes DIR/stories.json (default: a temporary folder). The figures in
docs/benchmarks.md "The notebook stories" came from these notebooks' runs on the 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STORIES = ["03_chunked_generation", "04_logprob_memory", "05_reference_and_offload"]


def run(name: str, out: Path) -> dict:
    import nbformat
    import papermill as pm

    start = time.perf_counter()
    pm.execute_notebook(
        str(ROOT / "notebooks" / f"{name}.ipynb"),
        str(out / f"{name}.ipynb"),
        cwd=str(ROOT),
        parameters={"steps": 1},
        kernel_name="python3",
        progress_bar=False,
    )
    from grpo_lab.ui.story import facts_in

    facts = facts_in(nbformat.read(out / f"{name}.ipynb", as_version=4))
    facts["seconds"] = time.perf_counter() - start
    return facts


def full_head_bytes_per_logit() -> dict:
    """One backward of logits-heavy-cpu with grpo.logprob_head: full; its RSS rise over rows x vocab."""
    import torch

    from grpo_lab import Lab
    from grpo_lab.models.shapes import load_shape

    lab = Lab("logits-heavy-cpu", overrides=["grpo.logprob_head=full"]).load()
    rollout = lab.rollout()
    advantages = lab.advantages(lab.rewards(rollout))
    advantages.values.copy_(torch.linspace(-1.0, 2.0, len(rollout)))
    lab.backward(rollout, advantages, lab.logprobs(rollout))
    row = [r for r in lab.memory.phase_rows if r["phase"] == "backward" and r["metric"] == "rss"][-1]
    rows = int(rollout.completion_mask.sum())
    vocab = load_shape(lab.config.model.name_or_path).vocab
    lab.close()
    rise = row["peak"] - row["start"]
    return {"rows": rows, "vocab": vocab, "rise_mib": rise / 2**20, "bytes_per_logit": rise / (rows * vocab)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default=None, help="one notebook's number (03, 04, 05), or 'head'")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="grpo-lab-stories-"))
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in STORIES:
        if args.only and not name.startswith(args.only):
            continue
        facts = results[name] = run(name, out)
        f, x = facts["failing"], facts["fixed"]
        print(
            f"{name}: {f['label']} {f['peak_mib']:,.0f} MiB ({f['phase']}) over the {f['line_mib']:,.0f} MiB line, "
            f"stopped; {x['label']} {x['peak_mib']:,.0f} MiB ({x['phase']}), ran; {facts['seconds']:.0f} s"
        )
    if args.only in (None, "head"):
        head = results["full_head"] = full_head_bytes_per_logit()
        print(
            f"full head: {head['rise_mib']:,.0f} MiB for {head['rows']:,} rows x {head['vocab']:,} vocab = "
            f"{head['bytes_per_logit']:.2f} bytes per logit"
        )
    (out / "stories.json").write_text(json.dumps(results, indent=1, default=float))
    print(f"wrote {out / 'stories.json'}")


if __name__ == "__main__":
    main()
