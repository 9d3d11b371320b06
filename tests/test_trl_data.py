"""A TRL user's data and rewards, unchanged: Hugging Face datasets (objects, files by path, streamed), TRL's
conversational conventions, TRL's own reward functions (TRL itself as the oracle), async rewards, trainer_state and
log_metric, the data position resumed at the exact row, and each bad input as one line."""

import asyncio
import json

import pytest
import torch

from grpo_lab import Lab, LabError

pytestmark = pytest.mark.xdist_group("trl_data")

SYSTEM = {"role": "system", "content": "Answer in a box."}


def chat_rows(n=6):
    return [
        {"prompt": [SYSTEM, {"role": "user", "content": f"What is {i} + {i}?"}], "solution": f"${2 * i}$", "n": i}
        for i in range(n)
    ]


def spy(fn, seen: list):
    """`fn` as a reward that records what it was given and what it returned (same name, so TRL and the Lab name it
    alike)."""

    def reward(**kwargs):
        values = fn(**kwargs)
        seen.append({"kwargs": kwargs, "values": values})
        return values

    reward.__name__ = fn.__name__
    return reward


def set_completions(lab, rollout, texts):
    """Put these completion texts into `rollout` as token ids (decoded back, as a generator decodes them)."""
    tokenizer = lab.learner.tokenizer
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    rollout.completion_ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids])
    rollout.completion_mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])
    rollout.sampler_logprobs = torch.zeros(len(ids), width)
    rollout.truncated = torch.zeros(len(ids), dtype=torch.bool)
    rollout.completions = tokenizer.batch_decode(ids, skip_special_tokens=True)
    return rollout


