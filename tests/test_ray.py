"""The sharded learner's ranks on Ray (grpo_lab/execution/sharded/ray_cluster.py, ranks.py): where they run, what a
dead rank costs, what is left when the driver dies, and the one-line refusals before any actor starts. The pure parts
(addresses, bundles, resources, the GPUs a local Ray is given, which device a rank is) are tested with made-up clusters
and device lists; the rest on real Ray, loopback only (conftest sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from grpo_lab import Lab, cli
from grpo_lab.checks.roles import parse_address
from grpo_lab.errors import LabError
from grpo_lab.execution.sharded.ray_cluster import bundles, check_resources, local_gpu_env, start_local
from grpo_lab.runtime import Runtime

# why solo: it starts Ray clusters and rank processes of its own (scripts/test.sh runs the ranks' group beside the
# browser's only)
pytestmark = [pytest.mark.solo, pytest.mark.xdist_group("ranks")]
SHARDED = ["placement.learner_procs=2"]


# --- pure: addresses, bundles, resources, devices ------------------------------------------------------------


def test_an_address_is_host_and_port_and_anything_else_says_what_to_give():
    assert parse_address("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert parse_address("head.local:6380") == ("head.local", 6380)
    for bad in ("10.0.0.5", ":6379", "host:port", "host:0", "host:70000", "ray://h:10001"):
        with pytest.raises(LabError, match=r"placement.ray_address: .* is not host:port .*ray start --head"):
            parse_address(bad)


def test_the_ranks_raw_output_stays_in_ray_s_logs_on_both_ways_in(monkeypatch):
    """A rank's failure reaches the driver as one line; Ray's forwarding of the ranks' stderr put a rank's C++
    teardown stack trace into a fresh clone's notebook 06. A local Ray and a joined one both start without it."""
    import ray

    from grpo_lab.execution.sharded import ray_cluster

    calls = []
    monkeypatch.setattr(ray_cluster, "_STARTED", dict(ray_cluster._STARTED))  # (this test's counts, not the module's)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_cluster, "check_reachable", lambda address: None)
    ray_cluster.start_local(cpus=2)
    ray_cluster.Cluster("10.0.0.1:6379", "cpu", ["cpu", "cpu"], 2)
    assert len(calls) == 2 and all(c["log_to_driver"] is False for c in calls), calls


@pytest.mark.parametrize(
    "learner, cores, ray_cpus, threads",
    [("cpu", 2, 2, 1), ("cpu", 8, 8, 4), ("cpu", 8, 2, 1), ("cpu", 2, 16, 1), ("cpu", 1, 1, 1), ("cuda:0", 8, 8, 1)],
)
def test_a_cpu_rank_s_threads_are_the_fewer_of_cores_and_ray_cpus_shared_out(learner, cores, ray_cpus, threads):
    from grpo_lab.execution.sharded.ranks import rank_threads

    assert rank_threads(learner, 2, cores, {"CPU": float(ray_cpus)}) == threads


def test_a_rank_bundle_is_a_gpu_with_a_cpu_or_its_share_of_cpus():
    assert bundles("cuda:0", 2, threads=4) == [{"CPU": 1, "GPU": 1}] * 2
    assert bundles("cpu", 3, threads=2) == [{"CPU": 2}] * 3


@pytest.mark.parametrize(
    "wanted, total, words",
    [
        (
            bundles("cuda:0", 4, 1),
            {"CPU": 64, "GPU": 2},
            "4 ranks need 4 GPU(s) (1 each), but the cluster has 2; use at most 2",
        ),
        (bundles("cpu", 3, 2), {"CPU": 4}, "3 ranks need 6 CPU(s) (2 each), but the cluster has 4; use at most 2"),
    ],
)
def test_more_ranks_than_the_cluster_holds_is_one_line(wanted, total, words):
    with pytest.raises(LabError, match="placement.learner_procs: ") as err:
        check_resources(wanted, total, "the cluster")
    assert words in str(err.value) and "\n" not in str(err.value)
    check_resources(wanted[:1], total, "the cluster")  # one rank fits


@pytest.mark.parametrize(
    "devices, visible, expected",
    [
        (["cuda:0", "cuda:1"], None, "0,1"),
        (["cuda:1", "cuda:2"], None, "1,2"),
        (["cuda:0", "cuda:1"], "2,3", "2,3"),  # this process's cuda:0 is the machine's GPU 2
        (["cuda:1"], "GPU-aaaa,GPU-bbbb", "GPU-bbbb"),  # named by UUID
        (["cpu", "cpu"], "0", None),
    ],
)
def test_a_local_ray_is_given_exactly_the_ranks_gpus_as_the_machine_names_them(devices, visible, expected):
    assert local_gpu_env(devices, visible) == expected


