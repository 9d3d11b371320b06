"""generator.gpu_memory_utilization: auto, planner arithmetic on real GPU shapes (bundled config.json copies): the
share it picks, what that leaves vLLM (KV tokens, full-length sequences), and the one-line refusal when no share
fits. Planned on the stated capacities (placement.gpu_memory_gib), so these run on any machine."""

from pathlib import Path

import pytest

from grpo_lab import Lab, load_config
from grpo_lab.cli import main
from grpo_lab.errors import ConfigError, LabError
from grpo_lab.planner import engine_share, plan
from grpo_lab.planner.estimate import CUDA_CONTEXT, GiB, generator_weight_bytes
from grpo_lab.planner.placement import Placement
from grpo_lab.planner.split import AUTO_MARGIN, engine_work_bytes, kv_token_bytes

PRESETS = Path(__file__).resolve().parents[1] / "grpo_lab" / "config" / "presets"
QWEN7B = PRESETS / "qwen2.5-7b-nf4-24gb.yaml"
QWQ = PRESETS / "p1-qwq32b-nf4-2xa100-40gb.yaml"
COLOCATED = ["generator.backend=vllm", "generator.gpu_memory_utilization=auto", "generator.chunk_size=null"]


def qwen7b(*extra):
    return load_config(QWEN7B, COLOCATED + list(extra))


