"""Every config field keeps the promise of its `when` (config.WHEN) on a loaded Lab: load-time fields are refused
in one line and change nothing; live and rebuild fields are edited after load and their effect is observed at the
next phase that reads them. The field lists come from the schema, so a new field without a declared `when`, a
rebuild without a REBUILDS entry or a live/rebuild field without an observation here fails a test."""

import dataclasses
import json
import math
import time
from types import SimpleNamespace
from typing import Literal, get_args, get_origin

import pytest
import torch
from conftest import tiny_dict

import grpo_lab.algo.grpo as step_module
from grpo_lab import Lab
from grpo_lab.algo.importance import importance_weights
from grpo_lab.config.edits import REBUILDS
from grpo_lab.config.fields import WHEN
from grpo_lab.config.loading import load_config
from grpo_lab.config.schema import LabConfig, field_when, leaf_fields
from grpo_lab.errors import ConfigError, LabError
from grpo_lab.memory.readers import MiB
from grpo_lab.memory.sampler import HostMemoryExceeded
from grpo_lab.models.reference import AdapterDisabledReference, CopyReference, NoReference

pytestmark = pytest.mark.xdist_group("knobs")  # why: its tests share module-scoped state: one worker builds it

LOAD = [path for path, _, _ in leaf_fields() if field_when(path) == "load"]
REBUILD = [path for path, _, _ in leaf_fields() if field_when(path) == "rebuild"]
LIVE_OR_REBUILD = {path for path, _, _ in leaf_fields() if field_when(path) in ("live", "rebuild")}

OBSERVED: set[str] = set()  # fields whose effect a test below observes (checked against the schema)


def observes(*paths):
    """Register the fields a test observes; a field in no test's list fails the coverage test."""
    OBSERVED.update(paths)
    return lambda test: test


def tiny(tiny_model, **sections) -> dict:
    """The shared Lab's config: conftest's tiny config, 8-token completions, run.steps 3."""
    generator = {"max_completion_length": 8, **sections.pop("generator", {})}
    run = {"steps": 3, **sections.pop("run", {})}
    return tiny_dict(tiny_model, generator=generator, run=run, **sections)


@pytest.fixture(scope="module")
def shared_lab(tiny_model):
    """One loaded Lab for the whole module (a load is the slowest thing here)."""
    lab = Lab(tiny(tiny_model)).load()
    yield lab
    lab.close()


@pytest.fixture(scope="module")
def loaded_state(shared_lab, tmp_path_factory):
    """A checkpoint of the shared Lab's state at load, taken before any test steps it."""
    return shared_lab.save_checkpoint(tmp_path_factory.mktemp("knobs") / "at-load")


@pytest.fixture
def lab(shared_lab, loaded_state, tiny_model):
    """The shared Lab; afterwards the config is put back (rebuilds included) and so is the state it had at load
    (weights, optimizer, RNG streams, data position). Why the state too: a test's finished steps stayed, so what a
    later test sampled depended on every test before it, on this CPU's kernels and on the order (a fresh clone's run
    saw all 8 completions end at their first token, where token and sequence importance weights are the same)."""
    yield shared_lab
    shared_lab.rollback()  # why: drop a half-done step's updates, so the next test's rollout can restart the step
    shared_lab.resume_at(shared_lab.step_index)  # the half-done step's rollout and log-probs go too
    shared_lab.config = tiny(tiny_model)
    shared_lab.restore_checkpoint(loaded_state)


def lora_state(lab) -> dict:
    return {n: p.detach().clone() for n, p in lab.learner.trainable_parameters().items()}


def walk_to_backward(lab):
    """A fresh step up to its backward: rollout, rewards, advantages, logprobs. The advantages are set to values
    of both signs with a non-zero sum: the tiny model's rewards often tie (all completions truncated), which would
    leave a zero loss and no gradient to observe."""
    rollout = lab.rollout()
    advantages = lab.advantages(lab.rewards(rollout))
    advantages.values.copy_(torch.linspace(-1.0, 2.0, len(rollout)))
    return rollout, advantages, lab.logprobs(rollout)


def groups_identical(rollout) -> bool:
    ids = rollout.completion_ids.view(len(rollout.batch), rollout.num_generations, -1)
    return bool((ids == ids[:, :1]).all())


# --- every field declares when it takes effect -------------------------------------------------------------


def schema_whens() -> dict:
    """'section.field' -> its declared when, read from the JSON schema (what the widget editor is built from)."""
    schema = LabConfig.model_json_schema()
    out = {}
    for section, prop in schema["properties"].items():
        ref = prop.get("$ref") or prop["allOf"][0]["$ref"]
        for name, field in schema["$defs"][ref.rsplit("/", 1)[-1]]["properties"].items():
            out[f"{section}.{name}"] = field.get("when")
    return out


def test_every_leaf_field_declares_when_it_takes_effect():
    whens = schema_whens()
    assert set(whens) == {path for path, _, _ in leaf_fields()}
    assert [path for path, when in whens.items() if when not in WHEN] == []
    for section, info in LabConfig.model_fields.items():  # the pydantic fields, as field_when reads them
        for name, field in info.annotation.model_fields.items():
            assert (field.json_schema_extra or {}).get("when") == whens[f"{section}.{name}"], f"{section}.{name}"


@pytest.mark.parametrize("path", REBUILD)
def test_every_rebuild_field_names_what_it_rebuilds(path):
    assert path in REBUILDS


def test_rebuilds_lists_only_rebuild_fields():
    assert {path: field_when(path) for path in REBUILDS} == {path: "rebuild" for path in REBUILDS}


# --- load-time fields are refused after load -----------------------------------------------------------------

