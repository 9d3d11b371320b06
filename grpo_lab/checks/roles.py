"""The placement's cross-checks of LabConfig (who may sit where), raised as ValueError inside its validator so that
pydantic reports them as one ConfigError line naming the field."""

from __future__ import annotations

from ..errors import LabError

NEEDS_SHARE = "needs a memory share"  # (grpo-lab plan recognises this refusal and plans with auto instead)


def check_roles(config) -> None:
    """Who may sit where (LabConfig's cross-checks; `config` is the config being validated): refused with one line per
    problem."""
    place, gen = config.placement, config.generator
    own = gen.own_weights
    if place.learner_procs > 1:
        check_sharding(config)
    else:
        check_one_process(config)
    shared_gpu = [d for d in place.generator_devices() if d == place.learner and d.startswith("cuda")]
    if own and shared_gpu and gen.gpu_memory_utilization is None:
        raise ValueError(
            f"generator.gpu_memory_utilization: the {gen.backend} generator shares {shared_gpu[0]} with the "
            f"learner (colocated) and {NEEDS_SHARE}: auto (grpo-lab plan prints the split it picks) "
            "or a number, e.g. 0.3; or place it on another GPU"
        )
    if own and gen.hf_decode not in ("dynamic", "auto"):
        raise ValueError(
            f"generator.hf_decode: backend {gen.backend!r} decodes in its own engine; hf_decode is the hf backend's "
            "(set it to dynamic, or generator.backend: hf)"
        )
    check_rollout_knobs(place, gen, own)
    if gen.hf_decode == "compiled" and not place.learner.startswith("cuda"):
        raise ValueError(
            f"generator.hf_decode: 'compiled' captures CUDA graphs, and the learner is on {place.learner}; use merged, "
            "static or dynamic there (compiled needs placement.learner on a GPU)"
        )
    if not own and (gen.model or gen.quantization or gen.gpu_memory_utilization or gen.sleep_mode):
        raise ValueError(
            f"generator.model/quantization/gpu_memory_utilization/sleep_mode: backend {gen.backend!r} samples with the "
            "learner's own weights; remove them or use a backend with its own weights"
        )
    if (
        own
        and gen.gpu_memory_utilization is not None
        and not any(d.startswith("cuda") for d in place.generator_devices())
    ):  # a knob that would do nothing says no
        raise ValueError(
            f"generator.gpu_memory_utilization: {gen.gpu_memory_utilization} is a share of a GPU for the "
            f"{gen.backend} generator, and this generator runs on the CPU (no GPU to share); remove it "
            "(on the CPU the engine's KV cache is generator.cpu_kv_cache_gib) or place the generator on "
            "a GPU"
        )
    if place.optimizer_offload and place.learner == "cpu":
        raise ValueError(
            "placement.optimizer_offload: the learner is on the CPU, so its optimizer state is in host RAM "
            "already; set it to false or place the learner on a GPU"
        )


def check_rollout_knobs(place, gen, own: bool) -> None:
    """The hf rollout's own knobs: rows that leave need a growing cache; parking and a kept copy need the merged
    copy."""
    static = gen.hf_decode in ("static", "compiled") or (
        place.learner.startswith("cuda") and gen.hf_decode in ("merged", "auto")  # (CUDA graphs over a static cache)
    )
    if gen.drop_finished_rows and (own or static or place.learner_procs > 1):
        where = (
            "decodes in its own engine"
            if own
            else "is sharded"
            if place.learner_procs > 1
            else f"decodes {gen.hf_decode!r} with a static cache on {place.learner}"
        )
        raise ValueError(
            f"generator.drop_finished_rows: rows leave a growing KV cache, and this rollout {where}; set "
            "generator.hf_decode: dynamic (one process, hf backend), or generator.drop_finished_rows: false"
        )
    if gen.rollout_copy == "keep" and (own or gen.hf_decode not in ("merged", "auto")):
        raise ValueError(
            "generator.rollout_copy: keep holds the hf backend's merged rollout copy between rollouts, and this "
            f"rollout {'decodes in its own engine' if own else f'decodes {gen.hf_decode!r}'}; set generator.hf_decode: "
            "merged (or auto), or generator.rollout_copy: auto"
        )
    if gen.park_learner and (own or gen.hf_decode not in ("merged", "auto")):
        raise ValueError(
            "generator.park_learner: parks the learner while the hf backend's merged rollout copy decodes, and this "
            f"rollout {'decodes in its own engine' if own else f'decodes {gen.hf_decode!r}'}; set generator.hf_decode: "
            "merged (or auto), or generator.park_learner: false"
        )


