"""A sharded learner's ranks, as the driver runs them: one Ray actor per rank (worker.RankWorker), placed in one
placement group (sharded/ray_cluster.py). A command is one actor call per rank; while it runs the driver polls each rank
for its memory samples (the live plot) and its generator's questions (sharded/remote.py). Ray tells the driver when a
rank's process dies, whatever the moment: every rank is then stopped and started again from its boundary state, which
the driver holds (object refs: the states stay in Ray's object store, owned by this process, so they outlive a killed
rank).
"""

from __future__ import annotations

import importlib
import time
from contextlib import contextmanager
from typing import Callable, Optional

from ...checks.world import usable_cpus
from ...errors import LabError
from ...memory.sampler import MemorySampler
from .interrupts import INTERRUPTS
from .remote import Answers

START_TIMEOUT_S = 900  # loading a model on every rank
STREAM_S = 0.5  # why: the live plot redraws every 0.5 s; a rank's samples are polled as often while it works
POLL_S = 30.0  # a rank's poll not answered within this is skipped (its samples come with its reply)
# what each rank's actor runs: a Lab of its own, so the entry point sits above the Lab (beside the runner) and is named
# by import path, as the Lab names this executor (execution/contract.py)
RANK_ENTRY = "grpo_lab.rank:RankWorker"
# why: the machine's used RAM and its limit read the same from every process; the driver's own host sampler has
# them (and its guard stops on them), so a rank sends only what is its own (RSS, its GPU), and, held to a budget of
# its own (placement.rank_memory_gib), its `used` (its RSS) and `limit` (the budget)
MACHINE_WIDE = {("host", "used"), ("host", "limit")}


class RankFailure(LabError):
    """A phase failed on some ranks; `restarted` says whether every rank was started afresh from its boundary state."""

    def __init__(self, message: str, restarted: bool):
        super().__init__(message)
        self.restarted = restarted


class RankMemory(MemorySampler):
    """The driver's own sampler (its host memory, and its vLLM engine's GPUs), plus every rank's samples and
    per-phase rows as they arrive."""

    def __init__(self, devices: list[str], *args, **kwargs):
        super().__init__(devices, *args, **kwargs)
        self.rank_capacities: dict[str, float] = {}
        self.streamed = 0  # polls that brought samples while a command ran
        self.wall0 = time.time() - (time.perf_counter() - self.t0)

    def ingest(self, rank: int, delta: dict, live: bool = False) -> None:
        """A rank's samples and per-phase rows since its last message (`live`: polled while its command ran)."""
        if not delta:
            return
        self.streamed += live
        shift = delta["wall0"] - self.wall0  # why wall clocks: ranks may be on other machines (own perf_counters)
        label = lambda device: f"rank{rank}/{device}"
        machine = set() if delta.get("own_host") else MACHINE_WIDE
        samples = [s for s in delta["samples"] if (s[3], s[4]) not in machine]
        with self._lock:
            for t, step, phase, device, metric, value in samples:
                self.samples.append((t + shift, step, phase, label(device), metric, value))
            self.total += len(samples)
            self.phase_rows.extend(
                {**row, "device": label(row["device"])}
                for row in delta["rows"]
                if (row["device"], row["metric"]) not in machine
            )
            self.segments.extend(ranks_mark(m, label, shift, machine) for m in delta.get("marks", []))


def ranks_mark(mark: dict, label: Callable[[str], str], shift: float, machine: set) -> dict:
    """A rank's mark inside a phase (a tool loop's `turn 2`) on the driver's time axis, its peaks under its devices."""
    peak = {(label(d), metric): v for (d, metric), v in mark["peak"].items() if (d, metric) not in machine}
    return {**mark, "start": mark["start"] + shift, "end": mark["end"] + shift, "peak": peak}


