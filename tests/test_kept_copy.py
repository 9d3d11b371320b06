"""generator.rollout_copy (issue 71): a merged rollout copy the plan keeps between rollouts stays put: each refresh
writes the fresh merge into its storage, so from rollout 2 on every weight and the KV cache keep their addresses (what
CUDA graphs need to replay), and it never serves a stale merge; released, the step's metrics say so; the plan holds a
kept copy resident, auto picks keep or release from the plan, and a kept copy the plan cannot fit is refused in one
line."""

from __future__ import annotations

import pytest
import torch

from grpo_lab import Lab, LabError, load_config

pytestmark = pytest.mark.xdist_group("kept_copy")


def merged_lab(tiny_model, copy: str) -> Lab:
    """A float32 Lab decoding from the merged copy (kept or released), greedy, 2 prompts x 4, 12 tokens."""
    return Lab(
        {
            "model": {"name_or_path": tiny_model, "dtype": "float32", "bnb_4bit_compute_dtype": "float32"},
            "generator": {"max_completion_length": 12, "temperature": 0.0, "hf_decode": "merged", "rollout_copy": copy},
            "grpo": {"num_generations": 4, "prompts_per_step": 2},
        }
    ).load()


def test_a_kept_copy_keeps_its_weight_and_cache_addresses_and_serves_the_learners_merge_at_every_rollout(
    tiny_model, monkeypatch
):
    """Three steps with the copy kept, decoding as on a GPU (a static cache; CUDA graphs are what the CPU lacks): a spy
    on transformers' GenerationMixin.generate sees one set of weight and cache addresses from rollout 2 on, and a copy
    equal to a fresh merge of the learner's LoRA of that moment (a refresh that skipped a weight would serve the last
    step's merge: the LoRA moves at every step here)."""
    from transformers.generation.utils import GenerationMixin

    from grpo_lab.generation import hf
    from grpo_lab.generation.rollout_copy import merged_copy

    # why: on the CPU merged decodes with the growing cache; a GPU's static cache, without its compile, is what keeps
    # the cache's addresses, and the path under test
    monkeypatch.setitem(hf.DECODES, "merged", lambda cuda: {"cache_implementation": "static", "disable_compile": True})
    lab = merged_lab(tiny_model, "keep")
    try:
        learner, copy = lab.executor.learner.model, lab.executor.generator.rollout_copy
        real, seen = GenerationMixin.generate, []

        def spied(self, *args, **kwargs):
            fresh = merged_copy(learner, copy.dtype).state_dict()
            stale = [n for n, t in self.state_dict().items() if not torch.equal(t, fresh[n])]
            out = real(self, *args, **kwargs)
            cache = kwargs["past_key_values"]
            weights = [p.data_ptr() for p in self.parameters()]
            seen.append((weights, [(c.keys.data_ptr(), c.values.data_ptr()) for c in cache.layers], stale))
            return out

        monkeypatch.setattr(GenerationMixin, "generate", spied)
        results = []
        for shift in range(3):
            with torch.no_grad():  # the LoRA moves between rollouts (a greedy group's update is 0: all rows alike)
                for name, p in learner.named_parameters():
                    if "lora_B" in name:
                        p.add_(0.05 * (shift + 1))
            results.append(lab.step())
        assert len(seen) == 3, len(seen)  # one generate() call per rollout
        assert all(not stale for _, _, stale in seen), [stale[:3] for _, _, stale in seen]
        assert seen[1][0] == seen[2][0] and seen[1][1] == seen[2][1]  # weights and cache stayed put from rollout 2 on
        assert seen[0][0] == seen[1][0]  # (kept from its build at rollout 1)
        assert copy.builds == 1 and copy.held_bytes() > 0  # kept between rollouts
        assert lab.executor.generator.static_cache is not None  # its cache kept with it
        assert all(r.rollout_copy == "kept" and r.cudagraph_recordings_expected == 0 for r in results)
        assert results[-1].metrics()["rollout_copy"] == "kept"
    finally:
        lab.close()


def test_a_kept_copy_samples_what_a_released_one_and_the_learner_sample(tiny_model):
    """The same greedy tokens from the learner's own path, a released copy and a kept one refreshed twice; released,
    the step's metrics say so (on a GPU: one CUDA graph recording per rollout expected; none on the CPU)."""
    lab = merged_lab(tiny_model, "release")
    try:
        tokens = {}
        for decode, copy in (("dynamic", "auto"), ("merged", "release"), ("merged", "keep")):
            lab.configure({"generator.hf_decode": decode, "generator.rollout_copy": copy})
            for _ in range(2):  # the second rollout of a kept copy decodes from its refreshed storage
                torch.manual_seed(0)
                out = lab.rollout()
            tokens[copy] = out
        assert tokens["release"].rollout_copy == "released" and tokens["keep"].rollout_copy == "kept"
        assert tokens["auto"].rollout_copy == ""  # no copy on the learner's own path
        for copy in ("release", "keep"):
            assert torch.equal(tokens[copy].completion_ids, tokens["auto"].completion_ids), copy
        held = lab.executor.generator.rollout_copy.held_bytes()
        lab.configure({"generator.rollout_copy": "release"})
        lab.rollout()  # the step's rollout, again (a restart: no update applied yet), with the copy released
        result = lab.step()  # the rest of the step, on that rollout
        assert held > 0 and lab.executor.generator.rollout_copy.held_bytes() == 0  # released after the rollout
        assert result.rollout_copy == "released" and result.cudagraph_recordings_expected == 0  # a CPU: no graphs
        lab.configure({"generator.rollout_copy": "keep"})
        lab.rollout()
        assert lab.executor.generator.rollout_copy.held_bytes() > 0
        lab.configure({"generator.hf_decode": "dynamic", "generator.rollout_copy": "auto"})
        lab.rollout()  # another path: a kept copy is on none of its plan lines, so it is let go
        assert lab.executor.generator.rollout_copy.held_bytes() == 0
    finally:
        lab.close()


