"""The tool loop on a sharded learner (placement.learner_procs > 1): each rank runs it on the rows it samples, its
engine calls kept in step with the other ranks' (generation/sample_once.py), and the rollout is gathered whole.

Real parts: 2 gloo CPU ranks under Ray, `builtin:tiny-tools` (it calls its calculator some of the time of its own
accord; nothing is forced), its environment class passed to the Lab as a Python object defined in a function (so
cloudpickle sends it by value), the reference is one process of the same config and seed, compared as
tests/test_sharded.py compares (the same tokens and rewards, the loss within LOSS_TOL)."""

from __future__ import annotations

import threading

import pytest
import torch

from grpo_lab import Lab
from grpo_lab.errors import LabError

pytestmark = [pytest.mark.solo, pytest.mark.xdist_group("ranks")]  # why solo: it starts Ray, two ranks

SHARDED = ["placement.learner_procs=2", "generator.hf_decode=dynamic"]  # (merged: a copy of the whole model)
LOSS_TOL = dict(rel=1e-5, abs=1e-6)  # tests/test_sharded.py's: gloo sums the two ranks' gradients in another order
SAMPLER_TOL = 1e-5  # tests/test_sharded_rollout.py's: a rank's forward runs another batch size
SMALL = [
    "grpo.prompts_per_step=2",
    "grpo.num_generations=4",
    "generator.hf_decode=dynamic",
    "generator.tools=[]",  # the calculator comes as the environment's method instead (by value, below)
    "data.rewards=[exact_answer,tests.tool_reward:tool_messages]",
    # why seed 2: rank 1's group calls the calculator (rows 4 and 7), rank 0's does not; so rank 0 samples a stand-in
    # beside rank 1's second turn, and its rewards read environments that only rank 1 stepped
    "run.seed=2",
]


def calculator_environment():
    """An environment class made in a function (cloudpickle sends it by value): its calculator is the built-in one,
    counted; get_reward is the row's calls (a row whose tools ran on another rank counts only if that rank's instance
    came back with the rollout)."""
    from grpo_lab.data.calculator import calculator as compute

    class Calculator:
        def reset(self, **row):
            self.calls = 0

        def calculator(self, expression: str) -> str:
            """Compute an arithmetic expression.

            Args:
                expression: Numbers with + - * / and parentheses, e.g. "15 * 8".
            """
            self.calls += 1
            return compute(expression)

        def get_reward(self) -> float:
            return float(self.calls)

    return Calculator


def one_step(lab) -> tuple:
    rollout = lab.rollout()
    rewards = lab.rewards(rollout)
    advantages = lab.advantages(rewards)
    stats = lab.backward(rollout, advantages, lab.logprobs(rollout))
    lab.optimizer()
    return rollout, rewards, stats, lab.sync()


@pytest.fixture(scope="module")
def one_process():
    lab = Lab("tiny-tools", overrides=SMALL, environment_factory=calculator_environment()).load()
    try:
        return one_step(lab)
    finally:
        lab.close()


