"""A sharded learner's vLLM generator, as a rank sees it: the engine lives in the driver (the notebook's process, or
its own GPUs), never in a rank. Why: vLLM sets up a process group of its own, which must not meet the ranks' FSDP
group, and one engine for every rank holds one copy of the weights, not N.

A rank's rollout is the one-process code (prompts, seeds from the rank's RNG, chunking, padding); each chunk's
sampling is a question to the driver (`ask`), answered once per chunk for every rank alike. The LoRA sync is the
driver's: after a step it gathers the LoRA tensors from the ranks (never the base) and loads them into the engine.
"""

from __future__ import annotations

import pickle

from ...generation.base import GenerationRequest, Generator, Sample
from ...generation.vllm_engine import draw_seeds
from ...models.source import resolve_model_path

TOOL_QUESTIONS = {"tool_rows", "tool_calls"}  # what a rank's tool loop asks the driver (sharded/driven.py)
_driver = {"rank": None, "asked": 0, "mine": 0}


def serve_questions_on(rank) -> None:
    """The rank (worker.RankWorker) that holds this command's questions until the driver's poll answers them."""
    _driver.update(rank=rank, asked=0, mine=0)


def ask(method: str, *args, mine: bool = False):
    """The driver's answer to `method(*args)`, asked while the driver waits for this rank's reply to a command.
    Every rank asks the same questions in the same order (numbered 1, 2, ...), answered once for all; a question of
    this rank's own (`mine`: its rows' tool calls) is numbered -1, -2, ... and answered for this rank alone."""
    key = "mine" if mine else "asked"
    _driver[key] += 1
    status, value = _driver["rank"].ask(-_driver[key] if mine else _driver[key], (method, args))
    if status != "ok":
        raise RuntimeError(value)
    return value


class RemoteVLLM(Generator):
    """generator.backend: vllm on a rank: samples come from the driver's engine."""

    def __init__(self, learner, config):
        super().__init__(learner.tokenizer, resolve_model_path(config.model.name_or_path))

    def generate(self, batch, num_generations, request):
        self._seeds = draw_seeds(len(batch) * num_generations)  # as VLLMGenerator: the same RNG, the same samples
        return super().generate(batch, num_generations, request)

    def generate_chunk(self, prompt_ids, request: GenerationRequest) -> list[Sample]:
        return ask("sample", prompt_ids, [next(self._seeds) for _ in prompt_ids], request)

    def sync(self, learner) -> None:
        pass  # the driver's: it gathers the adapter from every rank once their sync phase is done


class Answers:
    """The driver's side: answers each question once (the first rank to ask) and gives every rank the same answer;
    ranks ask the same questions in the same order, which is checked."""

    def __init__(self, service):
        self.service = service  # the driver's vLLM engine (sample), if any
        self.tools = None  # the driver's side of the tool loop (sharded/driven.py: rows, calls), if the Lab has tools
        self.given: dict[int, tuple[bytes, tuple]] = {}

    def answer(self, number: int, method: str, args: tuple) -> tuple:
        if number < 0:  # a rank's own question (its rows' tool calls): answered for it alone, never compared
            return self.reply(method, args)
        key = pickle.dumps((method, args))
        if number in self.given:
            asked, reply = self.given[number]
            if asked != key:
                return ("error", f"the ranks asked different questions ({method}): their rollouts diverged")
            return reply
        reply = self.reply(method, args)
        self.given[number] = (key, reply)
        return reply

    def reply(self, method: str, args: tuple) -> tuple:
        try:
            return ("ok", getattr(self.tools if method in TOOL_QUESTIONS else self.service, method)(*args))
        except Exception as err:  # why so broad: the rank must get an answer; the error comes back as its failure
            from .wire import one_line

            return ("error", one_line(err))

    def clear(self) -> None:
        self.given.clear()
