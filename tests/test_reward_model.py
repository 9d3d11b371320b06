"""A reward model (models/reward_model.py) scores as TRL 1.16's GRPOTrainer scores one, with TRL's own code as the
oracle: a trainer built with the model in reward_funcs, its `_calculate_rewards` called on the same prompts and
completions, conversational and standard. Micro-batching gives the scores of one batch; bad input is one line; a Lab
with data.reward_models steps, its rewards phase scoring with the model; its plan line holds its measured peak.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lab import Lab, load_config
from grpo_lab.errors import LabError
from grpo_lab.models.reward_model import load_reward_model, wrap_module

pytestmark = pytest.mark.xdist_group("reward_model")  # why: its tests share module-scoped state: one worker builds it

SYSTEM = "Answer inside <answer></answer>."
QUESTIONS = ["What is 2 + 3?", "What is 7 - 4?"]
ANSWERS = ["<answer>5</answer>", "It is 6", "<answer>3</answer> done", "three"]


@pytest.fixture(scope="module")
def reward_path(user_cache):
    from grpo_lab.models.source import resolve_model_path

    return resolve_model_path("builtin:tiny-reward")


def cpu_config(tiny_model: str, *overrides: str):
    """The suite's tiny learner in float32 (the reward model loads in model.dtype)."""
    return load_config(
        "tiny-cpu",
        [f"model.name_or_path={tiny_model}", "model.dtype=float32", "model.bnb_4bit_compute_dtype=float32", *overrides],
    )


def batches(conversational: bool) -> tuple[list, list]:
    """Two prompts x two completions each, as TRL passes them to rewards."""
    if conversational:
        prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
        completions = [[{"role": "assistant", "content": a}] for a in ANSWERS]
    else:
        prompts = [f"{SYSTEM}\n{q}\n" for q in QUESTIONS]
        completions = list(ANSWERS)
    return [p for p in prompts for _ in range(2)], completions


def trl_scores(tiny_model: str, reward, prompts: list, completions: list, tmp_path) -> list[float]:
    """TRL's GRPOTrainer with `reward` (a path, loaded by TRL, or a model) as its one reward function: its
    `_calculate_rewards` on these prompts and completions."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        bf16=False,
        per_device_train_batch_size=len(prompts),
        num_generations=2,
        max_completion_length=8,
    )
    trainer = GRPOTrainer(
        model=tiny_model,
        reward_funcs=[reward],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts[::2]]),
    )
    inputs = [{"prompt": p} for p in prompts]
    table = trainer._calculate_rewards(inputs, prompts, completions, [[1]] * len(prompts))
    return table[:, 0].tolist()


@pytest.mark.parametrize("conversational", [True, False], ids=["conversational", "standard"])
def test_scores_equal_trls(tiny_model, reward_path, conversational, tmp_path):
    prompts, completions = batches(conversational)
    ours = load_reward_model(reward_path, cpu_config(tiny_model), "cpu")
    mine = ours(prompts=prompts, completions=completions, completion_ids=[[1]] * 4)
    theirs = trl_scores(tiny_model, reward_path, prompts, completions, tmp_path)
    assert len(set(mine)) == 4, f"scores {mine} do not tell the completions apart: the test could not fail"
    assert mine == pytest.approx(theirs, abs=1e-6), f"ours {mine}, TRL's {theirs}"


def test_a_module_in_reward_funcs_scores_as_trl_does(tiny_model, reward_path, tmp_path):
    """An nn.Module passed as a reward function: its tokenizer from its config's _name_or_path, as TRL loads it."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(reward_path, num_labels=1, dtype=torch.float32)
    prompts, completions = batches(conversational=True)
    mine = wrap_module(model, cpu_config(tiny_model))(prompts=prompts, completions=completions)
    assert mine == pytest.approx(trl_scores(tiny_model, model, prompts, completions, tmp_path), abs=1e-6)


def test_micro_batches_give_the_scores_of_one_batch(tiny_model, reward_path):
    prompts, completions = batches(conversational=True)
    whole = load_reward_model(reward_path, cpu_config(tiny_model, "grpo.micro_batch_size=null"), "cpu")
    parts = load_reward_model(reward_path, cpu_config(tiny_model, "grpo.micro_batch_size=1"), "cpu")
    forwards = []
    parts.model.register_forward_hook(lambda module, args, kwargs, out: forwards.append(kwargs["input_ids"].shape[0]),
                                      with_kwargs=True)  # fmt: skip
    one = whole(prompts=prompts, completions=completions)
    each = parts(prompts=prompts, completions=completions)
    assert forwards == [1, 1, 1, 1], f"forwards of {forwards} rows, not four of one"
    assert each == pytest.approx(one, abs=1e-5)


