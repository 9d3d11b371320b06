"""bitsandbytes picks a 4-bit code path by CPU: with AVX-512-BF16, `Linear4bit.forward` repacks a
layer's nf4 weights into a CPU inference layout the first time it runs in eval mode without
gradients, and a training forward on that layout fails in autograd (`result += bias`).

These tests force the hardware flag bnb reads (`bitsandbytes.nn.modules.has_avx512bf16`, read
when a layer is built) both ways, so CI walks both paths whatever its CPU: every eval and/or no-grad
forward of the learner (the HF rollout in eval mode, the adapter-disabled reference without gradients;
old log-probs are the training forward's own) must be followed by a training step that works and
leaves no layer in the packed layout.
"""

import math

import pytest
import torch


@pytest.fixture(params=[True, False], ids=["avx512bf16", "no-avx512bf16"])
def cpu_flag(request, monkeypatch):
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: request.param)
    return request.param


def linear4bit_layers(model):
    import bitsandbytes as bnb

    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def assert_training_layout(model):
    layers = linear4bit_layers(model)
    assert layers, "expected bitsandbytes Linear4bit layers"
    packed = [m for m in layers if getattr(m.weight.quant_state, "packing_format_for_cpu", False)]
    assert not packed, f"{len(packed)} of {len(layers)} 4-bit layers were repacked into the CPU inference layout"


def lora_state(lab):
    return {n: p.detach().clone() for n, p in lab.learner.model.named_parameters() if "lora_" in n}


def varied_rollout(lab):
    """A rollout whose rewards differ: with equal rewards every advantage, and so the gradient, is 0 (the
    rollout restarts freely before the step's first update)."""
    for _ in range(10):
        rollout = lab.rollout()
        rewards = lab.rewards(rollout)
        if rewards.total.std() > 0:
            return rollout, rewards
    pytest.fail("ten rollouts in a row got equal rewards")


def train_and_check(lab, rollout, rewards, logprobs):
    before = lora_state(lab)
    stats = lab.backward(rollout, lab.advantages(rewards), logprobs)
    grad_norm = lab.optimizer()
    lab.sync()  # the step's last phase: the next rollout starts the next step
    assert math.isfinite(stats.loss) and math.isfinite(grad_norm) and grad_norm > 0
    after = lora_state(lab)
    assert any(not torch.equal(before[n], after[n]) for n in before), "the training step changed no LoRA weight"
    assert_training_layout(lab.learner.model)


def test_flag_reaches_the_layers(cpu_flag, loaded_lab):
    """The forced flag is what the layers were built with, so the paths below are the ones named."""
    lab = loaded_lab()
    # the learner pins its layers to the training layout; the flag bnb read at build time is kept aside
    assert all(getattr(m, "grpo_lab_cpu_flag", None) == cpu_flag for m in linear4bit_layers(lab.learner.model))


def test_hf_rollout_then_training_step(cpu_flag, loaded_lab):
    lab = loaded_lab(grpo={"beta": 0.0})
    for _ in range(2):  # any number of eval/no-grad forwards, each followed by a training step
        rollout, rewards = varied_rollout(lab)
        assert_training_layout(lab.learner.model)
        train_and_check(lab, rollout, rewards, lab.logprobs(rollout))


def test_adapter_disabled_reference_then_training_step(cpu_flag, loaded_lab):
    lab = loaded_lab(grpo={"beta": 0.04}, reference={"strategy": "adapter-disabled"})
    rollout, rewards = varied_rollout(lab)
    logprobs = lab.logprobs(rollout)  # the reference pass: no grad, adapter off
    assert logprobs.ref is not None
    train_and_check(lab, rollout, rewards, logprobs)


def test_whole_steps_with_old_logprobs(cpu_flag, loaded_lab):
    """num_iterations > 1: no-grad reference passes and rollouts between updates of the same layers."""
    lab = loaded_lab(grpo={"beta": 0.04, "num_iterations": 2})
    for _ in range(2):
        result = lab.step()
        assert math.isfinite(result.loss) and result.grad_norm > 0
    assert_training_layout(lab.learner.model)


