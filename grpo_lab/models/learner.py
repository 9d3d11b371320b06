"""The learner: a (4-bit nf4) base loaded with `from_pretrained`, PEFT LoRA on top, AdamW over
the LoRA parameters only. Departs from TRL/PEFT's `prepare_model_for_kbit_training`: it does
not upcast every non-quantized weight to float32 (that doubles embedding memory on large vocabularies).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..algo.logprobs import add_logprob_head, score_completions
from ..errors import LabError
from ..memory.heap import trim_before_each_layer
from .fsdp import FSDP, decoder_layers
from .offload import HostAdamW
from .quant import pin_training_layout, quiet_bitsandbytes
from .resident import hold_in_memory
from .source import check_model_path, require_files, resolve_model_path

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Learner:
    model: torch.nn.Module  # PeftModel over the (4-bit) base
    tokenizer: object
    device: torch.device
    optimizer: torch.optim.Optimizer
    # what the algorithm and the generator ask of a learner that may be sharded: its executor's (execution/contract.py)
    sharding: object = field(default_factory=FSDP)

    def trainable_parameters(self) -> dict[str, torch.Tensor]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    from .random_shapes import parse_random, random_tokenizer

    # a built-in random shape has no files: the tiny models' tokenizer, built in memory (a copy: callers may set it)
    tok = copy.deepcopy(random_tokenizer()) if parse_random(path) else AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"  # why: generation appends after the prompt, so prompts are right-aligned
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def quantization_config(model_cfg):
    """The BitsAndBytesConfig of `model`'s 4-bit fields (None when not load_in_4bit)."""
    if not model_cfg.load_in_4bit:
        return None
    # why before the import: every 4-bit load (a Lab's, a rank's, TRL's side of a comparison) comes through here
    quiet_bitsandbytes()
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise LabError(
            "model.load_in_4bit needs bitsandbytes (a grpo-lab dependency): pip install bitsandbytes, "
            "or set model.load_in_4bit: false"
        ) from None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=model_cfg.bnb_4bit_quant_type,
        bnb_4bit_compute_dtype=_DTYPES[model_cfg.bnb_4bit_compute_dtype],
        bnb_4bit_use_double_quant=model_cfg.bnb_4bit_use_double_quant,
    )


def load_base(model_cfg, device: str, seed: int = 0):
    """The base model on `device`, nf4-quantized when `load_in_4bit`; frozen. On a sharded rank, already sharded
    (loaded layer by layer: models/meta_load.py); prepare_like_policy then leaves it as it is. A built-in random
    shape is drawn from `seed` on `device` (models/random_shapes.py)."""

    from .random_shapes import build_random, parse_random

    if runtime_is_rank():
        return load_sharded_base(model_cfg, device)
    path = check_model_path(model_cfg.name_or_path)
    random = parse_random(path)
    if random:
        quant = quantization_config(model_cfg)
        model = build_random(random, device, seed, _DTYPES[model_cfg.dtype], quant)
    elif model_cfg.load_in_4bit and experts_checkpoint(path):  # why: from_pretrained reads every expert in 16-bit
        from .experts import load_experts_checkpoint

        model = load_experts_checkpoint(path, model_cfg, device, quantization_config(model_cfg))
    else:
        model = _from_pretrained(path, model_cfg, device)
        if model_cfg.load_in_4bit:  # why: bitsandbytes' 4-bit load leaves a mixture of experts' experts in 16-bit
            from .experts import quantize_experts

            quantize_experts(model, model_cfg)
    if model_cfg.load_in_4bit:  # why: a forward dequantizes only the experts its tokens route to
        from .routed_experts import use_routed_experts

        # why redequantize without checkpointing: autograd would keep every layer's dequantized experts for backward
        use_routed_experts(model, redequantize=not model_cfg.gradient_checkpointing)
    # why: bnb's AVX-512-BF16 repack on eval/no-grad forwards breaks the next training forward
    pin_training_layout(model)
    model.requires_grad_(False)
    model.config.use_cache = False  # why: training forwards never reuse a KV cache; generate() turns it back on
    return model


