"""A sharded learner's data (execution/sharded/driver.py): the driver opens it once and hands every rank its step's
rows with the rollout, so a `train_dataset` object works on two ranks, a reward reads its columns there, and a
checkpoint holds the driver's data position: a restored run draws the exact rows it drew before.

One sharded Lab for the module (real Ray, two gloo CPU ranks, the tiny model): loading one costs tens of seconds."""

from __future__ import annotations

import pytest
import torch

from grpo_lab import Lab, LabError

pytestmark = [pytest.mark.solo, pytest.mark.xdist_group("ranks")]  # why solo: it starts Ray, two ranks

ROWS = [{"prompt": [{"role": "user", "content": f"Say {i}."}], "bonus": float(i)} for i in range(5)]
GENERATIONS = 4


@pytest.fixture(scope="module")
def sharded(tiny_model, tmp_path_factory):
    """A sharded Lab over a Dataset object with a `bonus` column; data.dataset names a file that does not exist, so a
    rank that opened data.dataset (as ranks did before the driver read the data) would fail to start."""
    import ray
    from conftest import tiny_dict
    from datasets import Dataset

    from grpo_lab.execution.sharded.ray_cluster import start_local

    if not ray.is_initialized():
        start_local(cpus=2)
    missing = tmp_path_factory.mktemp("data") / "never-written.jsonl"
    cfg = tiny_dict(
        tiny_model,
        placement={"learner_procs": 2},
        data={"dataset": str(missing), "rewards": ["tests.column_reward:bonus"], "system_prompt": None},
        generator={"max_completion_length": 4},
        grpo={"num_generations": GENERATIONS, "prompts_per_step": 2, "learning_rate": 1e-3},
    )
    lab = Lab(cfg, train_dataset=Dataset.from_list(ROWS)).load()
    yield lab
    lab.close()


@pytest.mark.slow
@pytest.mark.cores(2)
def test_a_train_dataset_object_steps_on_two_ranks_and_a_reward_there_reads_its_column(sharded):
    from grpo_lab.data.prompts import PromptSource

    lab = sharded
    rollout = lab.rollout()
    table = lab.rewards(rollout)  # rank 0's, computed in its process by tests.column_reward:bonus
    drawn = rollout.batch.extra["bonus"]
    expected = PromptSource(ROWS, None, None, seed=lab.config.run.seed).next_batch(2).extra["bonus"]
    assert drawn == expected  # the driver's seeded order, as one process draws it
    assert table.per_function[:, 0].tolist() == [b for b in drawn for _ in range(GENERATIONS)]
    assert [m[-1]["content"] for m in rollout.batch.raw] == [f"Say {int(b)}." for b in drawn]
    result = lab.step()  # the rest of step 0
    assert result.step == 0 and result.rewards["bonus"] == pytest.approx(sum(drawn) / len(drawn))


@pytest.mark.slow
@pytest.mark.cores(2)
def test_a_sharded_checkpoint_holds_the_drivers_data_position_and_resumes_at_the_exact_row(sharded, tmp_path):
    lab = sharded
    checkpoint = lab.save_checkpoint(tmp_path / "ckpt")
    saved = torch.load(checkpoint / "trainer_state.pt", weights_only=True)["data"]
    assert saved["order"] == lab.prompts.state_dict()["order"] and saved["epoch"] == 1
    straight = []
    for _ in range(2):  # across the epoch's end (5 rows, 2 a step)
        straight.append(lab.rollout().batch.extra["bonus"])
        lab.step()
    lab.restore_checkpoint(checkpoint)
    again = []
    for _ in range(2):
        again.append(lab.rollout().batch.extra["bonus"])
        lab.step()
    assert again == straight and len({b for rows in straight for b in rows}) >= 3


@pytest.mark.slow
@pytest.mark.cores(2)
def test_a_rollout_that_fails_on_every_rank_gives_its_rows_back_to_the_drivers_source(sharded):
    """A failed rollout is undone with its draw: the driver's source is back where the step began, so the retry
    samples the step's own rows (as one process: tests/test_lifecycle.py)."""
    lab = sharded
    position = lab.prompts.state_dict()
    for rank in (0, 1):
        lab.arm_fault(rank, "rollout", "runtime")
    with pytest.raises(LabError, match="rollout failed on every rank"):
        lab.rollout()
    assert lab.prompts.state_dict() == position
    assert lab.step().attempts == 2
