"""FSDP2 (`torch.distributed.fsdp.fully_shard`) over grpo_lab's 4-bit LoRA learner, as docs/fsdp2.md found it works
with the bitsandbytes we ship: every decoder layer its own FSDP unit, the transformers model under PEFT the root
(its forward runs at every decoding step, so generate() needs no registration), bitsandbytes' default uint8
storage (FSDP2 shards each parameter on dim 0: no flat parameter, so no storage-dtype match is needed), no
mixed-precision policy. The reference copy is prepared by the same function (P5); the generation gather (P3) is
a context manager that restores everything it changed in its `finally`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from ..errors import LabError
from .failed_pass import agreed, reset_after_failure

SCORE = "grpo_lab_score"  # the transformers model's method a log-prob pass runs through (registered with FSDP)
WHOLE_GATHERS = [0]  # rollouts this process generated with every FSDP unit gathered whole (gather_for_generation)


def _causal_lm(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model) -> list:
    """The decoder layers of a causal LM (or of the one under a PEFT wrapper)."""
    lm = _causal_lm(model)
    return list(getattr(lm, lm.base_model_prefix).layers)


def shard(model, device: torch.device, score):
    """Shard `model` (a PeftModel or a bare causal LM) in place over the default process group; returns it. `score` is
    the log-prob pass (algo/logprobs.score_completions), registered with FSDP as a forward of its own."""
    mesh = mesh_for(device)
    lm = _causal_lm(model)
    for layer in decoder_layers(lm):
        shard_unit(layer, mesh)  # why per layer: one layer whole at a time
    shard_unit(lm, mesh)  # the root owns the embedding, final norm and LM head (tied or not)
    finish(lm, score)
    return model


def mesh_for(device: torch.device):
    """A 1-D mesh over every rank of the default process group, on `device`'s type."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def shard_unit(module, mesh):
    """`fully_shard` one unit (a decoder layer, or the root after its layers) with grpo_lab's gradient reduction."""
    from torch.distributed.fsdp import fully_shard

    unit = fully_shard(module, mesh=mesh)
    # why a sum: each rank's loss is its rows' share of the whole batch's loss (normalised by the whole batch's
    # totals), so the whole batch's gradient is the sum over ranks, not FSDP's default mean
    unit.set_gradient_divide_factor(1.0)
    unit.set_force_sum_reduction_for_comms(True)  # why: gloo has no PREMUL_SUM (the op a custom factor picks)
    return unit


def finish(lm, score) -> None:
    """After the root is sharded: the log-prob pass `score(lm, ...)` registered with FSDP and the root's settings made
    final."""
    from types import MethodType

    from torch.distributed.fsdp import register_fsdp_forward_method

    setattr(lm, SCORE, MethodType(score, lm))
    register_fsdp_forward_method(lm, SCORE)  # why: a log-prob pass calls the backbone and the head, not forward()
    # why now: the root's settings (no reshard after forward) are final before any pass
    lm._get_fsdp_state()._lazy_init()


