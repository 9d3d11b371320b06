"""What a sharded Lab's driver `host` row counts. The host reader reads a process and all its children
(memory/readers.HostReader), and a Ray the Lab started is the driver's child: its daemons (GCS, raylet, dashboard,
agents, idle workers) and the rank processes are then in the driver's RSS. This names every process of that tree, and
splits the driver's own RSS by what is mapped: torch's shared libraries, the other libraries and files, and anonymous
memory (the Python heap: imported modules, the tokenizer, Ray's client, any tensors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import psutil

MiB = 1024**2


def driver_tree(rank_pids: list[int], pid: Optional[int] = None) -> list[dict]:
    """Each process the driver's host row counts, as {"what", "pid", "rss"} (bytes): the driver, then its
    children: a rank ('rank k', by `rank_pids`), or one of Ray's own processes ('Ray: <name>')."""
    me = psutil.Process(pid)
    rows = [{"what": "driver (this process)", "pid": me.pid, "rss": me.memory_info().rss}]
    for child in me.children(recursive=True):
        try:
            rss, name = child.memory_info().rss, process_name(child.cmdline(), child.name())
        except psutil.Error:
            continue  # it exited meanwhile
        what = f"rank {rank_pids.index(child.pid)}" if child.pid in rank_pids else f"Ray: {name}"
        rows.append({"what": what, "pid": child.pid, "rss": rss})
    return rows


def process_name(cmdline: list[str], fallback: str) -> str:
    """A short name: Ray's worker title ('ray::IDLE'), a Python script's file name, or the executable's."""
    if not cmdline:
        return fallback
    if cmdline[0].startswith("ray::"):
        return cmdline[0].split()[0]
    script = next((a for a in cmdline[1:] if a.endswith(".py")), None)
    return Path(script or cmdline[0]).name


def by_kind(tree: list[dict]) -> dict[str, float]:
    """The tree's RSS (bytes) summed as: the driver, the ranks, Ray's own processes."""
    out = {"driver (this process)": 0.0, "ranks": 0.0, "Ray's own processes": 0.0}
    for row in tree:
        kind = row["what"] if row["what"].startswith("driver") else "ranks" if row["what"].startswith("rank") else None
        out[kind or "Ray's own processes"] += row["rss"]
    return out


def mapped(pid: Optional[int] = None) -> dict[str, float]:
    """A process's RSS (bytes) by what is mapped (/proc/<pid>/smaps): torch's libraries, other libraries and files,
    anonymous memory. Empty where /proc is not there."""
    path = Path(f"/proc/{pid or 'self'}/smaps")
    out = {"torch's libraries": 0.0, "other libraries and files": 0.0, "anonymous (Python heap, tensors)": 0.0}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    kind = None
    for line in lines:
        fields = line.split()
        if len(fields) >= 5 and "-" in fields[0] and ":" in fields[3]:  # a mapping's header: range perms off dev inode
            where = fields[5] if len(fields) > 5 else ""
            kind = mapping_kind(where)
        elif fields and fields[0] == "Rss:" and kind is not None:
            out[kind] += int(fields[1]) * 1024
    return out


def mapping_kind(where: str) -> str:
    """Which of mapped()'s groups a mapping (its path, '[heap]', or '' for anonymous) belongs to."""
    if not where or where.startswith("["):
        return "anonymous (Python heap, tensors)"
    return "torch's libraries" if "/torch/" in where else "other libraries and files"


def driver_memory(rank_pids: list[int]) -> dict:
    """The driver's host row explained, in MiB: `tree`, its process tree by kind (by_kind; `all` their sum, what the
    row reads), and `process`, its own process by mapping (mapped)."""
    tree = driver_tree(rank_pids)
    kinds = {kind: rss / MiB for kind, rss in by_kind(tree).items()}
    return {"tree": {**kinds, "all": sum(kinds.values())}, "process": {k: v / MiB for k, v in mapped().items()}}


def format_driver(memory: dict) -> str:
    """driver_memory() as a table."""
    lines = [f"{'the driver host row: its process tree':<44}{'RSS MiB':>10}"]
    lines += [f"  {kind:<42}{mib:>10.1f}" for kind, mib in memory["tree"].items()]
    lines.append("the driver process itself, by what is mapped")
    lines += [f"  {kind:<42}{mib:>10.1f}" for kind, mib in memory["process"].items()]
    return "\n".join(lines)
