"""Resumable runs: a run killed with SIGKILL at any moment (also in the middle of writing a checkpoint)
continues with `grpo-lab run --resume DIR`, and on the CPU with a fixed seed its metrics equal an
uninterrupted run's. Kills are real: a subprocess runs the CLI and is SIGKILLed, either at a chosen
point inside the checkpoint write (by wrapping os.replace / torch.save in the child) or at whatever
moment a step has just finished."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_lab.cli import main

pytestmark = pytest.mark.xdist_group("resume")  # why: its tests share module-scoped runs: one worker makes them
HERE = Path(__file__).parent
STEPS = 4
RUN = ["tiny-cpu", "--quiet", "--set", "generator.max_completion_length=16", "--set", "run.save_every=1"]
# what training computes; timings, memory readings and the leak verdict are of the machine, not the run
NOT_TRAINING = {"step_seconds", "sync_seconds", "memory", "turn_memory", "leaks"}  # measured, not trained


def training(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in NOT_TRAINING and not k.startswith("seconds/")} for m in metrics]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, user_cache, tiny_model):
    """The uninterrupted run every resumed one must equal."""
    out = tmp_path_factory.mktemp("straight") / "run"
    assert main(["run", *RUN, "--steps", str(STEPS), "--out", str(out)]) == 0
    return training(read_metrics(out))


def killed_child(out: Path, prelude: str = "", extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """`grpo-lab run` (with `extra` arguments) in a child process; `prelude` (Python run first in the child) may
    arrange its own SIGKILL."""
    code = (
        "import os, signal, sys\n" + prelude + "\nfrom grpo_lab.cli import main\n"
        f"sys.exit(main({['run', *RUN, *extra, '--steps', str(STEPS), '--out', str(out)]!r}))\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def resume_and_compare(out: Path, straight: list[dict], capsys) -> None:
    capsys.readouterr()
    # a new run there is refused, pointing at --resume
    code = main(["run", *RUN, "--steps", str(STEPS), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "unfinished run" in err and "--resume DIR" in err, err
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    assert training(read_metrics(out)) == straight
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    assert not list(out.glob(".checkpoint.*")), "leftovers of the interrupted checkpoint write remain"


@pytest.mark.slow
def test_killed_between_the_checkpoint_renames_resumes_to_the_same_metrics(tmp_path, straight, capsys):
    # the worst moment: the old checkpoint is renamed away and the new one not yet in place
    prelude = """
real = os.replace
def replace(src, dst, *a, **k):
    real(src, dst, *a, **k)
    if str(dst).endswith(".checkpoint.old"):   # the second checkpoint write (after step 1), first rename done
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
"""
    out = tmp_path / "run"
    child = killed_child(out, prelude)
    child.communicate(timeout=300)
    assert child.returncode == -signal.SIGKILL
    assert (out / ".checkpoint.old").is_dir() and not (out / "checkpoint").exists()  # the kill landed where meant
    resume_and_compare(out, straight, capsys)


@pytest.mark.slow
def test_killed_while_the_checkpoint_is_half_written_resumes_to_the_same_metrics(tmp_path, straight, capsys):
    prelude = """
import torch
real, calls = torch.save, []
def save(obj, f, *a, **k):
    calls.append(f)
    # third checkpoint: its adapter is written, its state not
    if str(f).endswith("trainer_state.pt") and len(calls) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(obj, f, *a, **k)
