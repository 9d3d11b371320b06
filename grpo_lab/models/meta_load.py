"""The low-memory sharded load (P3): no rank ever holds the whole model. Every rank builds the model on the
meta device (transformers' config and bitsandbytes layer swap, PEFT on top), then materialises one decoder layer at a
time from the safetensors files, quantized exactly as `from_pretrained` quantizes it (`Params4bit(...).to(device)`,
transformers' Bnb4bitQuantize), replays PEFT's LoRA init for that layer, and `fully_shard`s it at once, so the layer's
whole bytes are freed before the next one is read. The root (embedding, final norm, LM head) is sharded while still
on meta and each rank reads only its own rows of it (`safe_open(...).get_slice`).

Departs from FSDP's "rank 0 loads, broadcasts" recipe: every rank reads the files itself (nothing whole crosses the
wire), and quantizes each layer whole, because bitsandbytes' quant state (absmax, double-quant offset) is per tensor.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from ..errors import LabError
from .fsdp import decoder_layers, finish, mesh_for, shard_unit

READ_BYTES = 4 * 2**20  # the most of a root parameter's rows read at once (its shard is filled block by block)


class Checkpoint:
    """A safetensors checkpoint read lazily, tensor by tensor (one file or an index of shards)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.exists():
            where = json.loads(index.read_text())["weight_map"]
        elif (path / "model.safetensors").exists():
            where = None
        else:
            raise LabError(
                f"model.name_or_path: {path} has no model.safetensors (a sharded learner reads safetensors "
                "layer by layer); save the checkpoint with save_pretrained(safe_serialization=True)"
            )
        files = sorted(set(where.values())) if where else ["model.safetensors"]
        self._files = {name: _open(safe_open, path / name) for name in files}
        self._where = where or {k: "model.safetensors" for k in self._files["model.safetensors"].keys()}

    def _file(self, key: str):
        if key not in self._where:
            raise LabError(
                f"model.name_or_path: the checkpoint has no tensor {key!r}, which this model needs (a "
                "renamed or partial checkpoint); load it once with from_pretrained and save_pretrained it"
            )
        return self._files[self._where[key]]

    def has(self, key: str) -> bool:
        return key in self._where

    def tensor(self, key: str) -> torch.Tensor:
        return self._file(key).get_tensor(key)

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor: only those bytes are read."""
        return self._file(key).get_slice(key)[start:stop]


def _open(safe_open, file: Path):
    """One safetensors file, read with pread: a slice is then only its bytes (with mmap, a slice of the embedding is
    a view of the whole embedding's mapping)."""
    try:
        return safe_open(str(file), framework="pt", device="cpu", backend="pread")
    except TypeError:  # a safetensors without the backend choice (< 0.7): mmap
        return safe_open(str(file), framework="pt", device="cpu")


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """What from_pretrained builds under: new floating tensors (bitsandbytes' meta Linear4bit weights) in `dtype`."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def meta_model(path: Path, dtype: torch.dtype, quantization_config, device: torch.device):
    """The causal LM with every parameter on meta (buffers real, on `device`), 4-bit layers swapped in as
    from_pretrained swaps them (the quantizer's own preprocess/postprocess)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(path)
    quantizer = None
    # why the meta device, not accelerate's init_empty_weights: that one makes each weight on the CPU first and then
    # moves it, so the LM head (the largest tensor) would exist whole for a moment
    with torch.random.fork_rng(devices=[]), _default_dtype(dtype), torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if quantization_config is not None:
            from transformers.quantizers import AutoHfQuantizer

            quantizer = AutoHfQuantizer.from_config(quantization_config, pre_quantized=False)  # quantized here
            quantizer.preprocess_model(model=lm, dtype=dtype, device_map={"": device})
    lm.tie_weights()  # as from_pretrained's finalisation: a tied LM head is the embedding's parameter
    with torch.random.fork_rng(devices=[]):
        for module in lm.modules():  # non-persistent buffers (rotary inv_freq): not in the files; computed as
            if any(b.is_meta for b in module.buffers(recurse=False)):  # from_pretrained computes them
                if any(True for _ in module.parameters(recurse=False)):
                    raise LabError(
                        f"model: {type(module).__name__} holds weights and computed buffers; a sharded "
                        "learner cannot load it layer by layer yet (use placement.learner_procs: 1)"
                    )
                module.to_empty(device=device, recurse=False)
                lm._init_weights(module)
    if quantizer is not None:
        lm.hf_quantizer = quantizer
        quantizer.postprocess_model(lm)
    try:  # as from_pretrained: the checkpoint's generation defaults
        lm.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass
    lm.eval()
    return lm


def _params_by_unit(lm) -> tuple[list[list[tuple]], list[tuple]]:
    """(per decoder layer, root): every distinct parameter as (module, attribute, checkpoint key), recorded before PEFT
    wraps anything (PEFT keeps each original module as its base_layer, so these stay valid)."""
    prefix = lm.base_model_prefix
    per_layer: list[list[tuple]] = [[] for _ in getattr(lm, prefix).layers]
    root: list[tuple] = []
    seen: set[int] = set()
    for name, module in lm.named_modules():
        for attr, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # a tied LM head: the embedding's parameter, read once
                continue
            seen.add(id(param))
            parts = name.split(".")
            in_layer = len(parts) > 2 and parts[:2] == [prefix, "layers"]
            (per_layer[int(parts[2])] if in_layer else root).append((module, attr, f"{name}.{attr}" if name else attr))
    return per_layer, root


def materialise(entries: list[tuple], checkpoint: Checkpoint, device: torch.device) -> None:
    """Read and (4-bit layers) quantize one unit's parameters whole, as from_pretrained does: each tensor cast to its
    meta parameter's dtype, a 4-bit weight made `Params4bit(value, **meta.__dict__).to(device)` (transformers'
    Bnb4bitQuantize), so the nf4 bytes and quant state are the one-process load's."""
    try:
        from bitsandbytes.nn import Params4bit
    except ImportError:
        Params4bit = None
    for module, attr, key in entries:
        empty = getattr(module, attr)
        value = checkpoint.tensor(key).to(device=device, dtype=empty.dtype)
        if Params4bit is not None and isinstance(empty, Params4bit):
            param = Params4bit(value, requires_grad=False, **empty.__dict__).to(device)
        else:
            param = torch.nn.Parameter(value, requires_grad=False)
        del value  # why: a 4-bit weight keeps only its packed bytes; the float copy goes now
        module._parameters[attr] = param


def replay_lora(layer, rng: torch.Tensor, configs: dict) -> torch.Tensor:
    """PEFT's LoRA init of one decoder layer's adapters, drawn from `rng` (torch's CPU generator state), exactly as
    get_peft_model drew them in one process: each LoRA module's `update_layer`, in module order. Returns the state
    after, for the next layer (why: LoRA A must equal one process's with the same seed)."""
    from peft.tuners.lora import LoraLayer

    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(rng)
        for module in layer.modules():
            if isinstance(module, LoraLayer):
                for name in list(module.lora_A.keys()):
                    module.update_layer(name, module.r[name], lora_alpha=module.lora_alpha[name], config=configs[name])
        return torch.get_rng_state()


def _fill_root(root_entries: list[tuple], checkpoint: Checkpoint, device: torch.device) -> None:
    """The root's parameters, already sharded on meta: each rank materialises its local shard and reads only its
    rows from the file (FSDP2's Shard(0): ceil(rows / N) rows per rank, the last rank fewer)."""
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    for module, attr, key in root_entries:
        module.to_empty(device=device, recurse=False)  # this rank's shard only (FSDP2 sharded it on meta)
        param = getattr(module, attr)
        local = param.to_local()
        start = min(rank * -(-param.shape[0] // size), param.shape[0])
        # why in blocks: the rows read whole beside the shard they fill would double the shard for a moment
        step = max(1, READ_BYTES // max(1, local[:1].numel() * local.element_size()))
        with torch.no_grad():
            for at in range(0, local.shape[0], step):
                stop = min(local.shape[0], at + step)
                local[at:stop].copy_(checkpoint.rows(key, start + at, start + stop).to(local.dtype))


def load_sharded(
    path: Path,
    dtype: torch.dtype,
    quantization_config,
    device: torch.device,
    score: Callable,
    wrap: Optional[Callable] = None,
):
    """The model sharded over the default process group, never whole on this rank. `wrap(lm)` adds what one process
    adds before sharding (the log-prob head, PEFT's LoRA, checkpointing) while everything is on meta; it returns the
    model to hand back (a PeftModel, or `lm`). Call with torch's RNG as one process has it right after from_pretrained
    (the seed): LoRA's init is drawn from it and it is left as get_peft_model leaves it."""
    rng = torch.get_rng_state()
    lm = meta_model(path, dtype, quantization_config, device)
    per_layer, root = _params_by_unit(lm)
    with torch.random.fork_rng(devices=[]):  # why: the meta pass's draws are thrown away; replay_lora redraws them
        model = wrap(lm) if wrap is not None else lm
    checkpoint = Checkpoint(path)
    mesh = mesh_for(device)
    layers = decoder_layers(lm)
    for layer, entries in zip(layers, per_layer):
        materialise(entries, checkpoint, device)
        rng = replay_lora(layer, rng, getattr(model, "peft_config", {}))
        shard_unit(layer, mesh)  # why now: this rank keeps its 1/N of the layer; the whole layer is freed here
    shard_unit(lm, mesh)  # the root on meta: nothing whole is ever made of the embedding or the LM head
    _fill_root(root, checkpoint, device)
    left = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if left:  # a LoRA target outside the decoder layers (e.g. the LM head): nothing here reads or draws it
        raise LabError(
            f"lora.target_modules: {left[0]} is outside the decoder layers, which a sharded learner "
            "(placement.learner_procs > 1) loads layer by layer; target the decoder layers' linear layers"
        )
    finish(lm, score)  # the log-prob pass (fsdp.finish)
    torch.set_rng_state(rng)  # where get_peft_model leaves one process's generator
    return model