def test_7b_colocated_on_24gb_with_sleep_mode_takes_the_largest_share_that_leaves_the_learner_room():
    """Sleep mode: vLLM's share sits beside the learner's rollout only, the learner's phases beside what vLLM keeps
    asleep. Auto takes the largest share (to 0.01) within 95% of the GPU; 0.01 more would not be."""
    cfg = qwen7b("generator.sleep_mode=true")
    p = plan(cfg)
    gpu = p.devices["cuda:0"]
    split = gpu.split
    capacity = 24 * GiB
    weights, work = generator_weight_bytes(p.shape, cfg), engine_work_bytes(p.shape, cfg, capacity)
    # independently: the learner's rollout-phase items (everything on the GPU but the engine's) plus share x GPU
    learner = sum(i.bytes for i in gpu.items if "engine" not in i.what and i.phase in (None, "rollout"))
    room = (capacity * (1 - AUTO_MARGIN) - learner + CUDA_CONTEXT) / capacity  # (the asleep part is inside the share)
    assert split.share == engine_share(cfg) == pytest.approx(int(room * 100) / 100) == 0.70
    assert gpu.phase_peak("rollout") <= capacity * (1 - AUTO_MARGIN) < gpu.phase_peak("rollout") + 0.01 * capacity
    assert all(gpu.phase_peak(ph) + 0 <= capacity * (1 - AUTO_MARGIN) for ph in ("logprobs", "backward"))
    kv = 0.70 * capacity - CUDA_CONTEXT - weights - work
    assert split.kv_tokens == int(kv // kv_token_bytes(p.shape, cfg)) == 1340
    assert split.sequences == 1340 // 1024 == 1 and split.feasible and p.fits
    text = " ".join(str(p).split())  # (the plan's text wraps its long lines between words at 120 columns)
    assert "vLLM 0.70 (auto)" in text and "1,340 tokens = 1 sequence of 1024" in text
    # the number the plan printed is what a number would plan, and what lab.placement shows before load
    assert (
        plan(qwen7b("generator.sleep_mode=true", "generator.gpu_memory_utilization=0.7")).devices["cuda:0"].total
        == gpu.total
    )
    assert "gpu_memory_utilization 0.70 (auto)" in repr(Placement(cfg))


def test_7b_colocated_on_24gb_awake_has_no_share_and_is_refused_naming_the_fix():
    """Without sleep mode vLLM's bf16 weights (14.2 GiB) and the learner's backward peak cannot share 24 GB: the plan
    says so, and load refuses in one line naming the knob that fits, before anything is fetched."""
    cfg = qwen7b()
    p = plan(cfg)
    split = p.devices["cuda:0"].split
    assert not split.feasible and not p.fits and split.minimum > split.largest
    assert p.fixes == ["generator.sleep_mode: true"]
    with pytest.raises(LabError) as err:
        engine_share(cfg)
    line = str(err.value)
    assert "\n" not in line and line.startswith("generator.gpu_memory_utilization: auto: cuda:0: no share")
    assert "needs 0.70" in line and "generator.sleep_mode: true" in line
    with pytest.raises(LabError, match="auto: cuda:0: no share"):
        Lab(cfg).load()  # refused in preflight: the 7B checkpoint is never looked for
    assert "no share fits" in repr(Placement(cfg))


def test_7b_with_a_share_below_vllms_minimum_does_not_fit():
    """A number too small for vLLM's weights, working memory and one sequence: vLLM would refuse to start."""
    p = plan(qwen7b("generator.sleep_mode=true", "generator.gpu_memory_utilization=0.5"))
    assert not p.fits and not p.devices["cuda:0"].split.feasible
    assert "it has 0.5" in str(p)


def test_qwq32b_two_gpu_preset_auto_takes_90_percent_of_its_own_gpu():
    """P1's preset: vLLM alone on cuda:1 (AWQ), so auto is vLLM's own default there; its KV cache as planned."""
    cfg = load_config(QWQ, ["generator.gpu_memory_utilization=auto"])
    p = plan(cfg)
    split = p.devices["cuda:1"].split
    capacity = 40 * GiB
    kv = (
        0.9 * capacity - CUDA_CONTEXT - generator_weight_bytes(p.shape, cfg) - engine_work_bytes(p.shape, cfg, capacity)
    )
    assert split.share == engine_share(cfg) == 0.9 and split.learner == 0
    assert split.kv_tokens == int(kv // kv_token_bytes(p.shape, cfg)) == 59934 and split.sequences == 23
    assert p.devices["cuda:0"].split is None and p.fits
    # as the preset's own 0.9
    assert plan(load_config(QWQ)).devices["cuda:1"].total == p.devices["cuda:1"].total


def test_qwq32b_tensor_parallel_over_the_learners_gpu_takes_one_share_bound_by_it():
    """vLLM over cuda:0 (the learner's) and cuda:1: one share for both GPUs, the learner's GPU decides it."""
    cfg = load_config(
        QWQ, ["placement.generator=[0, 1]", "generator.gpu_memory_utilization=auto", "generator.sleep_mode=true"]
    )
    p = plan(cfg)
    s0, s1 = p.devices["cuda:0"].split, p.devices["cuda:1"].split
    assert s0.share == s1.share == engine_share(cfg) < 0.9
    assert s0.largest < s1.largest and s0.share == int(s0.largest * 100) / 100
    assert s1.kv_tokens == s0.kv_tokens > 0 and p.fits


@pytest.mark.parametrize(
    "extra, message",
    [
        (["placement.generator=[cpu]"], "generator.gpu_memory_utilization: auto is a share of a GPU"),
        # a number was accepted and silently ignored: vLLM's CPU engine sizes its KV cache by generator.cpu_kv_cache_gib
        (
            ["placement.generator=[cpu]", "generator.gpu_memory_utilization=0.5"],
            "generator.gpu_memory_utilization: 0.5 is a share of a GPU.*runs on the CPU.*cpu_kv_cache_gib",
        ),
        (["generator.backend=hf"], "backend 'hf' samples with the learner's own weights"),
        (["generator.gpu_memory_utilization=1.5"], "generator.gpu_memory_utilization"),
        (["generator.gpu_memory_utilization=half"], "generator.gpu_memory_utilization"),
    ],
)
def test_bad_shares_are_refused_in_one_line(extra, message, capsys):
    with pytest.raises(ConfigError, match=message) as err:
        qwen7b(*extra)
    assert "\n" not in str(err.value)
    assert main(["plan", str(QWEN7B), *[a for o in COLOCATED + extra for a in ("--set", o)]]) == 2
    err_line = capsys.readouterr().err.strip()
    assert err_line.startswith("grpo-lab: error:") and "\n" not in err_line


def test_plan_recommends_auto_when_a_shared_gpu_has_no_share_set_and_run_refuses_it(capsys, tmp_path):
    """Unset on the learner's GPU: `grpo-lab plan` plans with auto and says so; a run needs the field set."""
    sets = ["generator.backend=vllm", "generator.sleep_mode=true", "generator.chunk_size=null"]
    args = [a for o in sets for a in ("--set", o)]
    assert main(["plan", str(QWEN7B), *args]) == 0
    out = capsys.readouterr().out
    assert "vLLM 0.70 (auto)" in out and out.strip().splitlines()[-1].startswith("recommended: generator.gpu_memory")
    assert main(["run", str(QWEN7B), *args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a memory share: auto" in err and "\n" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "backend,on_rank,handed",
    [("vllm", False, True), ("vllm", True, False), ("hf", False, False)],
)
def test_the_executor_hands_the_engine_the_share_the_plan_prints(monkeypatch, backend, on_rank, handed):
    """The generators stand below the planner, so the executor asks it and hands the share over: an engine with
    weights of its own starts with auto's share as `plan` prints it; a rank's sampler and the hf generator get none."""
    from grpo_lab.execution.local import start_generator

    got = {}

    class Recorder:
        def __init__(self, learner, config, **kwargs):
            got.update(kwargs, learner=learner)

    monkeypatch.setattr("grpo_lab.generation.backend_class", lambda name, on_rank=False: Recorder)
    cfg = qwen7b("generator.sleep_mode=true") if backend == "vllm" else load_config(QWEN7B, ["generator.backend=hf"])
    start_generator(cfg, "the learner", on_rank=on_rank)
    assert got.pop("learner") == "the learner"
    assert got == ({"gpu_share": plan(cfg).devices["cuda:0"].split.share} if handed else {}), got
    if handed:
        assert got["gpu_share"] == 0.70  # auto's number, not vLLM's default 0.9