def test_the_plan_holds_a_kept_copy_resident_and_auto_keeps_it_where_it_fits(tiny_model):
    from grpo_lab.planner import plan
    from grpo_lab.planner.learner_items import RELEASED_COPY_GRAPH_POOL
    from grpo_lab.planner.plan import rollout_copy_mode

    def made(copy, *more):  # (a fixed micro-batch: an auto one would shrink to fit a tighter host)
        overrides = [f"model.name_or_path={tiny_model}", "generator.hf_decode=merged", f"generator.rollout_copy={copy}"]
        return load_config("tiny-cpu", [*overrides, "grpo.micro_batch_size=8", *more])

    def line(result, device, what):
        return next(i for i in result.devices[device].items if i.what == what)

    kept, released = plan(made("keep")), plan(made("release"))
    assert line(kept, "host", "rollout copy (LoRA merged)").phase is None  # resident: held through every phase
    assert line(released, "host", "rollout copy (LoRA merged)").phase == "rollout"
    assert line(kept, "host", "generation KV cache").phase == "rollout"  # a CPU's growing cache is not kept
    assert kept.devices["host"].phase_peak("backward") > released.devices["host"].phase_peak("backward")
    assert rollout_copy_mode(made("auto")) == "keep" and "copy kept (auto)" in str(plan(made("auto")))
    # what a released copy leaves: nothing on the CPU (no CUDA graphs), and the line says so
    pool = line(released, "host", "released copy: CUDA graph pool")
    assert pool.bytes == 0 and pool.phase is None and "0 on the CPU" in pool.note
    assert not [i for i in kept.devices["host"].items if i.what == "released copy: CUDA graph pool"]
    assert rollout_copy_mode(load_config(made("auto"), ["generator.hf_decode=dynamic"])) == "release"

    # a 7B learner (bundled shape): on 21 GiB the copy fits only released (21.4 GiB kept, 20.2 released), and auto
    # releases it; on 24 GiB it is kept
    def gpu(copy, gib):
        return load_config(
            "qwen2.5-7b-nf4-24gb",
            ["generator.hf_decode=merged", f"generator.rollout_copy={copy}", f"placement.gpu_memory_gib={gib}"],
        )

    assert line(plan(gpu("keep", 24)), "cuda:0", "generation KV cache").phase is None  # kept with the copy on a GPU
    assert plan(gpu("keep", 24)).fits and rollout_copy_mode(gpu("auto", 24)) == "keep"
    assert not plan(gpu("keep", 21)).fits and plan(gpu("release", 21)).fits
    assert rollout_copy_mode(gpu("auto", 21)) == "release" and "copy released (auto)" in str(plan(gpu("auto", 21)))
    pool = line(plan(gpu("release", 21)), "cuda:0", "released copy: CUDA graph pool")  # resident: torch keeps it
    assert pool.bytes == RELEASED_COPY_GRAPH_POOL and pool.phase is None
    assert not [i for i in plan(gpu("keep", 24)).devices["cuda:0"].items if i.what.startswith("released copy")]


def test_a_kept_copy_the_plan_cannot_fit_is_refused_in_one_line_with_its_figure_and_the_fix():
    from grpo_lab.preflight import check_rollout_copy

    def gpu(copy):
        return load_config(
            "qwen2.5-7b-nf4-24gb",
            ["generator.hf_decode=merged", f"generator.rollout_copy={copy}", "placement.gpu_memory_gib=21"],
        )

    check_rollout_copy(gpu("release"))  # fits: nothing to say
    check_rollout_copy(gpu("auto"))
    with pytest.raises(LabError) as err:
        check_rollout_copy(gpu("keep"))
    line = str(err.value)
    assert line.startswith("generator.rollout_copy: keep holds the 1") and "GiB rollout copy on cuda:0" in line, line
    assert "use generator.rollout_copy: release (fits" in line and "\n" not in line


def test_keep_without_the_merged_copy_is_refused_in_one_line():
    from grpo_lab import ConfigError

    with pytest.raises(ConfigError) as caught:
        load_config("tiny-cpu", ["generator.hf_decode=dynamic", "generator.rollout_copy=keep"])
    message = str(caught.value)
    assert "generator.rollout_copy: keep" in message and "generator.hf_decode: merged" in message
    assert "\n" not in message


def test_a_run_says_whether_auto_keeps_the_copy(capsys):
    from grpo_lab.runner import say_decode

    def gpu(gib):
        return load_config("qwen2.5-7b-nf4-24gb", ["generator.hf_decode=merged", f"placement.gpu_memory_gib={gib}"])

    say_decode(gpu(24))
    say_decode(gpu(21))
    say_decode(load_config(gpu(21), ["generator.rollout_copy=release"]))  # set, not auto: nothing to say
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "rollout: the merged copy kept between rollouts (generator.rollout_copy: auto; the plan fits it beside the "
        "learner's phases)",
        "rollout: the merged copy released after each rollout (generator.rollout_copy: auto; the plan fits it in the "
        "rollout alone)",
    ], lines
