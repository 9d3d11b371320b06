"""The plan's CPU activations against what torch really keeps for backward.

`torch.autograd.graph.saved_tensors_hooks` sees every tensor autograd saves, so the bytes a forward of the real
learner (nf4 + LoRA, a padded batch) keeps for its backward are counted exactly, on any CPU and at any glibc heap
setting: unlike RSS, no heap holes, no sampling. The plan's `saved` line must read 0.95-1.05 of that count on shapes
whose widths differ (a query wider than the hidden size; grouped key/value heads).
"""

import pytest
import torch

from grpo_lab import Lab, load_config
from grpo_lab.models.shapes import load_shape
from grpo_lab.planner.estimate import activation_bytes


def saved_bytes(model, ids, mask) -> int:
    """Bytes of the distinct storages autograd saves in one training forward of the decoder (no LM head: the lab's
    chunked head never builds [rows, length, vocab] logits)."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    decoder = model.get_base_model().model
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        decoder(input_ids=ids, attention_mask=mask)
    return sum(seen.values())


def measured_and_planned(name: str, overrides: tuple = ()) -> tuple[int, float]:
    """What autograd keeps in one training forward of `name`'s learner (4 rows of 48 + 144 tokens, half of them
    left-padded, checkpointing off; `overrides`: more config), and the plan's `saved` line for the same batch."""
    rows, prompt, completion = 4, 48, 144
    config = load_config(
        "tiny-cpu",
        [
            f"model.name_or_path={name}",
            "model.gradient_checkpointing=false",
            f"grpo.num_generations={rows}",
            "grpo.prompts_per_step=1",
            "grpo.micro_batch_size=null",
            f"generator.max_prompt_length={prompt}",
            f"generator.max_completion_length={completion}",
            *overrides,
        ],
    )
    planned = activation_bytes(load_shape(name), config, on_cpu=True)["saved"]
    lab = Lab(config).load()
    try:
        model = lab.learner.model
        model.train()
        length = prompt + completion
        ids = torch.randint(0, model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[: rows // 2, : prompt // 3] = 0  # left padding on half the rows, as a batch of varied prompts has
        measured = saved_bytes(model, ids, mask)
    finally:
        lab.close()
    return measured, planned


@pytest.mark.parametrize("name", ["builtin:kv-heavy", "builtin:tiny-random"])
def test_the_cpu_plan_saves_what_torch_saves_for_backward(name):
    measured, planned = measured_and_planned(name)
    assert 0.95 <= measured / planned <= 1.05, (name, measured / 2**20, planned / 2**20)