torch.save = save
"""
    out = tmp_path / "run"
    child = killed_child(out, prelude)
    child.communicate(timeout=300)
    assert child.returncode == -signal.SIGKILL
    assert list(out.glob(".checkpoint.tmp-*")), "the kill should have left a half-written checkpoint"
    resume_and_compare(out, straight, capsys)


@pytest.mark.slow
def test_killed_at_an_arbitrary_moment_resumes_to_the_same_metrics(tmp_path, straight, capsys):
    out = tmp_path / "run"
    child = killed_child(out)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and child.poll() is None:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and metrics.read_text().count("\n") >= 2:
            break
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)  # wherever it is: between steps, inside step 2, or inside a checkpoint write
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, "the run finished before the kill; the test did not interrupt it"
    resume_and_compare(out, straight, capsys)


# a user's reward drawing from Python's `random` (tests/random_reward.py), in a child whose `random` is seeded as a
# user's script would seed it (grpo_lab seeds torch, not `random`)
SEED = 1234
RANDOM_REWARD = ("--set", "data.rewards=[random_reward:noisy]")
SEEDED = f"sys.path.insert(0, {str(HERE)!r})\nimport random\nrandom.seed({SEED})\n"


@pytest.mark.slow
def test_killed_with_a_reward_drawing_from_random_resumes_to_the_same_metrics(
    tmp_path, tiny_model, capsys, monkeypatch
):
    """The checkpoint holds Python's RNG state too: the resumed steps draw the rewards the uninterrupted run drew."""
    monkeypatch.syspath_prepend(str(HERE))  # the in-process resume imports random_reward too
    # the uninterrupted run, in a child like the killed one: both start from the same seeded `random`
    whole = tmp_path / "straight"
    child = killed_child(whole, SEEDED, RANDOM_REWARD)
    _, err = child.communicate(timeout=300)
    assert child.returncode == 0, err
    straight = training(read_metrics(whole))
    assert len({m["rewards/noisy/mean"] for m in straight}) == STEPS  # the reward did draw, anew each step
    prelude = (
        SEEDED
        + """
import random_reward
real, calls = random_reward.noisy, []
def noisy(*a, **k):
    values = real(*a, **k)
    calls.append(values)
    if len(calls) == 3:   # inside step 2, after its reward drew: the checkpoint after step 1 is the one resumed
        os.kill(os.getpid(), signal.SIGKILL)
    return values
random_reward.noisy = noisy
"""
    )
    out = tmp_path / "run"
    child = killed_child(out, prelude, RANDOM_REWARD)
    child.communicate(timeout=300)
    assert child.returncode == -signal.SIGKILL
    assert len(read_metrics(out)) == 2  # the kill landed inside step 2
    random.seed(SEED)  # the resuming process seeded as the run was: without the checkpoint's state it redraws step 0's
    resume_and_compare(out, straight, capsys)


def test_lab_checkpoint_continues_with_the_same_step_in_a_new_lab(loaded_lab, tmp_path):
    """The notebook path: lab.save_checkpoint between steps, a new Lab (a new kernel) restores and goes on."""
    first = loaded_lab()
    try:
        first.step()
        with pytest.raises(Exception, match=r"save_checkpoint\(\): step 1 is under way .*lab.step\(\)"):
            first.rollout()
            first.save_checkpoint(tmp_path / "ck")
        first.step()  # finishes step 1 (the rollout above started it)
        first.save_checkpoint(tmp_path / "ck")
        going_on = training([first.step().metrics()])
        weights = {n: p.detach().clone() for n, p in first.learner.trainable_parameters().items()}
    finally:
        first.close()
    second = loaded_lab()
    try:
        second.restore_checkpoint(tmp_path / "ck")
        assert second.step_index == 2
        assert training([second.step().metrics()]) == going_on
        for name, param in second.learner.trainable_parameters().items():
            assert param.equal(weights[name]), name
    finally:
        second.close()


