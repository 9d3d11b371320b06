"""This process's one answer to "which device am I, whose RNG, who decides": its rank in a sharded learner (or a world
of one), its compute device, each GPU's NVML handle (looked up by UUID), its RNG states, where its allocator snapshots
go, the collectives a step needs (sums, row gathers, and `agree`, the all-reduce by which every rank takes the same
branch), its CUDA allocator's settings, and whether a person's frontend shows its widgets. A notebook or CLI process is
the driver; a rank's worker sets its own once, at start. Nothing else reads `placement.learner` to mean "my device". The
bottom floor (docs/architecture.md): every package may import it, and it imports nothing of grpo_lab but `errors`.

Why one object: a CPU has one device, one RNG and no streams, so every "which device / whose RNG" bug passes on it; here
they are pure functions of (rank, size, placement), tested with remapped device lists.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch

from .errors import LabError


def rank_devices(learner: str, procs: int) -> list[str]:
    """Rank k's device: cuda:(N+k) for a learner on cuda:N; 'cpu' for every rank of a CPU learner."""
    if learner == "cpu":
        return ["cpu"] * procs
    first = int(learner.split(":")[1])
    return [f"cuda:{first + k}" for k in range(procs)]


@dataclass(frozen=True)
class Runtime:
    rank: int = 0
    size: int = 1
    is_rank: bool = False  # a worker process of a sharded learner (its driver is the notebook's process)
    own_gpu: bool = False  # a rank Ray gave one GPU: it sees that GPU alone, as its cuda:0 (CUDA_VISIBLE_DEVICES)

    @property
    def sharded(self) -> bool:
        return self.size > 1

    @property
    def is_driver(self) -> bool:
        """The process that decides for the run: it alone guards host RAM and reports (the ranks compute)."""
        return not self.is_rank

    # --- where am I ---
    def device(self, config) -> str:
        """This process's learner device: placement.learner, or this rank's own (rank_devices)."""
        return self.device_of(config.placement.learner)

    def device_of(self, learner: str) -> str:
        if self.is_rank and self.own_gpu and learner != "cpu":
            return "cuda:0"  # why: Ray set CUDA_VISIBLE_DEVICES to this rank's GPU; which one the driver's plan names
        return rank_devices(learner, self.size)[self.rank] if self.is_rank else learner

    def watched_devices(self, config) -> list[str]:
        """The devices this process's memory sampler reads: a rank its own device only (its reference copy sits on it
        too); one process its learner, generator engine and reference copy."""

        if self.is_rank:
            return [self.device(config)]
        place = config.placement
        engine = place.generator_devices() if config.generator.own_weights else []
        ref = [config.reference_device] if config.reference_strategy == "copy" else []
        return list(dict.fromkeys([place.learner, *engine, *ref]))

    def cuda_indices(self, config) -> list[int]:
        """The CUDA devices whose RNG this process owns (a rank: its own GPU only)."""
        devices = [self.device(config)] if self.is_rank else self.watched_devices(config)
        return sorted({int(d.split(":")[1]) for d in devices if d.startswith("cuda")})

    def snapshot_dir(self, output_dir: Optional[str]) -> Path:
        """Where this process writes allocator snapshots: one folder per rank, so ranks never overwrite each other."""
        base = Path(output_dir or ".") / "memory_snapshots"
        return base / f"rank{self.rank}" if self.is_rank else base

    # --- whose rows ---
    def rows(self, n: int) -> slice:
        """This rank's rows of an n-row batch: a contiguous 1/size of it (the config makes n divisible)."""
        share = n // self.size
        return slice(self.rank * share, (self.rank + 1) * share)

    def share(self, n: int, rank: Optional[int] = None) -> slice:
        """Rank `rank`'s (default: this one's) share of n whole items, e.g. a rollout's prompt groups: contiguous, in
        rank order, the first n % size ranks one more (so n need not divide; a rank may get none)."""
        k = self.rank if rank is None else rank
        base, extra = divmod(n, self.size)
        start = k * base + min(k, extra)
        return slice(start, start + base + (k < extra))

    # --- collectives (the identity in a world of one) ---
    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over the ranks (every rank gets it)."""
        if not self.sharded:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
        dist.all_reduce(t)
        return t.tolist()

    def agree(self, failed: bool) -> list[int]:
        """Who decides: the ranks that report `failed` at this point, the same list on every rank. Every branch that
        changes whether a collective runs next (refuse, retry, stop) is taken on this list, never on one rank's own
        view. On a group of its own (gloo, CPU), so a decision never pairs with a learner collective; a rank that
        failed waits DECIDE_S for the others: if they do not come, they are blocked in a collective it left, and it
        raises RanksBlocked (its driver then restarts every rank)."""
        if not self.sharded:
            return [self.rank] if failed else []
        import torch.distributed as dist

        flags = torch.zeros(self.size, dtype=torch.float64)
        flags[self.rank] = float(failed)
        work = dist.all_reduce(flags, group=_DECISIONS, async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=DECIDE_S if failed else DECISION_TIMEOUT_S))
        except RuntimeError:
            _BLOCKED[0] = True
            raise RanksBlocked(
                f"rank {self.rank} failed and the other ranks did not reach the decision within "
                f"{DECIDE_S:.0f} s (blocked in a collective the failure left)"
            ) from None
        return [k for k, flag in enumerate(flags.tolist()) if flag]

    def gather_rows(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's rows (its `rows(n)` slice of a per-row tensor) concatenated in rank order, on every rank."""
        if not self.sharded:
            return part
        import torch.distributed as dist

        device = _comm_device()
        parts = [torch.empty_like(part, device=device) for _ in range(self.size)]
        dist.all_gather(parts, part.to(device).contiguous())
        return torch.cat(parts).to(part.device)

    def gather_objects(self, value) -> list:
        """Every rank's `value`, in rank order, on every rank."""
        if not self.sharded:
            return [value]
        import torch.distributed as dist

        out: list = [None] * self.size
        dist.all_gather_object(out, value)
        return out


