"""The prompt source: a dataset's rows served in batches, in a seeded order reshuffled every epoch (a streamed dataset:
datasets' buffer shuffle, reseeded each epoch), formatted with the tokenizer's chat template. Its state is the exact
row, for every kind of source: a resumed run goes on from the row it stopped at. A sharded learner's ranks hold none:
their driver's source draws each step's rows and hands them over (HandedPrompts)."""

from __future__ import annotations

import itertools
import random
from typing import Optional

from ..algo.containers import PromptBatch
from ..errors import LabError
from .formats import check_prompt, format_prompt, reward_prompt
from .sources import Opened, is_streamed, open_dataset

SHUFFLE_BUFFER = 1000  # rows a streamed dataset's shuffle holds (datasets' IterableDataset.shuffle buffer_size)


class PromptSource:
    """Serves batches of a dataset's rows in a seeded, reshuffled-every-epoch order. A list of rows or a map-style
    dataset is read a row at a time by index (a Dataset's rows stay in Arrow, not in Python objects); a streamed one
    is read in order through datasets' buffer shuffle, reseeded every epoch."""

    def __init__(
        self,
        dataset,
        tokenizer,
        system_prompt: Optional[str],
        seed: int,
        sample: Optional[list] = None,
        tools: Optional[list] = None,
    ):
        """`tools`: the run's tools' JSON schemas, rendered into every prompt as the tool loop renders them (why: they
        make a prompt longer, and the plan holds the longest; tools/__init__.py's Tools.schemas)."""
        self.dataset, self.tokenizer, self.system_prompt, self.seed = dataset, tokenizer, system_prompt, seed
        self.tools = tools
        self.streamed = is_streamed(dataset)  # (else a list of rows, or a map-style Dataset: both read by index)
        self.sample = sample  # a streamed dataset's first rows as its check read them: lengths() measures these
        self._rng = random.Random(seed)
        self._order: list[int] = []  # map-style: what is left of this epoch's order
        self._epoch = self._taken = 0  # the epoch (map-style: epochs begun) and a streamed one's rows drawn from it
        self._stream = None  # streamed: the epoch's iterator, made when first drawn from
        self._before_last: Optional[dict] = None
        self._lengths = None

    def state_dict(self) -> dict:
        """The data position (for checkpoints): the shuffle RNG and what is left of this epoch's order; a streamed
        dataset's epoch and the rows drawn from it."""
        if self.streamed:
            return {"epoch": self._epoch, "taken": self._taken}
        return {"rng": self._rng.getstate(), "order": list(self._order), "epoch": self._epoch}

    def load_state_dict(self, state: dict) -> None:
        if self.streamed:
            self._epoch, self._taken, self._stream = state["epoch"], state["taken"], None  # re-read up to the row
            return
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))  # (a JSON round trip gives lists)
        self._order = list(state["order"])
        self._epoch = state.get("epoch", 0)  # (a checkpoint written before epochs were counted: from 0)

    @property
    def epoch(self) -> float:
        """Epochs drawn so far (TRL's trainer_state.epoch); a streamed dataset's length is unknown: its whole epochs."""
        if self.streamed or not self._order:
            return float(self._epoch)
        size = len(self.dataset)
        return self._epoch - 1 + (size - len(self._order)) / size

    def longest(self, max_prompt_length: int) -> tuple[dict, int]:
        """(the row whose formatted prompt has the most tokens, that count): at most max_prompt_length, as a rollout
        cuts longer prompts. A streamed dataset's: of the rows lengths() reads."""
        lengths = self.lengths()
        return lengths.longest_row, min(lengths.longest, max_prompt_length)

    def lengths(self):
        """Its prompts' token counts (data/lengths.py), measured once: the dataset and its formatting are fixed for
        this source's life (a data.* edit builds a new source)."""
        if self._lengths is None:
            from .lengths import prompt_lengths

            self._lengths = prompt_lengths(self)
            self.sample = None  # (measured: not kept)
        return self._lengths

    def rewind(self) -> None:
        """Back to before the last batch was drawn, so the next batch is that batch again (a redone step's)."""
        if self._before_last is not None:
            self.load_state_dict(self._before_last)

    def draw_for(self, step: int) -> None:
        """Where `step`'s rollout draws from, so that the rollout, if it fails, gives its draw back (undraw)."""
        self._drawn_for = (step, self.state_dict())

    def undraw(self, step: int) -> None:
        """A failed rollout of `step` is undone with the rows it drew: the retry samples the step's own prompts (one
        that failed before drawing finds another step's mark, and gives back nothing)."""
        drawn, self._drawn_for = getattr(self, "_drawn_for", None), None
        if drawn is not None and drawn[0] == step:
            self.load_state_dict(drawn[1])

    def next_batch(self, size: int) -> PromptBatch:
        self._before_last = self.state_dict()
        draw = self._draw_streamed if self.streamed else self._draw_indexed
        return self.batch_of([draw() for _ in range(size)])

    def _draw_indexed(self) -> dict:
        if not self._order:
            self._epoch += 1
            self._order = list(range(len(self.dataset)))
            self._rng.shuffle(self._order)
        return self.dataset[self._order.pop()]

    def _draw_streamed(self) -> dict:
        if self._stream is None:  # a new epoch, or a position put back: read up to the row it names
            shuffled = self.dataset.shuffle(seed=self.seed, buffer_size=SHUFFLE_BUFFER)
            shuffled.set_epoch(self._epoch)  # why: datasets reseeds the shuffle with the epoch, as TRL's sampler does
            self._stream = itertools.islice(iter(shuffled), self._taken, None)
        row = next(self._stream, None)
        if row is None:  # the epoch ended: the next one, reshuffled
            self._epoch, self._taken, self._stream = self._epoch + 1, 0, None
            return self._draw_streamed()
        check_prompt(row.get("prompt"), self._taken, "data.dataset")  # why here: a stream is checked as it is read
        self._taken += 1
        return row

    def batch_of(self, picked: list[dict]) -> PromptBatch:
        """These rows as a batch: prompts formatted, each row's prompt as rewards get it, the other columns passed
        on as the dataset has them (TRL's reward keywords)."""
        keys = sorted({k for r in picked for k in r} - {"prompt"})
        return PromptBatch(
            prompts=[format_prompt(self.tokenizer, r["prompt"], self.system_prompt, self.tools) for r in picked],
            answers=[None if r.get("answer") is None else str(r["answer"]) for r in picked],
            extra={k: [r.get(k) for r in picked] for k in keys},
            raw=[reward_prompt(r["prompt"], self.system_prompt) for r in picked],
        )


