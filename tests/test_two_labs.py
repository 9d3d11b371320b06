"""Two Labs in one process (issue 42): a notebook that loads two to compare settings saw the second's step 0 change
with the first beside it (rewards 1.500 against 1.141): both drew from the process's global random generators. Each
Lab now draws from streams of its own. Compared on the sampled token ids, which every draw changes."""

from __future__ import annotations

import torch

from grpo_lab import Lab


def make(tiny_config, seed: int = 0) -> Lab:
    return Lab(tiny_config(memory={"sample_hz": 0}, generator={"max_completion_length": 12}, run={"seed": seed})).load()


def sampled(lab: Lab) -> torch.Tensor:
    """The current step's rollout, then the rest of the step; the rollout's token ids."""
    ids = lab.rollout().completion_ids
    lab.step()
    return ids


def test_a_labs_steps_do_not_depend_on_another_lab_in_the_process(tiny_config):
    alone = make(tiny_config)
    expected = [sampled(alone) for _ in range(2)]
    alone.close()

    first, second = make(tiny_config), make(tiny_config, seed=1)  # both loaded, then stepped in turns
    turns = []
    for _ in range(2):
        sampled(second)
        torch.rand(7)  # a cell's own draw between two steps belongs to whichever Lab ran last
        turns.append(sampled(first))
    first.close()
    second.close()
    assert all(torch.equal(got, want) for got, want in zip(turns, expected))


def test_a_checkpoint_holds_its_own_labs_random_streams(tiny_config, tmp_path):
    """Saved after another Lab ran, a checkpoint still holds its own Lab's RNG states: restored, the run goes on as the
    Lab alone would have."""
    alone = make(tiny_config)
    expected = [sampled(alone) for _ in range(2)][-1]
    alone.close()

    first, second = make(tiny_config), make(tiny_config, seed=1)
    sampled(first)
    sampled(second)  # the process's generators are the second's now (another seed: other streams)
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    second.close()
    resumed = make(tiny_config).restore_checkpoint(tmp_path / "ckpt")
    got = sampled(resumed)
    resumed.close()
    assert torch.equal(got, expected)
