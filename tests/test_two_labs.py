"""Two Labs in one process (issue 42): a notebook that loads two to compare settings saw the second's step 0 change
with the first beside it (rewards 1.500 against 1.141): both drew from the process's global random generators. Each
Lab now draws from streams of its own."""

from __future__ import annotations

import torch

from grpo_lab import Lab


def test_a_labs_steps_do_not_depend_on_another_lab_in_the_process(tiny_config):
    def make():
        return Lab(tiny_config(memory={"sample_hz": 0}, generator={"max_completion_length": 12})).load()

    alone = make()
    expected = [alone.step() for _ in range(2)]
    alone.close()

    first, second = make(), make()  # both loaded, then stepped in turns, as a notebook's cells do
    turns = []
    for _ in range(2):
        first.step()
        torch.rand(7)  # a cell's own draw between two steps belongs to whichever Lab ran last
        turns.append(second.step())
    for got, want in zip(turns, expected):
        assert (got.reward_mean, got.loss, got.grad_norm) == (want.reward_mean, want.loss, want.grad_norm)
    first.close()
    second.close()