# Edits the field's type cannot give: Optional fields at None, free strings, and fields only valid together with
# another load-time field of their section (the cross-field checks). Each is a value the config accepts.
EDITS = {
    "model.name_or_path": {"model.name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"},
    "model.chat_template": {"model.chat_template": "trl:qwen2_5"},
    "generator.tools": {"generator.tools": ["test_tools:add"]},
    "generator.environment_factory": {"generator.environment_factory": "test_environments:Guess"},
    "lora.target_modules": {"lora.target_modules": ["q_proj", "v_proj"]},
    "lora.expert_r": {"lora.expert_r": 2},
    # the config accepts cuda:0 on this CPU machine (the device check is at load); the guard refuses before that
    "placement.learner": {"placement.learner": "cuda:0"},
    "placement.generator": {"placement.generator": ["cpu"]},
    "run.report_to": {"run.report_to": ["tensorboard"]},
    "placement.optimizer_offload": {"placement.optimizer_offload": True, "placement.learner": "cuda:0"},
    "placement.gpu_memory_gib": {"placement.gpu_memory_gib": 40.0},
    "placement.host_memory_gib": {"placement.host_memory_gib": 64.0},
    "placement.ray_address": {"placement.ray_address": "127.0.0.1:6379", "placement.learner_procs": 2},
    "placement.rank_memory_gib": {"placement.rank_memory_gib": 2.0, "placement.learner_procs": 2},
    "generator.gpu_memory_utilization": {
        "generator.gpu_memory_utilization": 0.3,
        "generator.backend": "vllm",
        "placement.generator": ["cuda:0"],
    },  # a share is of a GPU's memory
    "generator.model": {"generator.model": "Qwen/Qwen2.5-0.5B-Instruct-AWQ", "generator.backend": "vllm"},
    "generator.quantization": {"generator.quantization": "awq", "generator.backend": "vllm"},
    "generator.sleep_mode": {"generator.sleep_mode": True, "generator.backend": "vllm"},
    "reference.device": {"reference.device": "cpu"},
    "placement.reward_model": {"placement.reward_model": "cpu"},
    "run.output_dir": {"run.output_dir": "runs/elsewhere"},
    "memory.host_mmap_threshold_mib": {"memory.host_mmap_threshold_mib": 1.0},
}


def load_time_edit(config: LabConfig, path: str) -> dict:
    """A valid edit that changes `path`: from EDITS, else derived from the field's type and current value."""
    if path in EDITS:
        return EDITS[path]
    section, _, name = path.partition(".")
    annotation = LabConfig.model_fields[section].annotation.model_fields[name].annotation
    current = getattr(getattr(config, section), name)
    literals = [a for a in (annotation, *get_args(annotation)) if get_origin(a) is Literal]
    if isinstance(current, bool):
        value = not current
    elif literals and current in get_args(literals[0]):
        value = next(v for v in get_args(literals[0]) if v != current)
    elif isinstance(current, int):
        value = current + 1
    elif isinstance(current, float):
        value = current / 2 if current else 0.5
    else:
        raise AssertionError(f"{path}: no generic different value for {current!r}; add an entry to EDITS")
    return {path: value}


def assert_refused(err, *paths):
    """The guard's refusal: one line, naming the fields and the fix; not a validation error (the value was valid)."""
    message = str(err.value)
    assert not isinstance(err.value, ConfigError), message
    assert "\n" not in message and "make a new Lab" in message, message
    for path in paths:
        assert path in message, message


def test_edits_table_names_only_load_time_fields():
    assert {field_when(path) for edit in EDITS.values() for path in edit} == {"load"}
    assert all(path in edit for path, edit in EDITS.items())


@pytest.mark.parametrize("path", LOAD)
def test_load_time_field_is_refused_after_load(shared_lab, path):
    lab = shared_lab
    edit = load_time_edit(lab.config, path)
    before = lab.config.to_dict()
    assert load_config(before).update(edit).keys() == edit.keys()  # valid, and a change, on an unloaded copy
    section = path.partition(".")[0]
    with pytest.raises(LabError) as err:
        if len(edit) == 1:
            setattr(getattr(lab.config, section), path.partition(".")[2], edit[path])
        elif {p.partition(".")[0] for p in edit} == {section}:  # fields valid only together: assign the section
            setattr(lab.config, section, {**before[section], **{p.partition(".")[2]: v for p, v in edit.items()}})
        else:  # valid only with another section's field: the notebook's way to edit several at once
            lab.configure(edit)
    assert_refused(err, *edit)
    assert lab.config.to_dict() == before


def test_a_load_time_edit_is_refused_as_load_time_even_when_it_would_also_fail_a_cross_field_check(shared_lab):
    """3 ranks cannot split this batch of 8, but after load the first thing to say is that ranks are chosen at load:
    the batch message would send the user to change the batch for an edit that can never apply."""
    lab = shared_lab
    before = lab.config.to_dict()
    with pytest.raises(LabError) as err:
        lab.configure({"placement.learner_procs": 3})
    assert_refused(err, "placement.learner_procs")
    assert lab.config.to_dict() == before


@pytest.mark.parametrize("path", ["lora.r", "model.dtype", "run.seed"])
def test_load_time_field_is_refused_through_configure_and_config_assignment(shared_lab, path):
    lab = shared_lab
    edit = load_time_edit(lab.config, path)
    before = lab.config.to_dict()
    with pytest.raises(LabError) as err:
        lab.configure(edit)
    assert_refused(err, path)
    section, _, name = path.partition(".")
    with pytest.raises(LabError) as err:
        lab.configure(**{section: {name: edit[path]}})
    assert_refused(err, path)
    other = load_config(before)
    other.update(edit)
    with pytest.raises(LabError) as err:
        lab.config = other
    assert_refused(err, path)
    assert lab.config.to_dict() == before


def test_a_copy_of_the_loaded_config_with_a_load_time_change_is_refused(shared_lab):
    lab = shared_lab
    before = lab.config.to_dict()
    other = lab.config.model_copy()
    other.lora.r = lab.config.lora.r + 1
    with pytest.raises(LabError) as err:
        lab.config = other
    assert_refused(err, "lora.r")
    assert lab.config.to_dict() == before


# --- invalid edits and mixed edits change nothing -------------------------------------------------------------


