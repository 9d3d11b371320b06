"""A sharded learner's tools (placement.learner_procs > 1): the driver runs them, the ranks generate and train.

The driver holds the Lab's tools and environments (`DriverTools`): for each rollout it draws one environment per row
and resets it, once, in its own process, and it runs every tool call. No rank holds a tool or an environment. Each
rank's tool loop is tools/loop.py's, as in one process (`DrivenLoop`): it renders, decodes and parses its rows'
turns, and makes the tool messages' tokens; at the rollout's start it asks the driver for the rows' prompts (with
the environments' observations) and their tools' schemas, one question answered once for every rank; at each round
of tool calls it sends the driver one row's parsed calls and gets their results back as text (sharded/remote.py's
questions, which the driver answers as it polls). What crosses per turn is the calls and their results, JSON and
text; the tokens stay on the rank.

Rewards: the environments' get_reward runs on the driver, on its environments, and each rank is handed the scores (as
a reward model's); the reward functions run on every rank and get `environments=` as copies of the driver's,
pickled once the rollout is done (cloudpickle: a class made in a notebook cell travels by value).
"""

from __future__ import annotations

from typing import Optional

from ...errors import LabError
from ...tools.loop import ToolLoop, rows_of
from .remote import ask


class DriverTools:
    """The driver's side: the Lab's tools and environments (tools.Tools), and this rollout's rows' toolboxes and
    environments."""

    def __init__(self, tools):
        self.tools = tools
        self.toolboxes: list = []  # [N] this rollout's rows' tools
        self.environments: Optional[list] = None  # [N] this rollout's rows' environments (None: no environment_factory)

    def description(self) -> dict:
        """What every rank's Lab starts with instead of the tools: their schemas (the longest prompt the plan holds)
        and the names of the environments' get_reward sources (their scores come from here, `for_rewards`)."""
        return {"schemas": self.tools.schemas, "rewards": [f.__name__ for f in self.tools.reward_funcs]}

    def tool_rows(self, raw: list, extra: dict, num_generations: int, messages: list) -> tuple:
        """A rollout's rows (every rank asks, the driver answers once): each row's environment drawn and reset here
        (tools/loop.py rows_of); each row's prompt messages, its tools' schemas, and whether rows have environments."""
        messages, self.toolboxes, self.environments = rows_of(
            self.tools.toolbox, self.tools.environments, raw, extra, num_generations, messages
        )
        return messages, [t.schemas for t in self.toolboxes], self.environments is not None

    def tool_calls(self, row: int, calls: list[dict], timeout_s: float) -> tuple[list, int]:
        """Row `row`'s parsed tool calls, run here (toolbox.run_calls: its errors and timeouts as in one process);
        each result as the tool message's content (a list of content parts as it is, anything else as its text)."""
        results, failures = self.toolboxes[row].run_calls(calls, timeout_s)
        return [(name, r if isinstance(r, list) else str(r)) for name, r in results], failures

    def finish(self, rollout) -> None:
        """The driver's rollout (rank 0's) carries the driver's environments, as they stand after the tool calls."""
        if self.environments is not None:
            rollout.environments = self.environments

    def for_rewards(self, rollout) -> Optional[dict]:
        """What each rank's rewards phase is handed (None without environments): the environments' get_reward scores,
        computed here, and the environments pickled for the reward functions' `environments=`."""
        import cloudpickle  # why not pickle: a class the Lab was given by value (made in a notebook cell) has no module

        from ...algo.grpo import rewards

        if rollout.environments is None:
            return None
        funcs = self.tools.reward_funcs
        table = rewards(rollout, funcs).per_function if funcs else None  # [N, F]
        scores = [(f.__name__, table[:, j].tolist()) for j, f in enumerate(funcs)]
        try:
            copies = cloudpickle.dumps(rollout.environments)
        except Exception as err:  # why every Exception: pickling raises TypeError, PicklingError, AttributeError...
            raise LabError(
                f"environment_factory: {type(rollout.environments[0]).__name__} cannot be pickled "
                f"({type(err).__name__}: {err}); the ranks' reward functions get copies of the driver's environments "
                "(environments=): keep what an environment holds picklable (no locks, open files or sockets)"
            ) from None
        return {"environments": copies, "scores": scores}


def rank_tools(description: Optional[dict], environment_factory, config) -> Optional["RankTools"]:
    """A rank's tools (execution/contract.TOOLS): the driver's `description` of them (DriverTools.description; None:
    the driver has none). The rank's own config's generator.tools and environment_factory are the driver's to run."""
    return RankTools(description) if description is not None else None


class RankTools:
    """A rank's tools: the driver's. It holds their schemas, the loop that asks the driver (DrivenLoop) and the
    environments' get_reward scores as the driver computed them (its rewards phase reads them after the models')."""

    toolbox = environments = None  # (no tool and no environment lives on a rank)

    def __init__(self, description: dict):
        from ...models.reward_model import GivenScores

        self.schemas: list[dict] = description["schemas"]
        self.reward_funcs = [GivenScores(name, []) for name in description["rewards"]]

    def loop(self, tokenizer, eos_token_ids: list[int], config) -> "DrivenLoop":
        return DrivenLoop(None, tokenizer, eos_token_ids, config)

    def take(self, given: dict, rollout) -> None:
        """The rewards phase's inputs from the driver (DriverTools.for_rewards): its environments' copies and scores."""
        import pickle

        from ...models.reward_model import GivenScores

        rollout.environments = pickle.loads(given["environments"])
        self.reward_funcs = [GivenScores(name, values) for name, values in given["scores"]]


class DrivenLoop(ToolLoop):
    """A rank's tool loop: tools/loop.py's, its rows' tool side asked of the driver."""

    def rows(self, raw: list, extra: dict, num_generations: int, messages: list) -> tuple:
        messages, schemas, stateful = ask("tool_rows", raw, extra, num_generations, messages)
        # (stateful: placeholders; the rewards phase gets copies of the driver's environments, RankTools.take)
        return messages, [AskedTools(r, s) for r, s in enumerate(schemas)], [None] * len(messages) if stateful else None


class AskedTools:
    """Row `row`'s tools on a rank: their schemas (its turns are parsed against them here); its calls run on the
    driver (DriverTools.tool_calls)."""

    def __init__(self, row: int, schemas: list[dict]):
        self.row, self.schemas = row, schemas

    def run_calls(self, calls: list[dict], timeout_s: float) -> tuple[list, int]:
        return ask("tool_calls", self.row, calls, timeout_s, mine=True)
