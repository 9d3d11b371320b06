"""How long a dataset's prompts really are, in tokens, as the rollout will see them (chat template, system prompt and
the run's tools' schemas applied): the plan holds the longest one rather than generator.max_prompt_length alone, and
the load says how many prompts that length cuts. A streamed dataset is measured on its first rows
(sources.STREAM_SAMPLE)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .formats import format_prompt
from .sources import STREAM_SAMPLE

TOKENIZE_BATCH = 512  # prompts tokenized per call: the fast tokenizer's batch, bounded so a large dataset is streamed


@dataclass
class PromptLengths:
    tokens: list[int]  # [R] each measured row's formatted prompt, in tokens (before any cut)
    longest_row: dict  # the first row of the most tokens
    total: Optional[int]  # rows in the dataset (None: streamed, length unknown)

    @property
    def longest(self) -> int:
        return max(self.tokens)

    def cut(self, max_prompt_length: int) -> int:
        """How many measured prompts are longer than max_prompt_length (a rollout keeps their last tokens)."""
        return sum(n > max_prompt_length for n in self.tokens)

    def cut_note(self, max_prompt_length: int) -> Optional[str]:
        """One line when some prompts are cut, else None."""
        cut = self.cut(max_prompt_length)
        if not cut:
            return None
        of = f"{len(self.tokens):,}" if self.total is not None else f"the first {len(self.tokens):,} (streamed)"
        return (
            f"data: {cut:,} of {of} prompts are longer than generator.max_prompt_length={max_prompt_length} (the "
            f"longest {self.longest:,} tokens); they are cut from the left"
        )


def prompt_lengths(source) -> PromptLengths:
    """The token count of every prompt of a PromptSource's dataset (a streamed one's first STREAM_SAMPLE rows), read
    and tokenized TOKENIZE_BATCH rows at a time (why: a large dataset's rows never all sit in Python objects)."""
    import itertools

    dataset = source.dataset
    if source.streamed:  # (the rows its check read at open, when it has them: a stream is read once)
        rows = iter(source.sample if source.sample is not None else itertools.islice(iter(dataset), STREAM_SAMPLE))
        batches = iter(lambda: list(itertools.islice(rows, TOKENIZE_BATCH)), [])
    elif isinstance(dataset, list):
        batches = (dataset[start : start + TOKENIZE_BATCH] for start in range(0, len(dataset), TOKENIZE_BATCH))
    else:
        batches = (
            [dict(zip(batch, values)) for values in zip(*batch.values())]
            for batch in dataset.iter(batch_size=TOKENIZE_BATCH)
        )
    tokens: list[int] = []
    longest_row, longest = None, -1
    for batch in batches:
        texts = [format_prompt(source.tokenizer, r["prompt"], source.system_prompt, source.tools) for r in batch]
        counts = [len(ids) for ids in source.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        if max(counts) > longest:  # (the first of equals, as max over the rows gives)
            longest = max(counts)
            longest_row = batch[counts.index(longest)]
        tokens += counts
    return PromptLengths(tokens=tokens, longest_row=longest_row, total=None if source.streamed else len(tokens))
