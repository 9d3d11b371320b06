"""Typed containers passed between the phases of a step (shapes in comments; N = B*G)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import torch


@dataclass
class PromptBatch:
    prompts: list[str]  # [B] prompt text, chat template applied
    answers: list[Optional[str]]  # [B] the 'answer' column as text (None when the dataset has none)
    extra: dict[str, list] = field(default_factory=dict)  # the other dataset columns as the dataset has them, [B] each
    # [B] each row's prompt as reward functions get it (TRL's `prompts`): text, or chat messages (conversational);
    # None: `prompts` themselves, as text
    raw: Optional[list] = None

    @property
    def conversational(self) -> bool:
        """TRL's conversational format: prompts are chat messages, so completions reach rewards as messages too."""
        return bool(self.raw) and isinstance(self.raw[0], list)

    def __len__(self) -> int:
        return len(self.prompts)


@dataclass
class Rollout:
    """Completions of one step. Tensors stay on the CPU: they are small integer/float tables,
    and each phase moves only the micro-batch it is working on to its device."""

    batch: PromptBatch
    num_generations: int
    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    completion_ids: torch.Tensor  # [N, L] right-padded
    completion_mask: torch.Tensor  # [N, L] 1 up to and including EOS
    sampler_logprobs: torch.Tensor  # [N, L] log-prob of each sampled token under the sampler (0 where masked)
    truncated: torch.Tensor  # [N] bool: no EOS within max_completion_length
    completions: list[str]  # [N] decoded completion text
    temperature: float = 1.0  # sampled at (0 = greedy); the log-prob passes score at this temperature (greedy: 1)
    max_completion_length: int = 0  # the limit it was sampled with (dr_grpo normalises by it)
    step: int = -1  # the Lab step it belongs to (set by the Lab)
    generate_calls: int = 1  # engine calls it took (generator.chunk_size splits the batch)
    # what torch compiled while it decoded, by its own counters (torch._dynamo.utils.counters): graphs compiled, and
    # the inputs CUDA graphs recorded (0 = no new recording); a rollout after the first should read 0 and 0
    compiled_graphs: int = 0
    cudagraph_recorded_inputs: int = 0
    # generator.hf_decode merged: its copy "kept" between rollouts or "released" after each ("": no copy); released on
    # a GPU, its weights get new addresses at every rollout, so CUDA graphs record again: expected, 1 per rollout
    rollout_copy: str = ""
    cudagraph_recordings_expected: int = 0
    experts_dequantized: int = 0  # 4-bit experts its forwards dequantized, over layers and decoding steps
    # vllm: the share of the prompt tokens it sent (every turn's context) that vLLM's prefix cache held; None: hf
    prefix_cache_hit_rate: Optional[float] = None
    # a tool-calling rollout (tools/loop.py); None without tools
    tool_mask: Optional[torch.Tensor] = None  # [N, L] 0 on tool-result tokens: they condition, never train (TRL's)
    conversations: Optional[list[list[dict]]] = None  # [N] TRL's conversational completion: assistant + tool turns
    tool_calls: Optional[list[int]] = None  # [N] tool calls of each row
    tool_failures: Optional[list[int]] = None  # [N] of them, those whose result is {"error": ...}
    turns: Optional[list[int]] = None  # [N] assistant turns of each row
    # each turn's generate() calls as the model's forwards saw them, in order: {mark ("turn k"), rows in flight,
    # prefill (tokens fed at once, padded), context (KV tokens after it), decode (tokens decoded after it)}, the
    # planner's Turn (planner/turns.py); None where the backend does not record them (hf does)
    turn_shapes: Optional[list[dict]] = None
    # environment_factory: each row's environment instance, and its prompt as rewards get it (reset's observation in)
    environments: Optional[list] = None  # [N]
    row_prompts: Optional[list] = None  # [N]

    @property
    def logprob_temperature(self) -> float:
        """The temperature learner/reference log-probs of this rollout are taken at: the sampling one (greedy: 1)."""
        return self.temperature or 1.0

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def completion_lengths(self) -> torch.Tensor:  # [N]
        return self.completion_mask.sum(-1)

    def repeated(self, values: list) -> list:
        """A per-prompt list repeated for each of its G completions ([B] -> [N])."""
        return [v for v in values for _ in range(self.num_generations)]


@dataclass
class Rewards:
    per_function: torch.Tensor  # [N, F]
    names: list[str]  # [F]
    total: torch.Tensor  # [N] weighted sum over functions
    num_generations: int  # G: the group size of the rollout they score (not the config's, which may change)
    logged: dict[str, float] = field(default_factory=dict)  # what rewards logged with log_metric, each one's mean
    logged_columns: dict[str, list] = field(default_factory=dict)  # what they logged with log_extra, [N] each


@dataclass
class Advantages:
    values: torch.Tensor  # [N]
    group_mean: torch.Tensor  # [N] mean reward of each completion's group
    group_std: torch.Tensor  # [N] std of each completion's group


