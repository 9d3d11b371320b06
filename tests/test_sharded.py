"""The sharded learner (placement.learner_procs > 1): FSDP2 over 2 gloo CPU processes, driven from one Lab.

Real parts throughout: each rank is a fresh Python process with its own 4-bit (nf4) LoRA learner sharded by
torch's fully_shard, talking over gloo; the reference is one process of the same config and seed."""

from __future__ import annotations

import pytest
import torch

from grpo_lab import Lab, cli
from grpo_lab.errors import LabError

pytestmark = [pytest.mark.solo, pytest.mark.xdist_group("ranks")]  # why solo: it starts Ray, two ranks

SHARDED = ["placement.learner_procs=2"]
# why these tolerances: the two ranks' gradients are summed by gloo in another order than one process sums the
# whole batch (float32, ~1e-7 relative, docs/fsdp2.md); AdamW turns a gradient into an update of about
# learning_rate x sign, so a weight whose gradient is ~0 may move by up to 2 x 1e-4 differently
LOSS_TOL = dict(rel=1e-5, abs=1e-6)
LORA_TOL = 1e-6


def whole(shards: list[dict]) -> dict:
    """The whole LoRA tensors from every rank's dim-0 shards (FSDP2's Shard(0), in rank order)."""
    return {name: torch.cat([rank["lora"][name] for rank in shards]) for name in shards[0]["lora"]}


def same_state(a: dict, b: dict) -> bool:
    """Bit-identical LoRA shards and AdamW state of one rank."""
    if a["lora"].keys() != b["lora"].keys() or not all(torch.equal(a["lora"][n], b["lora"][n]) for n in a["lora"]):
        return False
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[i][k], sb[i][k]) if isinstance(sa[i][k], torch.Tensor) else sa[i][k] == sb[i][k]
        for i in sa
        for k in sa[i]
    )


@pytest.fixture(autouse=True)
def _ray(request):
    """Labs with ranks run on the session's local Ray (conftest.ray_local); pure tests start none."""
    if "slow" in request.keywords:
        request.getfixturevalue("ray_local")


@pytest.fixture(scope="module")
def one_process():
    """Two steps of tiny-cpu in one process: what the sharded runs must reproduce."""
    lab = Lab("tiny-cpu").load()
    try:
        results = [lab.step() for _ in range(2)]
        lora = {n: p.detach().clone() for n, p in lab.learner.trainable_parameters().items()}
    finally:
        lab.close()
    return results, lora


@pytest.mark.slow
@pytest.mark.cores(2)
def test_two_ranks_train_like_one_process(one_process):
    results, lora = one_process
    lab = Lab("tiny-cpu", overrides=SHARDED).load()
    try:
        sharded = [lab.step() for _ in range(2)]
        shards = lab.inspect()
    finally:
        lab.close()
    assert len(shards) == 2 and all(s["layout"]["sharded"] and all(s["layout"]["sharded"]) for s in shards)
    for mine, theirs in zip(sharded, results):
        assert mine.completion_length_mean == theirs.completion_length_mean  # the same completions were sampled
        assert mine.reward_mean == theirs.reward_mean and mine.rewards == theirs.rewards
        assert mine.loss == pytest.approx(theirs.loss, **LOSS_TOL)
        assert mine.grad_norm == pytest.approx(theirs.grad_norm, **LOSS_TOL)
    merged = whole(shards)
    assert merged.keys() == lora.keys()
    worst = max((merged[n] - lora[n]).abs().max().item() for n in lora)
    moved = max((lora[n] - 0).abs().max().item() for n in lora if "lora_B" in n)
    assert moved > 1e-5  # the steps did change the weights (B starts at 0)
    assert worst <= LORA_TOL, worst
    # every rank's memory is in the driver's sampler, per phase
    devices = {r["device"] for r in sharded[-1].memory}
    assert {"rank0/host", "rank1/host", "host"} <= devices
    assert {r["phase"] for r in sharded[-1].memory if r["device"] == "rank1/host"} >= {"rollout", "backward", "sync"}


