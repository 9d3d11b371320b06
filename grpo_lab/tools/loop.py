"""The tool loop, TRL 1.16's `_tool_call_loop` driven through a generator's chunk function, so every backend runs it
unchanged (generation/base.py starts an `Episode` per rollout when the generator has a loop, and runs each chunk
through it). A chunk's rows decode; each row's turn is parsed for tool calls (template.parse); each call runs
(toolbox.py); the tool messages' tokens (template.tool_suffix_ids) join the row, masked out of training (tool_mask
0); the rows that called a tool decode on, a finished row leaving the chunk; at most
generator.max_tool_calling_iterations times.

generator.max_completion_length is the whole trajectory's budget, tool tokens included: a tool result that would pass
it is left out and the row ends as it is (TRL's rule); a later turn decodes at most what is left of it (TRL decodes
the full length and cuts; the tokens kept are the same). Each turn asks for the rows' whole contexts; the hf backend
goes on from the turns' KV cache where it holds them (generator.turn_cache keep: generation/turn_cache.py), the vllm
backend reads the conversation's KV blocks from its prefix cache (generation/vllm_engine.py), any other re-prefills
the conversation, as TRL's loop does.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

from ..algo.containers import PromptBatch
from ..data.formats import with_system
from ..errors import LabError
from ..generation.base import Sample
from .environments import Environments
from .stepwise import PAUSED, check_paused, view
from .template import parse, render_prompt, tool_suffix_ids
from .toolbox import Toolbox


@dataclass
class Trajectory:
    """One row's multi-turn completion as it grows."""

    prompt: list[int]
    toolbox: Optional[Toolbox] = None  # the row's tools
    ids: list[int] = field(default_factory=list)  # every completion token: the model's and the tools'
    logprobs: list[float] = field(default_factory=list)  # the sampler's; 0 on tool tokens
    mask: list[int] = field(default_factory=list)  # 1 on the model's tokens, 0 on the tools' (TRL's tool_mask)
    messages: list[dict] = field(default_factory=list)  # TRL's conversational completion: assistant and tool turns
    truncated: bool = False
    calls: int = 0
    failures: int = 0
    turns: int = 0

    def add_turn(self, ids: list[int], logprobs: list[float], message: dict) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.mask += [1] * len(ids)
        self.turns += 1
        if message:  # ({}: a turn cut to nothing by the budget adds no message, as in TRL)
            self.messages.append(message)

    def add_tools(self, messages: list[dict], suffix: list[int]) -> None:
        self.messages += messages
        self.ids += suffix
        self.logprobs += [0.0] * len(suffix)
        self.mask += [0] * len(suffix)

    def sample(self) -> Sample:
        return Sample(
            self.ids,
            self.logprobs,
            self.truncated,
            tool_mask=self.mask,
            messages=self.messages,
            tool_calls=self.calls,
            tool_failures=self.failures,
            turns=self.turns,
        )


