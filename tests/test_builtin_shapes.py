"""Planning a built-in tiny model reads its shape from its build arguments: a new machine's `grpo-lab plan tiny-cpu`
builds and trains nothing (it used to train builtin:tiny-qwen2 for a minute first, its progress bar in the output),
and the shape is the built checkpoint's own."""

import json
from pathlib import Path

import pytest

from grpo_lab.models.shapes import ModelShape, load_shape
from grpo_lab.models.source import resolve_model_path


def test_planning_the_tiny_preset_in_an_empty_cache_builds_nothing(tmp_path, monkeypatch, capsys):
    from grpo_lab.cli import main

    cache = tmp_path / "cache"
    monkeypatch.setenv("GRPO_LAB_CACHE", str(cache))
    assert main(["plan", "tiny-cpu"]) == 0
    out = capsys.readouterr()
    assert "building" not in out.err and "verdict: fits" in out.out
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.parametrize("name", ["tiny-random", "kv-heavy", "qwen2-32k"])
def test_a_builtin_planned_unbuilt_has_its_built_shape(name):
    config = Path(resolve_model_path(f"builtin:{name}")) / "config.json"
    built = ModelShape.from_config(json.loads(config.read_text()))
    assert load_shape(f"builtin:{name}") == built