@pytest.mark.slow
def test_vllm_reference_pass_then_training_step(cpu_flag, loaded_lab):
    """The vLLM backend never runs the learner to sample; the reference pass (no grad) and the first
    iteration's old log-probs (the training forward's own) do."""
    lab = loaded_lab(generator={"backend": "vllm"}, grpo={"num_iterations": 2, "beta": 0.04})
    try:
        rollout = lab.rollout()
        advantages = lab.advantages(lab.rewards(rollout))
        logprobs = lab.logprobs(rollout)
        assert logprobs.ref is not None and lab.current.old_logprobs is None
        before = lora_state(lab)
        lab.backward(rollout, advantages, logprobs)
        assert lab.current.old_logprobs is not None
        lab.optimizer()
        lab.backward(rollout, advantages, logprobs)
        lab.optimizer()
        lab.sync()
        assert any(not torch.equal(before[n], t) for n, t in lora_state(lab).items())
        assert_training_layout(lab.learner.model)
        assert math.isfinite(lab.step().loss)
    finally:
        lab.close()


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["avx2"])
def test_run_on_a_cpu_without_avx512(capability, tiny_model, tmp_path):
    """torch (and bnb, which reads torch's capability) choose kernels by the CPU's vector width; a
    machine without AVX-512 is forced here with ATEN_CPU_CAPABILITY so CI walks that path too."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    seen = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert seen.strip().lower() == capability, seen
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_lab",
            "run",
            "tiny-cpu",
            "--steps",
            "2",
            "--out",
            str(out),
            "--quiet",
            "--set",
            "grpo.num_iterations=2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)


# bnb decides at `import bitsandbytes` (backends/cpu/ops.py) whether to fetch its packed kernel from the hub, asking its
# native library's has_avx512bf16_cpu(): this makes the library answer yes before that import, on any CPU
FORCED = """
import importlib.machinery, runpy, sys

class ForceAvx512Bf16:
    def find_spec(self, name, path, target=None):
        if name != "bitsandbytes.cextension":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.lib.has_avx512bf16_cpu = lambda: True

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, ForceAvx512Bf16())
if sys.argv[1] == "unfiltered":  # the control: grpo_lab's filter disabled, then what a Lab's load imports first
    from grpo_lab.models import quant

    quant.DropStartingWith.filter = lambda self, record: True
    import bitsandbytes
else:  # the CLI, as `grpo-lab run ...`
    sys.argv = ["grpo-lab", *sys.argv[2:]]
    try:
        runpy.run_module("grpo_lab", run_name="__main__")
    finally:
        from bitsandbytes.functional import has_avx512bf16

        print("has_avx512bf16:", bool(has_avx512bf16()))
"""


def test_a_run_on_an_avx512bf16_cpu_prints_no_kernels_notice(tiny_config, tmp_path):
    """Issue 51: on an AVX-512-BF16 CPU `import bitsandbytes` logs "Failed to load CPU gemm_4bit_forward ... pip
    install kernels", and a Lab's load imported it (trl -> peft) before grpo_lab's filter was in place, so the line
    broke every one-line output. The CPU flag is forced in both processes; the control shows the line unfiltered."""
    import subprocess
    import sys

    import yaml

    cfg = tiny_config(
        generator={"max_completion_length": 8, "max_prompt_length": 64},
        grpo={"num_generations": 2, "prompts_per_step": 2},
        data={"num_prompts": 8},
        run={"steps": 1},
    )
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = {"unfiltered": [], "filtered": ["run", str(path), "--out", str(tmp_path / "run"), "--quiet"]}
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-c", FORCED, mode, *rest], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for mode, rest in args.items()
    }
    (control, control_err), (out, err) = (procs[mode].communicate(timeout=300) for mode in ("unfiltered", "filtered"))
    notice = "Failed to load CPU gemm_4bit_forward"
    assert procs["unfiltered"].returncode == 0 and control_err.count(notice) == 1, control_err[-3000:]
    assert procs["filtered"].returncode == 0 and "has_avx512bf16: True" in out, err[-3000:]
    assert notice not in err and "pip install kernels" not in err, err