@dataclass
class LogProbs:
    ref: Optional[torch.Tensor]  # [N, L] reference policy (None: beta was 0 at the logprobs phase)


@dataclass
class LossStats:
    loss: float
    kl: Optional[float]  # mean per-token KL to the reference (None when beta = 0)
    clip_fraction: float  # fraction of completion tokens where the ratio was clipped
    logprob_mismatch: float  # mean |learner - sampler| log-prob over completion tokens
    logprob_kl: float  # KL(sampler || learner) per token (k3 estimate on the sampled tokens)
    num_tokens: int
    is_ratio_min: Optional[float] = None  # importance-sampling weights over the loss's tokens (None: not applied)
    is_ratio_mean: Optional[float] = None
    is_ratio_max: Optional[float] = None
    experts_dequantized: int = 0  # 4-bit experts its forwards, recomputes and backward dequantized (over layers)

    def __repr__(self) -> str:  # why: the dataclass's one line of 17-digit floats wrapped mid-word in a cell's output
        return key_values("<LossStats", [(f.name, getattr(self, f.name)) for f in fields(self)]) + ">"


def key_values(head: str, pairs: list[tuple[str, object]], width: int = 80) -> str:
    """`head` then `key value` pairs, floats to 4 significant digits, in lines of at most `width` columns that break
    between pairs (never inside a name or a number)."""
    lines, line = [], head
    for key, value in pairs:
        item = f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
        if line and len(line) + 2 + len(item) > width:
            lines.append(line)
            line = ""
        line = f"{line}  {item}"  # (two spaces between pairs; a continuation line starts indented by them)
    return "\n".join(lines + [line])


@dataclass
class BackwardResult:
    """What a backward phase returns: its metrics, and the old log-probs and importance-sampling weights it used (the
    rollout's first backward records the old log-probs from its own forward; its later iterations are given them)."""

    stats: LossStats
    old_logprobs: torch.Tensor  # [N, L] learner before the rollout's first update, detached, on the CPU
    is_weights: Optional[torch.Tensor]  # [N, L] or [N, 1] importance-sampling weights (None: not applied)


def reward_key(name: str) -> str:
    """A reward function's mean in metrics.jsonl, named as TRL logs it."""
    return f"rewards/{name}/mean"


def reward_name_of(key: str) -> Optional[str]:
    """The reward function a metrics key holds the mean of (also a run's from before TRL's names: reward/<name>)."""
    if key.startswith("rewards/") and key.endswith("/mean"):
        return key[len("rewards/") : -len("/mean")]
    return key[len("reward/") :] if key.startswith("reward/") else None


