"""generator.hf_decode: merged and auto (issue 39's CPU part). The rollout copy (every 4-bit + LoRA linear dense, LoRA
merged) samples the tokens the learner's own paths sample, greedy and seeded, after the LoRA has moved; it leaves the
4-bit base and the LoRA bit for bit and is gone after the rollout; its bytes are a planned line; auto picks it where the
plan fits it; a copy the plan cannot fit is refused in one line naming the path that fits."""

from __future__ import annotations

import hashlib

import pytest
import torch

from grpo_lab import ConfigError, Lab, LabError, load_config

pytestmark = pytest.mark.xdist_group("rollout_copy")  # why: its tests share one loaded Lab (module-scoped)


def greedy_lab(model: str = "builtin:tiny-random", learner: str = "cpu") -> Lab:
    """A loaded float32 Lab sampling greedily, 2 prompts x 4, 24 tokens, its LoRA moved (`moved`)."""
    lab = Lab(
        {
            "model": {"name_or_path": model, "dtype": "float32", "bnb_4bit_compute_dtype": "float32"},
            "placement": {"learner": learner},
            "generator": {"max_completion_length": 24, "temperature": 0.0},
            "grpo": {"num_generations": 4, "prompts_per_step": 2},
        }
    ).load()
    moved(lab)
    return lab


@pytest.fixture(scope="module")
def lab(tiny_model):
    lab = greedy_lab(tiny_model)
    yield lab
    lab.close()