def test_a_rank_on_a_gpu_ray_gave_it_is_its_cuda_0_and_its_rng_is_that_gpu_alone():
    for rank in range(3):
        me = Runtime(rank, 3, is_rank=True, own_gpu=True)
        assert me.device_of("cuda:2") == "cuda:0"
        assert me.device_of("cpu") == "cpu"
    assert Runtime(1, 2, is_rank=True).device_of("cuda:2") == "cuda:3"  # a rank that sees every GPU
    assert Runtime(0, 1).device_of("cuda:2") == "cuda:2"  # the driver


def test_the_driver_fetches_the_model_once_before_any_rank_starts(tiny_model, monkeypatch, tmp_path):
    """A hub id is downloaded by the driver (not by every rank at once, inside their start timeout); the ranks on
    this machine load its local copy. (No hub here: the download is the one thing replaced.)"""
    from grpo_lab.models.source import fetch_once

    calls = []
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda repo: calls.append(repo) or str(tmp_path))
    assert fetch_once("Qwen/Qwen2.5-0.5B", local=True) == str(tmp_path) and calls == ["Qwen/Qwen2.5-0.5B"]
    assert fetch_once("Qwen/Qwen2.5-0.5B", local=False) == "Qwen/Qwen2.5-0.5B" and len(calls) == 2
    assert fetch_once("builtin:tiny-random", local=True) == tiny_model  # a built-in: built where the cache says
    assert fetch_once("builtin:tiny-random", local=False) == "builtin:tiny-random"
    assert fetch_once(tiny_model, local=True) == tiny_model and len(calls) == 2


def test_a_ray_a_lab_started_stops_only_when_the_last_lab_on_it_closes():
    """Two sharded Labs in one notebook share the Ray the first started; closing the first must not stop the
    second's ranks, and closing both leaves no Ray running in the process."""
    import ray

    from grpo_lab.execution.sharded.ray_cluster import Cluster

    ray.shutdown()
    first = Cluster(None, "cpu", ["cpu", "cpu"], cpus=2)
    second = Cluster(None, "cpu", ["cpu", "cpu"], cpus=2)
    first.close()
    first.close()  # twice: counted once
    assert ray.is_initialized()
    second.close()
    assert not ray.is_initialized()
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")  # the notebook's own
    try:
        mine = Cluster(None, "cpu", ["cpu"], cpus=1)
        mine.close()
        assert ray.is_initialized()  # a Ray the notebook started is the notebook's to stop
    finally:
        ray.shutdown()


def test_closing_after_the_notebook_shut_ray_down_is_clean(tiny_model):
    """ray.shutdown() in a cell ends the rank actors with Ray; lab.close() afterwards must not fail on them."""
    import ray

    from grpo_lab.config.loading import load_config
    from grpo_lab.execution.sharded.ranks import Ranks

    ray.shutdown()
    ranks = Ranks(load_config("tiny-cpu", SHARDED).to_dict(), 2, memory=None)
    ranks.actors, ranks.pids = [object(), object()], [1, 2]  # handles of a Ray that is gone
    ranks.close()
    assert ranks.actors == [] and ranks.pids == []


# --- bad input: one line, exit 2, before any actor starts ----------------------------------------------------


def refused(capsys, *sets) -> tuple[str, float]:
    argv = ["run", "tiny-cpu", "--steps", "1", "--out", "/tmp/grpo-lab-never-written"]
    for item in sets:
        argv += ["--set", item]
    start = time.monotonic()
    code = cli.main(argv)
    seconds = time.monotonic() - start
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("grpo-lab: error:"), err
    return lines[0], seconds