def test_an_invalid_value_is_one_config_error_and_changes_nothing(lab):
    before, reference = lab.config.to_dict(), lab.reference
    with pytest.raises(ConfigError) as err:
        lab.config.grpo.beta = -1
    message = str(err.value)
    assert "grpo.beta" in message and "\n" not in message
    assert lab.config.to_dict() == before and lab.reference is reference


def test_a_cross_field_violation_is_one_config_error_and_changes_nothing(lab):
    lab.config.grpo.beta = 0.04
    before, reference = lab.config.to_dict(), lab.reference
    assert isinstance(reference, AdapterDisabledReference)
    with pytest.raises(ConfigError) as err:
        lab.config.reference.strategy = "none"  # 'none' needs beta 0
    message = str(err.value)
    assert "reference.strategy" in message and "\n" not in message
    assert lab.config.to_dict() == before and lab.reference is reference


def test_configure_is_all_or_nothing_when_one_field_is_load_time(lab):
    before, reference = lab.config.to_dict(), lab.reference
    assert isinstance(reference, NoReference)
    with pytest.raises(LabError) as err:
        lab.configure({"grpo.beta": 0.04, "lora.r": 9})  # a rebuild field first, then a load-time one
    assert_refused(err, "lora.r")
    with pytest.raises(LabError) as err:
        lab.configure(grpo={"learning_rate": 5e-3}, model={"dtype": "bfloat16"})
    assert_refused(err, "model.dtype")
    assert lab.config.to_dict() == before and lab.reference is reference  # beta not applied, nothing rebuilt


def test_a_rebuild_that_fails_puts_the_old_value_back(lab, tmp_path):
    before, prompts = lab.config.to_dict(), lab.prompts
    with pytest.raises(LabError) as err:
        lab.config.data.dataset = str(tmp_path / "missing.jsonl")  # valid for the schema; the rebuild cannot load it
    assert "data.dataset" in str(err.value)
    assert lab.config.to_dict() == before and lab.prompts is prompts


# --- live and rebuild fields: the effect at the next phase -----------------------------------------------------


def test_every_live_and_rebuild_field_has_an_observation():
    assert OBSERVED == LIVE_OR_REBUILD


@observes("generator.temperature")
def test_temperature_samples_and_scores_the_next_rollout_at_the_new_temperature(lab, tiny_model):
    lab.configure({"grpo.beta": 0.04, "generator.temperature": 0.7})
    rollout, advantages, logprobs = walk_to_backward(lab)
    assert rollout.temperature == 0.7
    mask = rollout.completion_mask.bool()
    fresh = Lab(tiny(tiny_model, generator={"temperature": 0.7}, grpo={"beta": 0.04})).load()
    try:  # the reference is the base model (adapter off) in both Labs, whatever the shared Lab has trained
        fresh_ref = fresh.reference.logprobs(fresh.learner, rollout, fresh.config)
    finally:
        fresh.close()
    assert torch.allclose(logprobs.ref[mask], fresh_ref[mask], atol=1e-5)
    at_one = lab.reference.logprobs(lab.learner, dataclasses.replace(rollout, temperature=1.0), lab.config)
    assert not torch.allclose(logprobs.ref[mask], at_one[mask], atol=1e-3)  # the old temperature would show
    lab.backward(rollout, advantages, logprobs)  # the first backward's own log-probs are the learner's at 0.7...
    assert torch.allclose(lab.current.old_logprobs[mask], rollout.sampler_logprobs[mask], atol=1e-3)  # ...as sampled


@observes("generator.gather_for_generation")
def test_gather_for_generation_is_refused_in_one_process(lab):
    """A knob that cannot act says no: one process has nothing to gather. On a sharded Lab it acts at the next rollout:
    tests/test_sharded.py::test_gather_on_and_off_... observes it (every rank's whole-model gathers counted: one for a
    gathered rollout, none for a layer-by-layer one; it fails when the setting is ignored), notebook 06 times them."""
    with pytest.raises(
        LabError,
        match=r"generator.gather_for_generation: false means generating through a sharded "
        r"learner.*placement.learner_procs: 1",
    ):
        lab.configure({"generator.gather_for_generation": False})
    assert lab.config.generator.gather_for_generation is True


@observes("generator.top_k")
def test_top_k_one_samples_greedily(lab):
    lab.config.generator.top_k = 1
    rollout = lab.rollout()
    mask = rollout.completion_mask.bool()
    assert groups_identical(rollout)  # at temperature 1 they would differ
    assert rollout.sampler_logprobs[mask].abs().max() < 1e-6  # one token left: probability 1


@observes("generator.top_p")
def test_a_tiny_top_p_samples_greedily(lab):
    lab.config.generator.top_p = 1e-6
    rollout = lab.rollout()
    mask = rollout.completion_mask.bool()
    assert groups_identical(rollout)
    assert rollout.sampler_logprobs[mask].abs().max() < 1e-6


@observes("generator.max_prompt_length")
def test_max_prompt_length_truncates_the_next_rollouts_prompts(lab):
    lab.configure({"generator.max_prompt_length": 8, "generator.max_completion_length": 2})
    assert lab.rollout().prompt_ids.shape[1] == 8  # the chat-templated prompts are ~80 tokens


@observes("generator.max_completion_length")
def test_max_completion_length_bounds_the_next_rollout(lab):
    lab.config.generator.max_completion_length = 3
    rollout = lab.rollout()
    assert rollout.max_completion_length == 3 and rollout.completion_ids.shape[1] <= 3


@observes("generator.chunk_size")
def test_chunk_size_splits_the_next_rollout_into_generate_calls(lab):
    lab.configure({"generator.chunk_size": 3, "generator.max_completion_length": 2})
    assert lab.rollout().generate_calls == 3  # 8 sequences in chunks of 3


