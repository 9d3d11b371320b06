"""A sharded learner's LoRA and AdamW state in and out of the single-process formats: checkpoints and adapters are
gathered whole (rank 0 writes exactly what one process writes, so a run can resume with another number of ranks),
and a whole state is cut back into each rank's shards on restore."""

from __future__ import annotations

from pathlib import Path

import torch

from ...models.fsdp import full, local


def _params(optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _map_state(state: dict, params: list, fn) -> dict:
    """The optimizer state dict with `fn(tensor, param)` applied to every per-parameter tensor of param's shape."""
    out = {"param_groups": state["param_groups"], "state": {}}
    for index, values in state["state"].items():
        p = params[index]
        out["state"][index] = {k: fn(v, p) if isinstance(v, torch.Tensor) and v.dim() else v for k, v in values.items()}
    return out


def full_optimizer_state(optimizer) -> dict:
    """Every AdamW moment gathered whole, on the CPU (a collective: every rank calls it)."""
    return _map_state(optimizer.state_dict(), _params(optimizer), lambda v, p: full(v).detach().cpu())


def load_optimizer_shards(learner, state: dict, whole: bool = False) -> None:
    """Load an optimizer state of this rank's shards (`whole`: of whole tensors, cut to this rank's shard here)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = _params(learner.optimizer)

    def to_param(v, p):
        if not isinstance(p, DTensor):
            return v
        if whole:
            return distribute_tensor(v.to(local(p).device), p.device_mesh, p.placements, src_data_rank=None)
        return DTensor.from_local(
            v.to(local(p).device), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )

    learner.optimizer.load_state_dict(_map_state(state, params, to_param))
    learner.optimizer.zero_grad(set_to_none=True)


def full_lora(learner) -> dict:
    """The LoRA weights gathered whole, on the CPU, keyed as the PeftModel's state dict (a collective)."""
    return {n: full(p).detach().cpu() for n, p in learner.trainable_parameters().items()}


def save_full_checkpoint(learner, prompts, config, step: int, path) -> None:
    """Every rank gathers; rank 0 writes the single-process checkpoint format."""
    from ...recovery.checkpoint import save_checkpoint
    from ...runtime import capture_rng, runtime

    me = runtime()
    lora, optimizer = full_lora(learner), full_optimizer_state(learner.optimizer)
    # why every rank's: each rank's CUDA generator is its own GPU's; rank 0's restored on rank 1 samples elsewhere
    rngs = me.gather_objects(capture_rng(me.cuda_indices(config)))
    if me.rank == 0:
        save_checkpoint(
            learner, prompts, config, step, path, lora=lora, optimizer=optimizer, rng={**rngs[0], "ranks": rngs}
        )
    _barrier()  # why: no rank reports done before the files exist


def save_full_adapter(learner, path) -> None:
    from ...files import atomic_write_dir
    from ...runtime import runtime

    lora = full_lora(learner)
    if runtime().rank == 0:

        def write(tmp: Path):
            learner.model.save_pretrained(tmp, state_dict=lora)
            learner.tokenizer.save_pretrained(tmp)

        atomic_write_dir(path, write)
    _barrier()


def restore_full_checkpoint(learner, prompts, path) -> int:
    """A checkpoint of any number of ranks into this rank: its shard of every tensor, RNG states, data position;
    returns the step it continues at."""
    from peft.utils import load_peft_weights
    from torch.distributed.tensor import DTensor, distribute_tensor

    from ...errors import LabError
    from ...recovery.checkpoint import read_checkpoint
    from ...runtime import rank_rng, restore_rng, runtime

    checkpoint = read_checkpoint(path)
    weights = load_peft_weights(str(checkpoint.path / "adapter"), device="cpu")
    params = learner.trainable_parameters()
    names = {n.replace(".default.", "."): n for n in params}  # PEFT saves without the adapter name
    if set(weights) != set(names):
        raise LabError(
            f"checkpoint {str(checkpoint.path)!r}: its LoRA tensors do not match this model's ({len(weights)} "
            f"saved, {len(params)} here); resume with the run's own model and lora settings"
        )
    with torch.no_grad():
        for saved, name in names.items():
            p = params[name]
            value = weights[saved].to(local(p).device, p.dtype)
            if isinstance(p, DTensor):
                value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None).to_local()
            local(p).copy_(value)
    state = checkpoint.load_state()
    load_optimizer_shards(learner, state["optimizer"], whole=True)
    prompts.load_state_dict(state["data"])
    me = runtime()
    restore_rng(rank_rng(state["rng"], me.rank, me.size))
    return checkpoint.step


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