class PeerFailed(LabError):
    """Another rank failed this phase: this one, which did not, undoes its share with it (the same branch
    everywhere)."""

    agreed = True  # every rank took part in the decision that raised it


def settle(phase: str, failed: bool) -> None:
    """Every rank ends `phase` on the same branch: a phase that failed on any rank fails on all (runtime.agree).
    A no-op in a world of one."""
    me = runtime()
    if not me.sharded:
        return
    ranks = me.agree(failed)
    if ranks and not failed:
        raise PeerFailed(
            f"{phase} failed on rank {', '.join(map(str, ranks))}; every rank stopped it there and undid "
            "this step's work"
        )


def take_blocked() -> bool:
    """Whether a decision since the last look found the other ranks blocked in a collective (and forget it): a rank's
    worker tells its driver, which restarts every rank, whatever error the phase turned that into (an OOM's LabError
    carries no notes)."""
    blocked, _BLOCKED[0] = _BLOCKED[0], False
    return blocked


_BLOCKED = [False]


class RanksBlocked(RuntimeError):
    """A failed rank's peers are blocked in a collective: only restarting every rank gets them out."""

    agreed = True  # nothing more to agree: the driver restarts every rank


DECIDE_S = 5.0  # how long a failed rank waits for its peers at a decision
DECISION_TIMEOUT_S = 600.0  # how long a rank that did not fail waits (a slow peer; as long as a collective)
_DECISIONS = None  # the decision process group (gloo), made by `init_decisions` on every rank


def init_decisions() -> None:
    """Make the decision group (a collective: every rank calls it once, after init_process_group)."""
    global _DECISIONS
    import torch.distributed as dist

    _DECISIONS = dist.new_group(backend="gloo", timeout=timedelta(seconds=DECISION_TIMEOUT_S))


def _comm_device() -> torch.device:
    """Where a collective's tensors must be: the rank's GPU under NCCL, the CPU under gloo."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


_RUNTIME = Runtime()


def runtime() -> Runtime:
    """This process's runtime (set once by a rank's worker; the driver's, a world of one, everywhere else)."""
    return _RUNTIME


def set_runtime(value: Runtime) -> None:
    global _RUNTIME
    _RUNTIME = value


# --- RNG: every stream a step draws from, per process ---


