"""`generator.backend: synthetic`: no sampling. Every completion is max_completion_length tokens of a fixed sequence,
so a step is the learner's worst case at that length, in seconds instead of a rollout's minutes or hours: the memory
frontier at 16K-128K tokens (bench/gpu/frontier.py), the learner's side of a comparison with TRL fed the same
completions (bench/gpu/trl_synthetic.py), a worst-case probe without a generator. Rewards still score the (meaningless)
text; there is no sampler, so its log-probs are NaN and stay out of the learner-sampler metrics.
"""

from __future__ import annotations

import math

from ..models.source import resolve_model_path
from .base import GenerationRequest, Generator, Sample


def content_ids(tokenizer, rows: int, length: int, first_row: int = 0) -> list[list[int]]:
    """The fixed completions: row k, position i is the ((first_row + k) x 7919 + i)-th ordinary token, cycling
    (no special, added or stop token, so nothing cuts a completion short). TRL's side uses the same sequence."""
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    ordinary = [t for t in range(len(tokenizer)) if t not in special]
    return [[ordinary[((first_row + k) * 7919 + i) % len(ordinary)] for i in range(length)] for k in range(rows)]


class SyntheticGenerator(Generator):
    def __init__(self, learner, config):
        from .hf import check_hf_placement

        super().__init__(learner.tokenizer, resolve_model_path(config.model.name_or_path))
        check_hf_placement(config)  # no weights of its own: no device of its own either
        self.row = 0

    def sync(self, learner) -> None:
        """Nothing to do: nothing samples."""

    def generate_chunk(self, prompt_ids, request: GenerationRequest) -> list[Sample]:
        ids = content_ids(self.tokenizer, len(prompt_ids), request.max_completion_length, self.row)
        self.row += len(prompt_ids)  # why: each row of a step its own content, so rewards and advantages vary
        ids = [[t for t in row if t not in self.eos_token_ids] or row for row in ids]
        return [Sample(completion_ids=row, logprobs=[math.nan] * len(row), truncated=True) for row in ids]
