"""The config's sections for the models a run loads and the devices they sit on: model, lora, placement and generator
(training.py has the other five; schema.py joins the nine into the one LabConfig). Knobs TRL also has keep
TRL's names (`num_generations`, `beta`, `loss_type`, `epsilon`, `scale_rewards`, ...), so a TRL user feels at home.
Unknown keys are errors; every field carries its own help text.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from ..generation.registry import BACKENDS, OWN_WEIGHTS
from .fields import Section, knob, normalize_device
from .turn_help import TOOL_RESPONSE_HELP, TURN_CACHE_HELP

Dtype = Literal["bfloat16", "float16", "float32"]
Share = Annotated[float, Field(gt=0, le=1)]


class ModelSection(Section):
    name_or_path: str = knob(
        "load", ..., planned=True, description="Local checkpoint directory (or hub id) loaded with from_pretrained."
    )
    dtype: Dtype = knob(
        "load",
        "bfloat16",
        planned=True,
        description="Dtype of the weights that are not quantized (embeddings, norms, LoRA).",
    )
    load_in_4bit: bool = knob(
        "load", True, planned=True, description="Quantize the learner's base to 4-bit with bitsandbytes (QLoRA)."
    )
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = knob(
        "load", "nf4", planned=True, description="4-bit data type; nf4 is the QLoRA default."
    )
    bnb_4bit_compute_dtype: Dtype = knob(
        "load", "bfloat16", planned=True, description="Dtype the 4-bit layers compute in."
    )
    bnb_4bit_use_double_quant: bool = knob(
        "load", True, planned=True, description="Also quantize the quantization constants (~0.4 bit/param saved)."
    )
    gradient_checkpointing: bool = knob(
        "load", True, planned=True, description="Recompute activations in backward instead of storing them."
    )
    activation_offload: bool = knob(
        "load",
        False,
        cuda_only=True,
        planned=True,
        description="Keep the checkpointed layer inputs in pinned host memory, brought back a layer ahead of "
        "backward (long completions on one GPU); needs gradient_checkpointing.",
    )
    chat_template: Optional[str] = knob(
        "load",
        None,
        description="The chat template prompts and tool calls are rendered with: null = the tokenizer's own; "
        "trl:NAME = one TRL ships (trl/chat_templates/NAME.jinja, e.g. trl:qwen2_5, which can run tools); or a path "
        "to a .jinja file.",
    )

    @model_validator(mode="after")
    def _offload_needs_checkpointing(self):
        if self.activation_offload and not self.gradient_checkpointing:
            raise ValueError(
                "activation_offload offloads the checkpointed layer inputs, and gradient_checkpointing is off; "
                "set model.gradient_checkpointing: true or model.activation_offload: false"
            )
        return self


class LoraSection(Section):
    r: int = knob("load", 16, gt=0, planned=True, description="LoRA rank.")
    lora_alpha: int = knob("load", 32, gt=0, description="LoRA scaling numerator (scale = lora_alpha / r).")
    lora_dropout: float = knob("load", 0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: Union[Literal["all-linear"], list[str]] = knob(
        "load",
        "all-linear",
        planned=True,
        description="Module names to adapt, or 'all-linear' for every linear layer but the LM head.",
    )
    target_experts: bool = knob(
        "load", False, planned=True, description="Adapt a mixture of experts' fused experts too: an adapter per expert."
    )
    expert_r: Optional[int] = knob(
        "load", None, gt=0, planned=True, description="Each expert's LoRA rank with target_experts (null = r)."
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _targets(cls, v):
        if isinstance(v, (list, tuple)) and not v:
            raise ValueError("empty list; name at least one module (e.g. [q_proj, v_proj]) or use 'all-linear'")
        if v != "all-linear" and not isinstance(v, (list, tuple)):
            raise ValueError(f"got {v!r}; use 'all-linear' or a list of module names, e.g. [q_proj, v_proj]")
        return v


class PlacementSection(Section):
    learner: str = knob(
        "load", "cpu", planned=True, description="Device of the learner (policy + LoRA + optimizer): 'cpu' or 'cuda:N'."
    )
    generator: Optional[list[str]] = knob(
        "load",
        None,
        planned=True,
        description="Generator device(s); null = the learner's device (colocated). GPU indices or 'cuda:N'.",
    )
    optimizer_offload: bool = knob(
        "load",
        False,
        cuda_only=True,
        planned=True,
        description="Keep AdamW's fp32 master weights and moments in host RAM (frees 12 bytes per LoRA parameter on "
        "the GPU).",
    )
    gpu_memory_gib: Optional[float] = knob(
        "load",
        None,
        cuda_only=True,
        gt=0,
        planned=True,
        description="GPU capacity (GiB) the planner assumes for GPUs it cannot see (e.g. 40 for an A100-40GB); null = "
        "read the device.",
    )
    host_memory_gib: Optional[float] = knob(
        "load",
        None,
        gt=0,
        planned=True,
        description="Host RAM (GiB) for this Lab: the planner plans against it and, when it is below this "
        "machine's RAM, the host guard and the live plot hold the Lab's processes (RSS) to it, as a cgroup limit "
        "would; null = this machine's (or its cgroup limit).",
    )
    host_limit: Literal["budget", "cgroup"] = knob(
        "load",
        "budget",
        description="Who holds placement.host_memory_gib: 'budget' = the host guard alone (the Lab's RSS); 'cgroup' = "
        "the kernel too: the Lab's process in a fresh memory cgroup that kills it there, the guard reading what the "
        "kernel counts (needs root and a memory controller).",
    )
    learner_procs: int = knob(
        "load",
        1,
        ge=1,
        le=64,
        planned=True,
        description="Processes the learner is sharded over with FSDP2 "
        "(PyTorch's fully_shard), one device each: rank k on cuda:(N+k) for learner cuda:N (NCCL), or CPU processes "
        "(gloo) for learner cpu; 1 = no sharding, one process.",
    )
    rank_memory_gib: Optional[float] = knob(
        "load",
        None,
        gt=0,
        planned=True,
        description="Sharded learner (placement.learner_procs > 1): the memory (GiB) each rank process may hold, "
        "planned per rank and held by that rank itself. CPU ranks: the rank's own RSS; its guard fails a phase whose "
        "peak crosses memory.host_threshold of it, and every rank undoes that phase. GPU ranks: the rank's GPU; its "
        "CUDA allocator is capped there, so an allocation past it is an out-of-memory error. null = no per-rank "
        "budget (the driver's guard holds the machine's RAM for all).",
    )
    ray_address: Optional[str] = knob(
        "load",
        None,
        planned=True,  # a Ray on this machine: the plan names the line its memory monitor kills a rank at
        description="Sharded learner: the Ray cluster its ranks run on, "
        "'host:port' of its head (`ray start --head`) or 'auto'; null = a Ray on this machine, started by the Lab.",
    )
    reward_model: Optional[str] = knob(
        "load",
        None,
        planned=True,
        description="Device of the reward models (data.reward_models, and sequence classifiers passed in "
        "reward_funcs); null = the learner's device.",
    )
    reward_model_4bit: bool = knob(
        "load",
        False,
        planned=True,
        description="Load the reward models in 4-bit with bitsandbytes (model.bnb_4bit_* settings); false = in "
        "model.dtype.",
    )

    @field_validator("learner", mode="before")
    @classmethod
    def _learner(cls, v):
        return normalize_device(v)

    @field_validator("reward_model", mode="before")
    @classmethod
    def _reward_model(cls, v):
        return None if v is None else normalize_device(v)

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

    def reward_model_device(self) -> str:
        return self.reward_model or self.learner


class GeneratorSection(Section):
    backend: Literal[tuple(BACKENDS)] = knob(
        "load",
        "hf",
        planned=True,
        description="Generator backend: "
        + ", ".join(BACKENDS)
        + " (hf = transformers.generate with the learner itself; synthetic = no sampling, fixed full-length "
        "completions: the learner's worst case, for memory frontiers).",
    )
    temperature: float = knob(
        "live",
        1.0,
        ge=0.0,
        description="Sampling temperature; 0 = greedy decoding. Read at the rollout; that rollout's log-probs are "
        "taken at the temperature it was sampled at.",
    )
    top_p: float = knob("live", 1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = knob("live", 0, ge=0, description="Top-k sampling; 0 = off.")
    max_prompt_length: int = knob(
        "live", 256, gt=0, planned=True, description="Prompts longer than this are truncated from the left."
    )
    max_completion_length: int = knob(
        "live",
        64,
        gt=0,
        planned=True,
        description="Maximum new tokens per completion; with tools, the whole trajectory's budget, tool results "
        "included (a tool result that would pass it is left out and the row ends).",
    )
    max_tool_calling_iterations: int = knob(
        "live",
        5,
        ge=0,
        planned=True,
        strict=True,
        description="With tools (Lab(tools=...)): the most tool-calling rounds a completion gets after its first "
        "turn (TRL's name); 0 = tools are rendered into the prompt but never called.",
    )
    max_tool_response_tokens: Optional[int] = knob("live", None, gt=0, planned=True, description=TOOL_RESPONSE_HELP)
    tools: list[str] = knob(
        "load",
        default_factory=list,
        planned=True,
        description="Tools the model may call, each as 'module:function' (plain functions with type hints and a "
        "docstring, sync or async; TRL's tools); Lab(tools=[...]) takes the functions instead. Needs a chat template "
        "that renders tools (model.chat_template).",
    )
    environment_factory: Optional[str] = knob(
        "load",
        None,
        planned=True,
        description="An environment class as 'module:Class' (TRL's environment_factory: one instance per rollout row, "
        "reset(**row) starts it, its public methods are the row's tools, an optional get_reward() is a reward); "
        "Lab(environment_factory=...) takes the class, or a dict of them, instead; null = none.",
    )
    tool_timeout_s: float = knob(
        "live",
        30.0,
        gt=0.0,
        description="With tools: seconds a tool call may take; one that does not return in time gets an error "
        "result and the rollout goes on (a hung synchronous tool's thread is left behind).",
    )
    chunk_size: Optional[int] = knob(
        "live",
        None,
        gt=0,
        planned=True,
        description="Sequences (prompts x completions) per generate call; null = all at once.",
    )
    gpu_memory_utilization: Union[Literal["auto"], Share, None] = knob(
        "load",
        None,
        cuda_only=True,
        planned=True,
        description="Share of its GPU a "
        "generator with its own weights (vllm) may take; required when it shares the learner's GPU: a number, or auto "
        "= "
        "the largest share that leaves the learner's planned peak room (grpo-lab plan prints it); null = 0.9 on a GPU "
        "of its own.",
    )
    model: Optional[str] = knob(
        "load",
        None,
        description="Checkpoint the generator loads (e.g. an int4 AWQ copy); null = the learner's base. Backends with "
        "their own weights only.",
    )
    quantization: Optional[Literal["awq", "gptq", "compressed-tensors", "fp8"]] = knob(
        "load",
        None,
        planned=True,
        description="Weight format of generator.model; null = the model dtype. Backends with their own weights only.",
    )

    @field_validator("tools", "environment_factory")
    @classmethod
    def _import_paths(cls, v):
        for spec in [v] if isinstance(v, str) else v or []:
            if ":" not in spec.strip(":"):
                raise ValueError(f"got {spec!r}; name it as 'module:name' (e.g. my_tools:calculator)")
        return v

    @field_validator("gpu_memory_utilization", mode="before")
    @classmethod
    def _share(cls, v):  # why: one line for a bad share, not one per member of the union
        if v is None or v == "auto" or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1):
            return v
        raise ValueError(f"got {v!r}; give a share of the GPU in (0, 1], or auto")

    sleep_mode: bool = knob(
        "load",
        False,
        cuda_only=True,
        planned=True,
        description="Colocated vllm on a GPU: sleep between rollouts, freeing its weights and KV cache for the learner "
        "(not on CPU).",
    )
    gather_for_generation: bool = knob(
        "live",
        True,
        planned=True,
        description="Sharded learner (placement.learner_procs > 1), "
        "hf backend: gather the full weights on every rank for the rollout (fast; needs room for the whole model, the "
        "planner says how much) or generate through the sharded model, one layer gathered at a time (slow; fits) (P3).",
    )
    cpu_kv_cache_gib: int = knob(
        "load", 1, ge=1, planned=True, description="vllm on the CPU: host RAM (whole GiB) for its KV cache."
    )
    hf_decode: Literal["dynamic", "static", "compiled", "merged", "auto"] = knob(
        "live",
        "dynamic",
        planned=True,
        description="hf backend: how the rollout decodes. dynamic = transformers' growing KV cache; static = the cache "
        "preallocated for the whole rollout (fixed shapes); compiled = static plus CUDA graphs over the 4-bit + LoRA "
        "decode step (torch.compile, mode reduce-overhead; a GPU learner only; the first rollout compiles); merged = "
        "a rollout copy: every 4-bit + LoRA linear dequantized to the compute dtype with the LoRA merged in (W + BA), "
        "one per Lab, refreshed at each rollout, kept or released between rollouts (generator.rollout_copy; planned; "
        "no 4-bit dequantization or LoRA wrapper per token; on a GPU its decode step runs as CUDA graphs too); auto "
        "= merged where the plan fits the copy, else compiled on a GPU, else dynamic (the plan and the run say "
        "which). Greedy decoding gives the same tokens on every path.",
    )
    rollout_copy: Literal["auto", "keep", "release"] = knob(
        "live",
        "auto",
        planned=True,
        description="hf backend, generator.hf_decode merged (or auto resolved to it): keep = the rollout copy (and on "
        "a GPU its StaticCache) stays on the learner's device for the whole step, each rollout writing the fresh "
        "merge into its storage, so from rollout 2 on every weight and the cache keep their addresses (CUDA graphs "
        "replay; planned resident); release = its weights given back after each rollout (planned in the rollout "
        "only; on a GPU a CUDA graph recording per rollout, which the step's metrics say); auto = keep where the "
        "plan fits it, else release (the plan says which).",
    )
    drop_finished_rows: bool = knob(
        "live",
        False,
        description="hf backend, decoding with the growing cache (hf_decode dynamic, or merged / auto on a CPU "
        "learner): finished rows leave the batch at bucket boundaries (once at most half the rows are unfinished, then "
        "a quarter...), their KV cache dropped, so a group whose completions mostly ended stops paying for full width; "
        "each row keeps its own sampling stream, so its tokens are the same. Refused where the cache is static.",
    )
    turn_cache: Literal["keep", "prefill"] = knob("live", "keep", planned=True, description=TURN_CACHE_HELP)
    park_learner: bool = knob(
        "live",
        False,
        planned=True,
        description="hf backend, generator.hf_decode merged (or auto resolved to it): while the rollout copy decodes, "
        "the learner's 4-bit base, LoRA and AdamW state wait in host memory (pinned, from a GPU) and come back bit for "
        "bit after it, also when the rollout raises, so the copy and its KV cache have the card (planned on both "
        "sides; on a CPU learner it frees nothing). Refused with another decode path.",
    )

    @property
    def own_weights(self) -> bool:
        """Whether the backend holds its own copy of the weights (vllm), and so a memory share of its GPU and an adapter
        to sync; hf samples with the learner itself."""
        return self.backend in OWN_WEIGHTS
