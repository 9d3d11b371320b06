"""`generator.backend: synthetic`: no sampling. Every completion is max_completion_length tokens of a fixed sequence,
so a step is the learner's worst case at that length, in seconds instead of a rollout's minutes or hours: the memory
frontier at 16K-128K tokens (bench/gpu/frontier.py), the learner's side of a comparison with TRL fed the same
completions (bench/gpu/trl_synthetic.py), a worst-case probe without a generator. Rewards still score the (meaningless)
text; there is no sampler, so its log-probs are NaN and stay out of the learner-sampler metrics.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

from ..errors import LabError
from ..models.source import resolve_model_path
from .base import GenerationRequest, Generator, Sample


def content_ids(
    tokenizer, rows: int, length: int, first_row: int = 0, exclude: Iterable = (), vocab_size: Optional[int] = None
) -> list[list[int]]:
    """The fixed sequences, each exactly `length` ids: row k, position i is the ((first_row + k) x 7919 + i)-th
    ordinary id, cycling. Ordinary: below the tokenizer's length (and `vocab_size`: ids past the tokenizer decode to
    nothing), not special, added, EOS, pad, BOS or in `exclude` (a stop id), so nothing cuts a completion short.
    The frontier's TRL side uses the same ids (bench/gpu/trl_synthetic.py)."""
    banned = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    banned |= {tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id, *exclude}
    limit = min(len(tokenizer), vocab_size or len(tokenizer))
    ordinary = [t for t in range(limit) if t not in banned]
    if not ordinary:
        raise LabError(f"generator.backend: synthetic: the tokenizer has no ordinary token id below {limit}")
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
        length, rows = request.max_completion_length, len(prompt_ids)
        ids = content_ids(self.tokenizer, rows, length, self.row, exclude=self.eos_token_ids)
        self.row += rows  # why: each row of a step its own content, so rewards and advantages vary
        return [Sample(completion_ids=row, logprobs=[math.nan] * len(row), truncated=True) for row in ids]
