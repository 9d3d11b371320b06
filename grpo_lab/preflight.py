"""Everything that can be checked before a weight is loaded (and before any rank process starts): what is
installed, the ranks, the model path, the placement, the generator, the rewards and the data."""

from __future__ import annotations

from typing import NamedTuple, Optional

from .algo.rewards import resolve_reward
from .config.schema import LabConfig
from .errors import LabError


def preflight(config: LabConfig, train_dataset=None) -> None:
    """Everything that can be checked before a weight is loaded (`train_dataset`: the Lab's own, if given)."""
    from .checks.devices import check_devices
    from .checks.installed import check_torchvision
    from .checks.world import check_ranks
    from .models.source import check_model_path, require_files

    check_torchvision()
    check_ranks(config)  # more ranks than devices, no FSDP2 in this torch: before any process starts
    if config.generator.gpu_memory_utilization == "auto":
        from .planner import engine_share

        engine_share(config)  # why before anything is fetched: no share that fits is refused with its fixes, at no cost
    check_model_path(config.model.name_or_path)
    check_experts(config)
    if config.model.activation_offload:
        check_offload_host(config)
    if config.generator.backend == "hf" and config.generator.hf_decode == "merged":
        check_rollout_copy(config)
    if config.placement.learner_procs > 1:
        check_host_budget(config)
        require_files(config.model.name_or_path, "a sharded learner's ranks (each reads its shard from the files)")
    if config.generator.backend == "vllm":
        from .generation.vllm_engine import check_tensor_parallel, generator_checkpoint, max_lora_rank

        require_files(generator_checkpoint(config)[0], "vLLM's engine (it loads the model from its files)")
        max_lora_rank(config.lora.r)
        check_tensor_parallel(config)
    check_devices(config)
    if not config.generator.own_weights:  # hf, synthetic: the learner's own device
        from .generation.hf import check_hf_placement

        check_hf_placement(config)
    for name in config.data.rewards:
        resolve_reward(name)
    if config.data.reward_models:
        from .models.reward_model import check_reward_model

        for name in config.data.reward_models:
            check_reward_model(name)
    check_data(config, train_dataset)


def check_data(config: LabConfig, given=None) -> None:
    """The dataset opens and is of TRL's formats (data/sources.py), and holds a step's distinct prompts."""
    from .data.sources import open_dataset

    if config.data.dataset == "arithmetic" and given is None:
        return  # built in memory from the config, which checked it (LabConfig's prompts_per_step check)
    dataset = open_dataset(config, given)
    rows = len(dataset) if hasattr(dataset, "__len__") else None  # (a streamed dataset's length is unknown)
    if rows is not None and config.grpo.prompts_per_step > rows:
        raise LabError(
            f"grpo.prompts_per_step: {config.grpo.prompts_per_step} distinct prompts per step, but the dataset has "
            f"{rows} rows; lower it or use a bigger dataset"
        )


def check_experts(config: LabConfig) -> None:
    """A mixture-of-experts model: what its learner cannot do yet, and expert LoRA where it cannot go, refused before
    anything loads (models/experts.py, models/expert_lora.py).
    A checkpoint without a readable config.json is left to the load's own error."""
    from .models.expert_lora import check_expert_lora
    from .models.experts import check_moe_config
    from .models.shapes import load_shape

    try:
        shape = load_shape(config.model.name_or_path)
    except LabError as err:
        if "no config.json" in str(err):
            return
        raise
    check_expert_lora(config, shape)
    check_moe_config(config, shape)


def check_host_budget(config) -> None:
    """A host budget below this machine's RAM is held by the one-process Lab's guard, which reads its own process
    tree; a sharded learner's ranks are Ray's processes, outside that tree: refused rather than half-held (each rank's
    own budget is placement.rank_memory_gib). CPU ranks on this machine whose budgets add up past its RAM are refused
    too: the machine would run out before any rank's guard stopped."""
    from .memory.readers import HostReader, host_budget

    place = config.placement
    if HostReader(budget=host_budget(config)).budget is not None:  # a budget set, and below this machine's RAM
        raise LabError(
            f"placement.host_memory_gib: {place.host_memory_gib} GiB is below this machine's RAM, and the guard "
            "holds such a budget for a one-process learner only (a sharded learner's ranks are Ray's processes); "
            "unset it (the guard then holds the machine's RAM) and hold each rank with placement.rank_memory_gib, "
            "or use placement.learner_procs: 1"
        )
    if place.learner != "cpu" or place.ray_address is not None:
        return
    from .checks.world import ray_kill_share

    share = ray_kill_share()  # a share Ray cannot start with: one line, before Ray times out on it
    if place.rank_memory_gib is None:
        return
    line = RayLine.now(share or 1.0)  # this machine's RAM and what it uses, read once for both checks
    machine = line.machine_gib
    if place.rank_memory_gib * place.learner_procs > machine:
        raise LabError(
            f"placement.rank_memory_gib: {place.learner_procs} CPU ranks x {place.rank_memory_gib} GiB is more than "
            f"this machine's {machine:.1f} GiB of RAM, which would run out before any rank's guard stopped it; "
            f"give each rank at most {machine / place.learner_procs:.1f} GiB"
        )
    from .runtime import runtime

    # why not on a rank: it checks before the ranks start, and a rank's own Lab would count the ranks as used
    if share is not None and not runtime().is_rank:
        check_ray_line(place, line)


