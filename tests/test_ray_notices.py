"""Ray's paragraph on a rank's death is kept off the driver's output (grpo_lab/execution/sharded/ray_notices.py): only
the deaths of this driver's own ranks, through Ray's real printer module; everything else Ray prints still prints."""

from __future__ import annotations

import pytest

DEATH = (
    "A worker died or was killed while executing a task by an unexpected system error. To troubleshoot the problem, "
    "check the logs for the dead worker. Worker IP address: 127.0.0.1 Worker port: 38225 Worker PID: {pid} Worker "
    "exit type: SYSTEM_ERROR"
)


@pytest.fixture
def printed(monkeypatch):
    import ray._private.worker as ray_worker

    from grpo_lab.execution.sharded import ray_notices

    seen = []
    monkeypatch.setattr(ray_worker, "print_to_stdstream", lambda data, ignore_prefix: seen.append(data["lines"][0]))
    monkeypatch.setattr(ray_notices, "OWN_RANKS", set())
    return ray_worker, seen


def test_only_the_death_of_an_own_rank_is_dropped(printed):
    from grpo_lab.execution.sharded.ray_notices import quiet_rank_deaths

    ray_worker, seen = printed
    quiet_rank_deaths([16187, 16188])
    quiet_rank_deaths([16190])  # a restart: new ranks, the old ones' late messages still dropped; one filter
    for pid in (16187, 16190, 999):
        ray_worker.print_to_stdstream({"lines": [DEATH.format(pid=pid)], "pid": "raylet", "is_err": False}, False)
    ray_worker.print_to_stdstream({"lines": ["Some other raylet notice"], "pid": "raylet", "is_err": False}, False)
    ray_worker.print_to_stdstream({"lines": [DEATH.format(pid=16187)], "pid": 42, "is_err": False}, False)
    assert seen == [DEATH.format(pid=999), "Some other raylet notice", DEATH.format(pid=16187)]


def test_a_ray_without_that_printer_still_starts_the_ranks(monkeypatch):
    """Ray's printer is private: where a Ray version has none by that name, registering the ranks is a no-op, not an
    AttributeError at every rank start."""
    import ray._private.worker as ray_worker

    from grpo_lab.execution.sharded import ray_notices

    monkeypatch.delattr(ray_worker, "print_to_stdstream")
    monkeypatch.setattr(ray_notices, "OWN_RANKS", set())
    ray_notices.quiet_rank_deaths([1234])
    assert not hasattr(ray_worker, "print_to_stdstream") and ray_notices.OWN_RANKS == {1234}