@observes("generator.hf_decode")
def test_hf_decode_picks_the_next_rollouts_kv_cache(lab, monkeypatch):
    """static: the next rollout preallocates transformers' StaticCache (tests/test_fast_rollout.py: same tokens)."""
    from transformers import cache_utils

    made, real = [], cache_utils.StaticCache.__init__
    monkeypatch.setattr(
        cache_utils.StaticCache, "__init__", lambda self, *a, **k: made.append(1) or real(self, *a, **k)
    )
    lab.configure({"generator.hf_decode": "static"})
    lab.rollout()
    assert made


@observes("generator.drop_finished_rows")
def test_drop_finished_rows_lets_rows_leave_the_next_rollout(lab, monkeypatch):
    """true: the next rollout's generate() call ends once half its rows are done, and the rest go on without them
    (tests/test_leaving.py: the same tokens)."""
    import grpo_lab.generation.leaving as leaving

    thresholds, real = [], leaving.LeaveAtBucket
    monkeypatch.setattr(leaving, "LeaveAtBucket", lambda *a: thresholds.append(a[2]) or real(*a))
    rng = torch.get_rng_state()  # why: the later tests' rollouts draw what they drew before this one was added
    lab.rollout()
    lab.configure({"generator.drop_finished_rows": True})
    lab.rollout()
    torch.set_rng_state(rng)
    assert thresholds[0] == -1 and thresholds[1] >= 1  # off: one call to the end; on: rows leave at half


@observes("generator.park_learner")
def test_park_learner_parks_the_learner_during_the_next_merged_rollout(lab, monkeypatch):
    """true: the next merged rollout decodes with the learner's 4-bit base, LoRA and AdamW in host memory
    (tests/test_park.py: bit for bit after it, the same tokens)."""
    from grpo_lab.models.park import Parking

    sizes, real = [], Parking.park

    def watched(self, tensors, reserve=0):
        sizes.append(len(tensors))
        return real(self, tensors, reserve)

    monkeypatch.setattr(Parking, "park", watched)
    lab.configure({"generator.hf_decode": "merged", "generator.max_completion_length": 2})
    lab.rollout()
    assert not sizes  # off: the merged rollout parked nothing
    lab.configure({"generator.park_learner": True})
    lab.rollout()
    assert sizes and sizes[0] > 0


@observes("generator.rollout_copy")
def test_rollout_copy_keeps_or_releases_the_copy_after_the_next_merged_rollout(lab):
    """keep: the copy's weights stay after the next merged rollout; release: given back after it
    (tests/test_kept_copy.py: its addresses, its merge, the plan)."""
    copy = lab.executor.generator.rollout_copy
    lab.configure({"generator.hf_decode": "merged", "generator.max_completion_length": 2})
    held = {}
    for mode in ("keep", "release"):
        lab.configure({"generator.rollout_copy": mode})
        held[mode] = (lab.rollout().rollout_copy, copy.held_bytes())
    assert held["keep"][0] == "kept" and held["keep"][1] > 0 and held["release"] == ("released", 0)


@observes("grpo.num_generations", "grpo.prompts_per_step")
def test_group_size_and_prompts_per_step_shape_the_next_rollout(lab):
    lab.configure({"grpo.num_generations": 2, "grpo.prompts_per_step": 3, "generator.max_completion_length": 2})
    rollout = lab.rollout()
    assert rollout.num_generations == 2 and len(rollout.batch) == 3 and len(rollout) == 6


@observes("grpo.beta")
def test_beta_builds_a_reference_and_the_step_reports_kl(lab):
    assert isinstance(lab.reference, NoReference) and lab.config.reference.strategy is None
    lab.config.grpo.beta = 0.04
    assert isinstance(lab.reference, AdapterDisabledReference) and lab.reference_strategy == "adapter-disabled"
    lab.rollout()
    result = lab.step()
    assert result.kl is not None and math.isfinite(result.kl)
    lab.config.grpo.beta = 0.0
    assert isinstance(lab.reference, NoReference) and lab.reference_strategy == "none"


@observes("reference.strategy")
def test_reference_strategy_copy_runs_the_reference_pass_on_a_copy(lab):
    lab.config.grpo.beta = 0.04
    learner_calls, copy_calls = [], []
    # on the decoders: the log-prob passes run a model's backbone and then the chunked head (algo/logprobs.py)
    handle = lab.learner.model.get_base_model().model.register_forward_hook(lambda *_: learner_calls.append(1))
    try:
        lab.config.reference.strategy = "copy"
        assert isinstance(lab.reference, CopyReference) and lab.reference_strategy == "copy"
        assert lab.reference.model is not lab.learner.model
        copy_handle = lab.reference.model.model.register_forward_hook(lambda *_: copy_calls.append(1))
        rollout = lab.rollout()
        learner_calls.clear()  # generation ran on the learner; the reference pass must not
        assert lab.logprobs(rollout).ref.shape == rollout.completion_ids.shape
        copy_handle.remove()
    finally:
        handle.remove()
    assert copy_calls and not learner_calls  # adapter-disabled would run on the learner


@observes("grpo.loss_type")
def test_loss_type_changes_the_normalisation_of_the_next_backward(lab):
    rollout, advantages, logprobs = walk_to_backward(lab)
    rollout.completion_mask[0, 3:] = 0  # one completion stops after 3 tokens, so tokens != sequences x length
    dapo = lab.backward(rollout, advantages, logprobs)
    lab.config.grpo.loss_type = "dr_grpo"
    dr_grpo = lab.backward(rollout, advantages, logprobs)
    n, width = len(rollout), rollout.max_completion_length
    assert dapo.loss != 0 and dapo.num_tokens < n * width
    assert dr_grpo.loss == pytest.approx(dapo.loss * dapo.num_tokens / (n * width), rel=1e-5)


