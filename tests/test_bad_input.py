"""Bad input never shows a traceback: through `grpo_lab.cli.main`, in-process, every leaf of the config
schema gets a wrong type, null, an out-of-range value, a non-finite float and an empty value, and every
user path a directory/file mix-up, a path under a file, an unwritable place, a file that is not
UTF-8/JSON/a notebook. Each must print exactly one `grpo-lab: error:` line naming the field or flag,
exit 2, and leave no run directory -- and fail before any model is loaded (a guard makes loading one
fail the test), so the whole file runs in seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

from grpo_lab import cli
from grpo_lab.config.loading import load_config
from grpo_lab.config.schema import LabConfig

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "notebooks" / "01_quickstart.ipynb"
UNWRITABLE = Path("/proc/grpo-lab-no-such-dir")  # even root cannot create anything here


# --- the schema, leaf by leaf -------------------------------------------------------------------


def schema_leaves() -> dict[str, dict]:
    """'section.field' -> its JSON schema, for every leaf of LabConfig."""
    schema = LabConfig.model_json_schema()
    leaves = {}
    for section, prop in schema["properties"].items():
        definition = schema["$defs"][prop["$ref"].rsplit("/", 1)[-1]]
        for name, leaf in definition["properties"].items():
            leaves[f"{section}.{name}"] = leaf
    return leaves


def variants(leaf: dict) -> list[dict]:
    return [v for v in leaf.get("anyOf", [leaf]) if v.get("type") != "null"]


def nullable(leaf: dict) -> bool:
    return any(v.get("type") == "null" for v in leaf.get("anyOf", []))


def out_of_range(v: dict) -> list[str]:
    """YAML texts just outside the variant's bounds or choices."""
    if "enum" in v or "const" in v:
        return ["not-a-choice"]
    values, integer = [], v.get("type") == "integer"
    step = 1 if integer else 0.5
    if "minimum" in v:
        values.append(v["minimum"] - step)
    if "exclusiveMinimum" in v:
        values.append(v["exclusiveMinimum"])
    if "maximum" in v:
        values.append(v["maximum"] + step)
    if "exclusiveMaximum" in v:
        values.append(v["exclusiveMaximum"])
    return [str(x) for x in values]


WRONG_TYPE = {
    "integer": ["abc", "1.5"],
    "number": ["abc"],
    "boolean": ["maybe"],
    "string": ["[a, b]"],
    "array": ["abc"],
}


def cases() -> list[tuple[str, str, str]]:
    """(field, kind, YAML value) for every leaf."""
    out = []
    for field, leaf in schema_leaves().items():
        kinds = [v.get("type") for v in variants(leaf)]
        out.append((field, "wrong type", "{wrong: type}"))
        for value in dict.fromkeys(x for k in kinds for x in WRONG_TYPE[k] if not (k == "string" and "array" in kinds)):
            out.append((field, "wrong type", value))
        out.append((field, "null", "null"))
        for value in dict.fromkeys(x for v in variants(leaf) for x in out_of_range(v)):
            out.append((field, "out of range", value))
        if "number" in kinds:
            out += [(field, "non-finite", v) for v in (".inf", "-.inf", ".nan")]
        if any(v.get("type") == "array" and v["items"].get("type") == "number" for v in variants(leaf)):
            out += [(field, "non-finite", v) for v in ("[.nan]", "[1.0, .inf]")]
        if "string" in kinds:
            out.append((field, "empty", '""'))
        if "array" in kinds:
            out.append((field, "empty", "[]"))
    return out


