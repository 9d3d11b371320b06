"""The worst-case probe: one step at the largest shapes (longest prompt, full-length completions, full micro-batches)
that leaves the Lab bit-identical, and catches before step 0 what an ordinary run meets at step 5."""

import json
import os
import subprocess
import sys

import pytest
import torch

from grpo_lab import Lab
from grpo_lab.cli import main
from grpo_lab.data.prompts import PromptSource
from grpo_lab.errors import LabError

MiB = 1024**2


def same(a, b, path="") -> None:
    """Equal to the bit, through nested dicts and lists of tensors."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


def lengths_seen():
    """A reward that records the prompts and completion lengths it is shown (and gives nothing)."""
    seen = []

    def spy(prompts, completion_ids, **kwargs):
        seen.append((list(prompts), [len(c) for c in completion_ids]))
        return [0.0] * len(prompts)

    return spy, seen


def test_the_probe_runs_the_worst_case_and_leaves_nothing_behind(tiny_config):
    spy, seen = lengths_seen()
    lab = Lab(
        tiny_config(generator={"max_completion_length": 24, "max_prompt_length": 128}), reward_funcs=["format", spy]
    ).load()
    try:
        lab.step()
        state, rng, data = lab.inspect(), torch.get_rng_state(), lab.prompts.state_dict()
        index, history, rows = lab.step_index, len(lab.history), len(lab.memory.phase_rows)
        report = lab.probe()
        # the worst case: every prompt the dataset's longest, every completion max_completion_length tokens
        prompts, lengths = seen[-1]
        longest = lab.prompts.batch_of([lab.prompts.longest(128)[0]]).raw[0]  # as rewards get it (TRL's prompts)
        assert prompts == [longest] * 8 and lengths == [24] * 8
        assert min(seen[0][1]) < 24  # (an ordinary step ends some completions earlier: the probe forced it)
        # nothing kept: LoRA and AdamW bit-identical, RNG, data position, step index, history, the memory views
        after = lab.inspect()
        same(after[0]["lora"], state[0]["lora"])
        same(after[0]["optimizer"], state[0]["optimizer"])
        assert torch.equal(torch.get_rng_state(), rng) and lab.prompts.state_dict() == data
        assert (lab.step_index, len(lab.history), len(lab.memory.phase_rows)) == (index, history, rows)
        # the report: per-phase peaks beside the plan, a verdict
        assert report.fits and report.verdict == "fits" and report.completion_tokens == 24
        assert report.measured("host", "backward") > 0 and report.planned["host"]["backward"] > 0
        text = str(report)
        assert "planned MiB" in text and "backward" in text and text.endswith("verdict: fits")
        # and the run goes on as if no probe had run: the next step equals a twin Lab's
        twin = Lab(
            tiny_config(generator={"max_completion_length": 24, "max_prompt_length": 128}), reward_funcs=["format", spy]
        ).load()
        try:
            twin.step()
            assert lab.step().loss == twin.step().loss
        finally:
            twin.close()
    finally:
        lab.close()


def test_a_probe_is_refused_before_load_and_mid_step(tiny_config):
    lab = Lab(tiny_config())
    with pytest.raises(LabError, match=r"lab.probe\(\): the lab is not loaded; call lab.load\(\) first"):
        lab.probe()
    lab.load()
    try:
        lab.rollout()
        with pytest.raises(LabError, match=r"lab.probe\(\): step 0 is under way"):
            lab.probe()
    finally:
        lab.close()


def long_prompt_at(step: int, n: int, seed: int, words: int) -> list[dict]:
    """n short arithmetic rows and one long one, placed where the lab's seeded order serves it at `step` (one prompt
    per step): PromptSource shuffles indices, so the same source over index rows says where that is."""
    order = PromptSource([{"prompt": str(i)} for i in range(n)], None, None, seed)
    at = (
        int(order.next_batch(1).prompts[0])
        if step == 0
        else [int(order.next_batch(1).prompts[0]) for _ in range(step + 1)][-1]
    )
    rows = [{"prompt": f"what is {i} plus 1?", "answer": str(i + 1)} for i in range(n)]
    rows[at] = {"prompt": "add these: " + " ".join(str(i % 10) for i in range(words)), "answer": "0"}
    return rows


@pytest.mark.slow
def test_the_probe_catches_at_load_the_prompt_an_ordinary_run_meets_at_step_5(tmp_path, tiny_model):
    """A dataset whose one long prompt first comes at step 5, and the host guard's line set between what the short
    steps and the long one use: `run.probe_first` refuses at load naming the phase; without it the run stops at 5."""
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in long_prompt_at(5, 10, 0, 900)))
    sets = [
        f"model.name_or_path={tiny_model}",
        f"data.dataset={data}",
        "data.system_prompt=null",
        "generator.max_prompt_length=990",
        "generator.max_completion_length=24",
        "grpo.prompts_per_step=1",
        "grpo.num_generations=64",
        "grpo.micro_batch_size=64",
        "grpo.beta=0",
        "model.gradient_checkpointing=false",
        "run.save_every=0",
        # why a budget below the machine: the guard then holds this run's own process tree (RSS), which the other
        # tests running beside it on the machine do not move (the machine's used RAM did, and the line was crossed
        # at step 0 on CI)
        "placement.host_memory_gib=8",
    ]
    # what the short steps use and what the long one does; each part in a process of its own (why: an earlier Lab's
    # freed heap in this process would count in its RSS)
    measured = json.loads(
        subprocess.run(
            [sys.executable, "-c", MEASURE, json.dumps(sets)], check=True, capture_output=True, text=True, env=ENV
        ).stdout.splitlines()[-1]
    )
    short, long, limit = measured["short"], measured["long"], measured["limit"]
    assert long - short > 800 * MiB, (long / MiB, short / MiB)  # the scenario's premise: the long step is heavier
    threshold = f"memory.host_threshold={(short + long) / 2 / limit:.6f}"
    # why --force: the plan judges at the guard's line too, and its worst case (every prompt 990 tokens) is past it;
    # this test is about what the probe and the run meet, past the plan's refusal
    args = [a for s in sets + [threshold] for a in ("--set", s)] + ["--force"]

    probed = cli(
        "run",
        "tiny-cpu",
        *args,
        "--set",
        "run.probe_first=true",
        "--out",
        str(tmp_path / "probed"),
        "--steps",
        "8",
        "--quiet",
    )
    line = probed.stderr.strip().splitlines()[-1]
    assert probed.returncode == 2, probed.stderr[-3000:]
    assert line.startswith("grpo-lab: error: run.probe_first: the worst-case step") and "does not fit" in line
    assert "phase backward" in line or "phase rollout" in line, line
    assert "worst-case probe" in probed.stdout and not (tmp_path / "probed").exists()  # refused before any file

    plain = cli("run", "tiny-cpu", *args, "--out", str(tmp_path / "plain"), "--steps", "8", "--quiet")
    line = plain.stderr.strip().splitlines()[-1]
    assert plain.returncode == 2 and "host RAM reached" in line and "of step 5" in line, plain.stderr[-3000:]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
MEASURE = """
import json, sys, warnings
warnings.filterwarnings("ignore")
from grpo_lab import Lab
lab = Lab("tiny-cpu", overrides=json.loads(sys.argv[1])).load()
for _ in range(3):
    lab.step()
# the short steps' and the load's highest used RAM (the process tree's RSS under the budget): every sample so far
# (the guard sees the load's too)
short = max(s[-1] for s in lab.memory.samples_since(0) if s[3] == "host" and s[4] == "used")
report = lab.probe()
long = max(report.measured("host", p, "used") or 0 for p in ("rollout", "logprobs", "backward"))
print(json.dumps({"short": short, "long": long, "limit": lab.memory.latest("host")["limit"]}))
"""


def cli(*argv):
    return subprocess.run([sys.executable, "-m", "grpo_lab", *argv], capture_output=True, text=True, env=ENV)


def test_grpo_lab_probe_prints_the_plan_and_the_probe(tiny_model, capsys):
    assert main(["probe", "tiny-cpu", "--set", f"model.name_or_path={tiny_model}"]) == 0
    out = capsys.readouterr().out
    assert out.index("memory plan:") < out.index("worst-case probe:") and out.strip().endswith("verdict: fits")
    assert main(["probe", "tiny-cpu", "--set", "grpo.beta=-1"]) == 2
    assert capsys.readouterr().err.startswith("grpo-lab: error: grpo.beta")
