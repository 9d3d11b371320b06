"""One step lifecycle: a phase walk and `step()` are the same step; a step ends when its sync ends; phases out
of order are refused in one line; a failure in any phase leaves the LoRA weights and AdamW state bit-identical
to before that step (not before an earlier one), and the failed attempt's timings and memory rows stay apart."""

import math

import pytest
from test_numerics import assert_same_state, train_state

import grpo_lab.algo.grpo as step_module
from grpo_lab import Lab, LabError
from grpo_lab.algo.phases import PHASE_NAMES

# num_iterations 2: every step has two backward/optimizer pairs, so a failure can come after an applied update
SECTIONS = dict(grpo={"beta": 0.04, "num_iterations": 2, "learning_rate": 5e-3}, lora={"lora_dropout": 0.1})


def comparable(result) -> dict:
    skip = ("step_seconds", "sync_seconds", "memory", "leaks")
    return {k: v for k, v in result.metrics().items() if not k.startswith("seconds/") and k not in skip}


def walk(lab):
    """One step, one phase at a time, as a notebook user types it."""
    rollout = lab.rollout()
    advantages = lab.advantages(lab.rewards(rollout))
    logprobs = lab.logprobs(rollout)
    for _ in range(lab.config.grpo.num_iterations):
        lab.backward(rollout, advantages, logprobs)
        lab.optimizer()
    return lab.sync()


def test_phase_walk_and_step_are_the_same_step(tiny_config):
    stepped = Lab(tiny_config(**SECTIONS)).load()  # one after the other: each load seeds the global RNG
    by_step = [stepped.step() for _ in range(2)]
    walked = Lab(tiny_config(**SECTIONS)).load()
    by_walk = [walk(walked) for _ in range(2)]
    assert [comparable(r) for r in by_step] == [comparable(r) for r in by_walk]
    assert [r.step for r in by_walk] == [0, 1] and walked.step_index == 2 and len(walked.history) == 2
    assert by_walk[0].iterations == 2 and by_walk[0].attempts == 1
    assert_same_state(walked, train_state(stepped))
    assert set(by_walk[1].phase_seconds) == set(PHASE_NAMES)
    assert {r["phase"] for r in by_walk[1].memory} == set(PHASE_NAMES)


def test_the_step_index_is_the_lifecycles_own(loaded_lab):
    lab = loaded_lab()
    with pytest.raises(AttributeError):
        lab.step_index += 1
    walk(lab)
    assert lab.step_index == 1 and lab.current.snapshot is None and lab.next_phase() == "rollout"


def fail_on_call(monkeypatch, phase, when):
    """Make step.<phase> raise on its `when`-th call from now; the optimizer fails after its update is
    applied, so the rollback has something to undo."""
    real, calls = getattr(step_module, phase), {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] != when:
            return real(*args, **kwargs)
        if phase == "optimizer":
            real(*args, **kwargs)
        raise RuntimeError(f"injected failure in {phase}")

    monkeypatch.setattr(step_module, phase, failing)


CASES = [(p, 1) for p in PHASE_NAMES] + [
    ("backward", 2),
    ("optimizer", 2),
]  # call 2: the second iteration, one update applied