class ToolLoop:
    """A generator's multi-turn driver (Generator.turns): each rollout starts an Episode, whose rows' prompts are
    rendered with their tools and whose chunks run turn by turn. The limits are read from the live config at every
    turn. A turn-by-turn rollout (grpo_lab/turns_api.py) runs inside `continuing`: its episode is kept (`paused`)
    between its calls, and each call goes on from it."""

    def __init__(self, toolbox: Optional[Toolbox], tokenizer, eos_token_ids: list[int], config, environments=None):
        """`toolbox`: the Lab's tools (None: none); `environments`: its environment_factory (environments.py)."""
        self.toolbox, self.tokenizer, self.eos_token_ids, self.config = toolbox, tokenizer, eos_token_ids, config
        self.environments: Optional[Environments] = environments
        # where each turn and each round of tool calls starts (the executor gives the memory sampler's `mark`: the
        # timeline marks them inside the rollout phase, each with its own peak)
        self.marker: Callable[[str], None] = lambda label: None
        # a turn-by-turn rollout: its episode between calls, and the turn a call stops after (None: the rollout's end)
        self.paused: Optional[Episode] = None
        self.stop_after: Optional[int] = None
        self._continuing = False
        # the generator's recorder of its calls' shapes (generation/turn_shapes.py; None: not recorded), and the
        # turns' shapes of the latest episode, as they ran (Rollout.turn_shapes; the story's plan of each turn)
        self.recorder = None
        self.shapes: Optional[list[dict]] = None

    @contextmanager
    def continuing(self, stop_after: Optional[int]):
        """Within: a rollout goes on from the paused episode (none: starts one, and keeps it paused) and stops after
        turn `stop_after` (None: runs to its end)."""
        self.stop_after, self._continuing = stop_after, True
        try:
            yield
        finally:
            self.stop_after, self._continuing = None, False

    def view(self, step: int):
        """What the paused rollout's rows called and their tools answered so far (tools/stepwise.TurnsView)."""
        return view(self.paused, step)

    def check_live(self, new) -> None:
        """Refuse an edit the paused rollout's next turns cannot honour (tools/stepwise.py)."""
        if self.paused is not None:
            check_paused(self.paused.rounds(), self.config, new)

    def rows(self, raw: list, extra: dict, num_generations: int, messages: list[list[dict]]) -> tuple:
        """The rows' tool side, in this process (rows_of); a sharded learner's rank asks its driver instead
        (execution/sharded/driven.py)."""
        return rows_of(self.toolbox, self.environments, raw, extra, num_generations, messages)

    def start(self, batch: PromptBatch, num_generations: int, request) -> "Episode":
        """The rollout's rows: a standard (text) prompt becomes its user message (with the system prompt), so
        completions reach rewards as conversations (TRL's tools need them); each row's environment, drawn and reset
        with its dataset row; each prompt rendered with its row's tools. A prompt longer than
        generator.max_prompt_length is refused: its cut, from the left, would drop the tools. Within `continuing`,
        the paused episode, when there is one."""
        if self.paused is not None:
            if not self._continuing:  # (lab.rollout() finishes a paused rollout; nothing else may start one)
                raise LabError(PAUSED)
            return self.paused
        raw = batch.raw if batch.raw is not None else batch.prompts
        system = self.config.data.system_prompt
        messages = [as_messages(p, system) for p in raw for _ in range(num_generations)]  # [N]
        messages, toolboxes, envs = self.rows(raw, batch.extra, num_generations, messages)
        texts = [render_prompt(self.tokenizer, m, t.schemas) for m, t in zip(messages, toolboxes)]
        longest = max(len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"])
        if longest > request.max_prompt_length:
            raise LabError(
                f"generator.max_prompt_length: {request.max_prompt_length} tokens would cut a prompt rendered with the "
                f"tools ({longest} tokens) from the left, dropping the tools' descriptions; raise it to at least "
                f"{longest}"
            )
        rendered = replace(batch, prompts=texts[::num_generations], raw=messages[::num_generations])
        episode = Episode(self, rendered, texts, messages, toolboxes, envs)
        if self._continuing:
            self.paused = episode
        self.shapes = episode.shapes if self.recorder is not None else None
        return episode


@dataclass
class Episode:
    """One rollout of a tool loop: its rows' prompts (rendered, and as rewards get them), tools and environments."""

    loop: ToolLoop
    batch: PromptBatch  # [B] the rendered batch (Rollout.batch; with environments, each group's first row's prompt)
    prompts: list[str]  # [N] each row's prompt, rendered with its tools
    messages: list[list[dict]]  # [N] each row's prompt as rewards get it (its environment's observation included)
    toolboxes: list[Toolbox]  # [N] each row's tools
    environments: Optional[list]  # [N] each row's environment instance (None: no environment_factory)
    rows: dict = field(default_factory=dict)  # row number -> its Trajectory so far
    going: set = field(default_factory=set)  # the rows whose next turn is still to run (their tools answered)
    shapes: list = field(default_factory=list)  # each turn's generate() calls' shapes (generation/turn_shapes.py)

    def finish(self, rollout) -> None:
        """What the rollout carries of the episode: the rows' own prompts and environments (rewards get them)."""
        if self.environments is not None:
            rollout.row_prompts, rollout.environments = self.messages, self.environments
        rollout.turn_shapes = list(self.shapes) if self.loop.recorder is not None else None

    def run(
        self,
        prompt_ids: list[list[int]],
        rows: Sequence[int],
        sample: Callable[[list[list[int]], Sequence[int], object], list[Sample]],
        request,
    ) -> list[Sample]:
        """The chunk's rows (`rows`: their numbers in the batch), decoded turn by turn with the backend's `sample`; a
        turn-by-turn rollout's later calls find each row's trajectory so far here and go on from it."""
        rows_ = list(rows)
        for p, r in zip(prompt_ids, rows_):
            if r not in self.rows:  # the row's first turn
                self.rows[r] = Trajectory(p, toolbox=self.toolboxes[r])
                self.going.add(r)
        trajectories = [self.rows[r] for r in rows_]
        going = self.turns(trajectories, [k for k, r in enumerate(rows_) if r in self.going], rows_, sample, request)
        self.going.difference_update(rows_)
        self.going.update(rows_[k] for k in going)
        return [t.sample() for t in trajectories]

    def turns(self, trajectories, going: list[int], rows: list, sample, request) -> list[int]:
        """The next turns of the rows `going` (each turn: a decode, then the tool calls it made, at most
        generator.max_tool_calling_iterations rounds, read at every turn), until no row goes on or the turn the loop
        stops after (ToolLoop.stop_after: a turn-by-turn rollout's call). Returns the rows that go on."""
        budget, mark = request.max_completion_length, self.loop.marker
        turn = max((trajectories[k].turns for k in going), default=0)  # (the rows that go on are all at one turn)
        while going and (self.loop.stop_after is None or turn < self.loop.stop_after):
            turn += 1
            mark(f"turn {turn}")
            self.decode(trajectories, going, rows, sample, request, budget, turn)
            waiting = [k for k in going if trajectories[k].messages and trajectories[k].messages[-1].get("tool_calls")]
            gen, going = self.loop.config.generator, []
            if waiting and turn <= gen.max_tool_calling_iterations:
                mark(f"tools {turn}")
                going = [k for k in waiting if self.call_tools(trajectories[k], budget, gen.tool_timeout_s)]
        return going

    def rounds(self) -> int:
        """The rounds of tool calls the rollout has run (a row that goes on ran its last turn's; a finished one did
        not, or made none)."""
        return max((t.turns - (r not in self.going) for r, t in self.rows.items()), default=0)

    def decode(self, trajectories, which: list[int], rows: list, sample, request, budget: int, number: int) -> None:
        """Turn `number` of the rows `which`: each decodes at most what is left of its budget."""
        left = {k: budget - len(trajectories[k].ids) for k in which}
        which = [k for k in which if left[k] > 0]  # (a row whose tool result filled the budget exactly ends cut)
        for k in set(left) - set(which):
            trajectories[k].truncated = True
        if not which:
            return
        contexts = [trajectories[k].prompt + trajectories[k].ids for k in which]
        turn = replace(request, max_completion_length=max(left[k] for k in which))
        tokenizer, eos = self.loop.tokenizer, self.loop.eos_token_ids
        recorder = self.loop.recorder
        with recorder.recording(f"turn {number}", self.shapes) if recorder is not None else nullcontext():
            samples = sample(contexts, [rows[k] for k in which], turn)
        for k, context, s in zip(which, contexts, samples):
            ids, logprobs = s.completion_ids[: left[k]], s.logprobs[: left[k]]
            message = parse(tokenizer, ids, context, trajectories[k].toolbox.schemas) if ids else {}
            trajectories[k].add_turn(ids, logprobs, message)
            trajectories[k].truncated = not ids or ids[-1] not in eos

    def cut(self, text: str, bound: Optional[int]) -> str:
        return cut_to_tokens(self.loop.tokenizer, text, bound)

    def call_tools(self, trajectory: Trajectory, budget: int, timeout_s: float) -> bool:
        """Run the row's last turn's tool calls and append their results; False when the results would pass the
        budget (left out: the row ends with its tool call, as in TRL)."""
        results, failures = trajectory.toolbox.run_calls(trajectory.messages[-1]["tool_calls"], timeout_s)
        trajectory.calls += len(results)
        trajectory.failures += failures
        bound = self.loop.config.generator.max_tool_response_tokens
        messages = [
            {"role": "tool", "name": name, "content": r if isinstance(r, list) else self.cut(str(r), bound)}
            for name, r in results
        ]
        suffix = tool_suffix_ids(self.loop.tokenizer, messages)
        if len(trajectory.ids) + len(suffix) > budget:
            return False
        trajectory.add_tools(messages, suffix)
        return True


def rows_of(toolbox, environments: Optional[Environments], raw: list, extra: dict, g: int, messages: list) -> tuple:
    """Each row's (prompt messages, toolbox, environment): with environment_factory, each row's environment drawn
    and reset with its dataset row (its observation appended to the prompt), its methods the row's tools; else the
    Lab's tools, and no environments (None)."""
    if environments is None:
        return messages, [toolbox] * len(messages), None
    names = [n for n in environments.names(extra, len(raw)) for _ in range(g)]
    envs = environments.draw(names)
    rows = [{"prompt": raw[i // g], **{k: v[i // g] for k, v in extra.items()}} for i in range(len(messages))]
    messages = [environments.reset(e, r, m) for e, r, m in zip(envs, rows, messages)]
    return messages, [environments.toolbox(e) for e in envs], envs


def cut_to_tokens(tokenizer, text: str, bound: Optional[int]) -> str:
    """A tool result's text cut to its first `bound` tokens (generator.max_tool_response_tokens; None: whole)."""
    if bound is None:
        return text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= bound else tokenizer.decode(ids[:bound])


def as_messages(prompt, system_prompt) -> list[dict]:
    """A prompt as chat messages: a conversational one as it is, a standard one as its user message, the system
    prompt in place of the conversation's own where one is set (data/formats.with_system)."""
    return with_system(
        list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}], system_prompt
    )
