"""bench/gpu_check.py's parts on the CPU, so the GPU check runs the first time a GPU is lent: the process-wide peak
survives the Lab's per-phase peak resets, the grpo_lab worker returns every figure the summary reads (per-phase
peaks beside the plan), and the summary's ratios are each length's grpo_lab / TRL. (The whole check as a dry run:
`python -m bench.gpu_check --device cpu ...`, its docstring.)"""

from __future__ import annotations

import torch

from bench import gpu_check


def test_the_process_peak_is_kept_across_the_labs_resets(monkeypatch):
    allocator = {"peak": 0}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocator["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: allocator.update(peak=0))
    peak = gpu_check.ProcessPeak("cuda:0")
    allocator["peak"] = 900
    torch.cuda.reset_peak_memory_stats(0)  # the Lab's reset at a phase start
    allocator["peak"] = 300
    assert peak.read() == 900
    allocator["peak"] = 1200
    assert peak.read() == 1200


def test_the_grpo_lab_worker_returns_what_the_summary_reads(tiny_model):
    overrides = gpu_check.base_overrides(tiny_model, "cpu", 8) + [
        "model.dtype=float32",
        "model.bnb_4bit_compute_dtype=float32",
    ]
    record = gpu_check.grpo_lab_worker(overrides, steps=1, warmup=0)
    assert len(record["seconds"]) == 1 and record["peak"] > 0 and record["metric"] == "rss"
    assert set(record["phase_peaks"]) == set(gpu_check.PHASES) == set(record["planned"])
    assert all(v > 0 for v in record["planned"].values()) and record["rollout_tokens_per_s"][0] > 0


def test_the_summary_gives_each_lengths_ratio_to_trl():
    mib = gpu_check.MiB
    records = [
        {
            "part": "side_by_side",
            "side": "grpo_lab",
            "length": 256,
            "peak": 600 * mib,
            "seconds": [2.0],
            "rollout_tokens_per_s": [500.0],
            "phase_peaks": {"backward": 550 * mib},
            "planned": {"backward": 500 * mib},
        },
        {"part": "side_by_side", "side": "trl", "length": 256, "peak": 800 * mib, "seconds": [3.0]},
        {"part": "side_by_side", "side": "trl", "length": 1024, "failed": "timed out after 170 s"},
    ]
    text = gpu_check.table(records)
    assert "| 256 | grpo_lab | 600 | 2.00 | 500 | 0.75 |" in text
    assert "| 256 | grpo_lab | backward | 550 | 500 | 1.10 |" in text
    assert "| 1024 | trl | timed out after 170 s |" in text
