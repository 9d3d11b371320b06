"""Reference policies for the KL term, by strategy name.

`adapter-disabled` is the LoRA policy with its adapter switched off: the base model, at zero
extra memory (verl's choice; TRL keeps a copy under FSDP, which P5 shows can land on the wrong
device). `copy` is a separate frozen model on a device of its own. Reference log-probs always
come back on the CPU next to the rollout, so where the reference runs never meets where they
are consumed (no device-mismatch errors deep inside torch).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..algo.containers import Rollout
from ..algo.logprobs import add_logprob_head, configure_head, rollout_logprobs
from ..checks.devices import ensure_on_device


class NoReference:
    def logprobs(self, learner, rollout: Rollout, config) -> Optional[torch.Tensor]:
        return None


class AdapterDisabledReference:
    def logprobs(self, learner, rollout, config):
        # why train mode: the learner's passes all run in the mode of its loss forward (see step.backward)
        learner.model.train()
        configure_head(learner.model, config, rollout.logprob_temperature)
        with learner.model.disable_adapter():  # PEFT restores the adapter in its own finally
            return rollout_logprobs(
                learner.model, rollout, learner.device, config.grpo.micro_batch_size, sharding=learner.sharding
            )


class CopyReference:
    """A frozen base model on `reference.device` (default: the learner's)."""

    def __init__(self, config):
        from ..runtime import runtime
        from .fsdp import check_reference_devices
        from .learner import learner_device, load_base, prepare_like_policy
        from .resident import hold_in_memory

        sharded = runtime().is_rank  # a sharded learner's copy: on the rank's device, sharded the same way (P5)
        self.device = torch.device(learner_device(config) if sharded else config.reference_device)
        self.model = load_base(config.model, str(self.device), config.run.seed)
        hold_in_memory(self.model)  # why: as the learner's, resident from load as the plan counts it
        add_logprob_head(self.model)
        prepare_like_policy(self.model, str(self.device))
        self.model.eval()
        if sharded:
            check_reference_devices(self.model, self.device)
        else:
            ensure_on_device(self.model, self.device, "reference.device")

    def logprobs(self, learner, rollout, config):
        configure_head(self.model, config, rollout.logprob_temperature)
        return rollout_logprobs(
            self.model, rollout, self.device, config.grpo.micro_batch_size, sharding=learner.sharding
        )


REFERENCES = {
    "none": lambda config: NoReference(),
    "adapter-disabled": lambda config: AdapterDisabledReference(),
    "copy": CopyReference,
}


def build_reference(config):
    return REFERENCES[config.reference_strategy](config)
