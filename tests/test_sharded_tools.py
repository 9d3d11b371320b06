"""The tool loop on a sharded learner (placement.learner_procs > 1): each rank decodes the turns of the rows it
samples, its engine calls kept in step with the other ranks' (generation/sample_once.py), and the rollout is gathered
whole; the driver holds the environments (one per row, made and reset once) and runs every tool call
(execution/sharded/driven.py).

Real parts: 2 gloo CPU ranks under Ray, `builtin:tiny-tools` (it calls its calculator some of the time of its own
accord; nothing is forced), its environment class passed to the Lab as a Python object defined in a function (its
copies reach the ranks' reward functions by value, cloudpickle), each of its resets, calls and get_reward written with
its process id to a file; the reference is one process of the same config and seed, compared as tests/test_sharded.py
compares (the same tokens and rewards, the loss within LOSS_TOL)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from grpo_lab import Lab

pytestmark = [pytest.mark.solo, pytest.mark.xdist_group("ranks")]  # why solo: it starts Ray, two ranks

SHARDED = ["placement.learner_procs=2", "generator.hf_decode=dynamic"]  # (merged: a copy of the whole model)
LOSS_TOL = dict(rel=1e-5, abs=1e-6)  # tests/test_sharded.py's: gloo sums the two ranks' gradients in another order
SAMPLER_TOL = 1e-5  # tests/test_sharded_rollout.py's: a rank's forward runs another batch size
SMALL = [
    "grpo.prompts_per_step=2",
    "grpo.num_generations=4",
    "generator.hf_decode=dynamic",
    "generator.tools=[]",  # the calculator comes as the environment's method instead (by value, below)
    "data.rewards=[exact_answer,tests.tool_reward:tool_messages,tests.tool_reward:environment_calls]",
    # why seed 2: rank 1's group calls the calculator (rows 4 and 7), rank 0's does not; so rank 0 samples a stand-in
    # beside rank 1's second turn, and its rewards read copies of environments that only rank 1's calls stepped
    "run.seed=2",
]


def calculator_environment(log=None):
    """An environment class made in a function (cloudpickle sends it by value): its calculator is the built-in one,
    counted, and it raises on every other instance (made in row order: rows 1, 3, 5, 7 get an error result);
    get_reward is the row's calls. With `log` (a path), each instance's making, reset, call and get_reward is a line
    there: `event pid instance`."""
    from grpo_lab.data.calculator import calculator as compute

    def note(event: str, instance) -> None:
        if log is not None:
            with open(log, "a") as f:
                f.write(f"{event} {os.getpid()} {instance.index}\n")

    class Calculator:
        made = 0

        def __init__(self):
            self.index, self.calls = Calculator.made, 0
            Calculator.made += 1
            note("made", self)

        def reset(self, **row):
            self.calls = 0
            note("reset", self)

        def calculator(self, expression: str) -> str:
            """Compute an arithmetic expression.

            Args:
                expression: Numbers with + - * / and parentheses, e.g. "15 * 8".
            """
            self.calls += 1
            note("call", self)
            if self.index % 2:
                raise ValueError("this calculator is broken")
            return compute(expression)

        def get_reward(self) -> float:
            note("get_reward", self)
            return float(self.calls)

    return Calculator


def logged(path) -> list[tuple[str, int, int]]:
    with open(path) as f:
        return [(event, int(pid), int(index)) for event, pid, index in (line.split() for line in f)]


def one_step(lab) -> tuple:
    rollout = lab.rollout()
    rewards = lab.rewards(rollout)
    advantages = lab.advantages(rewards)
    stats = lab.backward(rollout, advantages, lab.logprobs(rollout))
    lab.optimizer()
    return rollout, rewards, stats, lab.sync()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    log = tmp_path_factory.mktemp("one_process") / "environments.log"
    lab = Lab("tiny-tools", overrides=SMALL, environment_factory=calculator_environment(log)).load()
    try:
        return (*one_step(lab), logged(log))
    finally:
        lab.close()


@pytest.mark.slow
@pytest.mark.cores(2)
def test_two_ranks_decode_their_rows_the_driver_runs_the_tools_like_one_process(one_process, ray_local, tmp_path):
    rollout, rewards, stats, result, one_log = one_process
    calls = torch.tensor(rollout.tool_calls)
    assert rollout.tool_calls == [0, 0, 0, 0, 1, 0, 0, 1]  # rank 1's group alone (the seed's outcome, see SMALL)
    log = tmp_path / "environments.log"
    lab = Lab("tiny-tools", overrides=SMALL + SHARDED, environment_factory=calculator_environment(log)).load()
    try:
        assert type(lab.executor).__name__ == "RankExecutor"
        ranks = set(lab.executor.ranks.pids)
        mine = one_step(lab)
        first = logged(log)
        rows = [rank["generated_rows"] for rank in lab.inspect()]
        lab.configure(generator={"gather_for_generation": False})  # through the shards: every forward synced
        synced = lab.rollout()  # (its turns prefill; a rank's one-token stand-ins run beside the other's turns)
        second = logged(log)[len(first) :]
    finally:
        lab.close()
    # every environment is made, reset, called and rewarded in the driver's process, never on a rank
    assert {pid for _, pid, _ in first + second} == {os.getpid()} and os.getpid() not in ranks
    # one environment per row, made once (the pool's, reused by the next rollout), each reset once per rollout
    assert sorted(i for event, _, i in first if event == "made") == list(range(8))
    for events in (first, second):
        assert sorted(i for event, _, i in events if event == "reset") == list(range(8))
    assert not [e for e in second if e[0] == "made"]
    # the same resets, calls and get_rewards, instance by instance, as one process made
    assert sorted((e, i) for e, _, i in first) == sorted((e, i) for e, _, i in one_log)
    assert [i for e, _, i in second if e == "call"] == [i for i, c in enumerate(synced.tool_calls) for _ in range(c)]
    got, got_rewards, got_stats, got_result = mine
    assert min(rows) >= 4  # each rank sampled its own group's rows (its turns and its stand-ins beside them)
    for field in ("prompt_ids", "completion_ids", "completion_mask", "tool_mask", "truncated"):
        assert torch.equal(getattr(got, field), getattr(rollout, field)), field
    assert (got.tool_mask == 0).any() and got.tool_calls == rollout.tool_calls and got.turns == rollout.turns
    # a raising tool's result is its error, as in one process (rows 1, 3, 5, 7's calculator raises)
    assert got.tool_failures == rollout.tool_failures == [0, 0, 0, 0, 0, 0, 0, 1]
    answers = [m["content"] for m in got.conversations[7] if m["role"] == "tool"]
    assert answers and all("this calculator is broken" in a for a in answers), answers
    assert (got.sampler_logprobs - rollout.sampler_logprobs).abs().max().item() <= SAMPLER_TOL
    assert got.conversations == rollout.conversations and got.completions == rollout.completions
    # rewards read the conversations (tool messages counted) and every row's environment as the driver's calls left it
    assert torch.equal(got_rewards.per_function, rewards.per_function)
    names = got_rewards.names
    assert got_rewards.per_function[:, names.index("tool_messages")].tolist() == [float(c) for c in calls.tolist()]
    assert got_rewards.per_function[:, names.index("Calculator")].tolist() == [float(c) for c in calls.tolist()]
    # the ranks' reward functions read copies of the driver's environments, as its tool calls left them
    assert got_rewards.per_function[:, names.index("environment_calls")].tolist() == [float(c) for c in calls.tolist()]
    assert got_stats.loss == pytest.approx(stats.loss, **LOSS_TOL)
    assert got_result.loss == pytest.approx(result.loss, **LOSS_TOL)
    assert got_result.tool_calls_per_row == result.tool_calls_per_row > 0
    # each rank's turns reach the driver's timeline, under the rank's devices (rank 0's rows needed one turn); a rank's
    # `tools N` is its wait while the driver runs its rows' calls
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
    """A tool whose object holds a lock: it cannot be pickled, and need not be (the driver runs it)."""

    def __init__(self):
        self.lock = threading.Lock()

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b


def test_a_rank_holds_no_tool_the_driver_answers_its_rows_and_calls():
    """What crosses to the ranks: the schemas at start, each rollout's rows' prompts and schemas, each row's calls'
    results as text; the tools themselves (an unpicklable one too) and the environments stay in the driver."""
    from grpo_lab.execution.sharded.driven import DriverTools, RankTools

    executor = Lab("tiny-tools", overrides=SHARDED + ["generator.tools=[]"], tools=[Locked().add]).executor
    driven = executor.driven
    assert isinstance(driven, DriverTools) and driven.tools is executor.tools
    description = driven.description()
    assert [s["function"]["name"] for s in description["schemas"]] == ["add"] and description["rewards"] == []
    assert RankTools(description).toolbox is None and RankTools(description).environments is None
    prompt = [[{"role": "user", "content": "1 + 2?"}]] * 2
    messages, schemas, stateful = driven.tool_rows(["1 + 2?"], {}, 2, prompt)
    assert messages == prompt and schemas == [description["schemas"]] * 2 and stateful is False
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    assert driven.tool_calls(1, [call], 5.0) == ([("add", "3")], 0)
    unknown = {"type": "function", "function": {"name": "sub", "arguments": {}}}
    assert driven.tool_calls(0, [unknown], 5.0) == ([("sub", str({"error": "Tool sub not found."}))], 1)


def test_a_ranks_lab_is_made_with_the_drivers_tools_as_a_rank_holds_them(monkeypatch):
    """rank.py makes its Lab with the driver's description of the tools (DriverTools.description), and the executor
    executor_for makes holds them as RankTools: their schemas, the environments' get_reward as given scores."""
    import grpo_lab.runtime
    from grpo_lab.execution.sharded.driven import RankTools
    from grpo_lab.runtime import Runtime

    schema = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {}}}
    description = {"schemas": [schema], "rewards": ["calls"]}
    monkeypatch.setattr(grpo_lab.runtime, "_RUNTIME", Runtime(1, 2, is_rank=True))
    tools = Lab("tiny-tools", overrides=SHARDED, tools=description).executor.tools
    assert isinstance(tools, RankTools) and tools.schemas == [schema] and tools.toolbox is None
    assert [f.__name__ for f in tools.reward_funcs] == ["calls"]
    assert Lab("tiny-tools", overrides=SHARDED, tools=None).executor.tools is None  # (the driver had none)


def test_an_unpicklable_environment_is_one_line_when_the_ranks_rewards_need_its_copy():
    from types import SimpleNamespace

    from grpo_lab.errors import LabError

    class Holder:  # made here, so pickled by value: its class dict, lock included
        lock = threading.Lock()

        def reset(self, **row):
            pass

    driven = Lab("tiny-tools", overrides=SHARDED + ["generator.tools=[]"], environment_factory=Holder).executor.driven
    driven.tool_rows(["1 + 2?"], {}, 1, [[{"role": "user", "content": "1 + 2?"}]])  # (made and reset here: no pickling)
    with pytest.raises(LabError) as err:
        driven.for_rewards(SimpleNamespace(environments=driven.environments))
    line = str(err.value)
    assert "\n" not in line and line.startswith("environment_factory: Holder cannot be pickled (")
    assert "keep what an environment holds picklable" in line
