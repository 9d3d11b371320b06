"""A host limit the kernel enforces (placement.host_limit: cgroup, issue 68 item 2): a child process's Lab in a fresh
memory cgroup of placement.host_memory_gib. Without the live guard the crossing step is killed by the kernel (SIGKILL,
the shell's rc 137); with it the phase stops at the guard's line, the step is undone bit for bit, the fix runs under
the same limit and the process lives. The group is removed as the child ends, killed or not. Skipped, saying why,
where no memory cgroup can be made (not root, no memory controller)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_lab import LabError, load_config

CHILD = Path(__file__).with_name("kernel_limit_child.py")
ROOT = CHILD.parents[1]

pytestmark = pytest.mark.xdist_group("live_guard")  # why: its children allocate hundreds of MiB up to a limit


def cgroup_root() -> Path:
    """The memory controller's root a group can be made under, or skip saying why none can."""
    from grpo_lab.memory.kernel_limit import controller, unavailable

    why = unavailable()
    if why:
        pytest.skip(f"no memory cgroup can be made here: {why}")
    return controller()[1]


def run_child(kind: str, live: str, timeout: float = 240) -> tuple[int, list[dict], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(CHILD), kind, live], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, events, done.stderr


def gone(group: str, within: float = 10.0) -> bool:
    """The child's group was removed (its reaper runs as the child ends)."""
    deadline = time.monotonic() + within
    while Path(group).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not Path(group).exists()


def killed_by_the_kernel(group: str) -> bool:
    """The kernel log names the group as the OOM killer's (True where the log cannot be read: the SIGKILL stands)."""
    log = subprocess.run(["dmesg"], capture_output=True, text=True)
    return log.returncode != 0 or f"oom_memcg=/{Path(group).name}," in log.stdout


def test_without_the_live_guard_the_kernel_kills_the_crossing_step():
    cgroup_root()
    rc, events, stderr = run_child("hog", "off")
    kinds = [e["event"] for e in events]
    assert rc == -9, (rc, kinds, stderr[-2000:])  # SIGKILL: rc 137 in a shell
    assert kinds == ["loaded", "hog"]  # killed inside the allocating phase: no word from the lab
    group = events[0]["group"]
    assert killed_by_the_kernel(group) and gone(group)


def test_with_the_live_guard_the_phase_stops_at_the_line_is_undone_and_the_fix_runs_under_the_same_limit():
    cgroup_root()
    rc, events, stderr = run_child("hog", "live")
    by = {e["event"]: e for e in events}
    assert rc == 0 and list(by) == ["loaded", "hog", "stopped", "fixed"], (rc, list(by), stderr[-2000:])
    stopped, limit = by["stopped"], by["loaded"]["limit_mib"]
    assert "\n" not in stopped["message"] and "the kernel's limit on this process" in stopped["message"]
    assert "during phase 'rewards' of step 1, no update had been applied" in stopped["message"]
    assert stopped["same"]  # LoRA and AdamW state bit for bit as before the step
    # stopped past the guard's line, by at most 5 % of the limit: below the kernel's, which kills at 100 %
    assert stopped["line_mib"] < stopped["peak_mib"] <= stopped["line_mib"] + 0.05 * limit, stopped
    assert by["fixed"]["step"] == 1 and by["fixed"]["peak_mib"] < stopped["line_mib"]
    assert gone(by["loaded"]["group"])


def test_a_limit_below_what_the_process_holds_is_refused_in_one_line_and_makes_no_group():
    from grpo_lab.memory.kernel_limit import KernelLimit

    root = cgroup_root()
    with pytest.raises(LabError) as caught:
        KernelLimit(64 * 1024**2, 0.95).enforce()
    message = str(caught.value)
    assert message.startswith("placement.host_memory_gib: 0.0625 GiB is below what this process already holds (")
    assert "raise it above" in message and "\n" not in message
    assert not (root / f"grpo-lab-{os.getpid()}").exists()


def test_a_kernel_limit_where_none_can_be_made_is_refused_in_one_line():
    """Not root: a child that drops root (to `nobody`, after its imports: this interpreter is root's) asks for it."""
    if os.geteuid() != 0:
        pytest.skip("the test drops root to show the refusal; this process is not root")
    code = "import os\nfrom grpo_lab.memory.kernel_limit import KernelLimit\nos.setuid(65534)\nKernelLimit(2**30, 0.95)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith("grpo_lab.errors.LabError: placement.host_limit: cgroup needs root")
    assert last.endswith("use placement.host_limit: budget (the guard holds the budget itself)")


@pytest.mark.parametrize(
    "override, says",
    [
        ("memory.host_threshold=0", "memory.host_threshold: got 0; the share of the host limit"),
        ("memory.host_threshold=1.5", "memory.host_threshold: got 1.5; the share of the host limit"),
    ],
    ids=["threshold-0", "threshold-1.5"],
)
def test_bad_limits_are_one_line_naming_the_field_and_the_fix(override, says):
    with pytest.raises(LabError) as caught:
        load_config("tiny-cpu", [override])
    assert str(caught.value).startswith(says) and "\n" not in str(caught.value)


def test_a_kernel_limit_without_a_size_is_refused_at_load_in_one_line(tiny_config):
    from grpo_lab import Lab

    lab = Lab({**tiny_config(), "placement": {"host_limit": "cgroup"}})
    with pytest.raises(LabError) as caught:
        lab.load()
    assert str(caught.value) == (
        "placement.host_limit: cgroup has no size; set placement.host_memory_gib (the GiB the kernel kills the Lab at) "
        "or use placement.host_limit: budget"
    )
    assert lab.learner is None and lab.memory is None  # nothing loaded, nothing left behind