@observes("grpo.epsilon", "grpo.epsilon_high")
def test_epsilon_and_epsilon_high_bound_the_next_backwards_clipping(lab):
    lab.configure({"grpo.num_iterations": 2, "grpo.learning_rate": 5e-2})
    rollout, advantages, logprobs = walk_to_backward(lab)
    lab.backward(rollout, advantages, logprobs)
    lab.optimizer()  # the policy moves: the second iteration's ratios leave 1

    def clip_fraction(epsilon, epsilon_high):
        lab.configure({"grpo.epsilon": epsilon, "grpo.epsilon_high": epsilon_high})
        return lab.backward(rollout, advantages, logprobs).clip_fraction

    both = clip_fraction(0.01, None)  # epsilon_high null = epsilon
    low = clip_fraction(0.01, 100.0)
    high = clip_fraction(100.0, 0.01)
    assert clip_fraction(100.0, None) == 0.0
    assert both > 0 and low > 0 and high > 0
    assert both == pytest.approx(low + high)  # the two sides clip disjoint tokens


@observes("grpo.importance_sampling_level")
def test_importance_sampling_level_changes_the_next_backwards_ratio(lab):
    """GSPO: one ratio per completion (its tokens' mean log-ratio) instead of one per token, read at the next
    backward."""
    lab.configure({"grpo.num_iterations": 2, "grpo.learning_rate": 5e-2, "grpo.epsilon": 0.01})
    rollout, advantages, logprobs = walk_to_backward(lab)
    lab.backward(rollout, advantages, logprobs)
    lab.optimizer()  # the policy moves: the second iteration's ratios leave 1

    def second(level):
        lab.config.grpo.importance_sampling_level = level
        return lab.backward(rollout, advantages, logprobs)

    token, sequence = second("token"), second("sequence")
    # the loss alone: with epsilon 0.01 both levels can clip the same share of tokens (CI read 0.75 for both);
    # that GSPO's value is right is test_trl_parity's test_gspo_sequence_level_matches_trl
    assert token.loss != pytest.approx(sequence.loss, rel=1e-4)
    assert second("token").loss == pytest.approx(token.loss, rel=1e-6)


@observes("grpo.scale_rewards")
def test_scale_rewards_changes_the_next_advantages(lab):
    rollout = lab.rollout()
    rewards = lab.rewards(rollout)
    rewards.total.copy_(torch.arange(len(rollout), dtype=torch.float32) ** 2)  # spread within and across groups
    grouped = rewards.total.view(-1, rollout.num_generations)
    centred = rewards.total - grouped.mean(1).repeat_interleave(rollout.num_generations)
    expected = {
        "none": centred,
        "group": centred / (grouped.std(1).repeat_interleave(rollout.num_generations) + 1e-4),
        "batch": centred / (rewards.total.std() + 1e-4),
    }
    assert lab.config.grpo.scale_rewards == "group"
    for mode in ("group", "none", "batch"):
        lab.config.grpo.scale_rewards = mode
        assert torch.allclose(lab.advantages(rewards).values, expected[mode], atol=1e-5), mode
    assert not torch.allclose(expected["none"], expected["group"]) and not torch.allclose(
        expected["group"], expected["batch"]
    )


def one_update(lab, rollout, advantages, logprobs) -> dict:
    """Backward and optimizer from the current weights; returns the LoRA weights after the update."""
    lab.backward(rollout, advantages, logprobs)
    lab.optimizer()
    return lora_state(lab)


@observes("grpo.learning_rate")
def test_learning_rate_scales_the_next_update(lab):
    rollout, advantages, logprobs = walk_to_backward(lab)
    before = lora_state(lab)
    small = one_update(lab, rollout, advantages, logprobs)
    lab.rollback()  # the same weights and AdamW state again; the step goes on from backward
    lab.config.grpo.learning_rate = 4e-3
    large = one_update(lab, rollout, advantages, logprobs)
    assert lab.learner.optimizer.param_groups[0]["lr"] == 4e-3
    moved = [n for n in before if not torch.equal(before[n], small[n])]
    assert moved
    for n in moved:  # AdamW's update is linear in lr for the same gradient and state
        assert torch.allclose(large[n] - before[n], 4 * (small[n] - before[n]), rtol=1e-3, atol=1e-7), n
    assert lab.sync().learning_rate == 4e-3


@observes("grpo.use_bias_correction_kl")
def test_kl_bias_correction_changes_the_next_backwards_gradient_not_its_value(lab):
    lab.configure({"grpo.beta": 0.5, "grpo.learning_rate": 5e-2})
    rollout, advantages, logprobs = walk_to_backward(lab)
    one_update(lab, rollout, advantages, logprobs)
    lab.sync()  # the policy now differs from the reference: the KL has a gradient
    rollout, advantages, logprobs = walk_to_backward(lab)

    def backward(corrected):
        lab.config.grpo.use_bias_correction_kl = corrected
        stats = lab.backward(rollout, advantages, logprobs)
        grads = {n: p.grad.clone() for n, p in lab.learner.trainable_parameters().items() if p.grad is not None}
        lab.rollback()
        return stats, grads

    (on, on_grads), (off, off_grads) = backward(True), backward(False)
    assert on.kl > 0 and on.loss == pytest.approx(off.loss, rel=1e-6)  # on-policy the ratio is 1: same value...
    assert any(not torch.allclose(on_grads[n], off_grads[n], rtol=1e-4, atol=1e-8) for n in on_grads)  # ...not gradient


@observes("grpo.weight_decay")
def test_weight_decay_shrinks_the_weights_at_the_next_update(lab):
    rollout, advantages, logprobs = walk_to_backward(lab)
    before = lora_state(lab)
    plain = one_update(lab, rollout, advantages, logprobs)
    lab.rollback()
    lab.config.grpo.weight_decay = 10.0
    decayed = one_update(lab, rollout, advantages, logprobs)
    lr = lab.config.grpo.learning_rate
    assert any(before[n].abs().sum() > 0 for n in before)
    for n in before:  # decoupled decay: p * (1 - lr * wd) before the same Adam step
        assert torch.allclose(decayed[n] - plain[n], -lr * 10.0 * before[n], atol=1e-6), n


