"""Ray's own paragraph when a rank's process dies, kept off the driver's output: the Lab says it in one line.

Ray's driver prints every worker death the GCS publishes ("(raylet) A worker died or was killed while executing a
task by an unexpected system error. ... Worker PID: N ...", some 1,000 characters) from a thread of its own
(`ray._private.worker.listen_error_messages`), whatever `log_to_driver` says, so a notebook that saw a rank die saved
it beside the Lab's line. Only deaths of this driver's own ranks (their PIDs, registered as they start) are dropped;
every other message of Ray's is printed as Ray prints it.
"""

from __future__ import annotations

import re

DEATH = "A worker died or was killed while executing a task"
_PID = re.compile(r"Worker PID: (\d+)")
OWN_RANKS: set[int] = set()  # this driver's rank processes, as their start replies named them


def is_own_rank_death(data: dict) -> bool:
    """Whether a message Ray's driver is about to print is the death of one of this driver's ranks."""
    if data.get("pid") != "raylet":
        return False
    lines = data.get("lines") or []
    pids = {int(m.group(1)) for line in lines if DEATH in line for m in [_PID.search(line)] if m}
    return bool(pids) and pids <= OWN_RANKS


def quiet_rank_deaths(pids: list[int]) -> None:
    """Register `pids` as this driver's ranks, and (once per process) filter Ray's printer."""
    import ray._private.worker as ray_worker

    OWN_RANKS.update(pids)
    printer = getattr(ray_worker, "print_to_stdstream", None)
    if printer is None or getattr(printer, "grpo_lab_filter", False):
        return  # why None too: a Ray that renamed its printer prints its paragraph again; the ranks still start

    def print_to_stdstream(data, ignore_prefix: bool):
        if not is_own_rank_death(data):
            printer(data, ignore_prefix)

    print_to_stdstream.grpo_lab_filter = True
    ray_worker.print_to_stdstream = print_to_stdstream  # why: the listener thread looks it up at each message