class Ranks:
    """The rank actors. `step()` is the step the driver is at (the ranks start again from its boundary state);
    `stopped()` is called whenever the ranks lose the step's progress."""

    def __init__(
        self,
        config: dict,
        size: int,
        memory: RankMemory,
        step: Callable[[], int] = lambda: 0,
        stopped: Callable[[], None] = lambda: None,
        tools: Optional[dict] = None,
    ):
        self.config, self.size, self.memory, self.step, self.stopped = config, size, memory, step, stopped
        self.tools = tools  # the tools' schemas for every rank's Lab (sharded/driven.py: the driver runs them)
        self.down = False  # stopped by halt(): started again, from the driver's step, at the next command
        self.threads = 1  # each rank's torch threads: fitted to the Ray the ranks join, at their first start
        self.cluster = self.group = None
        self.actors: list = []
        self.pids: list[int] = []
        self.nodes: list[str] = []
        self.boundaries: dict[int, list] = {}  # step -> each rank's boundary state (object refs), the last two steps
        self.answers = Answers(None)  # what the ranks may ask mid-command: the driver's vLLM engine, if any

    def start(self, restore: Optional[int] = None) -> "Ranks":
        """Start every rank: loaded afresh, or (`restore`, a step index) from its state at that step's start."""
        try:
            with INTERRUPTS.held():  # why: a Ctrl-C raised inside Ray's own calls can be lost (sharded/interrupts.py)
                return self._start(restore)
        except BaseException:  # an interrupt or a failed rank: no actor may outlive the start
            if restore is None:
                self.close()  # a first start: its placement group and a Ray it started go too
            else:
                self.kill()
            raise

    def _start(self, restore: Optional[int]) -> "Ranks":
        from ...checks.world import import_ray_for
        from .ray_cluster import Cluster, bundles
        from .ray_notices import quiet_rank_deaths

        if restore is not None and restore not in self.boundaries:
            raise LabError(
                f"the ranks cannot start from step {restore}: no boundary state of it is held (held: "
                f"{sorted(self.boundaries)})"
            )
        states = self.boundaries[restore] if restore is not None else [None] * self.size
        place = self.config["placement"]
        ray = import_ray_for(place.get("ray_address"))
        if self.group is None:
            from ...runtime import rank_devices

            cores = usable_cpus()
            self.cluster = Cluster(
                place.get("ray_address"), place["learner"], rank_devices(place["learner"], self.size), cores
            )
            self.threads = rank_threads(place["learner"], self.size, cores, ray.cluster_resources())
            self.group = self.cluster.place(bundles(place["learner"], self.size, self.threads))
        self.actors = [self._actor(ray, rank) for rank in range(self.size)]
        address = self.actors[0].address.remote()
        try:
            if not wait_all([address], START_TIMEOUT_S):
                raise LabError("rank 0 did not start: not placed within the start timeout")
            master = ray.get(address)
        except lost_process() as err:
            raise LabError(f"rank 0 did not start: {died(err)}") from None
        calls = [
            a.start.options(num_returns=2).remote(master, self.config, s, self.threads, self.tools)
            for a, s in zip(self.actors, states)
        ]
        replies = self._collect({rank: c[0] for rank, c in enumerate(calls)}, START_TIMEOUT_S)
        failed = {rank: r for rank, r in replies.items() if r[0] != "ready"}
        if failed or len(replies) < self.size:
            rank, reply = min(failed.items()) if failed else (min(set(range(self.size)) - set(replies)), None)
            raise LabError(f"rank {rank} did not start: {reply[1] if reply else 'no answer within the start timeout'}")
        for rank, (_, info, delta) in replies.items():
            self.memory.ingest(rank, delta)
            self.memory.rank_capacities.update({f"rank{rank}/{d}": c for d, c in info["capacities"].items()})
        self.pids = [replies[rank][1]["pid"] for rank in range(self.size)]  # each rank's process, on its node
        quiet_rank_deaths(self.pids)  # why: a rank's death is the Lab's one line, not Ray's paragraph beside it
        self.nodes = [replies[rank][1]["node"] for rank in range(self.size)]  # the Ray node id it runs on
        if restore is None:
            self._keep(replies[0][1]["step"], [c[1] for c in calls])
        return self

    def _actor(self, ray, rank: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .ray_cluster import bundles

        module, _, name = RANK_ENTRY.partition(":")
        RankWorker = getattr(importlib.import_module(module), name)
        bundle = bundles(self.config["placement"]["learner"], 1, self.threads)[0]
        # why a group: poll runs on a thread of its own while a command runs; why made here, per start: a class
        # made under one Ray connection is not reused under the next (a notebook's ray.shutdown(), another cluster)
        remote = ray.remote(concurrency_groups={"poll": 1})(RankWorker)
        return remote.options(
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            max_restarts=0,
            name=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank),
        ).remote(rank, self.size)

    def _keep(self, step: int, states: list) -> None:
        """Hold the boundary states of `step`; the two latest steps are kept. Why two: the driver restarts from the
        step *it* is at, which may be one behind the ranks (an interrupt after their sync, before its reply was
        read)."""
        self.boundaries[step] = states
        for old in [s for s in self.boundaries if s < step - 1]:
            del self.boundaries[old]

    # --- commands ---
    def call(self, command: str, *args, describe: str = ""):
        """Run `command` on every rank; rank 0's result. A failure raises RankFailure (one line naming the rank)."""
        replies, states = self._run(range(self.size), command, args)
        errors = {rank: r[1] for rank, r in replies.items() if r[0] != "ok"}
        if not errors and len(replies) == self.size:
            if replies[0][3]["boundary"] is not None:
                self._keep(replies[0][3]["boundary"], states)
            return replies[0][1]
        died = sorted(rank for rank, r in replies.items() if r[0] == "died")
        blocked = any(r[0] == "error" and r[3]["blocked"] for r in replies.values())
        first = died[0] if died else first_failed(replies) if errors else min(set(range(self.size)) - set(replies))
        what = errors.get(first, "did not answer")
        if len(errors) == self.size and not died and not blocked:  # each undid its own work; their collectives agree
            everywhere = len(set(errors.values())) == 1
            raise RankFailure(
                f"{describe or command} failed on {'every rank' if everywhere else f'rank {first}'}: {what}",
                restarted=False,
            )
        self.restart()
        raise RankFailure(
            f"{describe or command} failed on rank {first}: {what}; every rank was restarted from the "
            "state it had when this step began (LoRA, AdamW, RNG; the driver's prompt order too); lab.step() "
            "runs the step again from its rollout",
            restarted=True,
        )

    def each(self, command: str, *args) -> list:
        """Run `command` on every rank; each rank's (status, value)."""
        replies, _ = self._run(range(self.size), command, args)
        if any(r[0] == "died" for r in replies.values()):
            self.halt()
        return [replies[rank][:2] for rank in range(self.size)]

    def one(self, rank: int, command: str, *args):
        """Run `command` on rank `rank` alone; its (status, value)."""
        replies, _ = self._run([rank], command, args)
        if replies[rank][0] == "died":
            self.halt()
        return replies[rank][:2]

    def _run(self, ranks, command: str, args: tuple) -> tuple[dict, list]:
        with self.exchange():
            self.answers.clear()
            calls = {rank: self.actors[rank].run.options(num_returns=2).remote(command, args) for rank in ranks}
            replies = self._collect({rank: c[0] for rank, c in calls.items()}, None)
        for rank, reply in replies.items():
            if reply[0] != "died":
                self.memory.ingest(rank, reply[2])
        return replies, [c[1] for c in calls.values()]

    def _collect(self, refs: dict, timeout: Optional[float]) -> dict:
        """Replies by rank. Stops early when a rank died or failed where the others cannot follow (they are then
        blocked in a collective): Ray's word on a process, not a grace period, decides."""
        import ray

        rank_of = {ref: rank for rank, ref in refs.items()}
        replies: dict = {}
        answered: set = set()
        deadline = float("inf") if timeout is None else time.monotonic() + timeout
        pending = dict(refs)
        while pending and time.monotonic() < deadline:
            ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=STREAM_S)
            INTERRUPTS.check()  # a Ctrl-C noted while Ray waited: raised here, and the exchange stops every rank
            for ref in ready:
                rank = rank_of[ref]
                del pending[rank]
                try:
                    replies[rank] = ray.get(ref)
                except lost_process() as err:
                    replies[rank] = ("died", died(err))
            if any(r[0] == "died" or (r[0] == "error" and len(r) > 3 and r[3]["blocked"]) for r in replies.values()):
                break
            if pending:
                self._poll(pending, answered)
        return replies

    def _poll(self, pending: dict, answered: set) -> None:
        """Mid-command: each working rank's memory samples so far, and its generator's questions answered."""
        import ray
        from ray.exceptions import GetTimeoutError

        polls = {rank: self.actors[rank].poll.options(concurrency_group="poll").remote() for rank in pending}
        wait_all(list(polls.values()), POLL_S)
        for rank, ref in polls.items():
            try:
                delta, questions = ray.get(ref, timeout=0)
            except (*lost_process(), GetTimeoutError):
                continue  # its command's reply says so next, or brings its samples
            self.memory.ingest(rank, delta, live=bool(delta and (delta["samples"] or delta["rows"])))
            for number, (method, args) in sorted(questions.items()):
                if (rank, number) not in answered:
                    answered.add((rank, number))
                    with INTERRUPTS.let_through():  # the driver's engine samples: Ctrl-C stops it at once
                        reply = self.answers.answer(number, method, args)
                    self.actors[rank].answer.options(concurrency_group="poll").remote(number, reply)

    @contextmanager
    def exchange(self):
        """Commands out, replies in. Anything that stops the driver in between (an interrupt, an error of its own)
        leaves ranks that may be blocked in a collective: every rank is then stopped (halt), and the next command
        starts them from the driver's step. Why SIGINT is held meanwhile: sharded/interrupts.py."""
        try:
            with INTERRUPTS.held():
                self.up()
                yield
        except BaseException:
            self.halt()
            raise

    def up(self) -> None:
        """Start the ranks again if halt() stopped them, each from its state at the driver's step's start."""
        if self.down:
            self.start(restore=self.step())
            self.down = False

    def halt(self) -> None:
        self.kill()
        self.down = True
        self.stopped()

    def restart(self) -> None:
        with INTERRUPTS.held():  # why: a Ctrl-C as the ranks start again is raised, never lost (sharded/interrupts.py)
            self.halt()
            self.up()

    def kill(self) -> None:
        import sys

        ray = sys.modules.get("ray")
        if self.actors and ray is not None and ray.is_initialized():  # (a notebook's ray.shutdown() ended them)
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
        self.actors, self.pids = [], []

    def close(self) -> None:
        import sys

        ray = sys.modules.get("ray")
        if self.actors and ray is not None and ray.is_initialized():
            try:
                ray.get([a.close.remote() for a in self.actors], timeout=60)
            except Exception:  # why so broad: a rank that cannot close cleanly is killed below all the same
                pass
        self.kill()
        self.boundaries.clear()
        if self.group is not None and ray is not None and ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
        if self.cluster is not None:
            self.cluster.close()
        self.cluster = self.group = None


