"""The generator interface. A backend implements `generate_chunk` (token ids in, sampled
token ids and their sampler log-probs out) and `sync`; this base class tokenizes, repeats
each prompt G times, splits the requests into chunks, merges the chunks in order and pads.

Chunking (P2): `chunk_size` sequences per engine call bound the generator's peak memory
(KV cache and logits grow with the number of sequences in flight); the tokens are identical
in order and content to one call (each sequence samples from its own seed: `row_seeds`), the
sampler log-probs up to float rounding (another batch composition in the forward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from ..algo.containers import GenerationRequest, PromptBatch, Rollout


@dataclass
class Sample:
    completion_ids: list[int]  # up to and including EOS (or max_completion_length tokens)
    logprobs: list[float]  # sampler log-prob of each completion token
    truncated: bool
    # a multi-turn row (Generator.turns: the tool loop): 0 on the tools' tokens, the conversation's assistant and tool
    # messages, its tool calls, failed calls and turns
    tool_mask: Optional[list[int]] = None
    messages: Optional[list[dict]] = None
    tool_calls: int = 0
    tool_failures: int = 0
    turns: int = 1


# a backend's chunk function: (prompt ids, their row numbers in the batch, the request) -> one Sample per prompt
SampleChunk = Callable[[list[list[int]], Sequence[int], GenerationRequest], list[Sample]]


def chunked(items: Sequence, chunk_size: Optional[int]) -> Iterator[Sequence]:
    """Consecutive chunks of `chunk_size` (ceil-divided: the last one may be partial); None = one chunk."""
    size = len(items) if not chunk_size else chunk_size
    for i in range(math.ceil(len(items) / max(size, 1))):
        yield items[i * size : (i + 1) * size]


def row_seeds(n: int) -> list[int]:
    """One seed per sequence, drawn from torch's (the lab's seeded) RNG in one call before any chunking: a row's samples
    depend on its seed alone, not on chunk_size nor on which rank samples it; the RNG advances by n draws whatever the
    completions' lengths (vllm.draw_seeds is the same draw)."""
    return torch.randint(0, 2**31 - 1, (n,)).tolist()


def split(items: Sequence, pieces: int) -> list[Sequence]:
    """`items` in `pieces` consecutive parts of near-equal size (the first len % pieces one longer; some may be
    empty)."""
    base, extra = divmod(len(items), pieces)
    bounds = [k * base + min(k, extra) for k in range(pieces + 1)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:])]


def eos_token_ids(tokenizer, checkpoint: str) -> list[int]:
    """The ids every backend stops on: the tokenizer's eos_token_id, then the checkpoint's generation_config
    eos_token_id (an int or a list: Qwen2.5-Instruct lists <|im_end|> and <|endoftext|>)."""
    from transformers import GenerationConfig

    from ..models.random_shapes import parse_random

    if parse_random(checkpoint):  # why: a built-in random shape has no files; its tokenizer's EOS is its EOS
        return [tokenizer.eos_token_id]
    try:
        listed = GenerationConfig.from_pretrained(checkpoint).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        listed = None
    listed = [listed] if isinstance(listed, int) else list(listed or [])
    return [t for t in dict.fromkeys([tokenizer.eos_token_id, *listed]) if t is not None]


