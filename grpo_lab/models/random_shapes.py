"""Built-in random-weight models of real 7-8B shapes (`builtin:qwen3-8b-random`, `...:layers=2`), for measuring memory
and speed where they depend on shape alone, with no model hub and no disk write. The shape is the real model's
config.json (bundled in models/configs/); the weights are drawn from a seed on the target device, layer by layer,
each linear layer quantized to nf4 as soon as it is drawn, so no 16-bit copy of the model is ever whole in memory.
The tokenizer is the tiny models' (models/tiny.py), built in memory: ids past it decode to nothing.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Optional

from ..errors import LabError
from .bundled import BUNDLED, bundled_name

BUILTIN = "builtin:"
# name -> the real model whose config.json gives the shape
RANDOM_SHAPES = {
    "qwen2.5-7b-random": "Qwen/Qwen2.5-7B-Instruct",
    "qwen3-8b-random": "Qwen/Qwen3-8B",
    "llama3.1-8b-random": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen3-30b-a3b-random": "Qwen/Qwen3-30B-A3B",  # a mixture of experts: its experts drawn and quantized a layer each
}
# why: a random-weight model has no trained context limit; the frontier runs past the real models' 32K-40K
LONGEST_POSITION = 262_144


@dataclass(frozen=True)
class RandomShape:
    name: str  # e.g. qwen3-8b-random
    hub_id: str  # the real model it has the shape of
    layers: Optional[int]  # None: the real model's number of layers

    def hf_config(self) -> dict:
        """The real config.json, with `layers` decoder layers."""
        config = json.loads((BUNDLED / f"{bundled_name(self.hub_id)}.json").read_text())
        if self.layers is not None:
            config["num_hidden_layers"] = self.layers
            config.pop("max_window_layers", None)
        config["max_position_embeddings"] = max(config.get("max_position_embeddings", 0), LONGEST_POSITION)
        return config


def parse_random(name_or_path: str) -> Optional[RandomShape]:
    """`builtin:NAME-random[:layers=N]` as a RandomShape; None for anything else; a malformed one is a LabError."""
    if not name_or_path.startswith(BUILTIN):
        return None
    from .tiny import BUILTINS

    name, _, option = name_or_path.removeprefix(BUILTIN).partition(":")
    if name in BUILTINS or not name.endswith("-random"):
        return None  # tiny.py's checkpoints (tiny-random, qwen2.5-0.5b-random, ...), or an unknown name it refuses
    if name not in RANDOM_SHAPES:
        raise LabError(
            f"model.name_or_path: unknown built-in shape {name_or_path!r}; use one of "
            f"{[BUILTIN + n for n in RANDOM_SHAPES]} (optionally with ':layers=N')"
        )
    layers = None
    if option:
        key, _, value = option.partition("=")
        if key != "layers" or not value.isdigit() or int(value) < 1:
            raise LabError(
                f"model.name_or_path: {name_or_path!r} has option {option!r}; the only option is ':layers=N' "
                f"with N >= 1, e.g. {BUILTIN}{name}:layers=2"
            )
        layers = int(value)
    return RandomShape(name, RANDOM_SHAPES[name], layers)


@functools.lru_cache(maxsize=1)
def random_tokenizer():
    """The tiny models' BPE tokenizer, trained in memory (about a second), once per process."""
    from .tiny import _train_tokenizer

    return _train_tokenizer(384, seed=0)


def build_random(shape: RandomShape, device: str, seed: int, dtype, quantization=None, experts_4bit: bool = True):
    """The model of `shape` on `device` with weights drawn from `seed` in `dtype`, quantized by `quantization` (a
    BitsAndBytesConfig, through transformers' own bitsandbytes quantizer; None: not quantized); the same seed on the
    same device gives the same bytes. `experts_4bit=False`: a mixture of experts' fused experts stay in `dtype`, as
    transformers' bitsandbytes load leaves them (it quantizes nn.Linear only): the model TRL trains from a checkpoint
    (bench/gpu/trl_side.py)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = shape.hf_config()
    tokenizer = random_tokenizer()
    raw.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    config = AutoConfig.for_model(**raw)
    with torch.device("meta"):  # why: the skeleton holds no bytes; each weight is drawn straight on `device`
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    quantizer = None
    if quantization is not None:
        from transformers.quantizers import AutoHfQuantizer

        quantizer = AutoHfQuantizer.from_config(quantization, pre_quantized=False)
        quantizer.preprocess_model(model, dtype=dtype, device_map={"": device})  # Linear -> bnb Linear4bit (meta)
    draw = torch.Generator(device=device).manual_seed(seed)
    for module_name, module in list(model.named_modules()):
        for leaf, param in list(module.named_parameters(recurse=False)):
            module._parameters[leaf] = _drawn(param, leaf, module_name, config, dtype, device, draw)
        if quantization is not None and experts_4bit:  # why here: one layer's experts in 16-bit at a time
            from .experts import quantize_experts

            quantize_experts(module, quantization, recurse=False)
    _rebuild_rotary(model, device)
    if quantizer is not None:
        quantizer.postprocess_model(model)  # is_loaded_in_4bit, config.quantization_config: as from_pretrained
        model.hf_quantizer = quantizer
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise LabError(f"model.name_or_path: builtin:{shape.name} left {left[:3]} unbuilt; report this as a bug")
    return model.eval()


def _drawn(param, leaf: str, module_name: str, config, dtype, device: str, draw):
    """One parameter on `device`: norms 1, biases 0, weights N(0, initializer_range); a 4-bit weight is drawn in 16-bit
    and quantized at once (why: one linear layer's 16-bit bytes at a time, never a whole layer's or model's)."""
    import torch

    shape = tuple(param.shape)  # a meta Params4bit not yet quantized has the dense shape
    if "norm" in module_name.rsplit(".", 1)[-1]:
        value = torch.ones(shape, dtype=dtype, device=device)
    elif leaf == "bias":
        value = torch.zeros(shape, dtype=dtype, device=device)
    else:
        value = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, config.initializer_range, generator=draw)
    if type(param).__name__ == "Params4bit":
        import bitsandbytes as bnb

        # as transformers' Bnb4bitQuantize: the meta Params4bit's settings, quantized on `device`
        return bnb.nn.Params4bit(value, requires_grad=False, **param.__dict__).to(device)
    return torch.nn.Parameter(value, requires_grad=False)


def _rebuild_rotary(model, device: str) -> None:
    """The rotary embedding's inverse frequencies are a buffer computed at construction: on meta, so recompute them."""
    import torch

    for name, module in list(model.named_modules()):
        if name.endswith("rotary_emb"):
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            with torch.device(device):  # why: its constructor's signature differs between transformers versions
                setattr(parent, name.rsplit(".", 1)[-1], type(module)(config=model.config))
