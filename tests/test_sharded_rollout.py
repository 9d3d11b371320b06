"""Sample once (issue 23): a sharded learner's hf rollout is computed once for all ranks. Each rank samples its share
of the prompt groups, the ranks all-gather, and every rank holds one process's rollout; a checksum is agreed.

The tolerance: token ids, masks and completions are equal to one process's (every row samples from its own seed,
padded to the whole batch's prompt width); sampler log-probs differ by float rounding only (a rank's forward runs
another batch size: <= 1.2e-6 measured on tiny-cpu's float32, 0 on logits-heavy-cpu's bfloat16), so they are
compared within SAMPLER_TOL."""

from __future__ import annotations

import pytest
import torch

from grpo_lab import Lab
from grpo_lab.errors import LabError
from grpo_lab.runtime import Runtime

pytestmark = [pytest.mark.solo, pytest.mark.xdist_group("ranks")]  # why solo: it starts Ray, two ranks

SHARDED = ["placement.learner_procs=2"]
SAMPLER_TOL = 1e-5


def test_shares_are_whole_groups_in_rank_order_and_uneven_counts_split():
    for n, size in [(4, 2), (3, 2), (1, 2), (7, 3), (2, 4)]:
        shares = [Runtime(k, size, is_rank=True).share(n) for k in range(size)]
        assert [i for s in shares for i in range(s.start, s.stop)] == list(range(n))  # every group once, in order
        assert max(s.stop - s.start for s in shares) - min(s.stop - s.start for s in shares) <= 1
    assert Runtime().share(5) == slice(0, 5)


def test_a_row_samples_the_same_tokens_whatever_rows_are_beside_it(tiny_model):
    """Each row draws from its own seed and is padded to the whole batch's prompt width: a chunk of 1, 3 or all rows
    samples the same completions (what lets a rank sample only its share), and the RNG advances by one draw per row
    whatever the lengths."""
    from grpo_lab.generation.base import GenerationRequest

    lab = Lab("tiny-cpu", overrides=[f"model.name_or_path={tiny_model}"]).load()
    model, widths = lab.learner.model, []
    generate = model.generate
    model.generate = lambda **kw: widths.append(kw["input_ids"].shape[1]) or generate(**kw)
    try:
        batch = lab.prompts.next_batch(3)
        outs, states = [], []
        for chunk in (None, 1, 3):
            torch.manual_seed(0)
            outs.append(lab.generator.generate(batch, 2, GenerationRequest(12, temperature=1.0, chunk_size=chunk)))
            states.append(torch.get_rng_state())
    finally:
        lab.close()
    lengths = outs[0].prompt_mask.sum(1).tolist()
    assert len(set(lengths)) > 1 and set(widths) == {max(lengths)}, (lengths, widths)  # every call the batch's width
    for out in outs[1:]:
        assert torch.equal(out.completion_ids, outs[0].completion_ids) and out.completions == outs[0].completions
        assert (out.sampler_logprobs - outs[0].sampler_logprobs).abs().max().item() <= SAMPLER_TOL
    assert all(torch.equal(s, states[0]) for s in states)
    assert len(set(outs[0].completions)) > 1  # sampled, not one string repeated


def test_a_checksum_mismatch_is_one_line_naming_the_rank(monkeypatch):
    from grpo_lab.generation import sample_once as sample

    digests = ["a" * 64, "a" * 64, "b" * 64]
    monkeypatch.setattr(sample, "runtime", lambda: type("R", (), {"gather_objects": lambda self, v: digests})())
    monkeypatch.setattr(sample, "digest", lambda rollout: "a" * 64)
    with pytest.raises(LabError) as err:
        sample.agree_on(None)
    line = str(err.value)
    assert "\n" not in line and line.startswith("rollout: rank 2 holds a rollout unlike the others'"), line
    assert "rank 2 bbbbbbbbbbbb" in line
    digests[:] = ["a" * 64] * 3
    sample.agree_on(None)  # agreed: nothing raised


def rows(lab) -> list[int]:
    return [rank["generated_rows"] for rank in lab.inspect()]


def same_rollout(mine, theirs) -> None:
    for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(mine, field), getattr(theirs, field)), field
    assert mine.completions == theirs.completions
    assert (mine.sampler_logprobs - theirs.sampler_logprobs).abs().max().item() <= SAMPLER_TOL


# each: the edits (on both Labs), then every rank's sequences sampled (a rank with no group samples one stand-in row,
# so that the other's engine calls have a partner)
CASES = [
    ({}, [4, 4]),  # 2 groups of 4: one each, gathered
    ({"generator": {"gather_for_generation": False, "chunk_size": 1}}, [4, 4]),  # through the shards, synced
    (
        {
            "grpo": {"prompts_per_step": 3, "num_generations": 2},
            "generator": {"gather_for_generation": False, "chunk_size": 3},
        },
        [4, 2],
    ),  # uneven: 2 groups and 1
    (
        {
            "grpo": {"prompts_per_step": 1, "num_generations": 4},
            "generator": {"gather_for_generation": True, "chunk_size": None},
        },
        [4, 1],
    ),  # 1 group: rank 1 has none
]


@pytest.mark.slow
@pytest.mark.cores(2)
def test_two_ranks_sample_once_what_one_process_samples(ray_local):
    one = Lab("tiny-cpu").load()
    try:
        expected = []
        for edits, _ in CASES:  # gather_for_generation means nothing in one process (refused there)
            one.configure(
                **{k: {f: v for f, v in fields.items() if f != "gather_for_generation"} for k, fields in edits.items()}
            )
            expected.append(one.rollout())
    finally:
        one.close()
    lab = Lab("tiny-cpu", overrides=SHARDED).load()
    try:
        for (edits, share), theirs in zip(CASES, expected):
            lab.configure(**edits)
            before = rows(lab)
            mine = lab.rollout()
            assert [a - b for a, b in zip(rows(lab), before)] == share, edits  # each rank sampled its share only
            same_rollout(mine, theirs)
        lab.arm_fault(1, "rollout", "diverge")  # rank 1 hashes one token differently after the gather
        pids = list(lab.executor.ranks.pids)
        with pytest.raises(LabError) as err:
            lab.rollout()
        line = str(err.value)
        assert "\n" not in line and line.startswith(
            "rollout failed on every rank: rollout: rank 1 holds a rollout unlike the others' after the gather"
        ), line
        assert list(lab.executor.ranks.pids) == pids  # decided together: no rank restarted
        assert len(lab.rollout()) == 4  # the next rollout is agreed again
    finally:
        lab.close()