def fsdp_units(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model) -> bool:
    return bool(fsdp_units(model))


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as it is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_state(state):
    """An optimizer state dict with every DTensor as its local shard (plain tensors: picklable, comparable)."""
    if isinstance(state, torch.Tensor):
        return local(state).detach().clone()
    if isinstance(state, dict):
        return {k: local_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(local_state(v) for v in state)
    return state


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole on every rank (a collective; a plain tensor as it is)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def layout(model) -> dict:
    """What the generation context must leave as it found it: per FSDP unit its reshard-after-forward setting and
    whether its parameters are sharded now, the train/eval mode and gradient checkpointing."""
    return {
        "training": model.training,
        "modules_training": sum(m.training for m in model.modules()),
        "gradient_checkpointing": [(on, func is not None) for on, func in _checkpointing(model).values()],
        "reshard_after_forward": [
            (auto, tuple(info is not None for info in infos))
            for auto, infos in map(_reshard_after_forward, fsdp_units(model))
        ],
        "sharded": [_params_sharded(u) for u in fsdp_units(model)],
        # a pass left open (an exception mid-forward, no reset): the next root pre-forward would skip its set-up
        "iteration_open": any(u._get_fsdp_state()._state_ctx.iter_forward_root is not None for u in fsdp_units(model)),
    }


def base_placements(model) -> dict:
    """Every base (non-LoRA) parameter's sharding, by its name in the base model: a DTensor's placements, or
    'whole'. The reference copy's must equal the policy's (P5: prepared by the same function)."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" not in name:
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            out[name] = str(tuple(p.placements)) if hasattr(p, "placements") else "whole"
    return out


def _reshard_after_forward(unit) -> tuple:
    """The unit's reshard-after-forward state exactly (FSDP keeps it per parameter group, plus an 'auto' flag)."""
    state = unit._get_fsdp_state()
    return state._auto_reshard_after_forward, tuple(g.post_forward_mesh_info for g in state._fsdp_param_groups)


def _set_reshard_after_forward(unit, saved: tuple) -> None:
    state = unit._get_fsdp_state()
    state._auto_reshard_after_forward = saved[0]
    for group, info in zip(state._fsdp_param_groups, saved[1]):
        group.post_forward_mesh_info = info


def _params_sharded(unit) -> bool:
    from torch.distributed.tensor import DTensor

    direct = [p for p in unit.parameters(recurse=False)]
    own = direct or [p for name, p in unit.named_parameters() if "." not in name]
    return all(isinstance(p, DTensor) for p in own)


@contextmanager
def generation(model, gather: bool) -> Iterator[None]:
    """The model set up for a rollout, exactly once, and put back in `finally` (also when generation raises):
    eval mode (KV cache on, checkpointing inactive), and on a sharded model with `gather` every FSDP unit's
    full parameters gathered for the whole generate (fast; needs room for the whole model), else one layer
    gathered per forward (slow; fits). P3's lessons: yield exactly once; restore reshard state, gradient
    checkpointing and mode whatever happens."""
    units = fsdp_units(model)
    before_mode = {m: m.training for m in model.modules()}
    checkpointing = _checkpointing(model)
    reshard = [_reshard_after_forward(u) for u in units]
    failed = False
    model.eval()
    try:
        if gather and units:
            WHOLE_GATHERS[0] += 1  # what inspect() reports: which way this rank's rollouts ran
            for unit in units:
                unit.set_reshard_after_forward(
                    False, recurse=False
                )  # why: a forward would reshard after itself otherwise
                unit.unshard()
        yield
    except BaseException:
        failed = True
        raise
    finally:
        if failed:
            reset_after_failure(model)
        for unit, saved in zip(units, reshard):
            unit.reshard()
            _set_reshard_after_forward(unit, saved)
        for module, (on, func) in checkpointing.items():  # P3's later reports: checkpointing left off after an OOM
            module.gradient_checkpointing = on
            if func is not None:
                module._gradient_checkpointing_func = func
        for module, mode in before_mode.items():
            module.training = mode


def _checkpointing(model) -> dict:
    """Every module's gradient-checkpointing switch and function, as transformers set them."""
    return {
        m: (m.gradient_checkpointing, getattr(m, "_gradient_checkpointing_func", None))
        for m in model.modules()
        if hasattr(m, "gradient_checkpointing")
    }


def check_reference_devices(model, compute: torch.device, where: str = "reference") -> None:
    """P5: every parameter and buffer of a reference must sit on the policy's compute device type; one line if not
    (TRL's FSDP path once left the reference on the CPU with the policy on CUDA)."""
    from torch.distributed.tensor import DTensor

    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        device = t.to_local().device if isinstance(t, DTensor) else t.device
        if device.type != compute.type:
            raise LabError(
                f"{where}: {name} is on {device.type}, the policy computes on {compute.type} (P5: a reference "
                "not prepared like the policy); use reference.strategy: adapter-disabled, or 'copy', which "
                "grpo_lab loads and shards like the policy"
            )


class FSDP:
    """The executor contract's `Sharding` (execution/contract.py) over FSDP2: what the algorithm and the generator
    ask of a learner that may be sharded, each the identity (or the plain eval-mode set-up) on a model no rank
    shares. An executor hands it to the learner it loads (Learner.sharding)."""

    agreed = staticmethod(agreed)  # a pass that, failing on any rank, fails on every rank, FSDP reset
    full = staticmethod(full)  # a tensor whole on every rank
    local = staticmethod(local)  # this rank's shard of a tensor
    generation = staticmethod(generation)  # the model set up for a rollout, gathered whole or layer by layer
