"""The generator interface. A backend implements `_generate_chunk` (token ids in, sampled
token ids and their sampler log-probs out) and `sync`; this base class tokenizes, repeats
each prompt G times, splits the requests into chunks, merges the chunks in order and pads.

Chunking (P2): `chunk_size` sequences per engine call bound the generator's peak memory
(KV cache and logits grow with the number of sequences in flight); results are identical
in order and content to one call, for greedy decoding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from ..types import PromptBatch, Rollout


@dataclass
class GenerationRequest:
    """Sampling settings of one rollout; temperature 0 means greedy."""
    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class Sample:
    completion_ids: list[int]   # up to and including EOS (or max_completion_length tokens)
    logprobs: list[float]       # sampler log-prob of each completion token
    truncated: bool


def chunked(items: Sequence, chunk_size: Optional[int]) -> Iterator[Sequence]:
    """Consecutive chunks of `chunk_size` (ceil-divided: the last one may be partial); None = one chunk."""
    size = len(items) if not chunk_size else chunk_size
    for i in range(math.ceil(len(items) / max(size, 1))):
        yield items[i * size:(i + 1) * size]


class Generator:
    """Base class: tokenization, repetition, chunking and padding shared by every backend."""

    def __init__(self, tokenizer, max_prompt_length: int, chunk_size: Optional[int] = None):
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.chunk_size = chunk_size

    # --- backends implement these ---
    def _generate_chunk(self, prompt_ids: list[list[int]], request: GenerationRequest) -> list[Sample]:
        raise NotImplementedError

    def sync(self, learner) -> None:
        """Bring the generator's weights up to date with the learner's (after an optimizer step)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the engine's memory."""

    # --- shared ---
    def encode_prompts(self, prompts: list[str]) -> list[list[int]]:
        ids = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        return [p[-self.max_prompt_length:] for p in ids]   # truncate from the left, keep the question's end

    def generate(self, batch: PromptBatch, num_generations: int, request: GenerationRequest) -> Rollout:
        prompt_ids = [p for p in self.encode_prompts(batch.prompts) for _ in range(num_generations)]  # [N]
        samples: list[Sample] = []
        for chunk in chunked(prompt_ids, self.chunk_size):
            samples.extend(self._generate_chunk(list(chunk), request))
        return self._to_rollout(batch, num_generations, prompt_ids, samples, request)

    def _to_rollout(self, batch, num_generations, prompt_ids, samples, request) -> Rollout:
        pad = self.tokenizer.pad_token_id
        n, p_len = len(prompt_ids), max(len(p) for p in prompt_ids)
        c_len = max(1, max(len(s.completion_ids) for s in samples))
        prompt = torch.full((n, p_len), pad, dtype=torch.long)
        prompt_mask = torch.zeros((n, p_len), dtype=torch.long)
        completion = torch.full((n, c_len), pad, dtype=torch.long)
        completion_mask = torch.zeros((n, c_len), dtype=torch.long)
        sampler_logprobs = torch.zeros((n, c_len), dtype=torch.float32)
        for i, (p, s) in enumerate(zip(prompt_ids, samples)):
            prompt[i, p_len - len(p):] = torch.tensor(p)
            prompt_mask[i, p_len - len(p):] = 1
            k = len(s.completion_ids)
            if k:
                completion[i, :k] = torch.tensor(s.completion_ids)
                completion_mask[i, :k] = 1
                sampler_logprobs[i, :k] = torch.tensor(s.logprobs, dtype=torch.float32)
        return Rollout(
            batch=batch, num_generations=num_generations,
            prompt_ids=prompt, prompt_mask=prompt_mask,
            completion_ids=completion, completion_mask=completion_mask,
            sampler_logprobs=sampler_logprobs,
            truncated=torch.tensor([s.truncated for s in samples]),
            completions=self.tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True),
        )