# Values a leaf legitimately accepts, each with its reason; checked below to be accepted (so the list
# cannot rot), every other generated case must be refused. Decided the other way, on purpose: "" is
# refused everywhere (data.system_prompt and run.output_dir included: null says "none"/"default", and
# the widget editor turns an empty box into null), and run.seed is bounded to [0, 2**32) because
# torch.manual_seed raises past 64 bits.
NULL_MEANS_DEFAULT = {  # null is the documented "automatic" value of these fields
    "model.chat_template": "the tokenizer's own chat template",
    "generator.environment_factory": "no environments",
    "placement.generator": "the learner's device (colocated)",
    "placement.gpu_memory_gib": "read the device",
    "placement.host_memory_gib": "this machine's RAM",
    "placement.ray_address": "a Ray on this machine, started by the Lab (for a sharded learner)",
    "placement.rank_memory_gib": "no budget of its own per rank (the driver guards the machine)",
    "placement.reward_model": "the learner's device",
    "generator.chunk_size": "all sequences in one call",
    "generator.max_tool_response_tokens": "no bound of its own (the trajectory budget is the bound)",
    "generator.gpu_memory_utilization": "0.9 on a GPU of its own",
    "generator.model": "the learner's base",
    "generator.quantization": "the model dtype",
    "grpo.epsilon_high": "= epsilon",
    "lora.expert_r": "= r (each expert's rank with lora.target_experts)",
    "grpo.micro_batch_size": "the whole batch",
    "grpo.importance_sampling_clip_max": "no upper bound (the *_mask modes; *_truncate needs one bound, a cross check)",
    "grpo.importance_sampling_clip_min": "no lower bound",
    "reference.strategy": "auto from beta",
    "reference.device": "the learner's device",
    "data.system_prompt": "the prompts as the dataset has them",
    "data.dataset_config": "no configuration (load_dataset's name=None)",
    "data.reward_weights": "all 1",
    "run.output_dir": "runs/<date-time>",
    "memory.host_mmap_threshold_mib": "glibc's own mmap threshold, not pinned",
}
ALLOWED = {(field, "null", "null"): f"null = {why}" for field, why in NULL_MEANS_DEFAULT.items()}
ALLOWED[("run.report_to", "empty", "[]")] = "[] = no tracker (the default; TRL's report_to takes it too)"
ALLOWED[("data.reward_models", "empty", "[]")] = "[] = no reward model (the default)"
ALLOWED[("generator.tools", "empty", "[]")] = "[] = no tools (the default)"


def case_id(case):
    return f"{case[0]}={case[2]}"


ALL_CASES = cases()
REFUSED = [c for c in ALL_CASES if c not in ALLOWED]


def test_the_allow_list_matches_the_schema():
    leaves = schema_leaves()
    assert set(NULL_MEANS_DEFAULT) == {f for f, leaf in leaves.items() if nullable(leaf)}
    assert set(ALLOWED) <= set(ALL_CASES)
    kinds = {(f, k) for f, k, _ in ALL_CASES}
    for field, leaf in leaves.items():  # every leaf is exercised with every kind that applies to its type
        types = {v.get("type") for v in variants(leaf)}
        assert {(field, "wrong type"), (field, "null")} <= kinds, field
        assert "number" not in types or (field, "non-finite") in kinds, field
        assert not types & {"string", "array"} or (field, "empty") in kinds, field
        bounded = any(
            k in v
            for v in variants(leaf)
            for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum", "enum", "const")
        )
        assert not bounded or (field, "out of range") in kinds, field


@pytest.mark.parametrize("case", sorted(ALLOWED), ids=case_id)
def test_allowed_values_are_accepted(base_config, case):
    field, _, value = case
    load_config(str(base_config), [f"{field}={value}"])


# --- the CLI, in-process -------------------------------------------------------------------------