class Generator:
    """Base class: tokenization, repetition, chunking and padding shared by every backend."""

    def __init__(self, tokenizer, checkpoint: str):
        """`checkpoint`: the learner's checkpoint directory, whose generation_config completes the EOS set."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids(tokenizer, checkpoint)  # one stop set for every backend
        # what drives each chunk turn by turn (tools/loop.ToolLoop: the executor sets it when a Lab has tools; each
        # rollout is an episode of it); None: one turn, the backend's chunk function as it is
        self.turns = None
        # records each generate() call's shape for the loop's turns (generation/turn_shapes.py); None: not known
        self.shapes = None

    # --- backends implement these ---
    def generate_chunk(self, prompt_ids: list[list[int]], request: GenerationRequest) -> list[Sample]:
        raise NotImplementedError

    def sync(self, learner) -> None:
        """Bring the generator's weights up to date with the learner's (after an optimizer step)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the engine's memory."""

    def check_live(self, config) -> None:
        """Refuse (LabError) a config edit this running engine cannot honour (e.g. a length beyond what it was
        started for); called before the edit is applied. Backends without such limits accept everything but what a
        paused turn-by-turn rollout cannot honour (tools/loop.ToolLoop.check_live)."""
        if self.turns is not None:
            self.turns.check_live(config)

    # --- shared ---
    def encode_prompts(self, prompts: list[str], max_prompt_length: int) -> list[list[int]]:
        ids = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        return [p[-max_prompt_length:] for p in ids]  # truncate from the left, keep the question's end

    def prompt_rows(self, batch: PromptBatch, num_generations: int, request: GenerationRequest) -> list[list[int]]:
        """[N] token ids: each prompt repeated num_generations times (a group's rows are consecutive)."""
        return [
            p for p in self.encode_prompts(batch.prompts, request.max_prompt_length) for _ in range(num_generations)
        ]

    def generate(self, batch: PromptBatch, num_generations: int, request: GenerationRequest) -> Rollout:
        return self.generate_in_chunks(
            batch, num_generations, request, lambda prompt_ids, rows, request: self.generate_chunk(prompt_ids, request)
        )

    def generate_in_chunks(
        self,
        batch: PromptBatch,
        num_generations: int,
        request: GenerationRequest,
        sample: SampleChunk,
    ) -> Rollout:
        """The rollout, `sample(prompt_ids, rows, request)` sampling each chunk: its prompts and their row numbers in
        the batch (what a backend needs to give each row its own seed). With `turns` (the tool loop), the batch's
        prompts are its rendering and each chunk is its run, which calls `sample` once per turn."""
        if self.turns is not None:
            self.turns.recorder = self.shapes  # (the turns' shapes: Rollout.turn_shapes)
        episode = self.turns.start(batch, num_generations, request) if self.turns is not None else None
        if episode is not None:  # each row's prompt rendered with its tools (its environment's, when it has one)
            batch, prompt_ids = episode.batch, self.encode_prompts(episode.prompts, request.max_prompt_length)
        else:
            prompt_ids = self.prompt_rows(batch, num_generations, request)  # [N]
        samples: list[Sample] = []
        calls = 0
        for rows in chunked(range(len(prompt_ids)), request.chunk_size):
            ids = [prompt_ids[i] for i in rows]
            samples.extend(episode.run(ids, rows, sample, request) if episode else sample(ids, rows, request))
            calls += 1
        out = self.to_rollout(batch, num_generations, prompt_ids, samples, request)
        out.generate_calls = calls
        if episode is not None:
            episode.finish(out)
        return out

    def to_rollout(self, batch, num_generations, prompt_ids, samples, request) -> Rollout:
        pad = self.tokenizer.pad_token_id
        n, p_len = len(prompt_ids), max(len(p) for p in prompt_ids)
        c_len = max(1, max(len(s.completion_ids) for s in samples))
        prompt = torch.full((n, p_len), pad, dtype=torch.long)
        prompt_mask = torch.zeros((n, p_len), dtype=torch.long)
        completion = torch.full((n, c_len), pad, dtype=torch.long)
        completion_mask = torch.zeros((n, c_len), dtype=torch.long)
        sampler_logprobs = torch.zeros((n, c_len), dtype=torch.float32)
        multi_turn = any(s.tool_mask is not None for s in samples)
        tool_mask = torch.ones((n, c_len), dtype=torch.long) if multi_turn else None
        for i, (p, s) in enumerate(zip(prompt_ids, samples)):
            prompt[i, p_len - len(p) :] = torch.tensor(p)
            prompt_mask[i, p_len - len(p) :] = 1
            k = len(s.completion_ids)
            if k:
                completion[i, :k] = torch.tensor(s.completion_ids)
                completion_mask[i, :k] = 1
                sampler_logprobs[i, :k] = torch.tensor(s.logprobs, dtype=torch.float32)
                if multi_turn:
                    tool_mask[i, :k] = torch.tensor(s.tool_mask)
        return Rollout(
            batch=batch,
            num_generations=num_generations,
            prompt_ids=prompt,
            prompt_mask=prompt_mask,
            completion_ids=completion,
            completion_mask=completion_mask,
            sampler_logprobs=sampler_logprobs,
            truncated=torch.tensor([s.truncated for s in samples]),
            completions=self.tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True),
            temperature=request.temperature,
            max_completion_length=request.max_completion_length,
            tool_mask=tool_mask,
            conversations=[s.messages for s in samples] if multi_turn else None,
            tool_calls=[s.tool_calls for s in samples] if multi_turn else None,
            tool_failures=[s.tool_failures for s in samples] if multi_turn else None,
            turns=[s.turns for s in samples] if multi_turn else None,
        )