def capture_rng(cuda: Optional[list[int]] = None) -> dict:
    """torch's CPU generator, Python's, and the CUDA generators of `cuda` (default: every initialised device);
    keyed by device index, so a rank's state never lands on another rank's GPU."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        indices = range(torch.cuda.device_count()) if cuda is None else cuda
        state["cuda"] = {i: torch.cuda.get_rng_state(i) for i in indices}
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        if isinstance(cuda, list):  # a checkpoint written before states were keyed by device
            cuda = dict(enumerate(cuda))
        for index, value in cuda.items():
            torch.cuda.set_rng_state(value, index)


_STREAMS_OWNER: list = [None]  # a weakref to the Lab whose random streams the process's generators hold now


def own_streams(lab) -> None:
    """Make `lab`'s random streams the process's: the other Lab's, if another Lab drew since, are kept in its
    `_rng` and this one's put back. Why: two Labs in one process (a notebook comparing settings) drew from the same
    global generators, so one Lab's step 0 depended on what the other had run (a loss of 1.500 against 1.141).
    Cheap when one Lab runs alone: nothing is swapped."""
    import weakref

    owner = _STREAMS_OWNER[0]() if _STREAMS_OWNER[0] is not None else None
    if owner is lab:
        return
    if owner is not None:
        owner._rng = capture_rng()
    if getattr(lab, "_rng", None) is not None:
        restore_rng(lab._rng)
    _STREAMS_OWNER[0] = weakref.ref(lab)


def rank_rng(saved: dict, rank: int, size: int) -> dict:
    """The RNG state a rank restores from a checkpoint: its own (`ranks`, written by every rank of a sharded run),
    else the one state the checkpoint has (one process, or another number of ranks: every rank's streams were equal
    by construction, the same seed and the same draws, so any one of them is right)."""
    ranks = saved.get("ranks")
    if ranks and len(ranks) == size:
        return ranks[rank]
    return ranks[0] if ranks else saved


# --- NVML: a CUDA device's handle by UUID (NVML ignores CUDA_VISIBLE_DEVICES; its indices are physical) ---


def _bare(uuid: str) -> str:
    return uuid.lower().removeprefix("gpu-").removeprefix("mig-")


def nvml_index(torch_uuid: str, nvml_uuids: list[str]) -> Optional[int]:
    """The NVML index of the device torch calls by `torch_uuid`, among NVML's devices' UUIDs; None if absent."""
    want = _bare(torch_uuid)
    return next((i for i, u in enumerate(nvml_uuids) if _bare(u) == want), None)


def nvml_handle(torch_index: int, pynvml=None, torch_uuid: Optional[str] = None):
    """NVML's handle of torch's cuda:`torch_index`, found by UUID; None when NVML is not there."""
    try:
        if pynvml is None:
            import pynvml
        if torch_uuid is None:
            torch_uuid = str(torch.cuda.get_device_properties(torch_index).uuid)
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        uuids = [u.decode() if isinstance(u, bytes) else u for u in map(pynvml.nvmlDeviceGetUUID, handles)]
    except Exception:  # nvidia-ml-py not installed or no driver: torch's figures still work
        return None
    index = nvml_index(torch_uuid, uuids)
    return None if index is None else handles[index]


# --- the CUDA caching allocator's settings this process runs with (memory.cuda_expandable_segments) ---


def expandable_segments(enabled: bool) -> bool:
    """Set torch's expandable_segments from now on (segments grow in place, so long-sequence steps do not fragment the
    cache into blocks no request fits), unless PYTORCH_CUDA_ALLOC_CONF names it: the user's own setting wins. Returns
    whether this call set it."""
    if "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or not torch.cuda.is_available():
        return False
    torch.cuda.memory._set_allocator_settings(f"expandable_segments:{enabled}")
    return True


LIVE_ENV = "GRPO_LAB_LIVE_WIDGETS"  # "1": always make the live widgets, "0": never; unset: frontend_is_live decides


def frontend_is_live() -> bool:
    """Whether a widget made now has a person's frontend to draw in. A headless runner (papermill, nbconvert
    --execute: nbclient) sends its cells with allow_stdin off, as no one is there to answer input(), and saves the state
    of every widget made into the notebook: the live plot's holds plotly's 5 MB widget bundle (FigureWidget's `_esm`),
    and the panel's hundreds of models. Outside a kernel (a script, a test) widgets are plain objects: True.
    GRPO_LAB_LIVE_WIDGETS=1 or 0 decides instead (e.g. Voila, which draws widgets but runs cells without stdin)."""
    forced = os.environ.get(LIVE_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    try:
        from IPython import get_ipython
    except ImportError:
        return True
    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None or not hasattr(kernel, "get_parent"):
        return True
    request = kernel.get_parent("shell") or {}
    return bool(request.get("content", {}).get("allow_stdin", True))
