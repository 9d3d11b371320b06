"""The data is read once at load: preflight opens and checks the dataset and hands it to the executor's prompt
source (data/prompts.prompt_source), which neither opens nor checks it again; a stream's first rows, read by the
check, are the rows the prompt lengths are measured on."""

from __future__ import annotations

import json

from grpo_lab import Lab


def test_a_dataset_file_is_opened_and_checked_once_at_load(tiny_config, tmp_path, monkeypatch):
    import datasets

    import grpo_lab.data.sources as sources

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say {i}.", "answer": str(i)}) + "\n" for i in range(6)))
    opens, checks = [], []
    load, check = datasets.load_dataset, sources.check_dataset
    # as the library calls them: datasets.load_dataset through the module, check_dataset from open_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: opens.append(a) or load(*a, **k))
    monkeypatch.setattr(sources, "check_dataset", lambda *a, **k: checks.append(a) or check(*a, **k))
    lab = Lab(tiny_config(data={"dataset": str(path), "system_prompt": None})).load()
    try:
        assert len(opens) == 1 and len(checks) == 1, (opens, checks)
        assert len(lab.prompts.dataset) == 6 and lab.prompts.lengths().total == 6
        lab.configure({"data.system_prompt": "Be brief."})  # a data edit opens it anew: once
        assert len(opens) == 2 and len(checks) == 2
    finally:
        lab.close()


def test_a_streams_first_rows_are_read_once_at_load(tiny_config):
    from datasets import IterableDataset

    reads = []

    def rows():
        reads.append(0)
        for i in range(300):
            reads[-1] += 1
            yield {"prompt": f"Say {i}.", "n": i}

    lab = Lab(tiny_config(data={"system_prompt": None}), train_dataset=IterableDataset.from_generator(rows)).load()
    try:
        assert reads == [256], reads  # the check's first 256 rows, measured by lengths() without a second read
        assert lab.prompts.lengths().total is None and len(lab.prompts.lengths().tokens) == 256
    finally:
        lab.close()