def moved(lab) -> None:
    """LoRA's B starts at zero, so a merge that dropped the delta would pass: moved weights make it count (0.2: greedy
    rows of 11 and 24 tokens, 15 distinct, none of them the base's)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in lab.executor.learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)


def rollout(lab, decode: str, temperature: float = 0.0):
    lab.configure({"generator.hf_decode": decode, "generator.temperature": temperature})
    torch.manual_seed(0)  # the rows' seeds (generation/base.row_seeds) come from torch's RNG: the same on every path
    return lab.rollout()  # (a restart rewinds the step's prompts: every path samples the same ones)


def digest(model) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_greedy_tokens_are_equal_on_every_path_and_the_merge_is_what_makes_them(lab):
    paths = {decode: rollout(lab, decode) for decode in ("dynamic", "static", "merged", "auto")}
    assert paths["dynamic"].completion_ids.unique().numel() > 5  # not one token repeated: a wrong merge would show
    for decode, out in paths.items():
        assert torch.equal(out.completion_ids, paths["dynamic"].completion_ids), decode
        torch.testing.assert_close(out.sampler_logprobs, paths["dynamic"].sampler_logprobs, rtol=0, atol=1e-4)
    # control: the base alone samples other tokens, so equal tokens above mean the LoRA was merged in
    model = lab.executor.learner.model
    with model.disable_adapter():
        base = rollout(lab, "dynamic")
    assert base.completion_ids.shape != paths["merged"].completion_ids.shape or not torch.equal(
        base.completion_ids, paths["merged"].completion_ids
    )


def test_a_seeded_sample_draws_the_same_tokens_and_log_probs_from_the_copy(lab):
    """Sampling at temperature 1: each row's seed gives the same tokens, and the sampler log-probs the learner's
    (float32: to rounding), so the mismatch metric the lab logs is unchanged by the path."""
    plain, merged = rollout(lab, "dynamic", 1.0), rollout(lab, "merged", 1.0)
    assert torch.equal(plain.completion_ids, merged.completion_ids)
    torch.testing.assert_close(plain.sampler_logprobs, merged.sampler_logprobs, rtol=0, atol=1e-4)


def test_a_merged_rollout_leaves_the_4bit_base_and_the_lora_bit_for_bit_and_releases_its_weights(lab):
    model = lab.executor.learner.model
    before = digest(model)
    assert any("absmax" in n or "quant_state" in n for n in model.state_dict())  # the 4-bit quant state is in it
    lab.configure({"generator.rollout_copy": "release"})  # (a kept copy: tests/test_kept_copy.py)
    try:
        rollout(lab, "merged")
    finally:
        lab.configure({"generator.rollout_copy": "auto"})
    assert digest(model) == before
    copy = lab.executor.generator.rollout_copy
    assert copy.module is not None and copy.held_bytes() == 0  # kept for the next rollout, its weights given back
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)  # the learner still trains


def test_three_merged_rollouts_in_one_lab_reuse_one_copy_refreshed_to_a_fresh_merge_bit_for_bit(tiny_model):
    """Compile once per Lab (issue 50): one module for every rollout, so torch.compile and CUDA graphs meet it again;
    at each rollout its weights are re-made in place from the LoRA of that moment, equal to a fresh merge bit for bit
    (a stale weight, or a refresh that skipped the LoRA, differs: the LoRA moves between rollouts here)."""
    from grpo_lab.generation.rollout_copy import merged_copy

    lab = greedy_lab(tiny_model)
    lab.configure({"generator.rollout_copy": "release"})  # (kept between rollouts: tests/test_kept_copy.py)
    try:
        copy, model = lab.executor.generator.rollout_copy, lab.executor.learner.model
        real, seen = copy.model_for, []

        def watched(source, decode, keep):  # compares the copy with a fresh merge while the rollout holds it
            context = real(source, decode, keep)

            class Watch:
                def __enter__(self):
                    module = context.__enter__()
                    fresh = merged_copy(source, copy.dtype)
                    same = all(
                        torch.equal(a, b) for a, b in zip(module.state_dict().values(), fresh.state_dict().values())
                    )
                    seen.append((id(module), same, copy.held_bytes()))
                    return module

                def __exit__(self, *exc):
                    return context.__exit__(*exc)

            return Watch()

        copy.model_for = watched
        tokens = []
        for shift in range(3):
            with torch.no_grad():  # the LoRA moves between rollouts, as an update would move it
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.add_(0.05 * (shift + 1))
            tokens.append(rollout(lab, "merged").completion_ids)
        assert len({module for module, _, _ in seen}) == 1 and copy.builds == 1, seen
        assert all(same and held > 0 for _, same, held in seen), seen
        assert copy.held_bytes() == 0
        assert not torch.equal(tokens[0], tokens[2]) or tokens[0].shape != tokens[2].shape  # the LoRA did move them
        copy.model_for = real
        assert torch.equal(rollout(lab, "dynamic").completion_ids, tokens[2])  # the last merge samples the learner's
    finally:
        lab.close()


def test_the_copy_shares_what_it_does_not_merge():
    """Embeddings, norms and rotary buffers are the learner's own tensors; only the linear layers are new."""
    from grpo_lab.generation.rollout_copy import merged_copy

    lab = Lab(
        {
            "model": {"name_or_path": "builtin:tiny-random", "dtype": "float32", "bnb_4bit_compute_dtype": "float32"},
            "grpo": {"num_generations": 2, "prompts_per_step": 1},
        }
    ).load()
    try:
        model = lab.executor.learner.model
        copy = merged_copy(model, torch.float32)
        base = model.get_base_model()
        assert copy.model.embed_tokens.weight is base.model.embed_tokens.weight
        assert copy.model.norm.weight is base.model.norm.weight
        assert copy.model.layers[0].self_attn.q_proj.weight is not base.model.layers[0].self_attn.q_proj.weight
        assert copy.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
        assert not any(
            p.requires_grad for p in copy.parameters() if p.data_ptr() not in {q.data_ptr() for q in base.parameters()}
        )
    finally:
        lab.close()