@observes("grpo.max_grad_norm")
def test_max_grad_norm_clips_the_next_update(lab):
    rollout, advantages, logprobs = walk_to_backward(lab)
    applied = []

    def record(optimizer, args, kwargs):  # the gradient norm AdamW is given, after clipping
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        applied.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())

    handle = lab.learner.optimizer.register_step_pre_hook(record)
    try:
        lab.config.grpo.max_grad_norm = 1e6
        lab.backward(rollout, advantages, logprobs)
        norm = lab.optimizer()
        lab.rollback()
        lab.config.grpo.max_grad_norm = norm / 10
        lab.backward(rollout, advantages, logprobs)
        lab.optimizer()
    finally:
        handle.remove()
    assert norm > 0 and applied[0] == pytest.approx(norm, rel=1e-4)
    assert applied[1] == pytest.approx(norm / 10, rel=1e-3)


@observes("grpo.micro_batch_size")
def test_micro_batch_size_splits_the_next_backward_into_forward_passes(lab, monkeypatch):
    rollout, advantages, logprobs = walk_to_backward(lab)
    calls = []
    real = step_module.completion_logprobs
    monkeypatch.setattr(
        step_module, "completion_logprobs", lambda model, *t: calls.append(len(t[0])) or real(model, *t)
    )
    whole = lab.backward(rollout, advantages, logprobs)
    assert calls == [8]
    calls.clear()
    lab.config.grpo.micro_batch_size = 3
    parts = lab.backward(rollout, advantages, logprobs)
    assert calls == [3, 3, 2]
    assert parts.loss == pytest.approx(whole.loss, abs=1e-5)  # the objective does not change


@observes("grpo.num_iterations")
def test_num_iterations_gives_the_next_step_that_many_updates(lab):
    lab.config.grpo.num_iterations = 2
    lab.rollout()
    result = lab.step()
    assert result.iterations == 2


@observes("grpo.mask_truncated_completions")
def test_mask_truncated_completions_drops_them_from_the_next_backward(lab):
    rollout, advantages, logprobs = walk_to_backward(lab)
    mask, truncated = rollout.completion_mask, rollout.truncated
    assert truncated.any(), "8-token completions of the tiny model: expected some truncated"
    assert lab.backward(rollout, advantages, logprobs).num_tokens == int(mask.sum())
    lab.config.grpo.mask_truncated_completions = True
    assert lab.backward(rollout, advantages, logprobs).num_tokens == int(mask[~truncated].sum())


# field -> (the config of the first backward, the edit before the second); token_truncate so that clip bounds show
IS_CASES = {
    "grpo.importance_sampling_correction": ({}, {"grpo.importance_sampling_correction": False}),
    "grpo.importance_sampling_mode": (
        {"grpo.importance_sampling_mode": "token_truncate"},
        {"grpo.importance_sampling_mode": "sequence_truncate"},
    ),
    "grpo.importance_sampling_clip_max": (
        {"grpo.importance_sampling_mode": "token_truncate"},
        {"grpo.importance_sampling_clip_max": 1.5},
    ),
    "grpo.importance_sampling_clip_min": (
        {"grpo.importance_sampling_mode": "token_truncate"},
        {"grpo.importance_sampling_clip_min": 0.5},
    ),
}


def expected_weights(config, old_logprobs, rollout):
    g = config.grpo
    if not g.importance_sampling_correction:
        return None
    return importance_weights(
        old_logprobs,
        rollout.sampler_logprobs,
        rollout.completion_mask.float(),
        g.importance_sampling_mode,
        g.importance_sampling_clip_min,
        g.importance_sampling_clip_max,
    )


@observes(*IS_CASES)
@pytest.mark.parametrize("path", list(IS_CASES))
def test_importance_sampling_knobs_change_the_next_backwards_weights(lab, monkeypatch, path):
    # why the patch: hf samples with the learner itself, so IS never applies to it; let the config's flag decide
    monkeypatch.setattr(
        step_module, "applies_importance_sampling", lambda config: config.grpo.importance_sampling_correction
    )
    first, edit = IS_CASES[path]
    lab.configure(first)
    rollout, advantages, logprobs = walk_to_backward(lab)
    # why: completions of one token make token and sequence weights the same, and the mode's edit unobservable
    assert rollout.completion_mask.sum(-1).max() > 1, rollout.completion_mask.sum(-1)
    noise = torch.randn(rollout.sampler_logprobs.shape, generator=torch.Generator().manual_seed(0))
    rollout.sampler_logprobs += noise * rollout.completion_mask  # a sampler that is not the learner: ratios ~ e^N(0,1)
    before = lab.backward(rollout, advantages, logprobs)
    weights_before = lab.current.is_weights
    assert torch.allclose(weights_before, expected_weights(lab.config, lab.current.old_logprobs, rollout))
    lab.configure(edit)
    after = lab.backward(rollout, advantages, logprobs)
    expected = expected_weights(lab.config, lab.current.old_logprobs, rollout)
    if expected is None:
        assert lab.current.is_weights is None and after.is_ratio_mean is None and before.is_ratio_mean is not None
        return
    weights = lab.current.is_weights
    assert torch.allclose(weights, expected)
    assert weights.shape != weights_before.shape or not torch.allclose(weights, weights_before)
    if path.endswith("clip_max"):
        assert before.is_ratio_max > 1.5 >= after.is_ratio_max
    if path.endswith("clip_min"):
        assert before.is_ratio_min < 0.5 <= after.is_ratio_min


@observes("data.reward_weights")
def test_reward_weights_weigh_the_next_rewards(lab):
    lab.config.generator.max_completion_length = 2
    rollout = lab.rollout()
    plain = lab.rewards(rollout)
    lab.config.data.reward_weights = [1.0, 1.0, 3.0]
    weighted = lab.rewards(rollout)
    expected = (weighted.per_function.nan_to_num() * torch.tensor([1.0, 1.0, 3.0])).sum(1)
    assert torch.allclose(weighted.total, expected)
    assert not torch.allclose(weighted.total, plain.total)  # the length reward is non-zero


