"""The CUDA caching allocator's settings a learner runs with (`memory.cuda_expandable_segments`)."""

from __future__ import annotations

import os


def expandable_segments(enabled: bool) -> bool:
    """Set torch's expandable_segments from now on (segments grow in place, so long-sequence steps do not fragment the
    cache into blocks no request fits), unless PYTORCH_CUDA_ALLOC_CONF names it: the user's own setting wins. Returns
    whether this call set it."""
    import torch

    if "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or not torch.cuda.is_available():
        return False
    torch.cuda.memory._set_allocator_settings(f"expandable_segments:{enabled}")
    return True
