"""Checkpoints a run can resume from: everything the next step depends on, taken between steps.

A checkpoint directory holds `adapter/` (the LoRA weights, written by PEFT, loadable on their own),
`trainer_state.pt` (optimizer state, RNG states, the prompt order) and `checkpoint.json` (step
index, what the data position belongs to). It is written with io.atomic_write_dir, so a process
killed at any moment, also mid-write, leaves the previous complete checkpoint or the new one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from ..errors import LabError

STATE, META, ADAPTER = "trainer_state.pt", "checkpoint.json", "adapter"
FORMAT = 1


def data_key(config) -> dict:
    """The settings the saved data position indexes into; with others it means nothing."""
    return {"dataset": config.data.dataset, "num_prompts": config.data.num_prompts, "seed": config.run.seed}


def save_checkpoint(
    learner,
    prompts,
    config,
    step: int,
    path: Union[str, Path],
    lora: Optional[dict] = None,
    optimizer: Optional[dict] = None,
    rng: Optional[dict] = None,
) -> Path:
    """Write a run's state between steps to `path`, atomically: `learner`'s LoRA and AdamW state, the RNG states,
    `prompts`' position, and `step`, the step that runs next (`lora`/`optimizer`: a sharded learner's, gathered
    whole, so one format serves every number of ranks; `rng`: with every rank's own states under 'ranks')."""
    from ..files import atomic_write_dir
    from ..runtime import capture_rng, runtime

    optimizer = learner.optimizer.state_dict() if optimizer is None else optimizer
    rng = capture_rng(runtime().cuda_indices(config)) if rng is None else rng
    state = {"optimizer": optimizer, "rng": rng, "data": prompts.state_dict()}
    meta = {"format": FORMAT, "step": step, "data": data_key(config)}

    def write(tmp: Path) -> None:
        learner.model.save_pretrained(tmp / ADAPTER, state_dict=lora)  # PEFT: the adapter tensors only, never the base
        learner.tokenizer.save_pretrained(tmp / ADAPTER)
        torch.save(state, tmp / STATE)
        (tmp / META).write_text(json.dumps(meta, indent=1))

    return atomic_write_dir(path, write)


@dataclass
class Checkpoint:
    path: Path
    step: int  # steps finished before it was taken = the index of the step that runs next
    data: dict

    def load_state(self) -> dict:
        return torch.load(self.path / STATE, map_location="cpu", weights_only=True)


def read_checkpoint(path: Union[str, Path]) -> Checkpoint:
    """The checkpoint at `path` (after putting back what an interrupted write left), checked complete."""
    from ..files import recover_dir

    path = recover_dir(Path(path))
    missing = [name for name in (META, STATE, f"{ADAPTER}/adapter_config.json") if not (path / name).exists()]
    if missing:
        raise LabError(
            f"checkpoint {str(path)!r}: {', '.join(missing)} missing; it is not a grpo_lab checkpoint "
            "(written by lab.save_checkpoint or grpo-lab run)"
        )
    meta = json.loads((path / META).read_text())
    if meta.get("format") != FORMAT:
        raise LabError(f"checkpoint {str(path)!r}: format {meta.get('format')!r}, this grpo_lab reads {FORMAT}")
    return Checkpoint(path, int(meta["step"]), meta["data"])


def restore_checkpoint(learner, prompts, config, checkpoint: Checkpoint) -> None:
    """Put the checkpoint's LoRA weights, optimizer state, RNG states and data position into a loaded learner and
    prompt source whose config matches it (same model and LoRA); the Lab resumes at its step."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    from ..runtime import rank_rng, restore_rng, runtime

    weights = load_peft_weights(str(checkpoint.path / ADAPTER), device="cpu")
    result = set_peft_model_state_dict(learner.model, weights)
    unexpected = [k for k in result.unexpected_keys if "lora_" in k]
    if unexpected or len(weights) != len(learner.trainable_parameters()):
        raise LabError(
            f"checkpoint {str(checkpoint.path)!r}: its LoRA tensors do not match this model's "
            f"({len(weights)} saved, {len(learner.trainable_parameters())} here); resume with the run's own "
            "model and lora settings"
        )
    state = checkpoint.load_state()
    learner.optimizer.load_state_dict(state["optimizer"])
    learner.optimizer.zero_grad(set_to_none=True)
    restore_data(prompts, config, checkpoint, state["data"])
    me = runtime()
    restore_rng(rank_rng(state["rng"], me.rank, me.size))


def restore_data(prompts, config, checkpoint: Checkpoint, data: dict) -> None:
    """The checkpoint's data position `data` into `prompts` (one process's source, or a sharded learner's driver's),
    where its data settings are the config's."""
    if checkpoint.data == data_key(config):
        prompts.load_state_dict(data)
    else:  # why not refused: a Lab may change data.* between steps; the prompt order then starts afresh
        import warnings

        warnings.warn(
            "checkpoint: data settings differ from the checkpoint's; the prompt order starts from the "
            "beginning of the new data",
            stacklevel=4,
        )
