"""A loaded learner's (and a reference copy's) weights are its own memory from load on, not views of the mapped
checkpoint that the first forward pages in (grpo_lab/models/resident.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_lab import load_config
from grpo_lab.models.resident import PAGE, checkpoint_mappings, copy_off, hold_in_memory, mapped_tensors

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


def mapped_names(model) -> list[str]:
    mapped = {id(t) for t in mapped_tensors(model, checkpoint_mappings())}
    return [n for n, t in (*model.named_parameters(), *model.named_buffers()) if id(t) in mapped]


def test_a_plain_load_leaves_the_embedding_mapped(tiny_model, tiny_config):
    """The case hold_in_memory is for: transformers' CPU load keeps the float32 embedding a view of the file."""
    from grpo_lab.models.learner import load_base

    base = load_base(load_config(tiny_config()).model, "cpu")
    assert "model.embed_tokens.weight" in mapped_names(base)


def test_the_learner_holds_its_weights_tied_and_unchanged(tiny_model, tiny_config):
    from grpo_lab.models.learner import load_learner

    learner = load_learner(load_config(tiny_config()))
    model = learner.model
    assert mapped_names(model) == []
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embedding is head  # the tied head is still the embedding's very tensor
    stored = load_file(str(Path(tiny_model) / "model.safetensors"))
    assert torch.equal(embedding, stored["model.embed_tokens.weight"])
    assert not embedding.requires_grad


def test_a_reference_copy_holds_its_weights(tiny_config):
    from grpo_lab.models.reference import CopyReference

    config = load_config(tiny_config(grpo={"beta": 0.04}, reference={"strategy": "copy"}))
    assert mapped_names(CopyReference(config).model) == []


def test_a_reward_model_holds_its_weights(tiny_config):
    from grpo_lab.models.reward_model import load_reward_model

    reward = load_reward_model("builtin:tiny-reward", load_config(tiny_config()), "cpu")
    assert mapped_names(reward.model) == []


def present_pages(tensor: torch.Tensor) -> int:
    """How many of the pages wholly inside `tensor`'s bytes this process has mapped in (/proc/self/pagemap bit 63)."""
    start = -(-tensor.data_ptr() // PAGE)
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start * 8)
        entries = f.read((end - start) * 8)
    return sum(int.from_bytes(entries[k : k + 8], "little") >> 63 for k in range(0, len(entries), 8))


def test_the_copy_lets_the_mapped_pages_go(tiny_config):
    """The pages read for a weight's copy leave RSS as it is copied, though the mapping stays while any view of it
    lives (here one kept on purpose; at load, the weights not yet copied): no load holds a weight twice."""
    from grpo_lab.models.learner import load_base

    base = load_base(load_config(tiny_config()).model, "cpu")
    mapped = base.get_input_embeddings().weight.data  # a view of the file: keeps the mapping
    expected = mapped.clone()  # (reads every page in)
    assert present_pages(mapped) > 0
    assert hold_in_memory(base) >= mapped.numel() * mapped.element_size()
    assert present_pages(mapped) == 0
    assert torch.equal(base.get_input_embeddings().weight, expected)


def test_a_copy_in_chunks_not_on_page_bounds_is_the_same_tensor(tiny_config):
    from grpo_lab.models.learner import load_base

    mapped = load_base(load_config(tiny_config()).model, "cpu").get_input_embeddings().weight.data
    expected = mapped.clone()
    copy = copy_off(mapped, chunk=3 * PAGE + 100)
    assert present_pages(mapped) == 0
    assert copy.data_ptr() != mapped.data_ptr() and torch.equal(copy, expected)