def test_a_model_that_is_not_a_sequence_classifier_is_one_line(tiny_model, monkeypatch):
    from transformers import AutoModelForCausalLM

    with pytest.raises(LabError) as err:
        Lab(cpu_config(tiny_model, f"data.reward_models=[{tiny_model}]")).load()
    message = str(err.value)
    assert "\n" not in message and message.startswith("data.reward_models: ")
    assert "Qwen2ForCausalLM, not a sequence classifier" in message and "ForSequenceClassification" in message
    import grpo_lab.models.reward_model as reward_model

    # a hub id: its config.json is not on disk before load, so the check before load passes it; the load refuses it
    monkeypatch.setattr(reward_model, "check_reward_model", lambda name: name)
    with pytest.raises(LabError, match=r"is a Qwen2ForCausalLM, not a sequence classifier"):
        load_reward_model(tiny_model, cpu_config(tiny_model), "cpu")
    monkeypatch.undo()
    causal = AutoModelForCausalLM.from_pretrained(tiny_model)
    with pytest.raises(LabError, match=r"is a Qwen2ForCausalLM, not a sequence classifier"):
        Lab(cpu_config(tiny_model), reward_funcs=[causal])


def test_a_missing_reward_model_is_one_line_and_nothing_loads(tiny_model, tmp_path, monkeypatch):
    import grpo_lab.models.learner

    def load_learner(*args, **kwargs):
        raise AssertionError("the learner was loaded before the missing reward model was refused")

    monkeypatch.setattr(grpo_lab.models.learner, "load_learner", load_learner)
    missing = str(tmp_path / "no-such-model")
    lab = Lab(cpu_config(tiny_model, f"data.reward_models=[{missing}]"))
    with pytest.raises(LabError) as err:
        lab.load()
    assert str(err.value) == (
        f"data.reward_models: {missing!r} does not exist; give a checkpoint directory, a hub id or a builtin: name"
    )
    assert lab.learner is None