@pytest.mark.slow  # 19 steps (~40 s on 2 cores)
def test_a_failure_in_any_phase_leaves_the_step_as_it_was_and_the_retry_is_clean(loaded_lab, monkeypatch):
    """Step 0 is a phase walk; then each step k fails once in CASES[k-1]'s phase and is retried. Weights and
    AdamW state after the failure are those after step k-1 (not before an earlier step), bit for bit, and
    the retry's result, timings and memory rows are those of a clean step."""
    lab = loaded_lab(**SECTIONS)
    walk(lab)
    for k, (phase, when) in enumerate(CASES, start=1):
        before = train_state(lab)
        fail_on_call(monkeypatch, phase, when)
        with pytest.raises(RuntimeError, match=f"injected failure in {phase}"):
            lab.step()
        monkeypatch.undo()
        assert_same_state(lab, before)
        assert all(p.grad is None for p in lab.learner.model.parameters()), phase
        assert lab.step_index == k and len(lab.history) == k and lab.current.updates == 0, phase

        result = lab.step()  # the retry goes on from the failed phase
        assert (result.step, result.attempts, result.iterations, lab.step_index) == (k, 2, 2, k + 1), phase
        assert math.isfinite(result.loss)
        assert phase in {r["phase"] for r in lab.memory.rows_for(k, failed_attempts=True)}
        kept = lab.memory.rows_for(k)
        rows_per_call = len({(r["device"], r["metric"]) for r in kept if r["phase"] == "rollout"})
        for p in PHASE_NAMES:  # the retry's rows only: each phase as often as in a clean step
            expected = rows_per_call * (2 if p in ("backward", "optimizer") else 1)
            assert sum(r["phase"] == p for r in kept) == expected, (phase, p)
        timed = [r for r in lab.timeline.records if r.step == k]
        assert any(r.failed_attempt == 1 and r.phase == phase for r in timed), phase
        assert sum(r.failed_attempt is None and r.phase == "backward" for r in timed) == 2, phase
        assert set(result.phase_seconds) == set(PHASE_NAMES)


def test_phases_out_of_order_are_refused_in_one_line(loaded_lab):
    lab = loaded_lab(grpo={"num_iterations": 1})
    old = lab.rollout()
    old_adv = lab.advantages(lab.rewards(old))
    old_lp = lab.logprobs(old)
    with pytest.raises(LabError, match=r"^optimizer: step 0 has no gradients to apply; run lab\.backward"):
        lab.optimizer()
    with pytest.raises(LabError, match=r"^sync: step 0 has done 0 of grpo\.num_iterations = 1"):
        lab.sync()
    lab.backward(old, old_adv, old_lp)
    with pytest.raises(LabError, match=r"^rollout: step 0 has gradients waiting for lab\.optimizer\(\)"):
        lab.rollout()
    lab.optimizer()
    with pytest.raises(LabError, match=r"^backward: step 0 has done its 1 update"):
        lab.backward(old, old_adv, old_lp)
    with pytest.raises(LabError, match=r"^rewards: step 0 has applied 1 update"):
        lab.rewards(old)
    lab.sync()
    new = lab.rollout()
    for phase, call in (("rewards", lambda: lab.rewards(old)), ("logprobs", lambda: lab.logprobs(old))):
        # issue 40: the line starts with the phase called (it read "rollout:" for a stale lab.rewards(...))
        with pytest.raises(LabError, match=rf"^{phase}: this is step 0's rollout, not the one step 1 produced") as err:
            call()
        assert "\n" not in str(err.value)
    adv = lab.advantages(lab.rewards(new))
    with pytest.raises(LabError, match=r"^backward: step 1 has no logprobs yet; run lab\.logprobs"):
        lab.backward(new, adv, old_lp)
    lab.logprobs(new)
    with pytest.raises(LabError, match=r"^backward: this is an earlier logprobs, not the one step 1 produced"):
        lab.backward(new, adv, old_lp)
    assert lab.step().step == 1  # refusals left the step usable


def test_a_restarted_rollout_files_the_first_as_a_failed_attempt(loaded_lab):
    lab = loaded_lab()
    first = lab.rollout()
    lab.rewards(first)
    second = lab.rollout()  # no update yet: the user may start the step over
    with pytest.raises(LabError, match="not the one step 0 produced"):
        lab.rewards(first)
    lab.advantages(lab.rewards(second))
    result = lab.step()
    assert result.attempts == 2 and sum(r["phase"] == "rollout" for r in lab.memory.rows_for(0)) == sum(
        r["phase"] == "sync" for r in lab.memory.rows_for(0)
    )
    assert {r["phase"] for r in lab.memory.rows_for(0, failed_attempts=True)} == {"rollout", "rewards"}


