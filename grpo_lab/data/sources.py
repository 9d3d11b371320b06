"""A run's dataset, TRL's way: a `datasets.Dataset`, `DatasetDict` (the split from data.split), `IterableDataset`
(streamed) or list of dicts handed to the Lab as `train_dataset`, or named by data.dataset: the built-in arithmetic
set, a local file or folder `datasets.load_dataset` reads (JSON lines, Parquet, CSV, Arrow, or a `save_to_disk`
folder), or a hub id with data.dataset_config and data.split. Every source is checked here, before a weight loads:
a `prompt` column, prompts of TRL's two formats (standard: text; conversational: chat messages), rows present.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional

from ..errors import LabError
from .arithmetic import arithmetic_rows
from .formats import check_prompt

# a local file's suffix -> the `datasets` builder that reads it
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
# rows of a streamed dataset read at load to check its columns and plan its prompts (the rest are checked as drawn)
STREAM_SAMPLE = 256


class Opened(NamedTuple):
    """A dataset opened and checked (open_dataset): what preflight hands the executor's prompt source, so the data is
    opened, checked and (a stream's first rows) read once."""

    dataset: object  # a list of rows, a datasets.Dataset or an IterableDataset
    sample: Optional[list]  # a streamed dataset's first STREAM_SAMPLE rows, as the check read them (else None)


def open_dataset(config, given=None) -> Opened:
    """The rows of config.data, or of `given` (the Lab's `train_dataset`), checked: a list of dicts (the built-in set,
    a list given: kept as Python rows, why: importing `datasets` costs every process ~100 MiB of host RSS, measured),
    or a `datasets.Dataset` or `IterableDataset`. Nothing is trained on yet: a bad dataset is one line with the fix."""
    data = config.data
    field = "train_dataset" if given is not None else "data.dataset"
    dataset = from_object(given, data.split) if given is not None else from_config(data, config.run.seed)
    if data.streaming and given is None and not is_streamed(dataset):  # (built in memory, or Arrow)
        import datasets

        rows = datasets.Dataset.from_list(dataset) if isinstance(dataset, list) else dataset
        dataset = rows.to_iterable_dataset(num_shards=1)
    if isinstance(dataset, list):
        check_rows(dataset, field)
        return Opened(dataset, None)
    return Opened(dataset, check_dataset(dataset, field))


def is_streamed(dataset) -> bool:
    """A `datasets.IterableDataset` (without importing `datasets` where nothing has: no object can be one then)."""
    import sys

    return "datasets" in sys.modules and isinstance(dataset, sys.modules["datasets"].IterableDataset)


def from_object(given, split: str):
    if isinstance(given, list) and all(isinstance(row, dict) for row in given):
        if not given:
            raise LabError("train_dataset: the list has no rows; give at least one {'prompt': ...} row")
        return given
    import datasets

    if isinstance(given, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        return pick_split(given, split, "train_dataset")
    if isinstance(given, (datasets.Dataset, datasets.IterableDataset)):
        return given
    raise LabError(
        f"train_dataset: got {type(given).__name__}; give a datasets.Dataset, DatasetDict, IterableDataset or a "
        "list of dicts with a 'prompt' key"
    )


def from_config(data, seed: int):
    name = data.dataset
    if name == "arithmetic":
        return arithmetic_rows(data.num_prompts, seed)
    import datasets

    path = Path(name).expanduser()
    if path.is_file():
        builder = _BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise LabError(
                f"data.dataset: {name!r} is a {path.suffix or 'suffix-less'} file; give a .jsonl, .json, .parquet, "
                ".csv or .arrow file, a folder, or a hub id"
            )
        return _load(name, lambda: datasets.load_dataset(builder, data_files=str(path), split="train", **_stream(data)))
    if path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        loaded = _load(name, lambda: datasets.load_from_disk(str(path)))  # a save_to_disk folder
        return pick_split(loaded, data.split, "data.split") if isinstance(loaded, datasets.DatasetDict) else loaded
    if path.is_dir():
        return _load(
            name,
            lambda: _with_split(datasets.load_dataset(str(path), data.dataset_config, **_stream(data)), data.split),
        )
    if path.exists():  # a FIFO, a device: reading it could block forever
        raise LabError(f"data.dataset: {name!r} is not a regular file or folder; give a file, a folder or a hub id")
    if name.startswith((".", "/", "~")) or path.suffix.lower() in _BUILDERS:
        raise LabError(f"data.dataset: {name!r} does not exist; give 'arithmetic', a local file or folder, or a hub id")
    return _load(
        name, lambda: _with_split(datasets.load_dataset(name, data.dataset_config, **_stream(data)), data.split)
    )


def _stream(data) -> dict:
    return {"streaming": True} if data.streaming else {}


def _with_split(loaded, split: str):
    """load_dataset without `split` gives every split; pick ours so a missing one lists the ones there are."""
    return pick_split(loaded, split, "data.split")


def pick_split(splits, split: str, field: str):
    if split not in splits:
        raise LabError(f"{field}: the dataset has no split {split!r}; set data.split to one of {sorted(splits)}")
    return splits[split]


def _load(name: str, load):
    """Run a `datasets` load; what it cannot reach or read becomes one line naming data.dataset."""
    import logging

    import datasets

    datasets.disable_progress_bars()  # why: a refusal is one line on the CLI; the load's own bars would come first
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # (and so would the error line a builder logs before it raises)
    try:
        return load()
    except LabError:
        raise
    except ConnectionError as err:
        raise LabError(
            f"data.dataset: cannot reach {name!r} on the Hugging Face hub ({first_line(err, 120)}); this "
            "machine may be offline (HF_HUB_OFFLINE=1 fails at once): download it where the hub is reachable and "
            "give its local path, or name a local file or folder"
        ) from None
    except (FileNotFoundError, ValueError) as err:
        raise LabError(f"data.dataset: cannot load {name!r}: {first_line(err)}") from None
    except Exception as err:  # a builder's own error (a malformed JSON line, a CSV it cannot parse)
        cause = err.__cause__ or err
        raise LabError(f"data.dataset: cannot read {name!r}: {type(cause).__name__}: {first_line(cause)}") from None
    finally:
        logger.setLevel(level)


def first_line(err: BaseException, width: int = 200) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:width]


def check_rows(rows: list[dict], field: str) -> None:
    """Python rows: each with a prompt of one of TRL's two formats."""
    for index, row in enumerate(rows):
        if "prompt" not in row:
            raise LabError(
                f"{field}: no 'prompt' column (row {index} has {sorted(row)}); name the prompt column 'prompt', e.g. "
                "dataset.rename_column('question', 'prompt')"
            )
        check_prompt(row["prompt"], index, field)


def check_dataset(dataset, field: str) -> Optional[list]:
    """A `prompt` column, at least one row, and every prompt (a streamed dataset: its first STREAM_SAMPLE rows) of
    one of TRL's two formats. Returns a streamed dataset's rows it read (None for a map-style one)."""
    import datasets

    columns = dataset.column_names
    rows = sample_rows(dataset) if isinstance(dataset, datasets.IterableDataset) else None
    if columns is None:  # a streamed dataset whose features are unknown until read
        columns = sorted({k for row in rows for k in row})
    if "prompt" not in columns:
        raise LabError(
            f"{field}: no 'prompt' column (it has {sorted(columns)}); rename the prompt column, e.g. "
            "dataset.rename_column('question', 'prompt')"
        )
    prompts = [row["prompt"] for row in rows] if rows is not None else dataset["prompt"]
    if not len(prompts):
        raise LabError(f"{field}: the dataset has no rows; give a dataset (or split) with at least one prompt")
    try:
        for index, prompt in enumerate(prompts):
            check_prompt(prompt, index, field)
    except UnicodeDecodeError as err:  # (Arrow keeps a non-UTF-8 file's bytes until a row is read)
        raise LabError(f"{field}: its text is not UTF-8 ({err.reason} at byte {err.start}); save it as UTF-8") from None
    return rows


def sample_rows(dataset, n: int = STREAM_SAMPLE) -> list[dict]:
    """The first `n` rows of a streamed dataset (its order before any shuffle)."""
    import itertools

    return list(itertools.islice(iter(dataset), n))
