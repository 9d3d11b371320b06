"""The planner for a learner sharded with FSDP2 (placement.learner_procs > 1): per-rank arithmetic on Qwen2.5-7B's
real shape (bundled config.json; nothing is loaded), checked against the one-process plan and the shape itself."""

import pytest

from grpo_lab import load_config
from grpo_lab.planner import plan
from grpo_lab.planner.estimate import HOST_BASELINE, PHASES, RANK_BASELINE_CPU, RAY_PROCESSES

GiB = 1024**3
PRESET = "qwen2.5-7b-nf4-24gb"  # Qwen2.5-7B-Instruct, nf4 + double quant, bf16 embeddings, LoRA r 16 all-linear


def sharded(procs: int, *overrides: str):
    return plan(load_config(PRESET, [f"placement.learner_procs={procs}", "placement.host_memory_gib=256", *overrides]))


def items(device) -> dict:
    return {(i.what, i.phase): i.bytes for i in device.items}


def units(shape):
    """One decoder layer and the root, whole, computed here from the shape: nf4 codes (half a byte per weight), two
    bf16 norms and the layer's fp32 LoRA; the root's bf16 embedding, untied LM head and final norm."""
    linear = sum(a * b for _, a, b in shape.linear_layers())
    lora = sum(16 * (a + b) for _, a, b in shape.linear_layers())
    layer = linear / 2 + 2 * shape.hidden * 2 + lora * 4
    root = (2 * shape.vocab * shape.hidden + shape.hidden) * 2
    return layer, root


@pytest.mark.parametrize("procs", [2, 4])
def test_each_rank_holds_1_over_n_of_the_weights_and_optimizer_but_all_of_the_quant_state(procs):
    one = plan(load_config(PRESET, ["placement.host_memory_gib=256"]))
    split = sharded(procs)
    shape = split.shape
    assert not shape.tied and shape.layers == 28 and one.ranks == {}
    assert list(split.devices) == [f"cuda:{k}" for k in range(procs)] + ["host"]
    assert list(split.ranks) == [f"cuda:{k}" for k in range(procs)]
    single = items(one.devices["cuda:0"])
    # bitsandbytes' quant state (double quant: an int8 absmax per 64 weights + fp32 per 256 blocks; per 4-bit tensor,
    # the nf4 codebook's 16 floats, the absmax's 256-float codebook and its float offset) stays whole
    quant_state = shape.linear_params * (8 / 64 + 32 / (64 * 256)) / 8 + shape.quantized_tensors * (16 + 256 + 1) * 4
    for name, rank in split.ranks.items():
        per_rank = items(rank)
        assert per_rank[(f"base weights (1/{procs} shard)", None)] == pytest.approx(
            (single[("base weights", None)] - quant_state) / procs, rel=1e-12
        )
        assert per_rank[("4-bit quant state (whole on every rank)", None)] == pytest.approx(quant_state, rel=1e-12)
        for what in ("LoRA weights", "LoRA gradients"):
            assert per_rank[(f"{what} (1/{procs})", None)] == single[(what, None)] / procs
        assert per_rank[(f"AdamW moments (1/{procs})", None)] == single[("AdamW moments", None)] / procs
        # each rank loads layer by layer (models/meta_load.py): beyond its shards, one layer whole + the float weight
        # being quantized (Qwen2.5-7B's largest linear, 18944 x 3584, read in bf16)
        layer, _ = units(shape)
        assert per_rank[("one layer whole before fully_shard", "load")] == pytest.approx(layer + 18944 * 3584 * 2)
        assert rank.roles[0] == f"learner rank {int(name.split(':')[1])} of {procs} (FSDP2)"
    # what sharding buys: the resident weights and optimizer state shrink ~N-fold (the quant state aside)
    resident = [i.bytes for i in split.ranks["cuda:0"].items if i.phase is None and not i.what.startswith("CUDA ")]
    before = sum(single[(w, None)] for w in ("base weights", "LoRA weights", "LoRA gradients", "AdamW moments"))
    assert sum(resident) == pytest.approx(before / procs + quant_state * (1 - 1 / procs), rel=1e-12)


