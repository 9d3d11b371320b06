"""`builtin:tiny-tools` calls its calculator by itself on the vllm backend: the `tiny-tools` preset's headless run, two
steps, counts the calls its rows made (no forcing; tests/test_vllm_tools.py forces the random model's calls).
Slow: a vLLM engine of its own, and it builds builtin:tiny-tools once per session where the cache lacks it."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm_tools")]  # why the group: one vLLM engine at a time


def test_tiny_tools_calls_its_calculator_on_vllm(user_cache, tmp_path):
    from grpo_lab.config.loading import load_config
    from grpo_lab.runner import run

    overrides = ["run.steps=2", "generator.backend=vllm", "generator.hf_decode=dynamic", "grpo.prompts_per_step=4"]
    run_dir = run(load_config("tiny-tools", overrides), out=str(tmp_path), progress=False)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:  # (the preset's model calls it on ~0.3-0.7 of its rows: docs/benchmarks.md, "tiny-tools")
        assert 0 < row["tool_calls_per_row"] and row["turns_mean"] > 1, row
        assert 0.5 < row["prefix_cache_hit_rate"] < 1  # the shared system prompt and tools, and the turns before
    # the run's report tables each step's hit rate beside its tool figures
    table = (run_dir / "report.html").read_text().split("<h2>Tool calls per step</h2>")[1].split("</table>")[0]
    assert re.findall(r"<th[^>]*>([^<]*)</th>", table)[-1] == "prefix cache hit"
    shown = [re.findall(r"<td[^>]*>([^<]*)</td>", line)[-1] for line in table.split("<tr>")[2:]]
    assert shown == [f"{row['prefix_cache_hit_rate']:.0%}" for row in rows]
