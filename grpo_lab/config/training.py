"""The config's sections for how a run trains, reads its data and is watched: grpo (TRL's names), reference, memory,
data and run (schema.py joins them with models_and_devices.py's sections into the one LabConfig).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import field_validator

from ..algo.losses import LOSSES, RATIO_LEVELS
from ..algo.rewards import REWARDS, TRL_REWARDS
from .fields import Section, knob, normalize_device


class GRPOSection(Section):
    num_generations: int = knob(
        "live",
        8,
        ge=2,
        planned=True,
        description="Completions per prompt (the group size G); needs >= 2 for an advantage.",
    )
    prompts_per_step: int = knob(
        "live",
        4,
        ge=1,
        planned=True,
        description="Distinct prompts per step; the batch is prompts_per_step x num_generations.",
    )
    beta: float = knob(
        "rebuild",
        0.0,
        ge=0.0,
        planned=True,
        description="KL coefficient to the reference policy; 0 = no reference needed.",
    )
    loss_type: Literal[tuple(LOSSES)] = knob(
        "live", "dapo", description="Loss normalisation: " + ", ".join(LOSSES) + "."
    )
    epsilon: float = knob("live", 0.2, gt=0.0, description="Lower clip range of the importance ratio.")
    epsilon_high: Optional[float] = knob(
        "live", None, gt=0.0, description="Upper clip range; null = epsilon (DAPO uses 0.28)."
    )
    scale_rewards: Literal["group", "batch", "none"] = knob(
        "live", "group", description="Divide advantages by the group's std, the batch's std, or not at all (Dr. GRPO)."
    )
    learning_rate: float = knob("live", 1e-5, gt=0.0, description="AdamW learning rate for the LoRA parameters.")
    weight_decay: float = knob("live", 0.0, ge=0.0, description="AdamW weight decay.")
    max_grad_norm: float = knob("live", 1.0, gt=0.0, description="Gradient clipping norm.")
    micro_batch_size: Optional[int] = knob(
        "live",
        None,
        gt=0,
        planned=True,
        description="Sequences per log-prob/backward forward pass, and per reward-model scoring forward; null = the "
        "whole batch at once.",
    )
    logprob_chunk_size: int = knob(
        "live",
        128,
        ge=1,
        le=65536,
        planned=True,
        description="Completion tokens per chunk of the log-prob "
        "head: at most this many rows of [tokens x vocab] logits exist at once, forward or backward.",
    )
    logprob_head: Literal["chunked", "trl", "full"] = knob(
        "live",
        "chunked",
        planned=True,
        description="Log-prob head kernel: 'chunked' "
        "(grpo_lab's, recomputes each chunk in backward), 'trl' (TRL's fused head; Triton on CUDA) or 'full' (the "
        "textbook pass: all [tokens, vocab] logits at once in float32, kept for backward; for comparison).",
    )
    num_iterations: int = knob(
        "live", 1, ge=1, description="Optimizer updates per rollout (TRL's mu); >1 computes old log-probs."
    )
    use_bias_correction_kl: bool = knob(
        "live",
        True,
        description="Multiply the KL term by the importance ratio "
        "learner/old, so its gradient is the unbiased reverse-KL gradient (DeepSeek-V3.2; TRL's "
        "use_bias_correction_kl, "
        "on by default): changes the KL gradient whenever beta > 0, on-policy too.",
    )
    mask_truncated_completions: bool = knob(
        "live", False, description="Exclude completions that hit max_completion_length from the loss."
    )
    importance_sampling_level: Literal[tuple(RATIO_LEVELS)] = knob(
        "live",
        "token",
        description="Where the PPO ratio "
        "learner/old is taken and clipped: 'token' (GRPO) or 'sequence' (GSPO: the mean of a completion's token "
        "log-ratios, one ratio per completion; pair it with loss_type grpo, as the paper does) (TRL's name).",
    )
    importance_sampling_correction: bool = knob(
        "live",
        True,
        description="Correct for a generator that samples from other weights than the learner's (backends with their "
        "own "
        "weights, e.g. vllm; hf samples with the learner itself, so it never applies): weight the loss by "
        "learner/sampler "
        "probability as importance_sampling_mode says (TRL's vllm_importance_sampling_correction).",
    )
    importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = knob(
        "live",
        "sequence_mask",
        description="token_* weigh each token by its own ratio, sequence_* each completion by the product "
        "over its tokens; *_truncate clips the ratio to [clip_min, clip_max], *_mask zeroes ratios outside it (TRL's "
        "vllm_importance_sampling_mode).",
    )
    importance_sampling_clip_max: Optional[float] = knob(
        "live",
        3.0,
        gt=0,
        description="Upper bound C_max of the importance-sampling ratio; null = none (TRL's "
        "vllm_importance_sampling_clip_max).",
    )
    importance_sampling_clip_min: Optional[float] = knob(
        "live",
        None,
        ge=0,
        description="Lower bound C_min of the importance-sampling ratio; null = none (TRL's "
        "vllm_importance_sampling_clip_min).",
    )


class MemorySection(Section):
    sample_hz: float = knob(
        "rebuild", 20.0, ge=0.0, le=1000.0, description="Memory sampler rate; 0 = only at phase starts and ends."
    )
    host_threshold: float = knob(
        "rebuild",
        0.95,
        gt=0.0,
        le=1.0,
        planned=True,
        description="Host RAM used/limit fraction at which the guard stops a phase and undoes the step; the plan "
        "judges host RAM against the same line.",
    )
    leak_window: int = knob(
        "rebuild", 5, ge=2, description="Steps over which steadily rising after-step memory is flagged as a leak."
    )
    leak_min_growth_mib: float = knob(
        "rebuild",
        4.0,
        gt=0.0,
        description="Growth per step (MiB; the window's mean and median) below which a rise is noise, not a leak.",
    )

    @field_validator("host_threshold", mode="before")
    @classmethod
    def _a_share_of_the_limit(cls, v):
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not 0 < v <= 1:
            raise ValueError(f"got {v}; the share of the host limit the guard stops a phase at is in (0, 1], e.g. 0.95")
        return v

    host_mmap_threshold_mib: Optional[float] = knob(
        "load",
        None,
        ge=0.125,
        le=32.0,
        planned=True,
        description="Pin glibc's mmap "
        "threshold at load (whole process): host blocks of this size (MiB) or more are mapped on their own and given "
        "back when freed, so host RSS follows the live tensors, as planned, instead of keeping heap holes; 0.125 is "
        "what the planner's CPU grid was measured with. Costs page faults: CPU steps 1.2-2.5x slower "
        "(bench/plan_accuracy/mmap_threshold_step.py). null = glibc's own, which rises up to 32 MiB (the log-prob head "
        "and the rollout's recorder hold their buffers, so leave no holes; a CPU learner trims the heap before each "
        "layer's full-sequence forward).",
    )
    cuda_expandable_segments: bool = knob(
        "load",
        True,
        cuda_only=True,
        description="Let torch's CUDA caching allocator grow segments in place (expandable_segments) from load on, "
        "unless PYTORCH_CUDA_ALLOC_CONF already sets it: at long completions its cached-but-free blocks otherwise "
        "fragment (H200, Qwen3-8B's shape at 32K tokens under 24 GiB: out of memory with 20 GiB allocated and 4 GiB "
        "cached; with it, a 22.6 GiB peak fit). CUDA learners only.",
    )
    cuda_snapshots: bool = knob(
        "load",
        False,
        cuda_only=True,
        description="Record a CUDA allocator snapshot per phase (for pytorch.org/memory_viz); CUDA only.",
    )


class DataSection(Section):
    dataset: str = knob(
        "rebuild",
        "arithmetic",
        description="'arithmetic' (built-in word problems), a local file or folder datasets.load_dataset reads "
        "(JSON lines, Parquet, CSV, Arrow, a save_to_disk folder), or a hub id (openai/gsm8k); rows need a 'prompt' "
        "(text or chat messages), other columns reach the rewards. The Lab's train_dataset= takes a Dataset instead.",
    )
    dataset_config: Optional[str] = knob(
        "rebuild", None, description="The hub dataset's configuration (load_dataset's name, e.g. 'main'); null = none."
    )
    split: str = knob(
        "rebuild", "train", description="The split to train on, of a hub dataset, a folder or a DatasetDict given."
    )
    streaming: bool = knob(
        "rebuild",
        False,
        description="Stream the dataset (load_dataset(streaming=True)): rows read as drawn, shuffled in a "
        "1,000-row buffer, never all in memory; prompts are planned from the first 256 rows.",
    )
    num_prompts: int = knob(
        "rebuild",
        512,
        ge=1,
        le=100_000,
        description="Size of the built-in arithmetic set (made in memory at load; at most 100000).",
    )
    system_prompt: Optional[str] = knob(
        "rebuild",
        None,
        description="A system message for every prompt, in place of the dataset's own; null = the prompts as the "
        "dataset has them (the built-in set's carry their own instruction).",
    )
    rewards: list[str] = knob(
        "rebuild",
        default_factory=lambda: ["exact_answer", "format"],
        description="Reward functions: names from " + ", ".join([*REWARDS, *TRL_REWARDS]) + " (TRL's, as its "
        "`trl grpo` script names them), or 'module:function'.",
    )
    reward_weights: Optional[list[float]] = knob(
        "live", None, description="One weight per reward function; null = all 1."
    )
    reward_models: list[str] = knob(
        "rebuild",
        default_factory=list,
        planned=True,
        description="Reward models scored after the reward functions, as TRL scores a sequence classifier: "
        "checkpoint paths, hub ids or builtin:tiny-reward; each loaded on placement.reward_model.",
    )

    @field_validator("rewards")
    @classmethod
    def _rewards(cls, v):
        if not v:
            raise ValueError("empty list; name at least one reward function")
        for name in v:
            if name not in REWARDS and name not in TRL_REWARDS and ":" not in name:
                raise ValueError(
                    f"unknown reward {name!r}; use one of {sorted([*REWARDS, *TRL_REWARDS])} or 'module:function'"
                )
        return v


class RunSection(Section):
    steps: int = knob("live", 10, ge=1, description="GRPO steps to run.")
    seed: int = knob(
        "load", 0, ge=0, lt=2**32, description="Seed for data order, sampling and LoRA init (0 <= seed < 2**32)."
    )
    output_dir: Optional[str] = knob("load", None, description="Run directory; null = runs/<date-time>.")
    save_every: int = knob(
        "live",
        1,
        ge=0,
        description="Checkpoint (adapter, optimizer, RNG states, data position) every N "
        "steps and at the end; a killed run resumes from the last one (grpo-lab run --resume DIR); "
        "0 = only at the end.",
    )
    probe_first: bool = knob(
        "load",
        False,
        description="Probe the worst case at load (lab.probe(): longest prompt, "
        "full-length completions, full micro-batches), print it beside the plan, and refuse to "
        "start when it does not fit; nothing the probe changed is kept.",
    )
    report_to: list[str] = knob(
        "load",
        default_factory=list,
        description="Trackers that get each step's metrics and "
        "per-phase memory peaks (TRL's name): tensorboard, trackio, wandb (offline); 'all' = every "
        "installed one; [] or 'none' = none. Each is an extra: pip install 'grpo-lab[NAME]'.",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to(cls, v):
        from ..checks.installed import resolve_trackers

        return resolve_trackers(v)


class ReferenceSection(Section):
    strategy: Optional[Literal["none", "adapter-disabled", "copy"]] = knob(
        "rebuild",
        None,
        planned=True,
        description="Reference policy: 'adapter-disabled' (no extra memory), 'copy' (frozen model), 'none' (beta must "
        "be 0); null = auto.",
    )
    device: Optional[str] = knob(
        "load", None, planned=True, description="Device for strategy 'copy'; null = the learner's device."
    )

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, v):
        return None if v is None else normalize_device(v)