def test_rank_devices_start_at_the_learners_gpu_and_the_reference_copy_is_sharded_too():
    result = sharded(2, "placement.learner=cuda:2", "grpo.beta=0.04", "reference.strategy=copy")
    assert list(result.devices) == ["cuda:2", "cuda:3", "host"]
    rank = items(result.devices["cuda:3"])
    assert rank[("reference weights (1/2 shard)", None)] == rank[("base weights (1/2 shard)", None)]
    assert rank[("reference quant state (whole on every rank)", None)] > 0
    assert "reference copy (sharded like the policy)" in result.devices["cuda:3"].roles


def test_gather_for_generation_costs_the_whole_model_minus_the_layers_in_flight():
    gathered, layered = sharded(2), sharded(2, "generator.gather_for_generation=false")
    shape = gathered.shape
    layer, root = units(shape)
    whole = shape.layers * layer + root
    one = items(plan(load_config(PRESET)).devices["cuda:0"])
    assert whole == pytest.approx(
        one[("base weights", None)]
        - shape.linear_params * (8 / 64 + 32 / 16384) / 8
        - shape.quantized_tensors * (16 + 256 + 1) * 4  # (the quant state, codebooks too, is not gathered)
        + one[("LoRA weights", None)],
        rel=1e-12,
    )  # the same bytes, counted two ways
    for name in gathered.ranks:
        a, b = gathered.ranks[name], layered.ranks[name]
        assert items(a)[("generation gather: whole model", "rollout")] == pytest.approx(whole, rel=1e-12)
        assert items(b)[("generation gather: layer by layer", "rollout")] == pytest.approx(root + 2 * layer, rel=1e-12)
        assert a.phase_peak("rollout") - b.phase_peak("rollout") == pytest.approx(whole - root - 2 * layer, rel=1e-12)
        assert a.phase_peak("rollout") - b.phase_peak("rollout") > 2.5 * GiB  # most of a 7B nf4 model
        assert all(a.phase_peak(p) == b.phase_peak(p) for p in PHASES if p != "rollout")
        # the rollout runs the whole batch on every rank: its KV cache is the one-process plan's, not 1/N of it
        assert items(a)[("generation KV cache", "rollout")] == one[("generation KV cache", "rollout")]


def test_a_plan_that_fits_only_without_the_gather_says_so_and_more_ranks_are_offered():
    common = ["generator.chunk_size=32", "placement.gpu_memory_gib=10"]
    gathered = sharded(2, *common)
    assert not gathered.fits and gathered.devices["cuda:0"].peak_phase == "rollout"
    assert gathered.fixes[0] == "generator.gather_for_generation: false"
    assert sharded(2, *common, "generator.gather_for_generation=false").fits
    tight = sharded(2, "generator.chunk_size=32", "placement.gpu_memory_gib=7", "generator.gather_for_generation=false")
    assert not tight.fits and "placement.learner_procs: 4" in tight.fixes
    assert sharded(
        4, "generator.chunk_size=32", "placement.gpu_memory_gib=7", "generator.gather_for_generation=false"
    ).fits