def test_a_killed_run_is_reported_as_resumable_and_refuses_a_second_writer(tmp_path, capsys, straight):
    from grpo_lab.recovery.rundir import RunLock

    out = tmp_path / "run"
    assert main(["run", *RUN, "--steps", "2", "--out", str(out)]) == 0
    (out / "run.json").write_text('{"status": "running", "steps": 2}')  # what a SIGKILLed runner leaves
    capsys.readouterr()
    assert main(["run", *RUN, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert (
        "holds an unfinished run (2 of 2 steps done, checkpoint at step 2); resume it with `grpo-lab run --resume DIR`"
        in err
    )
    with RunLock(out, "test"):  # a live run holds the directory: neither a new run nor a resume may write there
        writing = out / ".checkpoint.tmp-live"  # the live run is half-way through its next checkpoint
        writing.mkdir()
        assert main(["run", *RUN, "--out", str(out)]) == 2
        assert "in use by another grpo-lab run" in capsys.readouterr().err
        assert main(["run", "--resume", str(out), "--steps", "3"]) == 2
        assert "in use by another grpo-lab run" in capsys.readouterr().err
        assert writing.is_dir(), "looking at a live run's directory removed the checkpoint it is writing"


def test_resume_keeps_earlier_memory_rows_and_cuts_a_torn_metrics_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", *RUN, "--steps", "2", "--out", str(out)]) == 0  # a checkpoint at step 2...
    with open(out / "metrics.jsonl", "a") as f:  # ...and a line cut short by a kill inside step 2, after it
        f.write('{"step": 2, "reward_me')
    (out / "run.json").write_text('{"status": "running", "steps": 3}')
    before = (out / "memory.csv").read_text().splitlines()
    assert main(["run", "--resume", str(out), "--steps", "3", "--quiet"]) == 0
    assert [m["step"] for m in read_metrics(out)] == [0, 1, 2]
    rows = (out / "memory.csv").read_text().splitlines()
    assert rows[: len(before)] == before  # steps 0-1's samples kept as they were
    earlier = [float(r.split(",")[0]) for r in before[1:]]
    resumed = [float(r.split(",")[0]) for r in rows[len(before) :]]
    steps = {int(r.split(",")[1]) for r in rows[len(before) :]}
    # the resumed process's time goes on after the earlier rows (samples within a process may interleave)
    assert resumed and min(resumed) >= max(earlier) and steps == {2}


@pytest.mark.parametrize(
    "argv, says",
    [
        (["run", "--resume", "{tmp}/nothing"], "--resume: '{tmp}/nothing' holds no grpo_lab run"),
        (["run", "--resume", "{run}", "--out", "{tmp}/x"], "--out: a resumed run stays in its own directory"),
        (
            ["run", "--resume", "{run}", "--steps", "5", "--set", "lora.r=4"],
            "--resume: lora.r is 8 in the run and 4 here",
        ),
        (
            ["run", "tiny-cpu", "--resume", "{run}", "--steps", "5", "--set", "model.load_in_4bit=false"],
            "--resume: model.load_in_4bit",
        ),
        (["run", "--resume", "{run}"], "--resume: '{run}' finished all its 1 steps; pass --steps N with N > 1"),
        (["run"], "give a config (a preset name or a YAML file, e.g. tiny-cpu) or --resume DIR"),
    ],
)
def test_bad_resumes_are_one_line_and_change_nothing(tmp_path, capsys, argv, says, finished_run):
    fill = {"tmp": str(tmp_path), "run": str(finished_run)}
    before = {p: p.stat().st_mtime_ns for p in finished_run.rglob("*")}
    assert main([a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says.format(**fill) in err, err
    assert {p: p.stat().st_mtime_ns for p in finished_run.rglob("*")} == before


def test_a_broken_checkpoint_is_one_line(tmp_path, capsys, finished_run):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "checkpoint" / "trainer_state.pt").unlink()
    assert main(["run", "--resume", str(run), "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trainer_state.pt missing" in err


def test_resume_applies_live_changes(tmp_path, capsys, finished_run):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    assert main(["run", "--resume", str(run), "--steps", "2", "--quiet", "--set", "grpo.learning_rate=0.0002"]) == 0
    assert [m["learning_rate"] for m in read_metrics(run)] == [1e-4, 2e-4]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, user_cache, tiny_model):
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["run", *RUN, "--steps", "1", "--out", str(out)]) == 0
    return out