@dataclass
class StepResult:
    step: int
    reward_mean: float
    reward_std: float
    rewards: dict[str, float]  # mean of each reward function
    advantage_std: float
    loss: float
    kl: Optional[float]
    clip_fraction: float
    logprob_mismatch: float
    logprob_kl: float
    grad_norm: float
    completion_length_mean: float
    completion_length_min: int
    completion_length_max: int
    truncated_fraction: float
    phase_seconds: dict[str, float]
    step_seconds: float
    sync_seconds: float = 0.0  # pushing the LoRA weights to the generator
    generate_calls: int = 1  # engine calls of the rollout (generator.chunk_size)
    compiled_graphs: int = 0  # graphs torch compiled during the rollout (Rollout.compiled_graphs)
    cudagraph_recorded_inputs: int = 0  # inputs CUDA graphs recorded during it (0: no new recording)
    rollout_copy: str = ""  # the merged rollout copy "kept" or "released" (Rollout.rollout_copy); "": none
    cudagraph_recordings_expected: int = 0  # 1: a released copy on a GPU, re-recorded at every rollout by design
    # a mixture of experts' 4-bit experts dequantized (over layers; models/routed_experts.py): by the rollout's
    # forwards, and by the learner's last backward (its forwards, their recomputes, the experts' backward)
    rollout_experts_dequantized: int = 0
    learner_experts_dequantized: int = 0
    prefix_cache_hit_rate: Optional[float] = None  # vllm: the rollout's prompt tokens read from its prefix cache
    temperature: float = 1.0  # the rollout was sampled at (0 = greedy)
    learning_rate: float = 0.0  # of the step's last update
    iterations: int = 1  # optimizer updates on this rollout
    attempts: int = 1  # 1 + rolled-back attempts (their rows: memory.rows_for(step, failed_attempts=True))
    is_ratio_min: Optional[float] = None
    is_ratio_mean: Optional[float] = None
    is_ratio_max: Optional[float] = None
    memory: list[dict] = field(default_factory=list)  # per phase x device x metric: start/peak/end/delta bytes
    leaks: list[str] = field(default_factory=list)  # devices whose after-step memory keeps climbing
    logged: dict[str, float] = field(default_factory=dict)  # what reward functions logged (log_metric), by name
    tool_calls_per_row: Optional[float] = None  # TRL's tools/call_frequency (None: no tools)
    tool_failure_frequency: Optional[float] = None  # TRL's tools/failure_frequency: failed calls / calls
    turns_mean: Optional[float] = None  # assistant turns per row
    # a tool loop's rollout: per mark inside it (turn 1, tools 1, turn 2, ...) x device x metric, its peak bytes and
    # seconds (memory/sampler.py mark_rows)
    turn_memory: list[dict] = field(default_factory=list)

    def metrics(self) -> dict:
        """JSON-ready dict: one line of metrics.jsonl (scalars flat, the memory table as a list; what rewards logged
        under the names they gave, as TRL logs them)."""
        out = {k: v for k, v in self.__dict__.items() if k not in ("rewards", "phase_seconds", "logged")}
        out.update({reward_key(k): v for k, v in self.rewards.items()})
        out.update({f"seconds/{k}": v for k, v in self.phase_seconds.items()})
        out.update({k: v for k, v in self.logged.items() if k not in out})
        return out

    @classmethod
    def from_metrics(cls, record: dict) -> "StepResult":
        """Back from a metrics.jsonl line (a resumed run's report covers the steps before the resume too)."""
        known = {f.name for f in fields(cls)}
        out = {k: v for k, v in record.items() if k in known}
        out["rewards"] = {name: v for k, v in record.items() if (name := reward_name_of(k))}
        out["phase_seconds"] = {k[len("seconds/") :]: v for k, v in record.items() if k.startswith("seconds/")}
        out["logged"] = {
            k: v
            for k, v in record.items()
            if k not in known and not reward_name_of(k) and not k.startswith("seconds/") and isinstance(v, float)
        }
        return cls(**out)

    def __repr__(self) -> str:  # why: a bare lab.step() ending a cell showed every field, the memory table's too
        return f"<StepResult {self.summary()}  ·  .memory: {len(self.memory)} rows, .metrics(): every field>"

    def summary(self) -> str:
        kl = "-" if self.kl is None else f"{self.kl:.4f}"
        each = ", ".join(f"{name} {mean:.3f}" for name, mean in self.rewards.items())
        return (
            f"step {self.step}: reward {self.reward_mean:.3f}±{self.reward_std:.3f}"
            + (f" ({each})" if len(self.rewards) > 1 else "")
            + f"  loss {self.loss:+.4f}  "
            f"kl {kl}  grad {self.grad_norm:.3f}  len {self.completion_length_mean:.1f}  {self.step_seconds:.2f}s"
            + "".join(f"  {name} {value:.3g}" for name, value in self.logged.items())
            + (
                f"  tools {self.tool_calls_per_row:.2f}/row (failed {self.tool_failure_frequency:.2f}), "
                f"{self.turns_mean:.2f} turns"
                if self.tool_calls_per_row is not None
                else ""
            )
            # vllm's rollout: its prompt tokens read from the prefix cache (hf measures none: nothing shown)
            + (f"  prefix cache {self.prefix_cache_hit_rate:.0%}" if self.prefix_cache_hit_rate is not None else "")
        )


@dataclass
class GenerationRequest:
    """Settings of one rollout, read from the live config at the rollout phase (the generator keeps
    no copy of them, so an edit between steps takes effect at the next rollout); temperature 0 = greedy."""

    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_length: int = 256
    chunk_size: Optional[int] = None  # sequences per engine call; None = all at once
    gather_for_generation: bool = True  # a sharded hf learner: full weights for the rollout, or one layer at a time
    full_length: bool = False  # the worst-case probe: stop tokens suppressed until max_completion_length
    decode: str = "dynamic"  # the hf rollout's decode path (generator.hf_decode; auto resolved by the executor)
    park_learner: bool = False  # generator.park_learner: the learner's state in host memory while the copy decodes
    drop_finished_rows: bool = False  # generator.drop_finished_rows: finished rows leave the batch at bucket boundaries
    rollout_copy: str = "release"  # generator.rollout_copy, auto resolved by the executor: keep or release the copy
    park_buffer_bytes: int = 0  # generator.park_learner: the host buffer's planned size (the executor reads the plan)
    turn_cache: str = "keep"  # generator.turn_cache: a tool loop's turn goes on from the KV cache (hf), or prefills

    @property
    def keeps_copy(self) -> bool:
        """A merged rollout whose copy (and on a GPU its StaticCache) stays for the next rollout."""
        return self.decode == "merged" and self.rollout_copy == "keep"

    @classmethod
    def from_config(
        cls, config, full_length: bool = False, decode: Optional[str] = None, copy: str = "release"
    ) -> "GenerationRequest":
        gen = config.generator
        return cls(
            gen.max_completion_length,
            gen.temperature,
            gen.top_p,
            gen.top_k,
            gen.max_prompt_length,
            gen.chunk_size,
            gen.gather_for_generation,
            full_length,
            decode or gen.hf_decode,
            gen.park_learner,
            gen.drop_finished_rows,
            copy,
            turn_cache=gen.turn_cache,
        )