def experts_checkpoint(path: str) -> bool:
    """Whether the checkpoint at `path` is a mixture of experts the lab reads (its config.json)."""
    from .experts import read_by_layer
    from .shapes import read_model_config

    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    hf_config = read_model_config(config, "model.name_or_path")
    return read_by_layer(hf_config.get("text_config", hf_config))


def _from_pretrained(path: str, model_cfg, device: str):
    """The checkpoint at `path` on `device` (nf4-quantized when `load_in_4bit`), its load errors as one LabError."""
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=_DTYPES[model_cfg.dtype], device_map={"": device})
    if model_cfg.load_in_4bit:
        kwargs["quantization_config"] = quantization_config(model_cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as err:
        raise LabError(
            f"model.name_or_path: cannot load {model_cfg.name_or_path!r} "
            f"({str(err).splitlines()[0]}); give a local checkpoint directory"
        ) from None
    # why: transformers' ValueError for a config.json it cannot use (e.g. an unknown model_type)
    except ValueError as err:
        raise LabError(
            f"model.name_or_path: cannot load {model_cfg.name_or_path!r} "
            f"({(str(err).strip().splitlines() or ['ValueError'])[0][:300]}); give a checkpoint transformers "
            "can load with AutoModelForCausalLM"
        ) from None
    return model


def load_learner(config, sharding=None) -> Learner:
    """The learner of `config` on this process's device; `sharding`: the executor's `Sharding` (default FSDP2's)."""
    device = learner_device(config)
    torch.manual_seed(config.run.seed)  # why here: LoRA A's random init must be reproducible
    if runtime_is_rank():
        model = load_sharded_learner(config, device)
    else:
        model = add_lora(load_base(config.model, device, config.run.seed), config)
        prepare_like_policy(model, device)
        hold_in_memory(model)  # why: the plan counts the weights resident from load, not from the first forward
    if device == "cpu" and config.memory.host_mmap_threshold_mib is None:  # why: heap.trim_before_each_layer
        trim_before_each_layer(decoder_layers(model))
    params = [p for p in model.parameters() if p.requires_grad]  # after sharding: FSDP2 replaced them with DTensors
    adamw = HostAdamW if config.placement.optimizer_offload else torch.optim.AdamW
    optimizer = adamw(params, lr=config.grpo.learning_rate, weight_decay=config.grpo.weight_decay)
    return Learner(
        model=model,
        tokenizer=load_tokenizer(resolve_model_path(config.model.name_or_path)),
        device=torch.device(device),
        optimizer=optimizer,
        sharding=FSDP() if sharding is None else sharding,
    )


def add_lora(base, config):
    """The log-prob head, PEFT's LoRA and gradient checkpointing on `base` (on meta too: a sharded load adds them
    before any weight is read)."""
    from peft import LoraConfig, get_peft_model

    from .expert_lora import expert_lora_kwargs, mend_expert_wrappers, quiet_expert_ranks

    # before PEFT wraps it, as TRL requires; each pass sets its rollout's temperature
    add_logprob_head(base, autocast=autocast_dtype(config.model, learner_device(config)))
    lora = config.lora
    experts = expert_lora_kwargs(base, lora)  # lora.target_experts: the fused experts as target_parameters
    try:
        peft_config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.lora_alpha,
            lora_dropout=lora.lora_dropout,
            target_modules=moe_linear_targets(base, lora.target_modules),
            task_type="CAUSAL_LM",
            **experts,
        )
        with quiet_expert_ranks():
            model = get_peft_model(base, peft_config)
    except ValueError as err:  # why: PEFT's ValueError for targets that match no module or an unsupported one
        raise lora_target_error(base, lora.target_modules, err) from None
    mend_expert_wrappers(model)  # why: PEFT's expert adapters over bitsandbytes' 4-bit experts (models/expert_lora.py)
    if config.model.gradient_checkpointing:
        # why: non-reentrant checkpointing needs no grad-requiring inputs, so the frozen embeddings stay as they are
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.model.activation_offload:  # why: the layer inputs checkpointing keeps wait on the host (P2 at length)
        from .activation_offload import attach

        attach(model, learner_device(config))
    return model