def test_the_plan_has_the_copys_line_and_auto_picks_the_copy_where_it_fits(tiny_model):
    from grpo_lab.planner import plan
    from grpo_lab.planner.estimate import DTYPE_BYTES
    from grpo_lab.planner.plan import rollout_decode

    def made(decode, *more):  # (a fixed micro-batch: an auto one would shrink to fit a tighter host)
        overrides = [f"model.name_or_path={tiny_model}", f"generator.hf_decode={decode}", "grpo.micro_batch_size=8"]
        return load_config("tiny-cpu", [*overrides, *more])

    copy = [i for i in plan(made("merged")).devices["host"].items if i.what == "rollout copy (LoRA merged)"]
    assert len(copy) == 1 and copy[0].phase is None  # kept where it fits (auto): resident (tests/test_kept_copy.py)
    shape = plan(made("merged")).shape
    largest = max(a * b for _, a, b in shape.linear_layers())
    assert copy[0].bytes == shape.linear_params * DTYPE_BYTES["float32"]
    merging = [i for i in plan(made("merged")).devices["host"].items if i.what == "rollout copy merge temporaries"]
    assert len(merging) == 1 and merging[0].bytes == 8 * largest and merging[0].phase == "rollout"
    assert not [i for i in plan(made("dynamic")).devices["host"].items if i.what.startswith("rollout copy")]
    assert rollout_decode(made("auto")) == "merged" and "decode merged (auto)" in str(plan(made("auto")))
    # a 7B learner (bundled shape, nothing loaded): a 24 GiB GPU fits the 13 GiB copy, a 16 GiB one only the 4-bit path
    from grpo_lab.preflight import check_rollout_copy

    def gpu(decode, gib):
        return load_config("qwen2.5-7b-nf4-24gb", [f"generator.hf_decode={decode}", f"placement.gpu_memory_gib={gib}"])

    copy = [i for i in plan(gpu("merged", 24)).devices["cuda:0"].items if i.what == "rollout copy (LoRA merged)"]
    assert 12 * 1024**3 < copy[0].bytes < 14 * 1024**3  # ~6.5 B linear weights in bfloat16
    assert rollout_decode(gpu("auto", 24)) == "merged" and rollout_decode(gpu("auto", 16)) == "compiled"
    assert plan(gpu("dynamic", 16)).fits and not plan(gpu("merged", 16)).fits
    check_rollout_copy(gpu("merged", 24))  # fits: nothing to say
    with pytest.raises(LabError) as err:
        check_rollout_copy(gpu("merged", 16))
    line = str(err.value)
    assert line.startswith("generator.hf_decode: merged needs a 1") and "on cuda:0" in line, line
    assert "use generator.hf_decode: compiled (fits)" in line and "park_learner" not in line and "\n" not in line
    with pytest.raises(LabError) as err:  # 18 GiB: parked, the copy fits (19.9 GiB planned unparked, 16.3 parked)
        check_rollout_copy(gpu("merged", 18))
    line = str(err.value)
    assert "use generator.park_learner: true" in line and "generator.hf_decode: compiled (fits)" in line, line
    check_rollout_copy(load_config(gpu("merged", 18), ["generator.park_learner=true"]))  # parked: nothing to say


def test_a_merged_rollout_on_a_sharded_learner_is_refused_in_one_line(tiny_config):
    cfg = load_config(tiny_config())
    with pytest.raises(ConfigError) as err:
        cfg.update({"generator.hf_decode": "merged", "placement.learner_procs": 2})
    assert "generator.hf_decode: 'merged' builds a rollout copy" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("avx512bf16", [True, False], ids=["avx512bf16", "no-avx512bf16"])
def test_the_copy_reads_the_4bit_weights_on_either_of_bitsandbytes_cpu_paths(avx512bf16, monkeypatch):
    """bitsandbytes picks a CPU 4-bit path by hardware (tests/test_bnb_cpu_paths.py): forced both ways, a merged
    greedy rollout samples what the learner's own forward samples, and no layer is left in the packed layout."""
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: avx512bf16)
    lab = greedy_lab()
    try:
        plain, merged = rollout(lab, "dynamic"), rollout(lab, "merged")
        assert torch.equal(plain.completion_ids, merged.completion_ids) and plain.completion_ids.unique().numel() > 5
        weights = [getattr(m, "weight", None) for m in lab.executor.learner.model.modules()]
        states = [w.quant_state for w in weights if getattr(w, "quant_state", None) is not None]
        assert states and not [s for s in states if getattr(s, "packing_format_for_cpu", False)]
        lab.step()  # the learner still trains after both
    finally:
        lab.close()


def test_a_run_says_which_path_auto_picked(tiny_model, tmp_path, capsys):
    from grpo_lab.cli import main

    args = ["run", "tiny-cpu", "--steps", "1", "--out", str(tmp_path / "run"), "--set", "generator.hf_decode=auto"]
    assert main([*args, "--set", f"model.name_or_path={tiny_model}"]) == 0
    err = capsys.readouterr().err
    assert "rollout: hf decode merged (generator.hf_decode: auto; the plan fits the rollout copy)" in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_copy_with_cuda_graphs_samples_the_learners_greedy_tokens(tiny_model):
    """On a GPU `merged` decodes its copy with CUDA graphs (static cache, torch.compile reduce-overhead): greedy tokens
    equal the 4-bit path's."""
    lab = greedy_lab(tiny_model, learner="cuda:0")
    try:
        plain, merged = rollout(lab, "dynamic"), rollout(lab, "merged")
        assert torch.equal(plain.completion_ids, merged.completion_ids)
    finally:
        lab.close()