@pytest.fixture
def no_actors(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a rank actor started")

    monkeypatch.setattr("grpo_lab.execution.sharded.ranks.Ranks._actor", refuse)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_ray_address_is_one_line_within_ten_seconds(capsys, no_actors):
    import ray

    ray.shutdown()  # why: a process already connected to a Ray uses that one
    port = _free_port()
    line, seconds = refused(capsys, *SHARDED, f"placement.ray_address=127.0.0.1:{port}")
    assert f"placement.ray_address: no Ray cluster answers at 127.0.0.1:{port}" in line and "ray start --head" in line
    assert seconds < 10


@pytest.mark.parametrize("value", ["10.0.0.5", "ray://10.0.0.5:10001"])
def test_a_malformed_ray_address_is_refused_at_the_config(capsys, no_actors, value):
    line, _ = refused(capsys, *SHARDED, f"placement.ray_address={value}")
    assert "placement.ray_address" in line and "is not host:port" in line


def test_a_ray_address_without_ranks_is_refused(capsys, no_actors):
    line, _ = refused(capsys, "placement.ray_address=127.0.0.1:6379")
    assert "placement.ray_address" in line and "placement.learner_procs: 1" in line


def test_ray_not_installed_is_one_line_naming_the_extra(capsys, no_actors, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    line, _ = refused(capsys, *SHARDED)
    assert "Ray is not installed" in line and "pip install 'grpo-lab[ray]'" in line


# --- a 2-node cluster on this machine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_nodes():
    """A Ray cluster of two nodes of one CPU each (ray.cluster_utils), all on 127.0.0.1: two CPU ranks can only
    be placed one per node."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    for attempt in range(2):  # why twice: Ray gives a node 30 s to register, which a busy 2-core machine can miss
        cluster = Cluster()
        try:
            cluster.add_node(num_cpus=1, include_dashboard=False)
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            break
        except Exception:
            cluster.shutdown()
            if attempt:
                raise
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_more_ranks_than_a_cluster_holds_is_refused_before_any_actor_starts(capsys, no_actors, two_nodes):
    import ray

    ray.shutdown()
    line, _ = refused(capsys, "placement.learner_procs=4", f"placement.ray_address={two_nodes.address}")
    assert "4 ranks need 4 CPU(s) (1 each), but the Ray cluster at" in line and "use at most 2" in line
    ray.shutdown()


@pytest.fixture(scope="module")
def uninterrupted():
    """Five steps of tiny-cpu on 2 ranks, nothing killed: what every interrupted run must reproduce bit for bit.
    Loaded as on an 8-core machine beside a Ray of 2 CPUs (a notebook's ray.init(num_cpus=2)): each rank then gets
    one of the Ray's CPUs (rank_threads), as on this machine; 8 cores' share, 4 a rank, was refused ("use at most
    0 ranks")."""
    one_node_ray()
    with pytest.MonkeyPatch.context() as patch:
        for where in ("grpo_lab.checks.world", "grpo_lab.execution.sharded.ranks"):
            patch.setattr(f"{where}.usable_cpus", lambda: 8)
        lab = Lab("tiny-cpu", overrides=SHARDED).load()
    try:
        assert lab.executor.ranks.threads == 1
        results = [lab.step() for _ in range(5)]
        shards = lab.inspect()
    finally:
        lab.close()
    return results, shards


def one_node_ray() -> None:
    """A local Ray of one node, this module's own, whatever Ray an earlier test left this process connected to. Why:
    a fresh clone's run put these ranks on the two-node test cluster (one CPU a node, Ray's workers at niceness 15
    beside the browser tests), so 'one node' was two, and the kill test's ranks died as they started."""
    import ray

    ray.shutdown()
    start_local(cpus=2)
    assert len([n for n in ray.nodes() if n["Alive"]]) == 1


def same_result(a, b) -> bool:
    return (
        a.rewards == b.rewards
        and a.loss == b.loss
        and a.grad_norm == b.grad_norm
        and a.completion_length_mean == b.completion_length_mean
    )


def same_shards(a: list[dict], b: list[dict]) -> bool:
    return all(
        x["lora"].keys() == y["lora"].keys() and all(torch.equal(x["lora"][n], y["lora"][n]) for n in x["lora"])
        for x, y in zip(a, b)
    )


TWO_NODES = """
import json, os
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
from grpo_lab import Lab
lab = Lab("tiny-cpu", overrides=["placement.learner_procs=2", "placement.ray_address=ADDRESS"]).load()
nodes = list(lab.executor.ranks.nodes)
results = [lab.step() for _ in range(2)]
layout = [all(s["layout"]["sharded"]) for s in lab.inspect()]
lab.close()
print("RESULT " + json.dumps(dict(nodes=nodes, layout=layout, rewards=[r.rewards for r in results],
      loss=[r.loss for r in results], grad_norm=[r.grad_norm for r in results])))
"""


@pytest.mark.cores(2)
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_ranks_on_two_nodes_equal_two_ranks_on_one(two_nodes, uninterrupted):
    """In a process of its own: Ray cancels every actor of a cluster a process joins after running a Ray of its
    own (as this test process did), which the Lab refuses in one line (below)."""
    results, _ = uninterrupted
    out = subprocess.run(
        [sys.executable, "-c", TWO_NODES.replace("ADDRESS", two_nodes.address)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=1400,
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, out.stdout[-2000:] + out.stderr[-3000:]
    got = json.loads(line.removeprefix("RESULT "))
    assert len(set(got["nodes"])) == 2 and all(got["layout"])  # one rank per node, each holding its shards
    # bit for bit the run on one node (which tests/test_sharded.py holds to one process's within its tolerance);
    # step 2's loss and gradient norm are computed from the LoRA and AdamW state after step 1
    assert got["rewards"] == [r.rewards for r in results[:2]]
    assert got["loss"] == [r.loss for r in results[:2]] and got["grad_norm"] == [r.grad_norm for r in results[:2]]


def test_joining_a_cluster_after_a_ray_of_its_own_is_one_line(capsys, no_actors, two_nodes):
    import ray

    from grpo_lab.execution.sharded.ray_cluster import start_local

    if not ray.is_initialized():
        start_local(cpus=1)
    ray.shutdown()
    line, _ = refused(capsys, *SHARDED, f"placement.ray_address={two_nodes.address}")
    assert "already ran a Ray of its own" in line and "restart the kernel" in line


# --- a rank killed at any moment costs one line ---------------------------------------------------------------


def _fails_in_one_line(capfd, call) -> str:
    with pytest.raises(LabError) as err:
        call()
    out, errs = capfd.readouterr()
    message = str(err.value)
    assert "\n" not in message.strip(), message
    for word in ("Traceback", "BrokenPipe", "Connection reset", "EOFError", "(raylet)"):
        assert word not in out + errs, (word, out + errs)
    return message


@pytest.mark.cores(2)
@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_rank_killed_at_any_moment_costs_one_line_and_the_step_runs_again_bit_for_bit(capfd, uninterrupted):
    results, shards = uninterrupted
    one_node_ray()
    lab = Lab("tiny-cpu", overrides=SHARDED).load()
    ranks = lab.executor.ranks
    lines = []
    try:
        # inside a phase: SIGKILL at a point of its real code (recovery/faults.py 'kill')
        for step, (rank, phase) in enumerate([(1, "rollout"), (0, "logprobs"), (1, "backward")]):
            lab.arm_fault(rank, phase, "kill")
            lines.append(_fails_in_one_line(capfd, lab.step))
            assert f"failed on rank {rank}: its process died" in lines[-1] and "restarted" in lines[-1]
            assert "memory" not in lines[-1]  # issue 42: a SIGKILL read "killed: out of host memory"
            assert same_result(lab.step(), results[step]), (step, phase)
        # between two phases: the rank dies after the rollout, before the rewards
        rollout = lab.rollout()
        os.kill(ranks.pids[1], signal.SIGKILL)
        time.sleep(1)
        lines.append(_fails_in_one_line(capfd, lambda: lab.rewards(rollout)))
        assert "failed on rank 1: its process died" in lines[-1]
        assert same_result(lab.step(), results[3])
        # idle between steps
        os.kill(ranks.pids[0], signal.SIGKILL)
        time.sleep(1)
        lines.append(_fails_in_one_line(capfd, lab.step))
        assert "failed on rank 0: its process died" in lines[-1]
        assert same_result(lab.step(), results[4])
        assert same_shards(lab.inspect(), shards)  # LoRA and AdamW as if nothing had happened
    finally:
        lab.close()
    assert len(lines) == 5


# --- the driver killed: nothing left behind -------------------------------------------------------------------


def _rank_processes(of: int) -> set[int]:
    """The rank actors' processes under process `of` (a local Ray's workers are its raylet's children)."""
    import psutil

    def rank(p) -> bool:
        try:
            return "ray::RankWorker" in " ".join(p.cmdline())
        except psutil.Error:
            return False

    return {p.pid for p in psutil.Process(of).children(recursive=True) if rank(p)}


def _alive(pids: set[int]) -> set[int]:
    import psutil

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    return {pid for pid in pids if alive(pid)}


def _tree(of: int) -> set[int]:
    """Every process under process `of` (its local Ray's GCS, raylet, agents and workers), empty once it is gone."""
    import psutil

    try:
        return {p.pid for p in psutil.Process(of).children(recursive=True)}
    except psutil.Error:
        return set()


@pytest.mark.cores(2)
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_driver_leaves_no_rank_process(tmp_path):
    tree: set[int] = set()
    dirs = set(Path(tempfile.gettempdir()).glob("grpo-lab-ranks-*"))
    driver = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "grpo_lab.cli",
            "run",
            "tiny-cpu",
            "--steps",
            "50",
            "--out",
            str(tmp_path / "run"),
            "--set",
            "placement.learner_procs=2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        for line in driver.stdout:  # until the first step's line: the ranks are up and working
            if line.startswith("step 0:"):
                break
        tree = _tree(driver.pid)
        mine = _rank_processes(of=driver.pid)
        assert len(mine) == 2, mine
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 30
        while _alive(mine) and time.monotonic() < deadline:
            time.sleep(1)
        assert not _alive(mine)
        assert not set(Path(tempfile.gettempdir()).glob("grpo-lab-ranks-*")) - dirs  # the pipe layer's; none now
    finally:
        tree |= _tree(driver.pid)
        driver.kill()
        # Ray's own agents of the driver's local Ray outlive it (Ray's behaviour, not a rank): do not leak them here.
        # Why only the driver's own tree: every Ray process new on the machine included the other solo worker's, and
        # killing its GCS and raylet killed that worker's pytest process (a fresh clone's solo pass)
        for pid in _alive(tree):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