def test_trl_reward_functions_see_and_give_what_they_do_inside_trl(tiny_config, tmp_path):
    """TRL's think_format_reward and accuracy_reward, called by TRL 1.16's own GRPOTrainer on the same conversational
    rows and completions, get the same prompts, completions and columns and give the same values."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.rewards import accuracy_reward, think_format_reward

    ours, theirs = [], []
    cfg = tiny_config(data={"system_prompt": None}, grpo={"num_generations": 2, "prompts_per_step": 2})
    rows = chat_rows(2)
    lab = Lab(cfg, reward_funcs=[spy(think_format_reward, ours), spy(accuracy_reward, ours)], train_dataset=rows)
    lab.load()
    texts = ["<think>\nadd\n</think>\n\\boxed{0}", "\\boxed{1}", "<think>\nhm\n</think>\n\\boxed{2}", "no box 2"]
    rollout = set_completions(lab, lab.rollout(), texts)
    got = lab.rewards(rollout)
    inputs = [row for row in rollout.batch.extra["n"] for _ in range(2)]
    inputs = [rows[n] for n in inputs]
    trainer = GRPOTrainer(
        model=lab.learner.model,
        reward_funcs=[spy(think_format_reward, theirs), spy(accuracy_reward, theirs)],
        args=GRPOConfig(
            output_dir=str(tmp_path / "trl"),
            use_cpu=True,
            report_to=[],
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=16,
        ),
        train_dataset=Dataset.from_list(rows),
        processing_class=lab.learner.tokenizer,
    )
    completion_ids = [ids[:k] for ids, k in zip(rollout.completion_ids.tolist(), rollout.completion_lengths.tolist())]
    trl_completions = [[{"role": "assistant", "content": c}] for c in rollout.completions]  # TRL's decode, as it does
    table = trainer._calculate_rewards(inputs, [r["prompt"] for r in inputs], trl_completions, completion_ids)
    assert torch.allclose(got.per_function, table.cpu(), equal_nan=True)
    assert len({v for v in got.per_function[:, 0].tolist()}) == 2  # why: values that differ, or parity proves little
    for a, b in zip(ours, theirs):
        for key in ("prompts", "completions", "completion_ids", "solution", "n"):
            assert a["kwargs"][key] == b["kwargs"][key], key
        assert {"trainer_state", "log_extra", "log_metric"} <= set(a["kwargs"])
    lab.close()


def test_a_conversational_dataset_steps_twice_with_trl_shapes_state_and_logged_metrics(tiny_config):
    seen = []

    def judge(prompts, completions, n, trainer_state, log_metric, log_extra, **kwargs):
        seen.append((prompts[0], completions[0], list(n), trainer_state.global_step, trainer_state.max_steps))
        log_metric("judge/agree", 0.25)
        log_extra("judge_note", ["ok"] * len(completions))
        return [float(len(c[0]["content"]) % 2) for c in completions]

    cfg = tiny_config(data={"system_prompt": None}, run={"steps": 7})
    lab = Lab(cfg, reward_funcs=[judge], train_dataset=chat_rows()).load()
    first, second = lab.step(), lab.step()
    prompt, completion, ns, steps, max_steps = seen[0]
    assert prompt[0] == SYSTEM and completion[0]["role"] == "assistant" and isinstance(completion[0]["content"], str)
    assert len(ns) == 8 and ns[0] == ns[1] == ns[2] == ns[3]  # a column repeated for its group, as TRL repeats it
    assert [s[3] for s in seen] == [0, 1] and max_steps == 7
    assert first.logged == {"judge/agree": 0.25} and second.metrics()["judge/agree"] == 0.25
    assert "judge/agree 0.25" in second.summary()
    lab.close()


def test_the_builtin_set_is_conversational_so_trl_rewards_run_on_it_by_name(tiny_config):
    lab = Lab(tiny_config(data={"rewards": ["think_format_reward", "exact_answer"]})).load()
    rollout = lab.rollout()
    assert rollout.batch.conversational and rollout.batch.raw[0][0]["role"] == "system"
    rewards = lab.rewards(rollout)
    assert rewards.names == ["think_format_reward", "exact_answer"] and not torch.isnan(rewards.per_function).any()
    lab.close()


def test_a_users_prompts_reach_the_model_and_the_rewards_as_trl_renders_them_and_the_knob_replaces_their_system(
    tiny_config,
):
    """By default (data.system_prompt: null) a user's conversational rows are rendered as TRL 1.16 renders them (its
    maybe_apply_chat_template as the oracle) and reach the rewards as the dataset has them; the knob, once set, is the
    prompts' one system message, in place of a row's own."""
    from trl.data_utils import maybe_apply_chat_template

    user_only = [
        {"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)} for i in range(4)
    ]
    rows = user_only + chat_rows(4)
    cfg = tiny_config(generator={"max_completion_length": 1}, grpo={"prompts_per_step": 8, "num_generations": 2})
    lab = Lab(cfg, train_dataset=rows).load()
    batch, tokenizer = lab.rollout().batch, lab.learner.tokenizer
    assert sorted(map(str, batch.raw)) == sorted(str(r["prompt"]) for r in rows)  # every row, each as it is
    assert batch.prompts == [maybe_apply_chat_template({"prompt": raw}, tokenizer)["prompt"] for raw in batch.raw]
    lab.configure({"data.system_prompt": "Be brief."})
    for raw in lab.rollout().batch.raw:
        assert raw[0] == {"role": "system", "content": "Be brief."} and [m["role"] for m in raw[1:]] == ["user"]
    lab.close()


def test_async_rewards_run_concurrently_even_under_a_running_loop():
    """Two async rewards that each wait for the other: they finish only if they run at once (a sequential runner
    times out); called from inside a running event loop, as a notebook cell is."""
    from grpo_lab.algo.reward_calls import call_rewards

    a_started, b_started = None, None

    async def reward_a(**kwargs):
        a_started.set()
        await asyncio.wait_for(b_started.wait(), 5)
        return [1.0]

    async def reward_b(**kwargs):
        b_started.set()
        await asyncio.wait_for(a_started.wait(), 5)
        return [2.0]

    def sync_reward(**kwargs):
        return [3.0]

    async def cell():  # a notebook's loop is running while the cell calls the Lab
        return call_rewards([("a", reward_a), ("s", sync_reward), ("b", reward_b)], 1, {})

    async def events():
        nonlocal a_started, b_started
        a_started, b_started = asyncio.Event(), asyncio.Event()

    from grpo_lab.algo.reward_calls import run_coroutine

    run_coroutine(events())  # the events belong to the rewards' loop
    assert asyncio.run(cell()) == [[1.0], [3.0], [2.0]]


def test_a_reward_that_raises_or_miscounts_is_one_line_naming_it_and_the_step_is_undone(loaded_lab):
    lab = loaded_lab()
    before = {k: v.clone() for k, v in lab.learner.model.named_parameters() if v.requires_grad}

    def broken(prompts, completions, **kwargs):
        raise KeyError("score")

    lab.reward_funcs = [broken]
    with pytest.raises(LabError, match=r"reward 'broken' raised KeyError: 'score'"):
        lab.step()
    lab.reward_funcs = [lambda prompts, completions, **kw: [1.0] * (len(completions) + 1)]
    with pytest.raises(LabError, match="returned 9 values for 8 completions"):
        lab.step()
    after = dict(lab.learner.model.named_parameters())
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    lab.reward_funcs = [lambda prompts, completions, **kw: [float(i) for i in range(len(completions))]]
    lab.step()  # the Lab steps again


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv", "saved"])
def test_a_dataset_file_or_folder_by_path(tiny_config, tmp_path, kind):
    from datasets import Dataset

    rows = [{"prompt": f"Say {i}", "answer": str(i), "topic": "say"} for i in range(5)]
    path = tmp_path / f"d.{kind}"
    dataset = Dataset.from_list(rows)
    {
        "jsonl": lambda: path.write_text("".join(json.dumps(r) + "\n" for r in rows)),
        "parquet": lambda: dataset.to_parquet(str(path)),
        "csv": lambda: dataset.to_csv(str(path)),
        "saved": lambda: dataset.save_to_disk(str(path)),
    }[kind]()
    seen = {}

    def topic_reward(prompts, completions, topic, answer, **kwargs):
        seen.update(prompts=prompts, topic=topic, answer=answer)
        return [0.0] * len(completions)

    lab = Lab(tiny_config(data={"dataset": str(path)}), reward_funcs=[topic_reward]).load()
    lab.rewards(lab.rollout())
    assert seen["topic"] == ["say"] * 8 and seen["prompts"][0].startswith("Say ")  # standard: the text as given
    assert len({a for a in seen["answer"]}) == 2
    lab.close()


def positions(source, steps, size=3):
    return [[row for row in source.next_batch(size).extra["n"]] for _ in range(steps)]


@pytest.mark.parametrize("kind", ["list", "dataset", "streamed"])
def test_the_data_order_is_seeded_and_resumes_at_the_exact_row(kind):
    """Five batches straight through equal two, a checkpoint's state into a new source, then three more (a
    streamed source past the end of its first epoch included)."""
    from datasets import Dataset

    from grpo_lab.data.prompts import PromptSource

    class Tok:
        chat_template = None

    rows = [{"prompt": f"p{i}", "n": i} for i in range(7)]
    make = {
        "list": lambda: rows,
        "dataset": lambda: Dataset.from_list(rows),
        "streamed": lambda: Dataset.from_list(rows).to_iterable_dataset(num_shards=1),
    }[kind]
    straight = positions(PromptSource(make(), Tok(), None, seed=4), 5)
    first = PromptSource(make(), Tok(), None, seed=4)
    head = positions(first, 2)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint writes it
    again = PromptSource(make(), Tok(), None, seed=4)
    again.load_state_dict(state)
    assert head + positions(again, 3) == straight
    assert sorted(sum(straight, [])[:7]) == list(range(7))  # the first epoch is every row once
    assert straight != positions(PromptSource(make(), Tok(), None, seed=5), 5)


def test_a_streamed_dataset_steps_and_is_checked_as_it_is_read(tiny_config):
    from datasets import Dataset

    stream = Dataset.from_list(chat_rows(300)).to_iterable_dataset(num_shards=1)
    lab = Lab(tiny_config(data={"system_prompt": None}), train_dataset=stream).load()
    assert lab.prompts.streamed and lab.prompts.lengths().total is None
    lab.rollout()
    lab.close()


def test_prompts_longer_than_max_prompt_length_are_said_at_load(tiny_config, capsys):
    rows = [{"prompt": "word " * (5 if i % 3 else 60)} for i in range(9)]
    cfg = tiny_config(generator={"max_prompt_length": 100}, data={"system_prompt": None})
    lab = Lab(cfg, train_dataset=rows).load()
    out = capsys.readouterr().out
    assert "data: 3 of 9 prompts are longer than generator.max_prompt_length=100" in out and "cut from the left" in out
    row, tokens = lab.prompts.longest(100)
    assert tokens == 100 and row["prompt"].count("word") == 60
    lab.close()


@pytest.mark.parametrize(
    "given, error",
    [
        ([{"question": "a"}], r"train_dataset: no 'prompt' column \(row 0 has \['question'\]\); .*rename_column"),
        ([{"prompt": "a"}, {"prompt": 3}], r"train_dataset: row 1's 'prompt' is int"),
        ([], r"train_dataset: the list has no rows"),
        ("not a dataset", r"train_dataset: got str; give a datasets.Dataset"),
    ],
)
def test_bad_datasets_are_one_line_before_anything_loads(tiny_config, given, error):
    lab = Lab(tiny_config(), train_dataset=given)
    with pytest.raises(LabError, match=error):
        lab.load()
    assert lab.learner is None


def test_bad_config_datasets_are_one_line(tiny_config, tmp_path, monkeypatch):
    from datasets import Dataset, DatasetDict

    from grpo_lab.config.loading import load_config
    from grpo_lab.data.sources import open_dataset

    def opened(**data):
        return open_dataset(load_config(tiny_config(data=data))).dataset

    saved = tmp_path / "dd"
    DatasetDict(
        {"train": Dataset.from_list([{"prompt": "a"}]), "test": Dataset.from_list([{"prompt": "b"}])}
    ).save_to_disk(str(saved))
    with pytest.raises(LabError, match=r"data.split: the dataset has no split 'validation'; .*\['test', 'train'\]"):
        opened(dataset=str(saved), split="validation")
    assert len(opened(dataset=str(saved), split="test")) == 1
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(LabError, match="data.dataset"):
        opened(dataset=str(empty))
    with pytest.raises(LabError, match=r"data.dataset: '\./nope.jsonl' does not exist"):
        opened(dataset="./nope.jsonl")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LabError, match=r"data.dataset: cannot reach 'openai/gsm8k'.*HF_HUB_OFFLINE.*local path"):
        opened(dataset="openai/gsm8k", dataset_config="main")


def test_trl_rewards_by_name_and_math_verify_missing(monkeypatch):
    import importlib.util

    from grpo_lab.algo.rewards import resolve_reward

    assert resolve_reward("think_format_reward").__name__ == "think_format_reward"
    assert resolve_reward("accuracy_reward").__name__ == "accuracy_reward"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(LabError, match="accuracy_reward needs math-verify.*pip install math-verify"):
        resolve_reward("accuracy_reward")


def test_a_given_dataset_is_not_replaced_by_a_data_edit(tiny_config):
    lab = Lab(tiny_config(), train_dataset=chat_rows()).load()
    with pytest.raises(LabError, match=r"data.split: this Lab's data was passed to Lab\(train_dataset=...\)"):
        lab.configure({"data.split": "test"})
    lab.close()


def test_grpo_lab_run_takes_a_dataset_by_path_and_trl_rewards_by_name(tiny_config, tmp_path, capsys):
    import yaml
    from datasets import Dataset

    from grpo_lab import cli

    data = tmp_path / "chat.parquet"
    Dataset.from_list(chat_rows()).to_parquet(str(data))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(run={"steps": 1})))
    argv = ["run", str(config), "--out", str(tmp_path / "run"), "--set", f"data.dataset={data}"]
    assert cli.main(argv + ["--set", "data.rewards=[think_format_reward, format]"]) == 0
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "rewards/think_format_reward/mean" in record and "rewards/format/mean" in record


def test_a_streamed_datasets_checkpoint_resumes_at_the_exact_row(tiny_config, tmp_path):
    """A Lab's checkpoint mid-epoch of a streamed dataset: a new Lab restored from it draws the rows the first draws
    next (the stream re-read up to the row)."""
    from datasets import Dataset

    def stream():
        return Dataset.from_list(chat_rows(5)).to_iterable_dataset(num_shards=1)

    cfg = tiny_config(data={"system_prompt": None}, generator={"max_completion_length": 2})
    first = Lab(cfg, train_dataset=stream()).load()
    first.step()
    checkpoint = first.save_checkpoint(tmp_path / "ckpt")
    expected = [first.prompts.next_batch(2).extra["n"] for _ in range(3)]  # across the epoch's end
    first.close()
    again = Lab(cfg, train_dataset=stream()).load().restore_checkpoint(checkpoint)
    assert [again.prompts.next_batch(2).extra["n"] for _ in range(3)] == expected
    again.close()


def test_the_built_in_set_never_imports_datasets(tiny_config, tmp_path):
    """A Lab on the built-in set (or a list of rows) keeps `datasets` out of its process: its import costs ~100 MiB of
    host RSS, which the plan's baseline does not hold (notebook 05's plan/measured fell from 0.88 to 0.78 with it)."""
    import subprocess
    import sys

    import yaml

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config()))
    code = (
        f"import sys; from grpo_lab import Lab; Lab({str(config)!r}).load().rollout(); print('datasets' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout[-2000:]


def test_grpo_lab_plan_reads_the_datas_longest_prompt_as_the_loaded_lab_plans_it(tiny_config, tmp_path, capsys):
    """Build 4: `grpo-lab plan` (nothing loaded) tokenizes a dataset on disk with the model's tokenizer and plans the
    longest prompt, the figure a loaded Lab's plan holds."""
    import yaml

    from grpo_lab import cli

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": "word " * n}) + "\n" for n in (3, 17, 9)))
    cfg = tiny_config(data={"dataset": str(data), "system_prompt": None})
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    assert cli.main(["plan", str(config)]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("prompts: planned at the data's"))
    lab = Lab(cfg).load()
    try:
        assert lab.plan().prompts == line and f"longest, {lab.prompts.lengths().longest} tokens" in line
    finally:
        lab.close()