@pytest.fixture
def base_config(tiny_model, tmp_path):
    """A tiny-model config file: a case that passed validation would go on to load this model."""
    cfg = {
        "model": {"name_or_path": tiny_model, "dtype": "float32", "bnb_4bit_compute_dtype": "float32"},
        "lora": {"r": 8, "lora_alpha": 16},
        "generator": {"max_completion_length": 8, "max_prompt_length": 64},
        "grpo": {"num_generations": 2, "prompts_per_step": 2},
        "data": {"rewards": ["exact_answer", "format", "length"], "num_prompts": 8},
        "run": {"steps": 1},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(autouse=True)
def no_model_loading(monkeypatch):
    """Loading a model means the bad value got through every check: fail the test instead."""

    def refuse(self, *args, **kwargs):
        raise AssertionError("the value passed every check and a model started loading")

    monkeypatch.setattr("grpo_lab.lab.Lab.load", refuse)


def refused(capsys, argv, *names):
    """Run the CLI in-process; assert exit 2 with one `grpo-lab: error:` line naming each of `names`."""
    code = cli.main([str(a) for a in argv])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("grpo-lab: error:"), captured.err
    assert "Traceback" not in captured.err + captured.out
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("case", REFUSED, ids=case_id)
def test_bad_config_value_is_one_line_exit_2(capsys, base_config, tmp_path, case):
    field, _, value = case
    out = tmp_path / "run"
    refused(capsys, ["run", base_config, "--out", out, "--set", f"{field}={value}"], field)
    assert not out.exists()


@pytest.mark.parametrize(
    "override, field",
    [
        ("grpo.prompts_per_step=9", "grpo.prompts_per_step"),  # more distinct prompts than data.num_prompts (8)
        ("run.seed=4294967296", "run.seed"),  # torch.manual_seed overflows past 64 bits; kept to 32
        ("lora.target_modules=all", "lora.target_modules"),
        ("lora.target_modules=['']", "lora.target_modules"),
        ("data.rewards=['']", "data.rewards"),
        ("placement.generator=['']", "placement.generator"),
        ("placement.generator=[cpu, cpu]", "placement.generator"),  # hf samples with the learner: no devices of its own
        ("data.rewards=[no_such_module:f]", "data.rewards"),
        ("data.rewards=[math:pi]", "data.rewards"),  # not callable
        ("data.rewards=[os:getcwd]", "data.rewards"),  # callable, but not with the reward arguments
    ],
)
def test_more_bad_values(capsys, base_config, tmp_path, override, field):
    refused(capsys, ["run", base_config, "--out", tmp_path / "run", "--set", override], field)
    assert not (tmp_path / "run").exists()


# --- paths ---------------------------------------------------------------------------------------


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("keep me\n")
    return path


def test_run_out_under_a_file_or_unwritable_is_refused_before_loading(capsys, base_config, a_file):
    refused(capsys, ["run", base_config, "--out", a_file / "run"], "--out", "is a file")
    refused(capsys, ["run", base_config, "--out", a_file], "--out", "is a file")
    refused(capsys, ["run", base_config, "--out", UNWRITABLE / "run"], "--out", "cannot write")
    assert a_file.read_text() == "keep me\n"


def test_run_output_dir_from_the_config_is_checked_too(capsys, base_config, a_file):
    refused(capsys, ["run", base_config, "--set", f"run.output_dir={a_file / 'run'}"], "run.output_dir")


def test_bad_config_files(capsys, tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "latin1.yaml").write_bytes("model: {name_or_path: caf\xe9}\n".encode("latin-1"))
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "broken.yaml").write_text("model: [unclosed\n")
    (tmp_path / "section.yaml").write_text("model: just-a-string\n")
    for name in ("adir", "missing.yaml", "latin1.yaml", "list.yaml", "broken.yaml", "section.yaml"):
        line = refused(capsys, ["run", tmp_path / name, "--out", tmp_path / "run"])
        assert "config" in line or "model" in line, line
    assert not (tmp_path / "run").exists()