@pytest.mark.slow
@pytest.mark.cores(2)
def test_two_ranks_run_the_tool_loop_on_their_rows_like_one_process(one_process, ray_local):
    rollout, rewards, stats, result = one_process
    calls = torch.tensor(rollout.tool_calls)
    assert rollout.tool_calls == [0, 0, 0, 0, 1, 0, 0, 1]  # rank 1's group alone (the seed's outcome, see SMALL)
    lab = Lab("tiny-tools", overrides=SMALL + SHARDED, environment_factory=calculator_environment()).load()
    try:
        assert type(lab.executor).__name__ == "RankExecutor"
        mine = one_step(lab)
        rows = [rank["generated_rows"] for rank in lab.inspect()]
        lab.configure(generator={"gather_for_generation": False})  # through the shards: every forward synced
        synced = lab.rollout()  # (its turns prefill; a rank's one-token stand-ins run beside the other's turns)
    finally:
        lab.close()
    got, got_rewards, got_stats, got_result = mine
    assert min(rows) >= 4  # each rank sampled its own group's rows (its turns and its stand-ins beside them)
    for field in ("prompt_ids", "completion_ids", "completion_mask", "tool_mask", "truncated"):
        assert torch.equal(getattr(got, field), getattr(rollout, field)), field
    assert (got.tool_mask == 0).any() and got.tool_calls == rollout.tool_calls and got.turns == rollout.turns
    assert (got.sampler_logprobs - rollout.sampler_logprobs).abs().max().item() <= SAMPLER_TOL
    assert got.conversations == rollout.conversations and got.completions == rollout.completions
    # rewards read the conversations (tool messages counted) and every row's environment as its rank left it
    assert torch.equal(got_rewards.per_function, rewards.per_function)
    names = got_rewards.names
    assert got_rewards.per_function[:, names.index("tool_messages")].tolist() == [float(c) for c in calls.tolist()]
    assert got_rewards.per_function[:, names.index("Calculator")].tolist() == [float(c) for c in calls.tolist()]
    assert got_stats.loss == pytest.approx(stats.loss, **LOSS_TOL)
    assert got_result.loss == pytest.approx(result.loss, **LOSS_TOL)
    assert got_result.tool_calls_per_row == result.tool_calls_per_row > 0
    # each rank's turns reach the driver's timeline, under the rank's devices (rank 0's rows needed one turn)
    marks = {(r["device"], r["mark"]) for r in got_result.turn_memory if r["metric"] == "rss"}
    assert {
        ("rank0/host", "turn 1"),
        ("rank1/host", "turn 1"),
        ("rank1/host", "tools 1"),
        ("rank1/host", "turn 2"),
    } <= marks
    assert ("rank0/host", "turn 2") not in marks
    called = [i for i, c in enumerate(synced.tool_calls) if c]
    assert called == [1, 3], synced.tool_calls  # rank 0's group alone this time: rank 1 stands in, synced
    assert called == [i for i in range(len(synced)) if (synced.tool_mask[i] == 0).any()], synced.tool_calls
    assert (got_result.tool_failure_frequency, got_result.turns_mean) == (
        result.tool_failure_frequency,
        result.turns_mean,
    )


class Locked:
    """A tool whose object holds a lock: it cannot be pickled to reach the ranks."""

    def __init__(self):
        self.lock = threading.Lock()

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b


def test_an_unpicklable_tool_or_environment_is_refused_in_one_line():
    with pytest.raises(LabError) as err:
        Lab("tiny-tools", overrides=SHARDED, tools=[Locked().add])
    line = str(err.value)
    assert "\n" not in line and line.startswith("tools: Locked.add cannot be pickled to reach a sharded learner")
    assert "name it by import path in generator.tools ('module:function')" in line

    class Holder:  # made here, so sent by value: its class dict, lock included
        lock = threading.Lock()

        def reset(self, **row):
            pass

    with pytest.raises(LabError, match=r"^environment_factory: .*Holder cannot be pickled .*generator.environment_f"):
        Lab("tiny-tools", overrides=SHARDED, environment_factory=Holder)


def test_tools_the_config_names_are_imported_on_each_rank_and_objects_travel_pickled():
    from grpo_lab.execution.sharded.shipped import shipped, unshipped
    from grpo_lab.tools import tools_for

    named = Lab("tiny-tools", overrides=SHARDED).executor
    assert named.tools.toolbox.functions.keys() == {"calculator"} and named.shipped is None  # each rank imports it
    made = calculator_environment()
    given = unshipped(shipped(tools_for([], made, named.config)))  # (tools=[]: the Lab's own list, empty, wins)
    assert given["tools"] == []
    environment = given["environment_factory"]()
    environment.reset()
    assert environment.calculator("2 * 3") == "6" and environment.get_reward() == 1.0
