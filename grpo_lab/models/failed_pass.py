"""Recovery of a sharded pass that failed: FSDP's state reset, and the failure agreed by every rank (so none is
left inside a collective). The identity on an unsharded model and in a world of one."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


def reset_after_failure(model) -> None:
    """FSDP's recovery after a forward or backward raised mid-flight: reset the root's iteration state (else the next
    root pre-forward returns early, skipping its stream waits) and reshard every unit (else gathered layers stay
    allocated, and an OOM retry meets them). A no-op on a model that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    roots = [u for u in units if u._get_fsdp_state()._is_root]
    for root in roots:
        root.reset_iter_state()  # on the root only, as torch documents
    for unit in units:
        unit.reshard()


@contextmanager
def agreed(*models) -> Iterator[None]:
    """A pass over sharded `models`: when it raises on any rank, every rank raises at this point (runtime.agree), and
    each model's FSDP state is reset, so no rank is left in a collective and the next pass starts clean."""
    from ..runtime import PeerFailed, RanksBlocked, runtime

    me = runtime()
    if not me.sharded:
        yield
        return
    try:
        yield
    except Exception as err:
        for model in models:
            reset_after_failure(model)
        try:
            me.agree(True)  # the others learn it here and stop too
        except RanksBlocked as blocked:  # they are blocked in a collective this pass left: the driver restarts all
            err.add_note(str(blocked))
        err.agreed = True  # why: the phase's own decision (runtime.settle) must not wait for the others again
        raise
    failed = me.agree(False)
    if failed:
        for model in models:
            reset_after_failure(model)
        raise PeerFailed(f"the pass failed on rank {', '.join(map(str, failed))}; every rank stopped it there")