def prompt_source(
    config, tokenizer, given=None, opened: Optional[Opened] = None, say=print, tools: Optional[list] = None
) -> PromptSource:
    """The prompt source of data.* or of `given` (a Lab's train_dataset): `opened`, the dataset preflight opened and
    checked, so the data is opened and checked once (None: opened and checked here). `say` gets the one line on the
    prompts generator.max_prompt_length cuts, if any (None: not said). `tools`: the tools' schemas (PromptSource)."""
    opened = opened if opened is not None else open_dataset(config, given)
    source = PromptSource(opened.dataset, tokenizer, config.data.system_prompt, config.run.seed, opened.sample, tools)
    note = source.lengths().cut_note(config.generator.max_prompt_length)
    if note and say is not None:
        say(note)
    return source


class HandedPrompts:
    """A sharded learner's rank's prompts: the rows its driver's PromptSource draws, handed to the rank with each
    rollout (execution/sharded/driver.py), so no rank opens the dataset. The data position is the driver's too:
    `position` is what the driver hands for a checkpoint (which rank 0 writes)."""

    def __init__(self):
        self.batch: Optional[PromptBatch] = None
        self.epoch = 0.0  # the driver's source's, as it drew this batch (TRL's trainer_state.epoch)
        self.position: dict = {}

    def hand(self, batch: PromptBatch, epoch: float) -> None:
        self.batch, self.epoch = batch, epoch

    def next_batch(self, size: int) -> PromptBatch:
        batch, self.batch = self.batch, None
        if batch is None:
            raise LabError("a sharded learner's rank draws no prompts: its driver hands them with each rollout")
        return batch

    def rewind(self) -> None:
        """Nothing here: the driver's source rewinds, and hands the redone rollout its rows again."""

    def draw_for(self, step: int) -> None:
        """Nothing here: a failed rollout's rows go back to the driver's source (sharded/driver.py's failed)."""

    undraw = draw_for

    def state_dict(self) -> dict:
        return self.position

    def load_state_dict(self, state: dict) -> None:
        self.position = state