@pytest.mark.slow
@pytest.mark.cores(2)
def test_gather_on_and_off_sample_the_same_and_a_failed_generation_leaves_every_rank_as_it_was():
    lab = Lab("tiny-cpu", overrides=SHARDED + ["generator.temperature=0"]).load()
    try:
        before = lab.inspect()
        gathered = lab.rollout().completions
        after_gathered = lab.inspect()
        lab.configure(generator={"gather_for_generation": False, "chunk_size": 1})  # greedy: chunks change nothing
        streamed = lab.memory.streamed
        sharded = lab.rollout().completions  # a rollout may be redone until the step's first update
        after_sharded = lab.inspect()
        assert gathered == sharded
        # the setting took effect: every rank gathered every unit whole for the first rollout, none for the second
        for b, g, s in zip(before, after_gathered, after_sharded):
            assert g["whole_gathers"] == b["whole_gathers"] + 1 and s["whole_gathers"] == g["whole_gathers"]
        # ~2 s of rollout (8 calls through the shards): each rank's samples also came while it ran, for the live plot
        assert lab.memory.streamed >= streamed + 2, lab.memory.streamed - streamed
        lab.configure(generator={"chunk_size": None})
        for gather in (True, False):
            lab.configure(generator={"gather_for_generation": gather})
            for rank in (0, 1):
                lab.arm_fault(rank, "rollout", "runtime")  # raises at the third decoding step, inside generate
            with pytest.raises(LabError, match="rollout failed on every rank: RuntimeError: injected failure"):
                lab.rollout()
            after = lab.inspect()
            for b, a in zip(before, after):
                assert a["layout"] == b["layout"]  # sharded, same reshard settings, mode and checkpointing
                assert same_state(a, b)
        assert all(before[0]["layout"]["sharded"]) and before[0]["layout"]["training"]
        result = lab.step()
        assert result.step == 0 and result.attempts == 5  # every redone or failed rollout was filed as an attempt
    finally:
        lab.close()


@pytest.mark.slow
@pytest.mark.cores(2)
def test_an_oom_on_rank_1_in_backward_puts_every_rank_back_bit_for_bit_and_the_step_runs_again(one_process):
    results, _ = one_process
    lab = Lab("tiny-cpu", overrides=SHARDED).load()
    try:
        lab.step()
        before = lab.inspect()
        lab.arm_fault(1, "backward", "oom")
        with pytest.raises(
            LabError, match=r"backward failed on rank 1: .*out of memory.*every rank was restarted"
        ) as err:
            lab.step()
        assert "\n" not in str(err.value)
        after = lab.inspect()
        assert [a["step"] for a in after] == [1, 1]
        assert all(same_state(a, b) for a, b in zip(after, before))
        again = lab.step()  # the step again, from the same RNG state and prompt order: the one-process step 1
        assert again.step == 1 and again.attempts == 2
        assert again.reward_mean == results[1].reward_mean
        assert again.loss == pytest.approx(results[1].loss, **LOSS_TOL)
        assert [r for r in lab.memory.rows_for(1, failed_attempts=True) if r["device"] == "rank1/host"]
    finally:
        lab.close()