def test_bad_datasets(capsys, base_config, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    (data / "text.jsonl").write_text("not json\n")
    (data / "noprompt.jsonl").write_text('{"question": "x"}\n')
    (data / "intprompt.jsonl").write_text('{"prompt": 5, "answer": "1"}\n')
    (data / "badmessages.jsonl").write_text('{"prompt": [1, 2], "answer": "1"}\n')
    (data / "emptyprompt.jsonl").write_text('{"prompt": " ", "answer": "1"}\n')
    (data / "blank.jsonl").write_text("\n\n")
    (data / "one.jsonl").write_text('{"prompt": "1 + 1?", "answer": "2"}\n')  # prompts_per_step is 2
    os.mkfifo(data / "fifo.jsonl")  # reading it would block forever
    for name in (
        "",
        "missing.jsonl",
        "latin1.jsonl",
        "text.jsonl",
        "noprompt.jsonl",
        "intprompt.jsonl",
        "badmessages.jsonl",
        "emptyprompt.jsonl",
        "blank.jsonl",
        "fifo.jsonl",
    ):
        refused(
            capsys,
            ["run", base_config, "--out", tmp_path / "run", "--set", f"data.dataset={data / name}"],
            "data.dataset",
        )
    refused(
        capsys,
        ["run", base_config, "--out", tmp_path / "run", "--set", f"data.dataset={data / 'one.jsonl'}"],
        "grpo.prompts_per_step",
        "1 rows",
    )
    assert not (tmp_path / "run").exists()


def test_tiny_path_that_is_a_file_under_a_file_or_unwritable(capsys, a_file):
    refused(capsys, ["tiny", a_file], "grpo-lab tiny PATH", "is a file")
    refused(capsys, ["tiny", a_file, "--force"], "grpo-lab tiny PATH", "is a file")
    refused(capsys, ["tiny", a_file / "model"], "grpo-lab tiny PATH", "is a file")
    refused(capsys, ["tiny", UNWRITABLE / "model"], "grpo-lab tiny PATH", "cannot write")
    assert a_file.read_text() == "keep me\n" and not list(a_file.parent.glob(".a_file*"))
    refused(capsys, ["tiny", a_file.parent], "tiny model", "other files")  # was: swapped away, files deleted
    assert a_file.read_text() == "keep me\n"


def notebook(path: Path, **metadata) -> Path:
    nb = nbformat.v4.new_notebook(metadata=metadata)
    nb.cells = [nbformat.v4.new_code_cell("steps = 1\nresults_path = None", metadata={"tags": ["parameters"]})]
    nbformat.write(nb, path)
    return path


def test_bad_sweep_notebooks(capsys, tmp_path):
    (tmp_path / "adir.ipynb").mkdir()
    (tmp_path / "text.ipynb").write_text("not json\n")
    (tmp_path / "list.ipynb").write_text("[1, 2]\n")
    (tmp_path / "cells.ipynb").write_text(
        json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [{"cell_type": "code"}]})
    )
    (tmp_path / "latin1.ipynb").write_bytes('{"cells": "caf\xe9"}'.encode("latin-1"))
    notebook(tmp_path / "nokernel.ipynb")  # valid, but papermill cannot tell its language
    for name in (
        "missing.ipynb",
        "adir.ipynb",
        "text.ipynb",
        "list.ipynb",
        "cells.ipynb",
        "latin1.ipynb",
        "nokernel.ipynb",
    ):
        refused(capsys, ["sweep", tmp_path / name, "--grid", "steps=1,2", "--out", tmp_path / "s"], "sweep NOTEBOOK")
    assert not (tmp_path / "s").exists()


def test_bad_sweep_out(capsys, tmp_path, a_file):
    good = notebook(
        tmp_path / "good.ipynb", kernelspec={"name": "python3", "display_name": "Python 3", "language": "python"}
    )
    for out in (a_file, a_file / "s", UNWRITABLE / "s"):
        refused(capsys, ["sweep", good, "--grid", "steps=1,2", "--out", out], "--out")
    assert a_file.read_text() == "keep me\n"


