"""Long completions in the learner (issue 38): the plan's terms against the figures the H200 frontier recorded
(bench/results/frontier_h200_2026-11-27/), and the rule behind them checked on the CPU at a shrunken shape: the
backward's GPU terms are one layer's recompute, the offload's two layer inputs in flight, one head chunk, and
attention that never builds an L x L matrix."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "frontier_h200_2026-11-27"
PHASES = ("logprobs", "backward", "optimizer")


def recorded() -> list[dict]:
    """Every grpo_lab point, tagged with its run (the folder: the first, `edge` with expandable segments from the
    environment, `default` with grpo_lab's own) and whether it was its side's first step in that run."""
    rows = []
    for path in sorted(RESULTS.rglob("*.jsonl")):
        run = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        run = [r for r in run if r.get("side", "").startswith("grpo_lab") and "length" in r]
        for r in run:
            r["run"], r["first"] = (
                path.parent.name,
                r["length"] == min(o["length"] for o in run if o["side"] == r["side"]),
            )
        rows += run
    return rows


def replan(record: dict) -> tuple[dict, bool]:
    """Today's plan of a recorded point (bench/gpu/frontier.py's overrides): per-phase allocated peaks, and fits."""
    from bench.gpu.frontier import overrides
    from bench.gpu.gpu_check import planned_phases
    from grpo_lab import load_config
    from grpo_lab.planner import plan

    args = argparse.Namespace(
        model=record["model"], dtype="bfloat16", device="cuda:0", prompt=128, generations=record["G"],
        cap_gib=record["cap_gib"],
    )  # fmt: skip
    cfg = load_config("tiny-cpu", overrides(args, record["length"], record["side"].endswith("offload")))
    device = plan(cfg).devices["cuda:0"]
    return planned_phases(device, "allocated", first_step=record["first"]), device.fits


def test_the_h200_frontier_was_recorded():
    points = recorded()
    assert len([r for r in points if "phases" in r]) >= 12
    assert {r["side"] for r in points} == {"grpo_lab", "grpo_lab+offload"}


@pytest.mark.parametrize("record", [r for r in recorded() if "phases" in r], ids=lambda r: f"{r['side']}-{r['length']}")
def test_each_measured_phase_is_within_a_tenth_of_todays_plan(record):
    """Every grpo_lab point that ran: logprobs, backward and optimizer measured/planned in 0.9-1.1 (a change to the
    plan's activation, offload or head terms that misreads the recorded GPU fails here)."""
    planned, _ = replan(record)
    for phase in PHASES:
        measured = record["phases"][phase][0]
        assert 0.9 <= measured / planned[phase] <= 1.1, (phase, measured / planned[phase])


@pytest.mark.parametrize(
    "record",
    [r for r in recorded() if r["run"] in ("edge", "default")],
    ids=lambda r: f"{r['side']}-{r['length']}",
)
def test_with_an_unfragmented_allocator_the_verdict_is_the_measured_one(record):
    """With expandable segments (memory.cuda_expandable_segments, or the environment's), each point the plan says fits
    ran, and each it says does not fit ran out of memory."""
    _, fits = replan(record)
    assert fits == ("phases" in record), record.get("failed")


def test_the_offloads_backward_term_is_linear_in_tokens_and_the_inputs_leave_the_gpu():
    """The rule: with offload the backward's activation term is one layer's recompute plus 2 layer inputs (less the
    head chunk the allocator hands back), affine in tokens (no L x L term); without it, every layer's input stays
    (layers x tokens x hidden x 2 bytes, less the 2 in flight); the host holds what left."""
    from grpo_lab import load_config
    from grpo_lab.planner import plan

    def terms(length: int, offload: bool):
        cfg = load_config(
            "tiny-cpu",
            ["model.name_or_path=builtin:qwen3-8b-random:layers=4", "model.dtype=bfloat16",
             "model.bnb_4bit_compute_dtype=bfloat16", "placement.learner=cuda:0", "placement.gpu_memory_gib=80",
             "generator.backend=synthetic", "generator.max_prompt_length=128",
             f"generator.max_completion_length={length}", "grpo.micro_batch_size=1",
             f"model.activation_offload={str(offload).lower()}"],
        )  # fmt: skip
        p = plan(cfg)
        act = next(i.bytes for i in p.devices["cuda:0"].items if i.what == "activations (backward peak)")
        host = sum(i.bytes for i in p.devices["host"].items if i.what.startswith("offloaded"))
        return act, host

    (a1, h1), (a2, h2), (a3, h3) = (terms(n * 8192 - 128, True) for n in (1, 2, 3))
    assert a3 - a2 == pytest.approx(a2 - a1) and a2 - a1 > 0  # no quadratic term
    assert h2 == pytest.approx(2 * h1) and h3 == pytest.approx(3 * h1)
    plain, none = terms(8192 - 128, False)
    assert none == 0
    assert plain - a1 == pytest.approx(h1 - 2 * 4096 * 2 * 8192)  # 4 layers' inputs kept, less the 2 in flight
    assert h1 == 4 * 4096 * 2 * 8192


def test_a_full_length_micro_batch_attends_without_an_l_by_l_mask(tiny_config, monkeypatch):
    """Full-length completions of one micro-batch have no padding, so transformers' SDPA path gets no mask tensor and
    runs causal (flash or memory-efficient on a GPU; no [L, L] matrix); with offload on, the recompute too."""
    from grpo_lab import Lab

    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, **kwargs):
        calls.append((attn_mask is None, kwargs.get("is_causal"), q.shape[-2]))
        return real(q, k, v, attn_mask, *args, **kwargs)

    config = tiny_config(
        model={"activation_offload": True},
        generator={"backend": "synthetic", "max_completion_length": 64},
        grpo={"num_generations": 2, "prompts_per_step": 1, "micro_batch_size": 1, "learning_rate": 1e-3},
    )
    lab = Lab(config).load()
    try:
        while lab.next_phase() != "backward":
            lab.run_next_phase()
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        lab.run_next_phase()
    finally:
        lab.close()
    assert calls and all(no_mask and causal for no_mask, causal, _ in calls), calls[:3]
    assert min(length for _, _, length in calls) >= 64
