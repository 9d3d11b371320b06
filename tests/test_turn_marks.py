"""A tool loop's rollout seen turn by turn: the memory sampler marks each turn and each round of tool calls inside the
rollout phase (memory/sampler.py `mark`), `grpo-lab run` saves the marks beside memory.csv (marks.csv), the step's
metrics give each mark's peak (StepResult.turn_memory), and the timeline figure draws them."""

from __future__ import annotations

import csv
import json

from test_turn_cache import TEMPLATE, add, forced_turns


def test_each_turn_is_marked_in_the_saved_timeline(tiny_config, monkeypatch, tmp_path):
    from grpo_lab import Lab
    from grpo_lab.config.loading import load_config
    from grpo_lab.runner import _run

    cfg = load_config(
        tiny_config(
            model={"chat_template": TEMPLATE},
            generator={"max_completion_length": 200, "max_prompt_length": 1024, "max_tool_calling_iterations": 2},
            grpo={"beta": 0.0, "num_generations": 2, "prompts_per_step": 2},
            run={"steps": 1},
        )
    )
    lab = Lab(cfg, reward_funcs=["length"], tools=[add]).load()
    forced_turns(monkeypatch, lab.learner.tokenizer, 2)
    _run(cfg, tmp_path, 0, False, False, lab)

    with open(tmp_path / "marks.csv", newline="") as f:
        marks = list(csv.DictReader(f))
    order = list(dict.fromkeys(m["mark"] for m in marks))
    assert order[:4] == ["turn 1", "tools 1", "turn 2", "tools 2"], order
    assert {m["phase"] for m in marks} == {"rollout"} and {m["step"] for m in marks} == {"0"}
    # each mark lies inside the rollout phase's samples, in order, on memory.csv's clock
    with open(tmp_path / "memory.csv", newline="") as f:
        rollout = [float(r["seconds"]) for r in csv.DictReader(f) if r["phase"] == "rollout"]
    starts = [float(m["start"]) for m in marks if m["metric"] == "used"]
    ends = [float(m["end"]) for m in marks if m["metric"] == "used"]
    assert min(rollout) <= starts[0] and ends[-1] <= max(rollout) + 0.01  # (the end: the phase's last reading)
    assert starts == sorted(starts) and all(a <= b for a, b in zip(starts, ends))
    # the step's metrics: each mark's peak, none above the rollout phase's own
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    used = {r["mark"]: r["peak"] for r in record["turn_memory"] if r["device"] == "host" and r["metric"] == "used"}
    assert list(used)[:3] == ["turn 1", "tools 1", "turn 2"]
    phase = next(r for r in record["memory"] if r["phase"] == "rollout" and r["metric"] == "used")
    assert 0 < max(used.values()) <= phase["peak"]
    # the memory table: each mark's peak under the rollout phase's lines
    table = lab.memory_table(0)
    lines = table.splitlines()
    rollout_at = max(i for i, line in enumerate(lines) if line.startswith("rollout "))
    assert lines[rollout_at + 1].startswith("  turn 1 ") and any(line.startswith("  tools 1 ") for line in lines)
    assert "· turn 2" in table._repr_html_()


def test_the_timeline_figure_draws_the_marks(tiny_config):
    from grpo_lab.memory.figures import timeline_figure

    samples = [(t / 10, 0, "rollout", "host", "used", 1e8 + t) for t in range(10)]
    marks = [(0, "rollout", 0.0, 0.9)]
    segments = [
        {"step": 0, "phase": "rollout", "mark": "turn 1", "start": 0.1, "end": 0.4, "failed_attempt": None},
        {"step": 0, "phase": "rollout", "mark": "tools 1", "start": 0.4, "end": 0.5, "failed_attempt": None},
        {"step": 0, "phase": "rollout", "mark": "turn 2", "start": 0.5, "end": 0.9, "failed_attempt": None},
    ]
    figure = timeline_figure(samples, marks, segments=segments)
    texts = [a.text for a in figure.layout.annotations]
    assert {"turn 1", "tools 1", "turn 2"} <= set(texts)
    assert sum(1 for s in figure.layout.shapes if s.name == "turn-mark") == 3
