"""The design's contracts, checked: both executors implement executor.Executor (and reach no further into the Lab
than what they are given), the phase order is written once (grpo.step's calls and the lifecycle's next_phase walk
the same order as phases.PHASES), and a phase returns new values instead of changing its inputs."""

from __future__ import annotations

import inspect

import pytest

from grpo_lab.algo import grpo
from grpo_lab.algo.lifecycle import StepState, next_phase
from grpo_lab.algo.phases import PHASE_NAMES
from grpo_lab.config.loading import load_config
from grpo_lab.execution.contract import Executor


def contract_members() -> set[str]:
    return {name for name in dir(Executor) if not name.startswith("_")} | set(Executor.__annotations__)


@pytest.mark.parametrize("procs", [1, 2], ids=["local", "ranks"])
def test_both_executors_implement_the_contract(tiny_config, procs):
    """Built as the Lab builds them (config, reward functions, step index; never the Lab), each has every member of
    the Protocol, and nothing but those is what the Lab calls (lab.py names no other executor attribute)."""
    import importlib

    from grpo_lab.execution.contract import EXECUTORS

    cfg = load_config(tiny_config(placement={"learner_procs": procs}))
    module, _, attr = EXECUTORS["local" if procs == 1 else "ranks"].partition(":")
    executor = getattr(importlib.import_module(module), attr)(cfg, None, lambda: 7)
    assert isinstance(executor, Executor)
    missing = [m for m in contract_members() if not hasattr(executor, m)]
    assert not missing, missing
    assert executor.config is cfg and executor.reward_funcs and not executor.rewards_given
    assert "lab" not in inspect.signature(type(executor).__init__).parameters


def test_the_lab_asks_its_executor_only_what_the_contract_names():
    import ast
    from pathlib import Path

    import grpo_lab

    root = Path(grpo_lab.__file__).parent
    asked = set()
    for path in (root / "lab.py", root / "ui" / "views.py", root / "config" / "edits.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
                if node.value.attr == "executor":
                    asked.add(node.attr)
    assert asked and asked <= contract_members(), asked - contract_members()


def test_the_algorithm_and_the_generator_pass_through_the_executors_sharding(tiny_config):
    """Issue 48: algo/ and generation/ reach a sharded learner only through the executor contract's `Sharding`, which
    the executor hands to the learner it loads. A recording `Sharding` given to the executor sees every pass a step
    runs: the rollout's generation set-up, each log-prob pass (reference and backward), the gradient norm whole, each
    LoRA weight's shard checked after the update."""
    from collections import Counter
    from contextlib import contextmanager

    from grpo_lab import Lab
    from grpo_lab.models.fsdp import FSDP

    seen: Counter = Counter()

    class Recording(FSDP):
        @contextmanager
        def agreed(self, *models):
            seen["agreed"] += 1
            with FSDP.agreed(*models):
                yield

        def full(self, t):
            seen["full"] += 1
            return FSDP.full(t)

        def local(self, t):
            seen["local"] += 1
            return FSDP.local(t)

        @contextmanager
        def generation(self, model, gather):
            seen["generation"] += 1
            with FSDP.generation(model, gather):
                yield

    lab = Lab(tiny_config(grpo={"beta": 0.04, "micro_batch_size": 4}))
    lab.executor.sharding = Recording()
    lab.load()
    assert lab.learner.sharding is lab.executor.sharding
    lab.step()
    lora = len(lab.learner.trainable_parameters())
    # 8 completions in micro-batches of 4: 2 reference passes and 2 backward passes; one generate for the rollout
    assert seen == {"generation": 1, "agreed": 4, "full": 1, "local": lora}, seen


class Recorder:
    """Phases that record their calls, each returning a token of what it produced."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def run(*inputs):
            self.calls.append(name)
            return f"{name}-out"

        return run


@pytest.mark.parametrize("iterations", [1, 3])
def test_step_calls_the_phases_in_the_registrys_order(iterations):
    phases = Recorder()
    assert grpo.step(phases, iterations) == "sync-out"
    four, updates = list(PHASE_NAMES[:4]), ["backward", "optimizer"] * iterations
    assert phases.calls == four + updates + ["sync"]
    assert [n for n in dict.fromkeys(phases.calls)] == list(PHASE_NAMES)


@pytest.mark.parametrize("iterations", [1, 2])
def test_the_lifecycles_next_phase_walks_the_same_order_as_step(iterations):
    """next_phase reads PHASES' done rules; walking a step with it gives grpo.step's sequence."""
    produced = {"rollout": "rollout", "rewards": "rewards", "advantages": "advantages", "logprobs": "logprobs"}
    state, walked = StepState(index=0), []
    while True:
        name = next_phase(state, iterations)
        walked.append(name)
        if name == "sync":
            break
        if name in produced:
            setattr(state, produced[name], object())
        elif name == "backward":
            state.gradients = True
        else:
            state.gradients, state.updates = False, state.updates + 1
        assert len(walked) < 20
    recorder = Recorder()
    grpo.step(recorder, iterations)
    assert walked == recorder.calls


def test_backward_changes_none_of_its_inputs(loaded_lab):
    """The old log-probs the first backward records come back in its result and in the step's state; the LogProbs it
    was given is unchanged (the same fields, the same tensors)."""
    lab = loaded_lab(grpo={"num_iterations": 2, "beta": 0.04})
    rollout = lab.rollout()
    advantages = lab.advantages(lab.rewards(rollout))
    logprobs = lab.logprobs(rollout)
    before = dict(vars(logprobs))
    lab.backward(rollout, advantages, logprobs)
    assert vars(logprobs).keys() == before.keys()
    assert all(getattr(logprobs, k) is v for k, v in before.items())
    first_old = lab.current.old_logprobs
    assert first_old is not None and first_old.shape == rollout.completion_ids.shape
    lab.optimizer()
    lab.backward(rollout, advantages, logprobs)
    assert lab.current.old_logprobs is first_old  # the later iteration reuses the first's, as given