def check_one_process(config) -> None:
    """What only a sharded learner takes (placement.learner_procs: 1 here), refused in one line."""
    place, gen = config.placement, config.generator
    if place.ray_address is not None:
        raise ValueError(
            f"placement.ray_address: {place.ray_address!r} is where a sharded learner's ranks run, and "
            "this learner is one process (placement.learner_procs: 1); remove it or shard the learner"
        )
    if place.rank_memory_gib is not None:
        raise ValueError(
            f"placement.rank_memory_gib: {place.rank_memory_gib} GiB is each rank's budget in a sharded learner, and "
            "this learner is one process (placement.learner_procs: 1); remove it (placement.host_memory_gib holds "
            "one process's host RAM) or shard the learner"
        )
    if not gen.gather_for_generation:
        raise ValueError(
            "generator.gather_for_generation: false means generating through a sharded learner, and "
            "this one is one process (placement.learner_procs: 1) with its whole model in place; "
            "set it to true, or shard the learner"
        )


def check_sharding(config) -> None:
    """What a sharded learner cannot do, refused before anything starts (checks/world.py checks its
    devices and engine)."""
    from ..runtime import rank_devices

    procs, gen, g = config.placement.learner_procs, config.generator, config.grpo
    if gen.hf_decode == "merged":
        raise ValueError(
            "generator.hf_decode: 'merged' builds a rollout copy of the whole model, and this learner is sharded "
            f"over {procs} ranks; use dynamic (or auto, which picks it here)"
        )
    if gen.own_weights:  # vllm: one engine in the driver's process, never on a rank's device
        shared = sorted(
            set(rank_devices(config.placement.learner, procs)) & set(config.placement.generator_devices()) - {"cpu"}
        )
        if shared:
            raise ValueError(
                f"placement.generator: {shared[0]} is a learner rank's GPU (placement.learner_procs: "
                f"{procs} from {config.placement.learner}); a sharded learner's vLLM engine needs GPUs of "
                "its own: list others, or use generator.backend: hf"
            )
        if gen.sleep_mode:
            raise ValueError(
                "generator.sleep_mode: a sharded learner's vLLM engine has devices of its own, so "
                "sleeping frees memory for nobody; set it to false"
            )
        if not gen.gather_for_generation:
            raise ValueError(
                "generator.gather_for_generation: false chooses how the hf backend generates through "
                "the shards; the vLLM engine has weights of its own and gathers only the LoRA tensors; "
                "set it to true"
            )
    scorer = config.placement.reward_model_device()
    if config.data.reward_models and scorer in rank_devices(config.placement.learner, procs) and scorer != "cpu":
        raise ValueError(
            f"placement.reward_model: {scorer} is a learner rank's GPU (placement.learner_procs: {procs} from "
            f"{config.placement.learner}), and a sharded learner's driver scores with the reward models; place them "
            "on another GPU or cpu"
        )
    if config.placement.ray_address not in (None, "auto"):
        try:
            parse_address(config.placement.ray_address)
        except LabError as err:
            raise ValueError(str(err)) from None
    if config.reference.device is not None:
        raise ValueError(
            "reference.device: a sharded learner's reference copy is sharded like the policy, on every "
            "rank's own device (P5); remove reference.device"
        )
    if config.placement.optimizer_offload:
        raise ValueError(
            "placement.optimizer_offload: a sharded learner (placement.learner_procs > 1) keeps a shard "
            "of AdamW's state per rank already; set it to false"
        )
    batch = g.prompts_per_step * g.num_generations
    if batch % procs:
        raise ValueError(
            f"placement.learner_procs: {procs} ranks need a batch they split evenly; grpo.prompts_per_step "
            f"x num_generations = {batch}; use a multiple of {procs}"
        )


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' of a Ray cluster's head (its GCS), as `ray start --head` prints it."""
    host, sep, port = address.rpartition(":")
    if "/" in host or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LabError(
            f"placement.ray_address: {address!r} is not host:port (e.g. 10.0.0.5:6379, the address "
            "`ray start --head` prints; not a ray:// client address), 'auto' (the cluster this machine joined), or "
            "null (a local "
            "Ray)"
        )
    return host, int(port)
