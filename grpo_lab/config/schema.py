"""The one typed config behind the notebook, the CLI, the widget editor and papermill.

Sections mirror the parts of a GRPO run. Knobs TRL also has keep TRL's names
(`num_generations`, `beta`, `loss_type`, `epsilon`, `scale_rewards`, ...), so a TRL
user feels at home. Unknown keys are errors; every field carries its own help text.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator, model_validator

from ..checks.roles import check_roles
from .fields import (WHEN, Section, apply_overrides, canonical, knob, normalize_device,  # noqa: F401 (WHEN)
                            resolve_aliases)
from ..algo.prompts import SYSTEM_PROMPT
from ..errors import ConfigError, format_validation_error
from ..generation.registry import BACKENDS, OWN_WEIGHTS
from ..algo.losses import LOSSES, RATIO_LEVELS
from ..algo.rewards import REWARDS

Dtype = Literal["bfloat16", "float16", "float32"]
Share = Annotated[float, Field(gt=0, le=1)]
class ModelSection(Section):
    name_or_path: str = knob("load", ..., description="Local checkpoint directory (or hub id) loaded with from_pretrained.")
    dtype: Dtype = knob("load", "bfloat16", description="Dtype of the weights that are not quantized (embeddings, norms, LoRA).")
    load_in_4bit: bool = knob("load", True, description="Quantize the learner's base to 4-bit with bitsandbytes (QLoRA).")
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = knob("load", "nf4", description="4-bit data type; nf4 is the QLoRA default.")
    bnb_4bit_compute_dtype: Dtype = knob("load", "bfloat16", description="Dtype the 4-bit layers compute in.")
    bnb_4bit_use_double_quant: bool = knob("load", True, description="Also quantize the quantization constants (~0.4 bit/param saved).")
    gradient_checkpointing: bool = knob("load", True, description="Recompute activations in backward instead of storing them.")


class LoraSection(Section):
    r: int = knob("load", 16, gt=0, description="LoRA rank.")
    lora_alpha: int = knob("load", 32, gt=0, description="LoRA scaling numerator (scale = lora_alpha / r).")
    lora_dropout: float = knob("load", 0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: Union[Literal["all-linear"], list[str]] = knob("load", 
        "all-linear", description="Module names to adapt, or 'all-linear' for every linear layer but the LM head.")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _targets(cls, v):
        if isinstance(v, (list, tuple)) and not v:
            raise ValueError("empty list; name at least one module (e.g. [q_proj, v_proj]) or use 'all-linear'")
        if v != "all-linear" and not isinstance(v, (list, tuple)):
            raise ValueError(f"got {v!r}; use 'all-linear' or a list of module names, e.g. [q_proj, v_proj]")
        return v


class PlacementSection(Section):
    learner: str = knob("load", "cpu", description="Device of the learner (policy + LoRA + optimizer): 'cpu' or 'cuda:N'.")
    generator: Optional[list[str]] = knob("load", 
        None, description="Generator device(s); null = the learner's device (colocated). GPU indices or 'cuda:N'.")
    optimizer_offload: bool = knob("load", 
        False, description="Keep AdamW's fp32 master weights and moments in host RAM (frees 12 bytes per LoRA parameter on the GPU).")
    gpu_memory_gib: Optional[float] = knob("load", 
        None, gt=0, description="GPU capacity (GiB) the planner assumes for GPUs it cannot see (e.g. 40 for an A100-40GB); null = read the device.")
    host_memory_gib: Optional[float] = knob("load", 
        None, gt=0, description="Host RAM (GiB) the planner assumes; null = this machine's (or its cgroup limit).")
    learner_procs: int = knob("load", 1, ge=1, le=64, description="Processes the learner is sharded over with FSDP2 "
        "(PyTorch's fully_shard), one device each: rank k on cuda:(N+k) for learner cuda:N (NCCL), or CPU processes "
        "(gloo) for learner cpu; 1 = no sharding, one process.")
    ray_address: Optional[str] = knob("load", None, description="Sharded learner: the Ray cluster its ranks run on, "
        "'host:port' of its head (`ray start --head`) or 'auto'; null = a Ray on this machine, started by the Lab.")

    @field_validator("learner", mode="before")
    @classmethod
    def _learner(cls, v):
        return normalize_device(v)

    @field_validator("generator", mode="before")
    @classmethod
    def _generator(cls, v):
        if v is None:
            return None
        items = v if isinstance(v, (list, tuple)) else [v]
        if not items:
            raise ValueError("empty list; give at least one device or null for the learner's device")
        return [normalize_device(d) for d in items]

    def generator_devices(self) -> list[str]:
        return self.generator or [self.learner]


class GeneratorSection(Section):
    backend: Literal[tuple(BACKENDS)] = knob("load", "hf", description="Generator backend: " + ", ".join(BACKENDS) + " (hf = transformers.generate with the learner itself).")
    temperature: float = knob("live", 1.0, ge=0.0, description="Sampling temperature; 0 = greedy decoding. Read at the rollout; that rollout's log-probs are taken at the temperature it was sampled at.")
    top_p: float = knob("live", 1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = knob("live", 0, ge=0, description="Top-k sampling; 0 = off.")
    max_prompt_length: int = knob("live", 256, gt=0, description="Prompts longer than this are truncated from the left.")
    max_completion_length: int = knob("live", 64, gt=0, description="Maximum new tokens per completion.")
    chunk_size: Optional[int] = knob("live", 
        None, gt=0, description="Sequences (prompts x completions) per generate call; null = all at once.")
    gpu_memory_utilization: Union[Literal["auto"], Share, None] = knob("load", None, description="Share of its GPU a "
        "generator with its own weights (vllm) may take; required when it shares the learner's GPU: a number, or auto = "
        "the largest share that leaves the learner's planned peak room (grpo-lab plan prints it); null = 0.9 on a GPU of its own.")
    model: Optional[str] = knob("load", None, description="Checkpoint the generator loads (e.g. an int4 AWQ copy); null = the learner's base. Backends with their own weights only.")
    quantization: Optional[Literal["awq", "gptq", "compressed-tensors", "fp8"]] = knob("load", 
        None, description="Weight format of generator.model; null = the model dtype. Backends with their own weights only.")
    @field_validator("gpu_memory_utilization", mode="before")
    @classmethod
    def _share(cls, v):   # why: one line for a bad share, not one per member of the union
        if v is None or v == "auto" or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1):
            return v
        raise ValueError(f"got {v!r}; give a share of the GPU in (0, 1], or auto")

    sleep_mode: bool = knob("load", False, description="Colocated vllm on a GPU: sleep between rollouts, freeing its weights and KV cache for the learner (not on CPU).")
    gather_for_generation: bool = knob("live", True, description="Sharded learner (placement.learner_procs > 1), "
        "hf backend: gather the full weights on every rank for the rollout (fast; needs room for the whole model, the "
        "planner says how much) or generate through the sharded model, one layer gathered at a time (slow; fits) (P3).")
    cpu_kv_cache_gib: int = knob("load", 1, ge=1, description="vllm on the CPU: host RAM (whole GiB) for its KV cache.")

    @property
    def own_weights(self) -> bool:
        """Whether the backend holds its own copy of the weights (vllm), and so a memory share of its GPU and an adapter
        to sync; hf samples with the learner itself."""
        return self.backend in OWN_WEIGHTS


class GRPOSection(Section):
    num_generations: int = knob("live", 8, ge=2, description="Completions per prompt (the group size G); needs >= 2 for an advantage.")
    prompts_per_step: int = knob("live", 4, ge=1, description="Distinct prompts per step; the batch is prompts_per_step x num_generations.")
    beta: float = knob("rebuild", 0.0, ge=0.0, description="KL coefficient to the reference policy; 0 = no reference needed.")
    loss_type: Literal[tuple(LOSSES)] = knob("live", "dapo", description="Loss normalisation: " + ", ".join(LOSSES) + ".")
    epsilon: float = knob("live", 0.2, gt=0.0, description="Lower clip range of the importance ratio.")
    epsilon_high: Optional[float] = knob("live", None, gt=0.0, description="Upper clip range; null = epsilon (DAPO uses 0.28).")
    scale_rewards: Literal["group", "batch", "none"] = knob("live", 
        "group", description="Divide advantages by the group's std, the batch's std, or not at all (Dr. GRPO).")
    learning_rate: float = knob("live", 1e-5, gt=0.0, description="AdamW learning rate for the LoRA parameters.")
    weight_decay: float = knob("live", 0.0, ge=0.0, description="AdamW weight decay.")
    max_grad_norm: float = knob("live", 1.0, gt=0.0, description="Gradient clipping norm.")
    micro_batch_size: Optional[int] = knob("live", 
        None, gt=0, description="Sequences per log-prob/backward forward pass; null = the whole batch at once.")
    logprob_chunk_size: int = knob("live", 128, ge=1, le=65536, description="Completion tokens per chunk of the log-prob "
                                   "head: at most this many rows of [tokens x vocab] logits exist at once, forward or backward.")
    logprob_head: Literal["chunked", "trl"] = knob("live", "chunked", description="Log-prob head kernel: 'chunked' "
                                                   "(grpo_lab's, recomputes each chunk in backward) or 'trl' (TRL's fused head; Triton on CUDA).")
    num_iterations: int = knob("live", 1, ge=1, description="Optimizer updates per rollout (TRL's mu); >1 computes old log-probs.")
    use_bias_correction_kl: bool = knob("live", True, description="Multiply the KL term by the importance ratio "
        "learner/old, so its gradient is the unbiased reverse-KL gradient (DeepSeek-V3.2; TRL's use_bias_correction_kl, "
        "on by default): changes the KL gradient whenever beta > 0, on-policy too.")
    mask_truncated_completions: bool = knob("live", False, description="Exclude completions that hit max_completion_length from the loss.")
    importance_sampling_level: Literal[tuple(RATIO_LEVELS)] = knob("live", "token", description="Where the PPO ratio "
        "learner/old is taken and clipped: 'token' (GRPO) or 'sequence' (GSPO: the mean of a completion's token "
        "log-ratios, one ratio per completion; pair it with loss_type grpo, as the paper does) (TRL's name).")
    importance_sampling_correction: bool = knob("live", 
        True, description="Correct for a generator that samples from other weights than the learner's (backends with their own "
        "weights, e.g. vllm; hf samples with the learner itself, so it never applies): weight the loss by learner/sampler "
        "probability as importance_sampling_mode says (TRL's vllm_importance_sampling_correction).")
    importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = knob("live", 
        "sequence_mask", description="token_* weigh each token by its own ratio, sequence_* each completion by the product "
        "over its tokens; *_truncate clips the ratio to [clip_min, clip_max], *_mask zeroes ratios outside it (TRL's "
        "vllm_importance_sampling_mode).")
    importance_sampling_clip_max: Optional[float] = knob("live", 
        3.0, gt=0, description="Upper bound C_max of the importance-sampling ratio; null = none (TRL's vllm_importance_sampling_clip_max).")
    importance_sampling_clip_min: Optional[float] = knob("live", 
        None, ge=0, description="Lower bound C_min of the importance-sampling ratio; null = none (TRL's vllm_importance_sampling_clip_min).")


class ReferenceSection(Section):
    strategy: Optional[Literal["none", "adapter-disabled", "copy"]] = knob("rebuild", 
        None, description="Reference policy: 'adapter-disabled' (no extra memory), 'copy' (frozen model), 'none' (beta must be 0); null = auto.")
    device: Optional[str] = knob("load", None, description="Device for strategy 'copy'; null = the learner's device.")

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, v):
        return None if v is None else normalize_device(v)


class MemorySection(Section):
    sample_hz: float = knob("rebuild", 20.0, ge=0.0, le=1000.0, description="Memory sampler rate; 0 = only at phase starts and ends.")
    host_threshold: float = knob("rebuild", 0.95, gt=0.0, le=1.0, description="Host RAM used/limit fraction at which the run stops between phases.")
    leak_window: int = knob("rebuild", 5, ge=2, description="Steps over which steadily rising after-step memory is flagged as a leak.")
    leak_min_growth_mib: float = knob("rebuild", 4.0, gt=0.0, description="Mean growth per step (MiB) below which a rise is noise, not a leak.")
    host_mmap_threshold_mib: Optional[float] = knob("load", None, ge=0.125, le=32.0, description="Pin glibc's mmap "
        "threshold at load (whole process): host blocks of this size (MiB) or more are mapped on their own and given "
        "back when freed, so host RSS follows the live tensors, as planned, instead of keeping heap holes; 0.125 is "
        "what the planner's CPU grid was measured with. Costs page faults: CPU steps 1.2-2.5x slower "
        "(bench/mmap_threshold_step.py). null = glibc's own, which rises up to 32 MiB (the plan adds the head's holes).")
    cuda_snapshots: bool = knob("load", False, description="Record a CUDA allocator snapshot per phase (for pytorch.org/memory_viz); CUDA only.")


class DataSection(Section):
    dataset: str = knob("rebuild", "arithmetic", description="'arithmetic' (built-in word problems) or a path to a JSONL file with 'prompt' and 'answer'.")
    num_prompts: int = knob("rebuild", 512, ge=1, le=100_000, description="Size of the built-in arithmetic set (made in memory at load; at most 100000).")
    system_prompt: Optional[str] = knob("rebuild", SYSTEM_PROMPT,
        description="System message prepended to every prompt; null = none.")
    rewards: list[str] = knob("rebuild", 
        default_factory=lambda: ["exact_answer", "format"],
        description="Reward functions: names from " + ", ".join(REWARDS) + ", or 'module:function'.")
    reward_weights: Optional[list[float]] = knob("live", None, description="One weight per reward function; null = all 1.")

    @field_validator("rewards")
    @classmethod
    def _rewards(cls, v):
        if not v:
            raise ValueError("empty list; name at least one reward function")
        for name in v:
            if name not in REWARDS and ":" not in name:
                raise ValueError(f"unknown reward {name!r}; use one of {sorted(REWARDS)} or 'module:function'")
        return v


class RunSection(Section):
    steps: int = knob("live", 10, ge=1, description="GRPO steps to run.")
    seed: int = knob("load", 0, ge=0, lt=2 ** 32, description="Seed for data order, sampling and LoRA init (0 <= seed < 2**32).")
    output_dir: Optional[str] = knob("load", None, description="Run directory; null = runs/<date-time>.")
    save_every: int = knob("live", 1, ge=0, description="Checkpoint (adapter, optimizer, RNG states, data position) every N "
                           "steps and at the end; a killed run resumes from the last one (grpo-lab run --resume DIR); "
                           "0 = only at the end.")
    probe_first: bool = knob("load", False, description="Probe the worst case at load (lab.probe(): longest prompt, "
                             "full-length completions, full micro-batches), print it beside the plan, and refuse to "
                             "start when it does not fit; nothing the probe changed is kept.")
    report_to: list[str] = knob("load", default_factory=list, description="Trackers that get each step's metrics and "
                                "per-phase memory peaks (TRL's name): tensorboard, trackio, wandb (offline); 'all' = every "
                                "installed one; [] or 'none' = none. Each is an extra: pip install 'grpo-lab[NAME]'.")

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to(cls, v):
        from ..checks.installed import resolve_trackers

        return resolve_trackers(v)


def _at(data: dict, path: str):
    """data['section']['field'] for 'section.field'."""
    section, _, name = path.partition(".")
    return data[section][name]


class LabConfig(Section):
    model: ModelSection
    lora: LoraSection = Field(default_factory=LoraSection)
    placement: PlacementSection = Field(default_factory=PlacementSection)
    generator: GeneratorSection = Field(default_factory=GeneratorSection)
    grpo: GRPOSection = Field(default_factory=GRPOSection)
    reference: ReferenceSection = Field(default_factory=ReferenceSection)
    memory: MemorySection = Field(default_factory=MemorySection)
    data: DataSection = Field(default_factory=DataSection)
    run: RunSection = Field(default_factory=RunSection)

    _guard: Any = PrivateAttr(None)   # a loaded Lab's edit guard: check(changes) before, apply(changes) after an update

    def attach_guard(self, guard) -> None:
        """A loaded Lab's edit guard (config/edits.py): from now on every edit is checked against what was built."""
        self._guard = guard

    def detach_guard(self) -> None:
        """Nothing loaded is left to protect: the config is a plain config again."""
        self._guard = None

    def model_post_init(self, context: Any) -> None:
        for name in type(self).model_fields:
            section = self.__dict__[name]
            section._root, section._name = self, name

    def __setattr__(self, name: str, value: Any) -> None:
        if name in type(self).model_fields:   # a whole section: every field of it, through update
            data = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
            if not isinstance(data, dict):
                raise ConfigError(f"{name}: got {value!r}; assign a {name} section (a mapping of its fields)")
            fields = type(self).model_fields[name].annotation.model_fields
            defaults = {k: f.get_default(call_default_factory=True) for k, f in fields.items() if not f.is_required()}
            self.update({f"{name}.{k}": v for k, v in {**defaults, **data}.items()})   # the section replaced, as pydantic does
        else:
            super().__setattr__(name, value)

    def model_copy(self, *, update: Optional[dict] = None, deep: bool = False) -> "LabConfig":
        """A deep copy (sections are never shared between two configs: each belongs to one root), unguarded."""
        guard, self._guard = self._guard, None   # why: the guard holds loaded models (threads, locks): never copied
        try:
            copy = super().model_copy(update=update, deep=True)
        finally:
            self._guard = guard
        copy.model_post_init(None)
        return copy

    def update(self, changes: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
        """Apply 'section.field' -> value edits all at once: validated with every cross-field check, then
        (when a loaded Lab guards this config) checked and applied by it; all or nothing. Returns
        {path: (old, new)} of the values that changed. The one path every way of editing takes."""
        data = self.to_dict()
        changes = {canonical(str(path)): value for path, value in changes.items()}
        for path, value in changes.items():
            section, _, name = str(path).partition(".")
            fields = type(self).model_fields
            if section not in fields or name not in fields[section].annotation.model_fields:
                raise ConfigError(f"{path}: unknown field; fields look like grpo.beta (see README 'Config reference')")
            data[section][name] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        try:
            new = parse_config(data)
        except ConfigError:
            if self._guard is not None:   # an edit that can never apply after load says so, not what else is wrong
                before = self.to_dict()
                self._guard.refuse_fixed([p for p in map(str, changes) if _at(data, p) != _at(before, p)])
            raise
        changed = {path: (getattr(getattr(self, s), f), getattr(getattr(new, s), f)) for path, s, f in leaf_fields()
                   if getattr(getattr(self, s), f) != getattr(getattr(new, s), f)}
        if not changed:
            return changed
        if self._guard is not None:
            self._guard.check(self, new, changed)
        saved = {path: old for path, (old, _) in changed.items()}
        self._write({path: new_value for path, (_, new_value) in changed.items()})
        if self._guard is not None:
            try:
                self._guard.apply(self, changed)
            except BaseException:
                self._write(saved)   # why: all or nothing; a rebuild that failed leaves the old values in force
                raise
        return changed

    def assign(self, other: "LabConfig") -> dict[str, tuple[Any, Any]]:
        """Take every field of `other` through `update` (only those that differ change; a loaded Lab refuses
        load-time ones): what assigning `lab.config` and loading a YAML into the editor do."""
        data = other.to_dict()
        return self.update({path: data[s][f] for path, s, f in leaf_fields()})

    def _write(self, values: dict[str, Any]) -> None:
        for path, value in values.items():
            section, _, name = path.partition(".")
            target = self.__dict__[section]
            target.__dict__[name] = value   # why not setattr: the values were validated together above
            target.__pydantic_fields_set__.add(name)

    @model_validator(mode="after")
    def _cross_checks(self):
        ref = self.reference
        if ref.strategy == "none" and self.grpo.beta > 0:
            raise ValueError(f"reference.strategy: 'none' needs grpo.beta = 0 (got {self.grpo.beta}); "
                             "set beta: 0 or strategy: adapter-disabled")
        check_roles(self)
        weights = self.data.reward_weights
        if weights is not None and len(weights) != len(self.data.rewards):
            raise ValueError(f"data.reward_weights: {len(weights)} weights for {len(self.data.rewards)} rewards; give one per reward")
        g = self.grpo
        lo, hi = g.importance_sampling_clip_min, g.importance_sampling_clip_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"grpo.importance_sampling_clip_min: {lo} is not below importance_sampling_clip_max = {hi}; "
                             "lower it or raise the max")
        if g.importance_sampling_mode.endswith("_truncate") and lo is None and hi is None:
            raise ValueError(f"grpo.importance_sampling_clip_max: mode {g.importance_sampling_mode} needs a bound to clip "
                             "to; set importance_sampling_clip_max (TRL's default is 3.0)")
        if self.data.dataset == "arithmetic" and self.grpo.prompts_per_step > self.data.num_prompts:
            raise ValueError(f"grpo.prompts_per_step: {self.grpo.prompts_per_step} distinct prompts per step, but the arithmetic "
                             f"set has data.num_prompts = {self.data.num_prompts}; lower it or raise data.num_prompts")
        return self

    @property
    def reference_strategy(self) -> str:
        """reference.strategy with null resolved: adapter-disabled when beta > 0 (a free reference with LoRA), else none."""
        if self.reference.strategy is not None:
            return self.reference.strategy
        return "adapter-disabled" if self.grpo.beta > 0 else "none"

    @property
    def reference_device(self) -> str:
        """Where a reference copy lives: reference.device, else the learner's device."""
        return self.reference.device or self.placement.learner

    @property
    def epsilon_high(self) -> float:
        return self.grpo.epsilon_high if self.grpo.epsilon_high is not None else self.grpo.epsilon

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")


def leaf_fields() -> list[tuple[str, str, str]]:
    """Every leaf field as ('section.field', section, field), in schema order."""
    return [(f"{s}.{f}", s, f) for s, info in LabConfig.model_fields.items() for f in info.annotation.model_fields]


def field_when(path: str) -> str:
    """When a change of 'section.field' takes effect: 'live', 'rebuild' or 'load' (see WHEN)."""
    section, _, name = path.partition(".")
    info = LabConfig.model_fields[section].annotation.model_fields[name]
    return (info.json_schema_extra or {})["when"]


def parse_config(data: dict) -> LabConfig:
    """Validate a plain dict into a LabConfig; errors become one ConfigError naming the fields."""
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(data).__name__}")
    try:
        return LabConfig.model_validate(resolve_aliases(data))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