@pytest.mark.parametrize("procs", [2, 4])
def test_cpu_ranks_share_host_ram_each_with_its_own_runtime(procs):
    result = sharded(procs, "placement.learner=cpu")
    host = result.devices["host"]
    assert list(result.devices) == ["host"] and list(result.ranks) == [f"host (rank {k})" for k in range(procs)]
    baseline, driver = RANK_BASELINE_CPU, HOST_BASELINE["cpu"] + RAY_PROCESSES  # (the driver: a local Ray beside it)
    for rank in result.ranks.values():
        assert items(rank)[("Python, torch, libraries", None)] == baseline
    assert items(host)[("Ray's own processes", None)] == RAY_PROCESSES
    rank = result.ranks["host (rank 0)"]
    for phase in PHASES:  # the driver's process and Ray's plus every rank's, all in the same phase at once
        assert host.phase_peak(phase) == pytest.approx(driver + procs * rank.phase_peak(phase), rel=1e-12)
    runtimes = sum(i.bytes for r in result.ranks.values() for i in r.items if i.what == "Python, torch, libraries")
    assert runtimes == procs * baseline
    joined = sharded(procs, "placement.learner=cpu", "placement.ray_address=10.0.0.5:6379").devices["host"]
    assert ("Ray's own processes", None) not in items(joined)  # a cluster's Ray: its processes are not this machine's
    # the fit is the sum's: a host with room for one rank's peak (and the driver) but not for all of them
    room = (driver + rank.total * 1.5) / GiB
    squeezed = sharded(procs, "placement.learner=cpu", f"placement.host_memory_gib={room}")
    assert not squeezed.fits and [d.device for d in squeezed.failing()] == ["host"]
    assert all(r.fraction < 1 for r in squeezed.ranks.values())


def test_the_table_names_every_rank_and_how_the_rollout_gathers():
    text = str(sharded(4))
    assert "learner sharded over 4 ranks" in text and "generator.gather_for_generation: true" in text
    for k in range(4):
        assert f"cuda:{k}   learner rank {k} of 4 (FSDP2)" in text
        assert f"  rank {k} process" in text  # its host process
    assert text.count("generation gather: whole model") == 4
    layered = str(sharded(4, "generator.gather_for_generation=false"))
    assert layered.count("generation gather: layer by layer") == 4 and "gather_for_generation: false" in layered

    cpu = str(sharded(4, "placement.learner=cpu"))
    assert "host (rank 0) learner rank 0 of 4 (FSDP2)" in cpu
    assert "host (rank 1), host (rank 2), host (rank 3): the same as rank 0" in cpu
    host_block = cpu[cpu.index("\nhost     ") :]
    for k in range(4):
        assert f"\n  rank {k}  " in host_block and f"\n    rank {k}  " in host_block  # resident, and each phase
    assert "driver process" in host_block and host_block.rstrip().endswith("verdict: fits")


def test_a_vllm_engine_for_the_ranks_is_planned_on_its_own_gpu_and_the_ranks_gather_nothing_to_generate():
    """generator.backend: vllm with a sharded learner: one engine, in the driver, on GPUs of its own; the same engine
    items as one process's split generator, and no rollout gather or KV cache on any rank."""
    engine = ["generator.backend=vllm", "placement.generator=[2]"]
    one = plan(
        load_config(PRESET, ["placement.host_memory_gib=256", "generator.backend=vllm", "placement.generator=[1]"])
    )
    split = sharded(2, *engine)
    assert list(split.devices) == ["cuda:0", "cuda:1", "host", "cuda:2"] and list(split.ranks) == ["cuda:0", "cuda:1"]
    assert items(split.devices["cuda:2"]) == items(one.devices["cuda:1"])
    for rank in split.ranks.values():
        assert not [i for i in rank.items if i.phase == "rollout"]
        assert "rollout sampled by the driver's vllm engine" in rank.roles
    hf = sharded(2)
    assert items(split.devices["cuda:0"]) == {k: v for k, v in items(hf.devices["cuda:0"]).items() if k[1] != "rollout"}
    assert "runs their vllm engine" in [i for i in split.devices["host"].items if i.what.startswith("driver")][0].note


def test_the_load_phase_is_a_rank_s_shards_and_one_layer_never_the_whole_model():
    """P3 (issue 23): QwQ-32B nf4 on 2 x 40 GB ranks planned 19.6 GiB per rank at load when every rank loaded the whole
    model before fully_shard; the layer-by-layer load needs the rank's shards and one layer (~11.2 GiB)."""
    result = plan(load_config("p1-qwq32b-nf4-2xa100-40gb", ["placement.learner_procs=2", "placement.generator=[2]"]))
    shape = result.shape
    layer, root = units(shape)
    whole = shape.layers * layer + root
    for rank in result.ranks.values():
        load = rank.phase_peak("load")
        assert load - rank.resident == pytest.approx(layer + 27648 * 5120 * 2, rel=1e-12)  # + the float down_proj
        assert load < rank.resident + whole / 8 and load / GiB == pytest.approx(11.24, abs=0.01)
        assert rank.peak_phase != "load"