def test_a_lab_scores_its_rollouts_with_the_reward_model(tiny_model, reward_path):
    """Two steps with data.reward_models; then the rewards phase's column for the model is its scores of what the
    reward functions were given, weighed as TRL weighs it (after the functions)."""
    from grpo_lab.algo.rewards import exact_answer

    seen = {}

    def capture(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [0.0] * len(completions)

    cfg = cpu_config(
        tiny_model,
        "data.rewards=[exact_answer, format]",
        "data.reward_models=[builtin:tiny-reward]",
        "data.reward_weights=[1, 1, 0.5]",
    )
    lab = Lab(cfg, reward_funcs=[exact_answer, capture])
    assert "reward model (builtin:tiny-reward)" in repr(lab.placement)  # who sits where, before load
    lab.load()
    try:
        name = lab.executor.reward_models[0].__name__
        results = [lab.step() for _ in range(2)]
        for result in results:
            assert set(result.rewards) == {"exact_answer", "capture", name}
            assert math.isfinite(result.rewards[name])
        assert any(r["phase"] == "rewards" for r in lab.memory.rows_for(results[-1].step))
        rewards = lab.rewards(lab.rollout())
        direct = lab.executor.reward_models[0](prompts=seen["prompts"], completions=seen["completions"])
        assert rewards.names == ["exact_answer", "capture", name]
        assert rewards.per_function[:, 2].tolist() == pytest.approx(direct, abs=1e-6)
        table = rewards.per_function
        assert rewards.total.tolist() == pytest.approx((table[:, 0] + 0.5 * table[:, 2]).tolist(), abs=1e-6)
    finally:
        lab.close()
    assert lab.executor.reward_models == []  # released with the Lab


def test_reward_weights_count_the_reward_models():
    three = ["data.rewards=[exact_answer, format]", "data.reward_models=[builtin:tiny-reward]"]
    with pytest.raises(LabError, match=r"^data.reward_weights: 2 weights for 3 rewards \(data.rewards, then data.re"):
        load_config("tiny-cpu", [*three, "data.reward_weights=[1, 1]"])
    assert load_config("tiny-cpu", [*three, "data.reward_weights=[1, 1, 2]"]).data.reward_weights == [1, 1, 2]


def scoring_peak(fn) -> int:
    """The most bytes live at once on the CPU while `fn` runs, above what was live before: every allocation and free
    torch's profiler records (inside kernels too), in the order they happened. Unlike RSS: no heap holes, no
    sampling."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cpu = torch.autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == cpu]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize(
    "dtype, words",
    [("float32", 60), ("bfloat16", 60), ("float32", 15)],
    ids=["float32-906-tokens", "bfloat16-906-tokens", "float32-252-tokens"],
)
def test_the_plan_line_holds_the_measured_peak(tiny_model, reward_path, dtype, words):
    """The reward model's weights and its scoring pass's peak (micro-batches of 4 rows of varied length, the longest
    the planned prompt + completion) against its plan lines: within 0.9-1.1. Long rows peak in the attention, short ones
    in the MLP."""
    from grpo_lab.planner import plan

    prompts = [[{"role": "user", "content": "12 + 34 = 46. " * (k * words // 60)}] for k in (60, 45, 30, 52)]
    completions = [[{"role": "assistant", "content": "<answer>46</answer> " * k}] for k in (6, 10, 3, 8)]
    probe = load_reward_model(reward_path, cpu_config(tiny_model), "cpu")
    longest = max(
        len(probe.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in probe.texts(prompts, completions)
    )
    config = cpu_config(
        tiny_model,
        f"model.dtype={dtype}",
        "data.reward_models=[builtin:tiny-reward]",
        "grpo.micro_batch_size=4",
        f"generator.max_prompt_length={longest - 48}",
        "generator.max_completion_length=48",
    )
    lines = [i for i in plan(config).devices["host"].items if i.what.startswith("reward model")]
    planned = sum(i.bytes for i in lines)
    model = load_reward_model(reward_path, config, "cpu")
    weights = sum(t.numel() * t.element_size() for t in [*model.model.parameters(), *model.model.buffers()])
    model(prompts=prompts, completions=completions)  # warm-up: one-off library allocations
    measured = weights + scoring_peak(lambda: model(prompts=prompts, completions=completions))
    assert 0.9 <= measured / planned <= 1.1, (
        f"measured {measured / 2**20:.2f} MiB (weights {weights / 2**20:.2f}) against planned {planned / 2**20:.2f} "
        f"MiB: {[(i.what, round(i.bytes / 2**20, 2)) for i in lines]}, {longest} tokens"
    )


def test_a_4bit_reward_model_scores_near_its_16bit_self_and_its_weights_are_planned(tiny_model, reward_path):
    """placement.reward_model_4bit: every linear layer of the body in nf4 (bitsandbytes, as the learner), the score head
    kept; its scores near the float32 model's, its weights line within 0.9-1.1 of its bytes (quant state included)."""
    from bitsandbytes.nn import Linear4bit

    from grpo_lab.models.shapes import load_shape
    from grpo_lab.planner.reward_items import reward_weight_bytes

    config = cpu_config(tiny_model, "placement.reward_model_4bit=true")
    quantized = load_reward_model(reward_path, config, "cpu")
    layers = [m for m in quantized.model.modules() if isinstance(m, Linear4bit)]
    assert len(layers) == 7 * quantized.model.config.num_hidden_layers
    assert not isinstance(quantized.model.score, Linear4bit)
    prompts, completions = batches(conversational=True)
    plain = load_reward_model(reward_path, cpu_config(tiny_model), "cpu")(prompts=prompts, completions=completions)
    assert quantized(prompts=prompts, completions=completions) == pytest.approx(plain, abs=0.05)
    tensors = [*quantized.model.parameters(), *quantized.model.buffers()]
    for layer in layers:
        state = layer.weight.quant_state
        tensors += [state.absmax, state.code, *((state.state2.absmax, state.state2.code) if state.nested else ())]
    measured = sum(t.numel() * t.element_size() for t in tensors)
    planned, _ = reward_weight_bytes(load_shape("builtin:tiny-reward"), config)
    assert 0.9 <= measured / planned <= 1.1, f"measured {measured} bytes, planned {planned:.0f}"


def test_a_sharded_learners_reward_model_is_refused_on_a_ranks_gpu():
    """The driver scores: on a rank's GPU it would compete with the rank, unplanned there; one line, the fix."""
    sharded = ["placement.learner=cuda:0", "placement.learner_procs=2", "data.reward_models=[builtin:tiny-reward]"]
    with pytest.raises(LabError) as err:
        load_config("tiny-cpu", sharded)
    assert str(err.value) == (
        "placement.reward_model: cuda:0 is a learner rank's GPU (placement.learner_procs: 2 from cuda:0), and a "
        "sharded learner's driver scores with the reward models; place them on another GPU or cpu"
    )
    assert load_config("tiny-cpu", [*sharded, "placement.reward_model=cpu"]).placement.reward_model == "cpu"