@observes("data.rewards")
def test_rewards_rebuild_the_reward_functions(lab):
    lab.config.data.rewards = ["length"]
    assert len(lab.reward_funcs) == 1  # at once
    lab.config.generator.max_completion_length = 2
    rewards = lab.rewards(lab.rollout())
    assert rewards.names == ["length"] and rewards.per_function.shape[1] == 1


@observes("data.reward_models")
def test_reward_models_rebuild_the_reward_models(lab, tmp_path):
    lab.config.data.reward_models = ["builtin:tiny-reward"]
    [model] = lab.executor.reward_models  # at once
    lab.config.generator.max_completion_length = 2
    rewards = lab.rewards(lab.rollout())
    assert rewards.names[-1] == model.__name__ and rewards.per_function.shape[1] == 4
    with pytest.raises(LabError, match=r"^data.reward_models: .* does not exist"):
        lab.config.data.reward_models = [str(tmp_path / "missing")]
    assert lab.executor.reward_models == [model] and lab.config.data.reward_models == ["builtin:tiny-reward"]
    lab.config.data.reward_models = []
    assert lab.executor.reward_models == [] and model.model is None  # released


@observes("data.dataset")
def test_dataset_rebuilds_the_prompts_of_the_next_rollout(lab, tmp_path):
    path = tmp_path / "knobs.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"KNOBS question {i}: 2 + {i}?", "answer": str(2 + i)}) + "\n" for i in range(3))
    )
    lab.configure({"data.dataset": str(path), "generator.max_completion_length": 1})
    assert len(lab.prompts.dataset) == 3  # at once
    rollout = lab.rollout()
    assert all("KNOBS question" in p for p in rollout.batch.prompts)


@observes("data.num_prompts")
def test_num_prompts_rebuilds_the_arithmetic_set(lab):
    lab.configure({"data.num_prompts": 2, "generator.max_completion_length": 1})
    assert len(lab.prompts.dataset) == 2
    questions = {row["prompt"][-1]["content"] for row in lab.prompts.dataset}
    for _ in range(2):  # every batch is drawn from the two rows
        prompts = lab.rollout().batch.prompts
        assert {q for q in questions for p in prompts if q in p} == questions


def save_splits(tmp_path):
    """A dataset folder with two named configurations (README.md's `configs`, as on the hub), each with two splits."""
    folder = tmp_path / "knobs-data"
    folder.mkdir()
    for config in ("plain", "marked"):
        for split in ("train", "other"):
            rows = [{"prompt": f"KNOBS {config} {split} {i}: 2 + {i}?", "answer": str(2 + i)} for i in range(3)]
            (folder / f"{config}-{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "README.md").write_text(
        "---\nconfigs:\n"
        + "".join(
            f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}-train.jsonl\n"
            f"  - split: other\n    path: {c}-other.jsonl\n"
            for c in ("plain", "marked")
        )
        + "---\n"
    )
    return folder


@observes("data.split")
def test_split_rebuilds_the_prompts_from_that_split(lab, tmp_path):
    lab.configure({"data.dataset": str(save_splits(tmp_path)), "data.dataset_config": "plain"})
    lab.configure({"data.split": "other", "generator.max_completion_length": 1})
    assert all("KNOBS plain other" in p for p in lab.rollout().batch.prompts)


@observes("data.dataset_config")
def test_dataset_config_rebuilds_the_prompts_from_that_configuration(lab, tmp_path):
    lab.configure({"data.dataset": str(save_splits(tmp_path)), "data.dataset_config": "plain"})
    lab.configure({"data.dataset_config": "marked", "generator.max_completion_length": 1})
    assert all("KNOBS marked train" in p for p in lab.rollout().batch.prompts)


@observes("data.streaming")
def test_streaming_rebuilds_the_prompts_as_a_stream(lab):
    lab.configure({"data.streaming": True, "generator.max_completion_length": 1})
    assert lab.prompts.streamed  # at once
    assert len(lab.rollout().batch.prompts) == lab.config.grpo.prompts_per_step


@observes("data.system_prompt")
def test_system_prompt_is_in_the_next_rollouts_prompts(lab):
    lab.configure({"data.system_prompt": "KNOBS SYSTEM PROMPT", "generator.max_completion_length": 1})
    assert all("KNOBS SYSTEM PROMPT" in p for p in lab.rollout().batch.prompts)


def wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@observes("memory.sample_hz")
def test_sample_hz_stops_and_restarts_the_sampler_thread(lab):
    sampler = lab.memory
    lab.config.memory.sample_hz = 0
    assert sampler.hz == 0
    taken = sampler.total
    time.sleep(0.3)
    assert sampler.total == taken  # no thread: readings only at phase boundaries
    lab.config.memory.sample_hz = 50
    assert sampler.hz == 50 and wait_for(lambda: sampler.total > taken)


@observes("memory.host_threshold")
def test_host_threshold_stops_the_next_phase(lab):
    lab.config.memory.host_threshold = 1e-4
    assert lab.memory.host_threshold == 1e-4
    with pytest.raises(HostMemoryExceeded, match="memory.host_threshold=0.0001"):
        lab.rollout()


def leak_flags(lab, growth_mib: float, steps: int) -> list:
    """Feed the Lab's leak detector a fresh device whose after-step memory grows `growth_mib` per step."""
    device = f"test-{time.monotonic_ns()}"
    return [lab.leaks.observe({device: i * growth_mib * MiB}) for i in range(steps)][-1]


@observes("memory.leak_window", "memory.leak_min_growth_mib")
def test_leak_window_and_min_growth_retune_the_leak_detector(lab):
    assert leak_flags(lab, 5.0, 3) == []  # window 5: three steps are not enough
    lab.config.memory.leak_window = 2
    assert lab.leaks.window == 2 and leak_flags(lab, 5.0, 3)  # window 2: three steps rising are a leak
    assert leak_flags(lab, 2.0, 3) == []  # 2 MiB/step is below 4 MiB/step
    lab.config.memory.leak_min_growth_mib = 1.0
    assert lab.leaks.min_growth == 1 * MiB and leak_flags(lab, 2.0, 3)