def test_a_rank_budget_is_each_rank_s_capacity_checked_and_shown_per_rank():
    """placement.rank_memory_gib: every CPU rank a device of the plan, against its own line (the host still adds them
    up); the gathered rollout over it names the ranks and the fix; a GPU rank's capacity is its card or the budget,
    the smaller."""
    from grpo_lab.planner.sharded import rank_lines

    cpu16 = ["placement.learner=cpu", "model.load_in_4bit=false", "generator.chunk_size=8"]
    free = sharded(2, *cpu16)
    gathered = free.ranks["host (rank 0)"].total
    layered = sharded(2, *cpu16, "generator.gather_for_generation=false").ranks["host (rank 0)"].total
    assert layered < gathered
    budget = (gathered + layered) / 2 / GiB  # between the two: only the whole gather crosses it
    held = sharded(2, *cpu16, f"placement.rank_memory_gib={budget}")
    assert list(held.devices) == ["host (rank 0)", "host (rank 1)", "host"]
    assert [d.device for d in held.failing()] == ["host (rank 0)", "host (rank 1)"]
    assert held.fixes[0] == "generator.gather_for_generation: false"
    lines = rank_lines(held)
    assert set(lines) == {"host (rank 0)", "host (rank 1)"}
    for line in lines.values():
        assert line["phase"] == "rollout" and not line["fits"]
        assert line["capacity_mib"] == pytest.approx(budget * 1024) and line["peak_mib"] == pytest.approx(
            gathered / 2**20
        )
    assert held.devices["host"].total == free.devices["host"].total  # the sum is the same; only the lines are new
    text = str(held)
    assert text.count("its own budget: placement.rank_memory_gib") == 2
    assert "verdict: does not fit on host (rank 0), host (rank 1)" in text
    assert sharded(2, *cpu16, f"placement.rank_memory_gib={budget}", "generator.gather_for_generation=false").fits
    card = sharded(2, "placement.gpu_memory_gib=40", "placement.rank_memory_gib=10").devices["cuda:1"].capacity
    assert card == 10 * GiB
    assert (
        sharded(2, "placement.gpu_memory_gib=40", "placement.rank_memory_gib=80").devices["cuda:1"].capacity == 40 * GiB
    )


def test_a_cpu_rank_generating_layer_by_layer_holds_the_float32_logits_copy_as_a_block_of_its_own():
    """generation/step_logits.py makes generate()'s float32 copy of a CPU step's float32 logits a view of them only
    for an LM head with a plain weight: a rank generating through its sharded model (gather_for_generation false)
    reaches its head as a DTensor shard, its own forward runs, and the copy is a second [rows, vocab] block. Gathered
    whole, the head's weight is plain again: one block, as in one process."""
    from grpo_lab.planner.estimate import rollout_sequences

    f32 = ["placement.learner=cpu", "model.dtype=float32", "model.bnb_4bit_compute_dtype=float32"]
    config = load_config(PRESET, f32)
    block, vocab = rollout_sequences(config) * 4, 152064  # (Qwen2.5-7B's vocabulary, float32)

    def step(procs: int, *more: str) -> float:
        result = sharded(procs, *f32, *more) if procs > 1 else plan(load_config(PRESET, f32))
        device = result.ranks["host (rank 0)"] if procs > 1 else result.devices["host"]
        return items(device)[("generation logits step", "rollout")]

    one = step(1)
    assert step(2, "generator.gather_for_generation=true") == one
    assert step(2, "generator.gather_for_generation=false") == one + block * vocab
