"""A sharded learner's reward model (execution/sharded/driver.py): the driver loads it and scores each rollout once;
every rank's rewards phase carries those scores after its reward functions, as one process's does."""

from __future__ import annotations

import pytest

from grpo_lab import Lab

pytestmark = [pytest.mark.solo, pytest.mark.xdist_group("ranks")]  # why solo: it starts Ray, two ranks


@pytest.mark.slow
@pytest.mark.cores(2)
def test_the_driver_scores_and_every_rank_weighs_its_scores(ray_local, tiny_model):
    from grpo_lab.algo.grpo import rewards
    from grpo_lab.models.reward_model import load_reward_model

    overrides = [
        f"model.name_or_path={tiny_model}",
        "placement.learner_procs=2",
        "data.rewards=[format]",
        "data.reward_models=[builtin:tiny-reward]",
        "data.reward_weights=[1, 0.5]",
    ]
    lab = Lab("tiny-cpu", overrides=overrides).load()
    try:
        name = lab.executor.reward_models[0].__name__
        assert set(lab.step().rewards) == {"format", name}
        rollout = lab.rollout()
        table = lab.rewards(rollout)  # rank 0's: every rank computes the same
        scorer = load_reward_model("builtin:tiny-reward", lab.config, "cpu")  # another copy, in this test
        expected = rewards(rollout, [scorer]).per_function[:, 0]
        assert table.names == ["format", name]
        assert table.per_function[:, 1].tolist() == pytest.approx(expected.tolist(), abs=1e-6)
        assert table.total.tolist() == pytest.approx((table.per_function[:, 0] + 0.5 * expected).tolist(), abs=1e-6)
    finally:
        lab.close()