def rank_threads(learner: str, size: int, cores: int, resources: dict) -> int:
    """Each CPU rank's torch threads (and the CPUs its bundle asks Ray for): this machine's cores and the joined
    Ray's CPUs shared out, the fewer of the two. Why the Ray's too: a notebook's ray.init(num_cpus=2) on 8 cores
    asked for 4 CPUs a rank, and the placement was refused ("use at most 0 ranks"). A CUDA rank: one."""
    if learner != "cpu":
        return 1
    return max(1, min(cores, int(resources.get("CPU", 0))) // size)


def wait_all(refs: list, timeout: float) -> bool:
    """Wait until every ref is ready or `timeout` passes (whether all are ready), raising a Ctrl-C noted meanwhile
    at each turn (sharded/interrupts.py): why not one blocking ray.get: a held interrupt would wait with it."""
    import ray

    deadline = time.monotonic() + timeout
    while True:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(STREAM_S, max(deadline - time.monotonic(), 0)))
        INTERRUPTS.check()
        if len(ready) == len(refs) or time.monotonic() >= deadline:
            return len(ready) == len(refs)


def first_failed(replies: dict) -> int:
    """The first rank whose command failed of itself (not with PeerFailed, for another rank's failure): the one
    whose line the driver reports."""
    failed = sorted(rank for rank, r in replies.items() if r[0] != "ok")
    own = [rank for rank in failed if not (len(replies[rank]) > 3 and replies[rank][3].get("peer"))]
    return (own or failed)[0]


def died(err: BaseException) -> str:
    """One line for a rank whose process died (Ray's message is a paragraph). Out of memory only when Ray's memory
    monitor says so (ray.get raises its OutOfMemoryError). Why not from the text: the message of every other worker
    death lists "killed by the OOM killer" among its possible causes, so a SIGKILL would read as out of memory."""
    from ray.exceptions import OutOfMemoryError

    if isinstance(err, OutOfMemoryError):
        return "its process was killed by Ray's memory monitor (the node's memory crossed its kill threshold)"
    return "its process died (killed, or crashed; Ray saw its worker exit)"


def lost_process() -> tuple:
    """What ray.get raises when a rank's process is gone: it died, or Ray's memory monitor killed it (an
    OutOfMemoryError, no RayActorError). One tuple for every get on a rank: its start, its replies, its polls."""
    from ray.exceptions import OutOfMemoryError, RayActorError

    return (RayActorError, OutOfMemoryError)