def test_bad_model_checkpoints(capsys, base_config, tmp_path):
    """A config.json the planner reads before loading: not JSON, not an object, not UTF-8, wrong sizes."""
    for name, content in [
        ("notjson", b"not json"),
        ("list", b"[1]"),
        ("latin1", b"\xff\xfe"),
        (
            "sizes",
            json.dumps(
                {
                    "hidden_size": "abc",
                    "num_attention_heads": 2,
                    "intermediate_size": 4,
                    "num_hidden_layers": 1,
                    "vocab_size": 10,
                }
            ).encode(),
        ),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_bytes(content)
        refused(
            capsys,
            ["run", base_config, "--out", tmp_path / "run", "--set", f"model.name_or_path={tmp_path / name}"],
            "model.name_or_path",
        )
        refused(capsys, ["plan", base_config, "--set", f"model.name_or_path={tmp_path / name}"], "model.name_or_path")
    assert not (tmp_path / "run").exists()


def test_bad_generator_model_is_named_as_such(capsys, base_config, tmp_path, a_file):
    for path in (tmp_path / "missing", a_file):
        refused(
            capsys,
            [
                "run",
                base_config,
                "--out",
                tmp_path / "run",
                "--set",
                "generator.backend=vllm",
                "--set",
                f"generator.model={path}",
            ],
            "generator.model",
        )
    assert not (tmp_path / "run").exists()


def test_checkpoint_transformers_cannot_read_is_one_labError(tiny_model, tmp_path):
    """An unknown model_type passes the planner (the sizes are fine) and fails in from_pretrained's config
    step, before any weight is read."""
    from grpo_lab import LabError
    from grpo_lab.config.models_and_devices import ModelSection
    from grpo_lab.models.learner import load_base

    config = json.loads((Path(tiny_model) / "config.json").read_text())
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "model_type": "nope", "architectures": ["Nope"]}))
    with pytest.raises(LabError, match=r"^model.name_or_path: cannot load .*nope") as err:
        load_base(ModelSection(name_or_path=str(tmp_path / "m"), dtype="float32", load_in_4bit=False), "cpu")
    assert "\n" not in str(err.value)


def test_diverged_sampling_is_one_line_naming_the_knobs():
    """torch.multinomial's RuntimeError on inf/nan probabilities becomes one LabError naming the knobs (the whole
    path, with a real Lab, its rollback and the retry: tests/test_numerics.py)."""
    from types import SimpleNamespace

    import torch

    from grpo_lab import LabError
    from grpo_lab.generation.base import GenerationRequest
    from grpo_lab.generation.hf import HFGenerator
    from grpo_lab.generation.turn_shapes import TurnShapes
    from grpo_lab.models.fsdp import FSDP

    class Diverged(torch.nn.Module):
        def get_output_embeddings(self):
            return torch.nn.Linear(2, 2)

        def generate(self, **kwargs):
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")

    generator = HFGenerator.__new__(HFGenerator)
    generator.learner = SimpleNamespace(model=Diverged(), device=torch.device("cpu"), sharding=FSDP())
    generator.tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    generator.eos_token_ids = [1]
    generator.shapes = TurnShapes()  # (what __init__ gives every hf generator: its calls' shapes for a tool loop)
    with pytest.raises(LabError, match="grpo.learning_rate") as err:
        generator.generate_chunk([[5, 6]], GenerationRequest(max_completion_length=4))
    assert "\n" not in str(err.value)


# --- a real process ------------------------------------------------------------------------------


def test_lora_targets_that_match_nothing_name_the_valid_ones(base_config, tmp_path):
    """The one case that needs the model itself (PEFT matches names against the loaded modules)."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_lab",
            "run",
            str(base_config),
            "--out",
            str(out),
            "--quiet",
            "--set",
            "lora.target_modules=[qproj]",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("grpo-lab: error: lora.target_modules:"), proc.stderr
    assert "q_proj" in lines[0] and "qproj" in lines[0]
    assert not out.exists()