@pytest.mark.slow
@pytest.mark.timeout(900)  # why so long: a hang guard; beside two busy loops the fixture and load take minutes
@pytest.mark.cores(2)
@pytest.mark.usefixtures("python_sigint")  # why: a suite started in the background inherits SIGINT ignored
def test_an_interrupt_mid_phase_stops_every_rank_and_the_next_command_starts_them_from_the_step_start(one_process):
    """Jupyter's interrupt (and a terminal's Ctrl-C) sends SIGINT to the kernel's process group; the rank actors are
    Ray's processes, but the worst case (SIGINT reaching them too) is sent here: the kernel must stay usable, no late
    reply may answer its next command, and the step must run again exactly. The interrupt is sent once both ranks are
    seen running the rollout (their samples of it reached the driver): a state, not a delay (a fixed delay once landed
    after a quick rollout had returned; on a busy machine, before the ranks began)."""
    import os
    import signal
    import threading
    import time

    results, _ = one_process
    lab = Lab("tiny-cpu", overrides=SHARDED).load()
    try:
        before = lab.inspect()
        pids = list(lab.executor.ranks.pids)
        lab.configure(generator={"gather_for_generation": False, "chunk_size": 1})  # ~2 s of rollout when idle
        sent = []

        def ranks_in_rollout() -> set:
            return {d.split("/")[0] for _, _, phase, d, _, _ in list(lab.memory.samples) if phase == "rollout"} & {
                "rank0",
                "rank1",
            }

        def interrupt_mid_rollout():
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and ranks_in_rollout() != {"rank0", "rank1"}:
                time.sleep(0.01)
            sent.append(lab.memory.running())  # the driver is still in the rollout (asserted below)
            for pid in [os.getpid(), *pids]:  # the kernel's first: the worst order for a lost interrupt is both
                os.kill(pid, signal.SIGINT)

        interrupt = threading.Thread(target=interrupt_mid_rollout)
        interrupt.start()
        with pytest.raises(KeyboardInterrupt) as err:
            lab.rollout()
        interrupt.join()
        assert sent and sent[0] is not None and sent[0][1] == "rollout", sent  # sent while the rollout ran
        assert "every rank was stopped" in "".join(getattr(err.value, "__notes__", [])), err.value
        # every rank stopped, started at the next command
        assert not lab.executor.ranks.actors and lab.executor.ranks.down
        after = lab.inspect()  # the next command starts the ranks again, each from its state at the step's start
        assert all(same_state(a, b) for a, b in zip(after, before)) and [a["step"] for a in after] == [0, 0]
        lab.configure(generator={"gather_for_generation": True, "chunk_size": None})
        again = lab.step()
        assert again.step == 0 and again.attempts == 2  # the interrupted rollout is filed as an attempt
        assert again.reward_mean == results[0].reward_mean
        assert again.loss == pytest.approx(results[0].loss, **LOSS_TOL)
    finally:
        lab.close()


