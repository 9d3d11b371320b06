"""How a rank's death is named (issue 42): out of memory only when Ray's memory monitor says so, by the rank that
died. Ray's message for any worker death lists "killed by the OOM killer" among its possible causes, and the line read
"killed: out of host memory" for a SIGKILL; a kill by the memory monitor reaches ray.get as OutOfMemoryError, which
is no RayActorError and escaped the driver's reply loop. Real Ray exception objects, Ray's own texts; no cluster
started."""

from __future__ import annotations

import pytest

ray_exceptions = pytest.importorskip("ray.exceptions")

# the raylet's text for a worker that exited under a SIGKILL (core/src/ray/raylet/raylet's strings)
SIGKILLED = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: RankActor\n\tpid: 4242\n"
    "Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. "
    "End of file. Some common causes include: (1) the process was killed by the OOM killer due to high memory usage, "
    "(2) ray stop --force was called, or (3) the worker crashed unexpectedly due to SIGSEGV or another unexpected "
    "error."
)
# the memory monitor's kill, as ray.get raises it
MONITOR_KILLED = (
    "Task was killed due to the node running low on memory. Memory on the node was 23.1GB / 24.0GB (0.96), which "
    "exceeds the memory usage threshold of 0.95."
)


def test_a_sigkilled_rank_is_named_killed_not_out_of_memory():
    from grpo_lab.execution.sharded.ranks import died

    line = died(ray_exceptions.RayActorError(error_msg=SIGKILLED))
    assert line == "its process died (killed, or crashed; Ray saw its worker exit)"
    assert "memory" not in line


def test_a_kill_by_rays_memory_monitor_is_named_so():
    from grpo_lab.execution.sharded.ranks import died, lost_process

    err = ray_exceptions.OutOfMemoryError(MONITOR_KILLED)
    assert isinstance(err, lost_process()) and not isinstance(err, ray_exceptions.RayActorError)
    assert died(err) == "its process was killed by Ray's memory monitor (the node's memory crossed its kill threshold)"


def test_an_injected_oom_kill_is_a_died_reply_of_its_own_rank(monkeypatch):
    """The driver's reply loop meets a memory-monitor kill of rank 1 (ray.get raising OutOfMemoryError) and rank 0's
    reply: rank 1 died, by the memory monitor, and rank 0 answered; nothing escapes."""
    import ray

    from grpo_lab.execution.sharded.ranks import Ranks

    refs = {0: "ref0", 1: "ref1"}
    monkeypatch.setattr(ray, "wait", lambda pending, num_returns, timeout: (list(pending), []))

    def get(ref):
        if ref == "ref1":
            raise ray_exceptions.OutOfMemoryError(MONITOR_KILLED)
        return ("ok", 1.0, {}, {"boundary": None, "blocked": False})

    monkeypatch.setattr(ray, "get", get)
    replies = Ranks._collect(object.__new__(Ranks), refs, None)
    assert replies[1][0] == "died" and "Ray's memory monitor" in replies[1][1]
    assert replies[0][0] == "ok"


def test_a_rank_killed_while_its_memory_is_polled_is_left_to_its_reply(monkeypatch):
    """CI's stop-64 run: Ray's memory monitor killed rank 1 while the driver polled its memory mid-command, and that
    poll's ray.get raised OutOfMemoryError past the driver (the poll caught only RayActorError). A lost rank's poll is
    skipped, the live rank's samples still count, and its command's reply names the death next."""
    import ray

    from grpo_lab.execution.sharded import ranks as ranks_module
    from grpo_lab.execution.sharded.ranks import Ranks

    class Poll:
        def __init__(self, ref):
            self.ref = ref

        def options(self, **_):
            return self

        def remote(self):
            return self.ref

    class Actor:
        def __init__(self, ref):
            self.poll = Poll(ref)

    class Memory:
        def __init__(self):
            self.ingested = []

        def ingest(self, rank, delta, live=False):
            self.ingested.append(rank)

    def get(ref, timeout=None):
        if ref == "poll1":
            raise ray_exceptions.OutOfMemoryError(MONITOR_KILLED)
        return ({"samples": [1], "rows": []}, {})

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ranks_module, "wait_all", lambda refs, timeout: True)
    ranks = object.__new__(Ranks)
    ranks.actors, ranks.memory = [Actor("poll0"), Actor("poll1")], Memory()
    ranks._poll({0: "run0", 1: "run1"}, set())
    assert ranks.memory.ingested == [0]
