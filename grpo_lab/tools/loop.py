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

from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

from ..algo.containers import PromptBatch
from ..errors import LabError
from ..generation.base import Sample
from .environments import Environments
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
    rollout."""

    def __init__(self, toolbox: Optional[Toolbox], tokenizer, eos_token_ids: list[int], config, environments=None):
        """`toolbox`: the Lab's tools (None: none); `environments`: its environment_factory (environments.py)."""
        self.toolbox, self.tokenizer, self.eos_token_ids, self.config = toolbox, tokenizer, eos_token_ids, config
        self.environments: Optional[Environments] = environments
        # where each turn and each round of tool calls starts (the executor gives the memory sampler's `mark`: the
        # timeline marks them inside the rollout phase, each with its own peak)
        self.marker: Callable[[str], None] = lambda label: None

    def start(self, batch: PromptBatch, num_generations: int, request) -> "Episode":
        """The rollout's rows: a standard (text) prompt becomes its user message (with the system prompt), so
        completions reach rewards as conversations (TRL's tools need them); each row's environment, drawn and reset
        with its dataset row; each prompt rendered with its row's tools. A prompt longer than
        generator.max_prompt_length is refused: its cut, from the left, would drop the tools."""
        raw = batch.raw if batch.raw is not None else batch.prompts
        system = self.config.data.system_prompt
        messages = [as_messages(p, system) for p in raw for _ in range(num_generations)]  # [N]
        envs, toolboxes = None, [self.toolbox] * len(messages)
        if self.environments is not None:
            names = [n for n in self.environments.names(batch.extra, len(batch)) for _ in range(num_generations)]
            envs = self.environments.draw(names)
            rows = [
                {"prompt": raw[i // num_generations], **{k: v[i // num_generations] for k, v in batch.extra.items()}}
                for i in range(len(messages))
            ]
            messages = [self.environments.reset(e, r, m) for e, r, m in zip(envs, rows, messages)]
            toolboxes = [self.environments.toolbox(e) for e in envs]
        texts = [render_prompt(self.tokenizer, m, t.schemas) for m, t in zip(messages, toolboxes)]
        longest = max(len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"])
        if longest > request.max_prompt_length:
            raise LabError(
                f"generator.max_prompt_length: {request.max_prompt_length} tokens would cut a prompt rendered with the "
                f"tools ({longest} tokens) from the left, dropping the tools' descriptions; raise it to at least "
                f"{longest}"
            )
        rendered = replace(batch, prompts=texts[::num_generations], raw=messages[::num_generations])
        return Episode(self, rendered, texts, messages, toolboxes, envs)


@dataclass
class Episode:
    """One rollout of a tool loop: its rows' prompts (rendered, and as rewards get them), tools and environments."""

    loop: ToolLoop
    batch: PromptBatch  # [B] the rendered batch (Rollout.batch; with environments, each group's first row's prompt)
    prompts: list[str]  # [N] each row's prompt, rendered with its tools
    messages: list[list[dict]]  # [N] each row's prompt as rewards get it (its environment's observation included)
    toolboxes: list[Toolbox]  # [N] each row's tools
    environments: Optional[list]  # [N] each row's environment instance (None: no environment_factory)

    def finish(self, rollout) -> None:
        """What the rollout carries of the episode: the rows' own prompts and environments (rewards get them)."""
        if self.environments is not None:
            rollout.row_prompts, rollout.environments = self.messages, self.environments

    def run(
        self,
        prompt_ids: list[list[int]],
        rows: Sequence[int],
        sample: Callable[[list[list[int]], Sequence[int], object], list[Sample]],
        request,
    ) -> list[Sample]:
        """The chunk's rows (`rows`: their numbers in the batch), decoded turn by turn with the backend's `sample`."""
        budget, gen = request.max_completion_length, self.loop.config.generator
        rows_ = list(rows)
        trajectories = [Trajectory(p, toolbox=self.toolboxes[r]) for p, r in zip(prompt_ids, rows_)]
        mark = self.loop.marker
        mark("turn 1")
        self.decode(trajectories, list(range(len(rows_))), rows_, sample, request, budget)
        waiting = [k for k, t in enumerate(trajectories) if t.messages and t.messages[-1].get("tool_calls")]
        for turn in range(2, gen.max_tool_calling_iterations + 2):
            if waiting:
                mark(f"tools {turn - 1}")
            going = [k for k in waiting if self.call_tools(trajectories[k], budget, gen.tool_timeout_s)]
            if not going:
                break
            mark(f"turn {turn}")
            self.decode(trajectories, going, rows_, sample, request, budget)
            waiting = [k for k in going if trajectories[k].messages[-1].get("tool_calls")]
            if not waiting:
                break
        return [t.sample() for t in trajectories]

    def decode(self, trajectories, which: list[int], rows: list, sample, request, budget: int) -> None:
        """One turn of the rows `which`: each decodes at most what is left of its budget."""
        left = {k: budget - len(trajectories[k].ids) for k in which}
        which = [k for k in which if left[k] > 0]  # (a row whose tool result filled the budget exactly ends cut)
        for k in set(left) - set(which):
            trajectories[k].truncated = True
        if not which:
            return
        contexts = [trajectories[k].prompt + trajectories[k].ids for k in which]
        turn = replace(request, max_completion_length=max(left[k] for k in which))
        tokenizer, eos = self.loop.tokenizer, self.loop.eos_token_ids
        for k, context, s in zip(which, contexts, sample(contexts, [rows[k] for k in which], turn)):
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


def cut_to_tokens(tokenizer, text: str, bound: Optional[int]) -> str:
    """A tool result's text cut to its first `bound` tokens (generator.max_tool_response_tokens; None: whole)."""
    if bound is None:
        return text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= bound else tokenizer.decode(ids[:bound])


def as_messages(prompt, system_prompt) -> list[dict]:
    """A prompt as chat messages: a conversational one as it is, a standard one as its user message, the system
    prompt first where the conversation has none."""
    messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return messages