@pytest.mark.slow
@pytest.mark.cores(2)
def test_the_cli_runs_sharded_and_resumes_from_its_gathered_checkpoint(one_process, tmp_path):
    """grpo-lab run drives the same ranks; its checkpoint is whole (one-process format), and a resumed run goes on
    exactly as the uninterrupted one-process run."""
    import json

    results, _ = one_process
    out = tmp_path / "run"
    assert cli.main(["run", "tiny-cpu", "--steps", "1", "--out", str(out), "--set", *SHARDED]) == 0
    assert cli.main(["run", "--resume", str(out), "--steps", "2"]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    for mine, theirs in zip(metrics, results):
        assert mine["loss"] == pytest.approx(theirs.loss, **LOSS_TOL)
        assert mine["grad_norm"] == pytest.approx(theirs.grad_norm, **LOSS_TOL)
    assert "rank1/host" in (out / "memory.csv").read_text()


@pytest.mark.slow
@pytest.mark.cores(2)
def test_a_vllm_engine_samples_for_every_rank_and_syncs_only_the_lora_tensors():
    """generator.backend: vllm with 2 ranks: one engine, in the driver, answers both ranks' rollouts; its sync gathers
    the LoRA shards into an adapter (never the base weights). Two steps equal one process with the same engine."""
    from safetensors import safe_open

    vllm = ["generator.backend=vllm"]
    one = Lab("tiny-cpu", overrides=vllm).load()
    try:
        expected = [one.step() for _ in range(2)]
        lora = {n: p.detach().clone() for n, p in one.learner.trainable_parameters().items()}
    finally:
        one.close()
    lab = Lab("tiny-cpu", overrides=vllm + SHARDED).load()
    try:
        assert type(lab.executor).__name__ == "RankExecutor" and lab.generator is not None
        sharded = [lab.step()]
        with pytest.raises(LabError, match="this vLLM engine was started for"):  # the driver's engine checks live edits
            lab.configure(generator={"max_completion_length": 100000})
        with pytest.raises(LabError, match="arm_fault: a rollout fault goes into a rank's hf decoding"):
            lab.arm_fault(0, "rollout")
        lab.arm_fault(1, "backward", "oom")
        with pytest.raises(LabError, match="backward failed on rank 1: .*every rank was restarted"):
            lab.step()
        sharded.append(lab.step())  # restarted ranks, the engine synced again: the step as if nothing had happened
        assert sharded[-1].attempts == 2
        adapter = lab.generator.lora_request.lora_path  # what the engine samples the next rollout with
        with safe_open(f"{adapter}/adapter_model.safetensors", "pt") as f:
            sent = {k: f.get_tensor(k) for k in f.keys()}
        merged = whole(lab.inspect())
    finally:
        lab.close()
    for mine, theirs in zip(sharded, expected):
        assert mine.rewards == theirs.rewards and mine.completion_length_mean == theirs.completion_length_mean
        assert mine.loss == pytest.approx(theirs.loss, **LOSS_TOL)
        assert mine.logprob_mismatch == pytest.approx(theirs.logprob_mismatch, rel=1e-4)  # the engine had the update
    assert max((merged[n] - lora[n]).abs().max().item() for n in lora) <= LORA_TOL
    assert sent and all("lora_" in k for k in sent)  # LoRA tensors only...
    assert sum(t.numel() for t in sent.values()) == sum(t.numel() for t in lora.values())  # ...all of them, whole


@pytest.mark.slow
@pytest.mark.cores(2)
def test_the_reference_copy_is_sharded_like_the_policy_and_scores_as_the_base():
    """P5: the copy is prepared by the policy's own function, so every base parameter is sharded the same way; and
    after an update, when the policy no longer scores as the base, the copy still does (= adapter-disabled)."""
    lab = Lab("tiny-cpu", overrides=SHARDED + ["reference.strategy=copy", "grpo.learning_rate=0.05"]).load()
    try:
        for rank in lab.inspect():
            placements = rank["placements"]
            assert rank["reference_placements"] == placements
            assert all(p == "(Shard(dim=0),)" for p in placements.values()), set(placements.values())
        lab.step()  # an update: the policy leaves the base
        rollout = lab.rollout()
        lab.advantages(lab.rewards(rollout))
        copy = lab.logprobs(rollout).ref
        lab.configure({"reference.strategy": "adapter-disabled"})
        disabled = lab.logprobs(rollout).ref
        mask = rollout.completion_mask.bool()
        assert copy.shape == disabled.shape == rollout.completion_ids.shape
        assert (copy - disabled)[mask].abs().max().item() <= 1e-5
        # the hf rollout sampled with the updated policy at temperature 1: its log-probs are the
        # policy's, not the base's
        assert (rollout.sampler_logprobs - copy)[mask].abs().max().item() > 1e-3
    finally:
        lab.close()


def test_a_reference_left_on_another_device_type_is_refused_in_one_line(tiny_model):
    """P5 on a CPU: a copy that skipped preparation sits where it was created (here the meta device, as FSDP's
    memory-efficient loading leaves every rank but the first), and fails deep inside torch; the check says why."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_lab.models.fsdp import check_reference_devices

    with torch.device("meta"):
        naive = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model))
    policy_logps = torch.zeros(1, 3)
    with pytest.raises((RuntimeError, NotImplementedError)):  # the P5 failure: its log-probs meet the policy's
        ref = naive(input_ids=torch.tensor([[1, 2, 3]])).logits.log_softmax(-1)[..., 0]
        (policy_logps - ref).cpu()
    with pytest.raises(
        LabError, match=r"reference: model\.embed_tokens\.weight is on meta, the policy computes on cpu \(P5"
    ):
        check_reference_devices(naive, torch.device("cpu"))
    plain = AutoModelForCausalLM.from_pretrained(tiny_model)
    check_reference_devices(plain, torch.device("cpu"))  # a copy where the policy is passes


def test_the_driver_keeps_the_boundary_states_of_the_last_two_step_starts_and_a_rank_restores_the_one_asked():
    """The driver restarts its ranks from the step it is at, which may be one behind a rank that already returned the
    next step's state at the end of sync (interrupted before its reply was read)."""
    from grpo_lab.execution.sharded.ranks import Ranks
    from grpo_lab.rank import boundary_state, restore_boundary

    lab, fresh = Lab("tiny-cpu").load(), Lab("tiny-cpu").load()
    try:
        ranks = Ranks(lab.config.to_dict(), 2, memory=None)
        lora = []
        for _ in range(3):
            ranks._keep(lab.step_index, [boundary_state(lab), b""])
            lora.append({n: p.detach().clone() for n, p in lab.learner.trainable_parameters().items()})
            lab.step()
        assert sorted(ranks.boundaries) == [1, 2]
        restore_boundary(fresh, ranks.boundaries[1][0])
        assert fresh.step_index == 1
        assert all(torch.equal(p, lora[1][n]) for n, p in fresh.learner.trainable_parameters().items())
        with pytest.raises(LabError, match="cannot start from step 0: no boundary state of it is held"):
            ranks.start(restore=0)
    finally:
        lab.close()
        fresh.close()


# --- bad input: one line, exit 2, before any process starts ----------------------------------------


@pytest.fixture
def no_ranks(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a rank process started")

    monkeypatch.setattr("grpo_lab.execution.sharded.ranks.Ranks.start", refuse)
    monkeypatch.setattr("grpo_lab.lab.Lab.load", lambda self: (_ for _ in ()).throw(AssertionError("a model loaded")))


def refused(capsys, *sets) -> str:
    argv = ["run", "tiny-cpu", "--steps", "1", "--out", "/tmp/grpo-lab-never-written"]
    for item in sets:
        argv += ["--set", item]
    code = cli.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("grpo-lab: error:"), err
    return lines[0]


def test_more_cpu_ranks_than_cores_is_one_line(capsys, no_ranks, monkeypatch):
    monkeypatch.setattr("grpo_lab.checks.world.usable_cpus", lambda: 2)
    line = refused(capsys, "placement.learner_procs=4")
    assert "placement.learner_procs: 4 CPU ranks on 2 usable CPU core(s)" in line and "use at most 2" in line


def test_more_gpu_ranks_than_gpus_is_one_line(capsys, no_ranks, monkeypatch):
    from grpo_lab.config.loading import load_config

    monkeypatch.setattr("grpo_lab.checks.world.check_engine", lambda learner: None)  # this CPU torch has no NCCL
    monkeypatch.setattr("grpo_lab.checks.devices.cuda_device_count", lambda: 2)  # a machine with 2 GPUs
    line = refused(capsys, "placement.learner=cuda:1", "placement.learner_procs=2")  # through the CLI: exit 2
    assert (
        "placement.learner_procs: 2 ranks from cuda:1 need cuda:1..cuda:2, but this machine has 2 CUDA device(s); "
        "use at most 1 ranks"
    ) in line
    from grpo_lab.checks.world import check_ranks

    check_ranks(load_config("tiny-cpu", ["placement.learner=cuda:0", "placement.learner_procs=2"]), cuda_count=2)


def test_a_sharding_engine_that_is_not_installed_is_one_line(capsys, no_ranks, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", None)  # import fails as on a torch without FSDP2
    line = refused(capsys, "placement.learner_procs=2")
    assert "sharding needs FSDP2 (torch.distributed.fsdp.fully_shard" in line and "placement.learner_procs: 1" in line


@pytest.mark.parametrize(
    "sets, words",
    [
        (
            ["generator.backend=vllm", "placement.learner=cuda:0", "placement.learner_procs=2"],
            "placement.generator: cuda:0 is a learner rank's GPU",
        ),
        (
            [
                "generator.backend=vllm",
                "placement.learner=cuda:0",
                "placement.learner_procs=2",
                "placement.generator=[1]",
            ],
            "placement.generator: cuda:1 is a learner rank's GPU",
        ),
        (["generator.backend=vllm", "placement.learner_procs=2", "generator.sleep_mode=true"], "generator.sleep_mode"),
        (
            ["generator.backend=vllm", "placement.learner_procs=2", "generator.gather_for_generation=false"],
            "the vLLM engine has weights of its own",
        ),
        (["placement.learner_procs=3"], "ranks need a batch they split evenly"),
        (["placement.learner_procs=2", "reference.strategy=copy", "reference.device=cpu"], "reference.device"),
    ],
)
def test_what_a_sharded_learner_cannot_do_is_one_line(capsys, no_ranks, sets, words):
    line = refused(capsys, *sets)
    assert words in line


@pytest.mark.cores(2)
def test_a_sharded_lab_refuses_reward_functions_it_cannot_send(no_ranks):
    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    lab = Lab("tiny-cpu", reward_funcs=[reward], overrides=SHARDED)
    with pytest.raises(LabError, match="reward_funcs: a sharded Lab's ranks are processes"):
        type(lab)._load(lab)


@pytest.mark.slow
@pytest.mark.cores(2)
def test_failures_on_ranks_are_decided_together_and_leave_no_rank_behind(one_process):
    """Who decides (runtime.agree): a NaN loss on rank 1's rows only is refused by every rank in the same step, in
    one line, with no restart; faults in the reference pass and inside a sharded forward (after FSDP's pre-forward
    has gathered the layer) fail every rank at once and reset FSDP's state; the steps then equal one process's."""
    results, lora = one_process
    lab = Lab("tiny-cpu", overrides=SHARDED).load()
    try:
        pids = list(lab.executor.ranks.pids)
        lab.arm_fault(1, "backward", "nan")
        with pytest.raises(LabError) as err:
            lab.step()
        line = str(err.value)
        assert "\n" not in line and "backward failed on every rank" in line, line
        assert "loss is non-finite on rank 1's rows at step 0; the step was refused" in line, line
        assert lab.executor.ranks.pids == pids  # no rank restarted
        first = lab.step()  # the next try runs
        for rank in (0, 1):  # bug 10: a logprobs fault reaches the reference pass
            lab.arm_fault(rank, "logprobs", "runtime")
        with pytest.raises(LabError, match="logprobs failed on every rank: RuntimeError: injected failure in logprobs"):
            lab.step()
        layouts = [s["layout"] for s in lab.inspect()]
        for rank in (0, 1):  # bug 4: raised inside the first layer's forward, after FSDP's pre-forward hook
            lab.arm_fault(rank, "backward", "runtime")
        with pytest.raises(LabError, match="backward failed on every rank: RuntimeError: injected failure in backward"):
            lab.step()
        # FSDP's iteration state reset and every unit resharded (else layer 0 stays gathered, the next pass skips
        # its root set-up, and on a GPU an OOM retry meets the memory the failed pass left)
        assert [s["layout"] for s in lab.inspect()] == layouts and not layouts[0]["iteration_open"]
        second = lab.step()
        assert lab.executor.ranks.pids == pids
        merged = whole(lab.inspect())
    finally:
        lab.close()
    for mine, theirs in zip((first, second), results):
        assert mine.reward_mean == theirs.reward_mean and mine.completion_length_mean == theirs.completion_length_mean
        assert mine.loss == pytest.approx(theirs.loss, **LOSS_TOL)
        assert mine.grad_norm == pytest.approx(theirs.grad_norm, rel=1e-4)
    assert first.attempts == 2 and second.attempts == 3
    assert max((merged[n] - lora[n]).abs().max().item() for n in lora) <= LORA_TOL