@observes("run.steps")
def test_run_steps_is_how_many_steps_run_takes(lab):
    lab.config.run.steps = 1  # from 3
    lab.config.generator.max_completion_length = 2
    lab.rollout()  # start a fresh step (an earlier test may have left one half done)
    done = len(lab.history)
    assert len(lab.run()) == 1 and len(lab.history) == done + 1


@observes("run.save_every")
def test_the_runner_reads_save_every_of_the_labs_config_each_step(lab, monkeypatch, tmp_path):
    import grpo_lab.runner as runner

    lab.config.generator.max_completion_length = 2
    lab.rollout()  # a fresh step for the runner's first lab.step()
    saves, real_step = [], lab.step

    def step_then_edit():
        result = real_step()
        lab.config.run.save_every = 1  # an edit while the run goes on (as a cell or a callback would make it)
        return result

    monkeypatch.setattr(runner, "Lab", lambda config: SimpleNamespace(load=lambda: lab))  # the loaded shared Lab
    monkeypatch.setattr(runner, "write_report", lambda *a, **k: None)  # why: the report is not the subject
    monkeypatch.setattr(lab, "step", step_then_edit)
    monkeypatch.setattr(lab, "save_checkpoint", lambda path: saves.append(len(lab.history)))
    monkeypatch.setattr(lab, "close", lambda: None)
    lab.config.run.save_every = 0  # only at the end, until the edit above
    config = load_config(lab.config.to_dict())
    done = len(lab.history)
    runner.run(config, steps=2, out=str(tmp_path / "run"), progress=False, force=True)
    assert [n - done for n in saves] == [1, 2]  # after step 0 once save_every is 1, and at the end


@observes("grpo.logprob_chunk_size", "grpo.logprob_head")
def test_the_log_prob_head_knobs_reach_the_next_scoring_pass(lab, monkeypatch):
    import grpo_lab.algo.head as head
    import grpo_lab.algo.logprobs as logprobs

    seen = []
    real = head.ChunkedSelectiveLogProbs.forward

    def spy(ctx, hidden, weight, bias, targets, temperature, chunk, *lora):
        seen.append(chunk)
        return real(ctx, hidden, weight, bias, targets, temperature, chunk, *lora)

    monkeypatch.setattr(head.ChunkedSelectiveLogProbs, "forward", staticmethod(spy))
    trl_rows = []
    monkeypatch.setitem(logprobs.HEADS, "trl", lambda *rows: trl_rows.append(len(rows[0])) or head.trl_logprobs(*rows))
    lab.config.generator.max_completion_length = 4
    lab.config.grpo.logprob_chunk_size = 3
    lab.step()
    assert seen and set(seen) == {3}
    lab.config.grpo.logprob_chunk_size = 17  # live: the next phase that scores uses it
    lab.config.grpo.logprob_head = "trl"
    lab.step()
    assert set(seen) == {3} and trl_rows  # no pass of this step went through the chunked kernel
    lab.config.grpo.logprob_head = "chunked"
    lab.step()
    assert seen[-1] == 17


@observes(
    "generator.max_tool_calling_iterations",
    "generator.tool_timeout_s",
    "generator.max_tool_response_tokens",
    "generator.turn_cache",
)
def test_tool_knobs_apply_at_the_next_rollout(tiny_model, monkeypatch):
    """The tool loop reads them from the live config at each rollout (its turns driven here with given completions);
    the hf backend's turn cache follows generator.turn_cache at the next rollout."""
    from test_tools import TEMPLATE, add, call_text, hang, long_text, scripted

    import grpo_lab.generation.hf as hf
    from grpo_lab.algo.containers import GenerationRequest, PromptBatch

    cfg = tiny(tiny_model, model={"chat_template": TEMPLATE}, generator={"max_prompt_length": 2048})
    tool_lab = Lab(cfg, tools=[add, hang, long_text]).load()
    try:
        loop, tok = tool_lab.generator.turns, tool_lab.learner.tokenizer
        batch = PromptBatch(prompts=["2+3?"], answers=["5"], raw=["2+3?"])
        prompt = loop.start(batch, 1, GenerationRequest(2000, max_prompt_length=2048)).prompts[0]
        ids = tok(prompt, add_special_tokens=False)["input_ids"]

        def run(*turns):  # a rollout of its own: a new episode (an episode keeps its rows' trajectories between calls)
            episode = loop.start(batch, 1, GenerationRequest(2000, max_prompt_length=2048))
            return episode.run(
                [ids], range(1), scripted(tok, list(turns)), GenerationRequest(max_completion_length=2000)
            )[0]

        tool_lab.configure({"generator.max_tool_calling_iterations": 3})
        assert run(call_text("add", '{"a": 1, "b": 2}')).turns == 4
        tool_lab.configure({"generator.max_tool_calling_iterations": 1, "generator.tool_timeout_s": 0.2})
        began = time.monotonic()
        out = run(call_text("hang", '{"x": 1}'))
        assert out.turns == 2 and "within 0.2 s" in out.messages[1]["content"] and time.monotonic() - began < 3
        tool_lab.configure({"generator.max_tool_response_tokens": 5})
        cut = run(call_text("long_text", '{"x": 1}')).messages[1]["content"]
        assert 0 < len(tok(cut, add_special_tokens=False)["input_ids"]) <= 5
        made = []
        real = hf.TurnCache
        monkeypatch.setattr(hf, "TurnCache", lambda *args: made.append(args) or real(*args))
        tool_lab.rollout()
        assert len(made) == 1  # keep (the default): the rollout's turns go on from their cache
        tool_lab.configure({"generator.turn_cache": "prefill"})
        tool_lab.rollout()
        assert len(made) == 1  # prefill: every turn prefills again, no turn cache made
    finally:
        tool_lab.close()