def test_a_restarted_rollout_samples_the_steps_own_prompts_again(loaded_lab):
    """Redoing a step's rollout (e.g. to compare a setting on it, as notebook 06 does with the generation gather) must
    sample the same prompts; it drew the next batch, which the random model's look-alike greedy completions hid until
    the trained model showed different problems. The step after it draws what it would have drawn anyway."""
    lab, twin = loaded_lab(), loaded_lab()
    first = lab.rollout()
    lab.configure(generator={"temperature": 0.7})
    again = lab.rollout()
    assert again.batch.prompts == first.batch.prompts and again.batch.answers == first.batch.answers
    lab.step()
    twin.step()
    assert lab.rollout().batch.prompts == twin.rollout().batch.prompts


def test_a_failed_rollout_is_undone_with_its_draw_of_prompts(loaded_lab, monkeypatch):
    """A rollout that fails (out of memory here, anywhere in a tool loop's turns as well) is undone with the prompts
    it drew: the retry samples the step's own prompts, and the steps after draw what they would have drawn. A
    rollout that fails before it draws puts back nothing it did not take (the step before keeps its batch)."""
    import grpo_lab.execution.local as local

    lab, twin = loaded_lab(), loaded_lab()
    lab.arm_fault(0, "rollout", "oom")
    with pytest.raises(LabError, match="out of memory in phase 'rollout'"):
        lab.rollout()
    assert lab.rollout().batch.prompts == twin.rollout().batch.prompts
    lab.step(), twin.step()
    real = local.grpo.rollout
    monkeypatch.setattr(local.grpo, "rollout", lambda *a, **k: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(LabError, match="out of memory in phase 'rollout'"):
        lab.rollout()  # (fails before its draw)
    monkeypatch.setattr(local.grpo, "rollout", real)
    assert lab.rollout().batch.prompts == twin.rollout().batch.prompts


def test_the_rollback_snapshot_is_taken_inside_the_optimizer_phase(loaded_lab, monkeypatch):
    """A host MemoryError while copying the LoRA + AdamW state is that phase's one-line error, nothing applied."""
    import grpo_lab.recovery.rollback as rollback

    lab = loaded_lab()
    lab.step()
    before = train_state(lab)
    rollout = lab.rollout()
    lab.backward(rollout, lab.advantages(lab.rewards(rollout)), lab.logprobs(rollout))
    monkeypatch.setattr(
        rollback.RollbackSnapshot, "__init__", lambda self, learner: (_ for _ in ()).throw(MemoryError())
    )
    with pytest.raises(LabError, match=r"^out of memory in phase 'optimizer' of step 1 on host") as err:
        lab.optimizer()
    assert "\n" not in str(err.value)
    assert_same_state(lab, before)
    monkeypatch.undo()
    assert lab.current.snapshot is None
    lab.backward(rollout, lab.current.advantages, lab.current.logprobs)
    lab.optimizer()
    assert lab.current.snapshot is not None  # the step's snapshot, while the step is open...
    lab.sync()
    assert lab.current.snapshot is None  # ...dropped when it ends


def test_a_profiler_trace_of_one_step_names_every_phase(loaded_lab, tmp_path):
    """Each phase is a torch.profiler range (grpo_lab.<phase>): a trace of lab.step() shows GRPO phases by name,
    in the exported Chrome trace too."""
    import json

    from torch.profiler import ProfilerActivity, profile

    from grpo_lab.algo.phases import PHASE_NAMES

    lab = loaded_lab()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        lab.step()
    names = {e.name for e in prof.events()}
    assert {f"grpo_lab.{p}" for p in PHASE_NAMES} <= names, sorted(n for n in names if n.startswith("grpo_lab"))
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    traced = {e.get("name") for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]}
    assert {f"grpo_lab.{p}" for p in PHASE_NAMES} <= traced
