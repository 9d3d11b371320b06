"""Where a sharded learner's ranks run: a Ray cluster, local (started by the Lab) or joined (`placement.ray_address`),
and a placement group of one bundle per rank. Ray places and supervises the rank processes (an actor per rank):
it spans machines, and it tells the driver when a rank's process dies, whatever the cause (docs/fsdp2.md, "Why Ray").

Before any actor starts, the cluster's resources must be enough for the ranks (Ray installed and the address
reachable are checked earlier, by checks/world.py). The pure parts (bundles, resource arithmetic, the GPUs a local Ray
is given) are tested with made-up clusters (tests/test_ray.py).
"""

from __future__ import annotations

import os
import socket
from typing import Optional

from ...checks.roles import parse_address
from ...checks.world import check_reachable, import_ray_for
from ...errors import LabError

PLACE_S = 60  # a placement group that is not ready within this cannot be placed (resources taken by others)


def bundles(learner: str, procs: int, threads: int) -> list[dict]:
    """One bundle per rank: a GPU (and a CPU for its process) for a CUDA learner, `threads` CPUs for a CPU learner."""
    one = {"CPU": 1, "GPU": 1} if learner != "cpu" else {"CPU": threads}
    return [dict(one) for _ in range(procs)]


def check_resources(wanted: list[dict], total: dict, where: str) -> None:
    """More ranks than the cluster holds: one line, before any actor starts."""
    for resource in ("GPU", "CPU"):
        need = sum(b.get(resource, 0) for b in wanted)
        have = int(total.get(resource, 0))
        if need > have:
            per = wanted[0].get(resource, 0)
            raise LabError(
                f"placement.learner_procs: {len(wanted)} ranks need {need:g} {resource}(s) ({per:g} each), but "
                f"{where} has {have}; use at most {have // per if per else 0} ranks, or add nodes to the "
                "cluster (docs/sharded.md)"
            )


def local_gpu_env(devices: list[str], visible: Optional[str]) -> Optional[str]:
    """CUDA_VISIBLE_DEVICES for a local Ray started for ranks on `devices` (cuda:N.. in this process's numbering):
    Ray gives each rank one of the GPUs it was started with, so it is started with exactly those, named as the
    machine names them. None for CPU ranks."""
    cuda = [int(d.split(":")[1]) for d in devices if d.startswith("cuda")]
    if not cuda:
        return None
    names = visible.split(",") if visible else None
    return ",".join(names[i] if names else str(i) for i in cuda)


_STARTED = {
    "by_a_lab": False,
    "users": 0,
    "local_before": False,
}  # a Ray a Lab started is stopped when the last Lab using it closes


class Cluster:
    """The Ray this Lab uses: joined, or started here (and then stopped when the last Lab using it closes)."""

    def __init__(self, address: Optional[str], learner: str, devices: list[str], cpus: int):
        self.address, self.closed, self.after_local = address, False, False
        ray = import_ray_for(address)
        if not ray.is_initialized():
            _STARTED["by_a_lab"] = False
        self._join(ray, address, devices, cpus)
        _STARTED["users"] += 1

    def _join(self, ray, address: Optional[str], devices: list[str], cpus: int) -> None:
        if ray.is_initialized():  # the notebook's own ray.init(): use it as it is, if it is the one asked for
            joined = ray.get_runtime_context().gcs_address
            if address not in (None, "auto") and not same_address(address, joined):
                raise LabError(
                    f"placement.ray_address: {address}, but this process is connected to the Ray at "
                    f"{joined}; set placement.ray_address: {joined} (or null), or ray.shutdown() first"
                )
            return
        if address is not None:
            check_reachable(address)
            self.after_local = _STARTED["local_before"]
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")  # why: RANK_LOGS
            return
        gpus = local_gpu_env(devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:  # why: Ray hands out the GPUs its raylet saw at start; it must see exactly the ranks' ones
            if gpus is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = gpus
            start_local(cpus, len(gpus.split(",")) if gpus else 0)
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        _STARTED["by_a_lab"] = True

    @property
    def where(self) -> str:
        return f"the Ray cluster at {self.address}" if self.address else "this machine's Ray"

    def place(self, wanted: list[dict]):
        """A placement group of `wanted` bundles, ready; one line if the cluster cannot hold it."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        check_resources(wanted, ray.cluster_resources(), self.where)
        if self.after_local:
            raise LabError(
                f"placement.ray_address: this process already ran a Ray of its own, and Ray cancels every "
                f"actor of a cluster joined after one (ray {ray.__version__}); restart the kernel (or use a "
                f"new process) to join {self.address}"
            )
        group = placement_group(wanted, strategy="PACK")  # why PACK: ranks on as few machines as fit (NCCL in-node)
        if not _ready(group, PLACE_S):
            remove_placement_group(group)
            free = ray.available_resources()
            raise LabError(
                f"placement.learner_procs: {self.where} could not place {len(wanted)} ranks of {wanted[0]} "
                f"within {PLACE_S} s (free now: CPU {free.get('CPU', 0):g}, GPU {free.get('GPU', 0):g}); other "
                "jobs hold its resources"
            )
        return group

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        _STARTED["users"] -= 1
        if _STARTED["by_a_lab"] and _STARTED["users"] <= 0:  # why not before: another Lab's ranks still run on it
            import ray

            ray.shutdown()
            _STARTED.update(by_a_lab=False, users=0)


def same_address(a: str, b: str) -> bool:
    """Whether two 'host:port' name one GCS (a host name and its address are the same place)."""
    (ha, pa), (hb, pb) = parse_address(a), parse_address(b)
    resolve = lambda h: socket.gethostbyname(h) if h not in ("localhost",) else "127.0.0.1"
    return pa == pb and (ha == hb or resolve(ha) == resolve(hb))


# RANK_LOGS: a rank's failure reaches the driver as one line, in its reply; Ray's forwarding of the ranks' raw stderr
# also printed every rank's library warnings and, for a rank torn down mid-collective, a C++ stack trace (a fresh
# clone's notebook 06). The ranks' own logs stay in Ray's session directory: /tmp/ray/session_latest/logs/worker-*.err
def start_local(cpus: int, gpus: int = 0, tries: int = 2) -> None:
    """A Ray on this machine only. Ray gives its node 30 s to register (hard-coded in ray._private.node); on a
    machine busy enough to miss that, it is tried once more, then one line."""
    import ray

    for attempt in range(tries):
        try:
            ray.init(
                address="local",
                num_cpus=cpus,
                num_gpus=gpus,
                include_dashboard=False,
                logging_level="ERROR",
                log_to_driver=False,  # why: RANK_LOGS
                # why: Ray starts its workers at niceness 15, so on a machine with any other work the ranks (the run
                # itself) got the cores last (minutes per rank start beside two busy loops); 0, as Ray's job manager
                # gives a job's own processes
                _system_config={"worker_niceness": 0},
            )
            _STARTED["local_before"] = True
            return
        except Exception as err:  # why so broad: Ray raises a bare Exception for a node that timed out
            ray.shutdown()
            if "timed out during startup" not in str(err) or attempt == tries - 1:
                raise LabError(
                    f"placement.learner_procs: a local Ray for the ranks did not start ({str(err).splitlines()[0]}); "
                    "this machine may be too busy; try again, or start one with `ray start --head` and set "
                    "placement.ray_address"
                ) from None


def _ready(group, timeout: float) -> bool:
    import ray

    ready, _ = ray.wait([group.ready()], timeout=timeout)
    return bool(ready)