def moe_linear_targets(base, targets):
    """LoRA's targets as asked, but on a mixture of experts all-linear spelled out as the model's own nn.Linear
    modules (attention, a shared expert's MLP; not the LM head, not a router). Why: on transformers 5 PEFT maps
    all-linear on such a model to its routers and fused experts as target_parameters (v4's nn.Linear names): an
    adapter on a router moves which experts every token reaches; the experts are adapted when lora.target_experts
    asks (models/expert_lora.py)."""
    from .experts import has_experts

    if targets != "all-linear" or not has_experts(base):
        return targets
    head = base.get_output_embeddings()
    linear = [
        name
        for name, m in base.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not head and not name.endswith(("mlp.gate", "shared_expert_gate"))
    ]
    return linear


def load_sharded_learner(config, device: str):
    """A rank's learner, never whole on it (models/meta_load.py): the same model as one process's, sharded
    with FSDP2."""
    return load_sharded_base(config.model, device, lambda base: add_lora(base, config))


def load_sharded_base(model_cfg, device: str, wrap=None):
    """load_base's model on a rank, built on meta and sharded layer by layer as it is read; `wrap` (PEFT) is applied
    on meta, before any weight is read."""
    from .meta_load import load_sharded

    require_files(model_cfg.name_or_path, "a sharded learner's ranks (each reads its shard from the files)")
    path = Path(check_model_path(model_cfg.name_or_path))
    if not path.is_dir():  # a hub id: its files from the hub cache (downloaded there if not yet)
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"]))

    def prepare(base):
        pin_training_layout(base)  # as load_base (set on the meta modules; the attribute is what counts)
        base.requires_grad_(False)
        base.config.use_cache = False  # as load_base
        return wrap(base) if wrap is not None else base

    return load_sharded(
        path, _DTYPES[model_cfg.dtype], quantization_config(model_cfg), torch.device(device), score_completions, prepare
    )


def runtime_is_rank() -> bool:
    from ..runtime import runtime

    return runtime().is_rank


def autocast_dtype(model_cfg, device: str):
    """The dtype the learner's forward passes autocast to: its 16-bit compute dtype on a GPU (as TRL's, under
    accelerate's mixed precision), else None. Why: without autocast PEFT casts every LoRA layer's input to the
    adapters' float32 and backward keeps those copies (H100, Qwen2.5-0.5B's shape, 8 x 1,152 tokens: grpo_lab's
    backward peak 1.20x TRL's); on the CPU PEFT upcasts them whatever autocast says (it reads CUDA's state only)."""
    compute = model_cfg.bnb_4bit_compute_dtype if model_cfg.load_in_4bit else model_cfg.dtype
    if not str(device).startswith("cuda") or compute == "float32":
        return None
    return _DTYPES[compute]


def learner_device(config) -> str:
    """This process's learner device (the runtime's answer: placement.learner, or a sharded rank's own)."""
    from ..runtime import runtime

    return runtime().device(config)


def prepare_like_policy(model, device: str) -> None:
    """What every model the learner computes with goes through: on a sharded rank, FSDP2 over the ranks (P5: the
    reference copy too, so it lands where the policy is)."""
    from ..runtime import runtime

    if runtime().is_rank:
        from .fsdp import is_sharded, shard

        if not is_sharded(model):  # load_base on a rank shards as it loads
            shard(model, torch.device(device), score_completions)


def lora_target_error(base: torch.nn.Module, targets, err: Exception) -> LabError:
    """lora.target_modules that PEFT refused, as one line listing the names it can adapt."""
    names = sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in base.named_modules()
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and name
        }
    )
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return LabError(
        f"lora.target_modules: {targets!r} cannot be adapted ({reason[:200]}); "
        f"use 'all-linear' or names of this model's layers, e.g. {', '.join(names[:10])}"
    )


def save_adapter(learner: Learner, path: str | Path) -> Path:
    """Write the LoRA adapter (and tokenizer) atomically: a crash never leaves a half-written checkpoint."""
    from ..files import atomic_write_dir

    def write(tmp: Path):
        learner.model.save_pretrained(tmp)
        learner.tokenizer.save_pretrained(tmp)

    return atomic_write_dir(path, write)