class RayLine(NamedTuple):
    """The line above which the memory monitor of a Ray started on this machine kills a worker (P4), in GiB."""

    share: float  # RAY_memory_usage_threshold
    machine_gib: float  # this machine's RAM, or its cgroup's limit (what Ray reads too)
    used_gib: float  # what the machine uses now, the figure Ray's monitor reads (memory the kernel cannot reclaim)

    @classmethod
    def now(cls, share: Optional[float] = None) -> "RayLine":
        from .checks.world import ray_kill_share
        from .memory.readers import HostReader

        reader = HostReader()
        share = ray_kill_share() if share is None else share
        return cls(share or 1.0, reader.machine / 1024**3, reader.read()["used"] / 1024**3)

    @property
    def gib(self) -> float:
        return self.share * self.machine_gib

    def room_per_rank(self, procs: int) -> float:
        """The placement.rank_memory_gib that keeps `procs` CPU ranks, on top of what runs now, under the line (GiB,
        rounded down to 0.01)."""
        return int(max(self.gib - self.used_gib, 0.0) / procs * 100) / 100


def check_ray_line(place, line: RayLine) -> None:
    """CPU ranks whose budgets, on top of what this machine uses now, pass the line above which the memory monitor
    of the Ray they start on kills a worker: refused. Why: the monitor kills mid-phase, a rank's guard acts as a
    phase ends, so a budget above Ray's line is a line no guard ever holds (P4)."""
    if line.used_gib + place.rank_memory_gib * place.learner_procs <= line.gib:
        return
    raise LabError(
        f"placement.rank_memory_gib: {place.learner_procs} CPU ranks x {place.rank_memory_gib} GiB on top of the "
        f"{line.used_gib:.2f} GiB this machine uses now pass Ray's kill line, {line.gib:.2f} GiB "
        f"(RAY_memory_usage_threshold {line.share:g} of {line.machine_gib:.1f} GiB): its memory monitor would kill a "
        f"rank before the rank's guard stopped the phase; give each rank at most "
        f"{line.room_per_rank(place.learner_procs):.2f} GiB"
    )


def check_offload_host(config: LabConfig) -> None:
    """model.activation_offload keeps the layer inputs in pinned host memory: when the host cannot hold them under the
    guard's line (memory.host_threshold, P4), it is refused before anything loads."""
    from .planner import plan

    host = plan(config).devices["host"]
    offloaded = sum(i.bytes for i in host.items if i.what.startswith("offloaded layer inputs"))
    if offloaded and not host.fits:
        gib = 1024**3
        raise LabError(
            f"model.activation_offload: the offloaded layer inputs need {offloaded / gib:.1f} GiB of pinned host "
            f"memory (host peak {host.total / gib:.1f} GiB), above the {host.line_bytes / gib:.1f} GiB the host may "
            "hold under memory.host_threshold; shorten generator.max_completion_length, lower grpo.micro_batch_size, "
            "or set model.activation_offload: false"
        )


def check_rollout_copy(config: LabConfig) -> None:
    """generator.hf_decode: merged holds a rollout copy beside the learner: where the plan fits without it and not with
    it, it is refused before anything loads, naming the path that fits."""
    from .config.loading import load_config
    from .planner import plan

    with_copy = plan(config)
    if with_copy.fits:
        return
    if config.generator.rollout_copy == "keep":
        check_kept_copy(config, with_copy)
    fallback = "compiled" if config.placement.learner.startswith("cuda") else "dynamic"
    parks = not config.generator.park_learner and plan(load_config(config, ["generator.park_learner=true"])).fits
    fits = plan(load_config(config, [f"generator.hf_decode={fallback}", "generator.park_learner=false"])).fits
    if not (parks or fits):
        return  # it does not fit either way: the plan's own refusal names the fixes
    device = max(with_copy.failing(), key=lambda d: d.fraction)
    copy = sum(i.bytes for i in device.items if i.what.startswith("rollout copy"))
    gib = 1024**3
    fixes = (["generator.park_learner: true (the learner's state in host memory while the copy decodes; fits)"] if parks
             else []) + ([f"generator.hf_decode: {fallback} (fits), or auto (picks it)"] if fits else [])  # fmt: skip
    raise LabError(
        f"generator.hf_decode: merged needs a {copy / gib:.2f} GiB rollout copy on {device.device}, and with it the "
        f"plan does not fit ({device.total / gib:.1f} of the {device.line_bytes / gib:.1f} GiB it may hold); use "
        + "; or ".join(fixes)
    )


def check_kept_copy(config: LabConfig, with_copy) -> None:
    """generator.rollout_copy: keep holds the copy for the whole step: where only a released copy fits, refused in one
    line with the copy's figure (a kept copy that fits neither way is left to check_rollout_copy's own line)."""
    from .config.loading import load_config
    from .planner import plan

    if not plan(load_config(config, ["generator.rollout_copy=release"])).fits:
        return
    device = max(with_copy.failing(), key=lambda d: d.fraction)
    copy = sum(i.bytes for i in device.items if i.what == "rollout copy (LoRA merged)")
    gib = 1024**3
    raise LabError(
        f"generator.rollout_copy: keep holds the {copy / gib:.2f} GiB rollout copy on {device.device} for the whole "
        f"step, and with it the plan does not fit ({device.total / gib:.1f} of {device.capacity / gib:.1f} GiB); use "
        "generator.rollout_copy: release (fits: a CUDA graph recording per rollout), or auto (picks it)"
    )
