"""A loaded learner's (and a reference copy's) weights are its own memory from load on, not views of the mapped
checkpoint that the first forward pages in (grpo_lab/models/resident.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_lab import load_config
from grpo_lab.models.resident import checkpoint_mappings, mapped_tensors

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
