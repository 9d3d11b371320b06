from pathlib import Path

import pytest
import yaml

from grpo_lab.config.fields import apply_overrides
from grpo_lab.config.loading import load_config, save_config
from grpo_lab.config.schema import LabConfig
from grpo_lab.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
BASE = {"model": {"name_or_path": "some/model"}}


def with_(section, **values):
    cfg = {"model": {"name_or_path": "some/model"}}
    cfg.setdefault(section, {}).update(values)
    return cfg


@pytest.mark.parametrize(
    "preset", sorted((ROOT / "grpo_lab" / "config" / "presets").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_preset_loads_and_round_trips(preset, tmp_path):
    cfg = load_config(preset)
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


def test_defaults_follow_trl_names_and_resolve_reference():
    cfg = load_config(BASE)
    assert cfg.grpo.num_generations == 8 and cfg.grpo.loss_type == "dapo" and cfg.grpo.beta == 0.0
    assert cfg.reference.strategy is None and cfg.reference_strategy == "none"  # auto; beta 0: nothing needed
    assert load_config(with_("grpo", beta=0.1)).reference_strategy == "adapter-disabled"
    assert cfg.epsilon_high == cfg.grpo.epsilon


@pytest.mark.parametrize(
    "data, field",
    [
        (with_("grpo", bogus=1), "grpo.bogus"),
        ({**BASE, "extra_section": {}}, "extra_section"),
        (with_("generator", chunk_size=0), "generator.chunk_size"),
        (with_("generator", chunk_size=-3), "generator.chunk_size"),
        (with_("grpo", beta=-0.1), "grpo.beta"),
        (with_("grpo", num_generations=1), "grpo.num_generations"),
        (with_("grpo", loss_type="ppo"), "grpo.loss_type"),
        (with_("generator", backend="nope"), "generator.backend"),
        (with_("generator", temperature=-1), "generator.temperature"),
        (with_("lora", r=0), "lora.r"),
        (with_("placement", learner="gpu0"), "placement.learner"),
        (with_("placement", generator=[]), "placement.generator"),
        (with_("data", rewards=["nope"]), "data.rewards"),
        ({"grpo": {}}, "model"),
    ],
)
def test_invalid_values_name_the_field(data, field):
    with pytest.raises(ConfigError) as err:
        load_config(data)
    message = str(err.value)
    assert field in message and "\n" not in message


def test_reference_none_with_positive_beta_is_refused():
    with pytest.raises(ConfigError, match="reference.strategy.*beta"):
        load_config({**BASE, "grpo": {"beta": 0.1}, "reference": {"strategy": "none"}})


def test_reward_weights_must_match_rewards():
    with pytest.raises(ConfigError, match="reward_weights"):
        load_config(with_("data", rewards=["format"], reward_weights=[1.0, 2.0]))


def test_overrides_parse_yaml_values_and_reject_unknown_keys():
    cfg = load_config(
        BASE, ["grpo.beta=0.04", "generator.chunk_size=3", "placement.generator=[1, 2]", "generator.chunk_size=null"]
    )
    assert cfg.grpo.beta == 0.04 and cfg.generator.chunk_size is None
    assert cfg.placement.generator == ["cuda:1", "cuda:2"]
    with pytest.raises(ConfigError, match="grpo.nope"):
        load_config(BASE, ["grpo.nope=1"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(BASE, ["grpo.beta"])
    with pytest.raises(ConfigError, match="is a value"):
        apply_overrides({"grpo": {"beta": 1}}, ["grpo.beta.x=1"])


def test_assignment_is_validated():
    cfg = load_config(BASE)
    with pytest.raises(ConfigError, match=r"grpo\.micro_batch_size\b"):
        cfg.grpo.micro_batch_size = 0
    assert cfg.grpo.micro_batch_size is None  # the refused value was not stored
    with pytest.raises(ConfigError, match=r"grpo\.beta"):
        cfg.grpo = {"beta": -1.0}
    assert cfg.grpo.beta == 0.0
    cfg.grpo.micro_batch_size = 2
    assert cfg.grpo.micro_batch_size == 2


def test_assignment_error_is_a_one_line_config_error_naming_the_field():
    cfg = load_config(BASE)
    with pytest.raises(ConfigError, match=r"grpo\.micro_batch_size") as err:
        cfg.grpo.micro_batch_size = 0
    assert "\n" not in str(err.value)


def test_assignment_runs_the_cross_section_checks():
    cfg = load_config({**BASE, "reference": {"strategy": "none"}})
    with pytest.raises(ConfigError, match=r"reference\.strategy.*beta"):
        cfg.grpo.beta = 0.1


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.yaml' is neither a YAML file nor a preset; presets: .*tiny-cpu"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_saved_yaml_is_plain_and_complete(tmp_path):
    save_config(load_config(BASE), tmp_path / "c.yaml")
    data = yaml.safe_load((tmp_path / "c.yaml").read_text())
    assert set(data) == set(LabConfig.model_fields)
    assert data["reference"]["strategy"] is None  # auto stays auto in the saved file


def test_bad_edits_through_update_and_configure_are_one_line_naming_the_field(tiny_config):
    from grpo_lab import Lab

    cfg = load_config(BASE)
    before = cfg.to_dict()
    for changes, named in (
        ({"grpo.nope": 1}, "grpo.nope"),
        ({"nosection.beta": 1}, "nosection.beta"),
        ({"grpo.beta": 0.1, "grpo.nope": 1}, "grpo.nope"),
    ):
        with pytest.raises(ConfigError, match=rf"^{named}: unknown field") as err:
            cfg.update(changes)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"^grpo: got 5; assign a grpo section"):
        cfg.grpo = 5
    lab = Lab(tiny_config())
    with pytest.raises(ConfigError, match=r"^grpo: got 0\.1; pass a mapping of its fields"):
        lab.configure(grpo=0.1)
    assert cfg.to_dict() == before  # nothing applied, the valid beta of a bad batch included
    old_beta, old_chunk = lab.config.grpo.beta, lab.config.generator.chunk_size
    assert (old_beta, old_chunk) != (0.2, 2)
    assert lab.configure({"grpo.beta": 0.2}, generator={"chunk_size": 2}) == {
        "grpo.beta": (old_beta, 0.2),
        "generator.chunk_size": (old_chunk, 2),
    }
    assert lab.config.grpo.beta == 0.2 and lab.config.generator.chunk_size == 2


@pytest.mark.parametrize("trl_name", ["correction", "mode", "clip_max", "clip_min"])
def test_trls_vllm_importance_sampling_spellings_are_aliases(trl_name):
    """TRL's GRPOConfig names these vllm_importance_sampling_*; grpo_lab's names drop 'vllm_' (they apply to any
    generator with weights of its own). Both spellings work in YAML/--set, update() and attribute assignment."""
    value = {"correction": False, "mode": "token_mask", "clip_max": 2.5, "clip_min": 0.5}[trl_name]
    name = f"importance_sampling_{trl_name}"
    config = load_config("tiny-cpu", [f"grpo.vllm_{name}={str(value).lower() if isinstance(value, bool) else value}"])
    assert getattr(config.grpo, name) == value
    fresh = load_config("tiny-cpu")
    assert fresh.update({f"grpo.vllm_{name}": value}) == {
        f"grpo.{name}": (getattr(load_config("tiny-cpu").grpo, name), value)
    }
    other = load_config("tiny-cpu")
    setattr(other.grpo, f"vllm_{name}", value)
    assert getattr(other.grpo, name) == value
    with pytest.raises(ConfigError, match=rf"^grpo.vllm_{name}: given with grpo.{name}, its grpo_lab name; give one"):
        load_config("tiny-cpu", [f"grpo.vllm_{name}={value}", f"grpo.{name}={value}"])
