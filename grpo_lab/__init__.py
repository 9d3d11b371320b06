"""grpo_lab: stepwise GRPO on 4-bit LoRA models, with the memory of every phase in view.

Importing it changes nothing outside the package. A refusal in a notebook cell shows as its one line once a Lab is
made in the kernel, or after `%load_ext grpo_lab` (errors.one_line_in_cells)."""

from .algo.containers import Advantages, LogProbs, LossStats, PromptBatch, Rewards, Rollout, StepResult
from .comparison import compare
from .config.loading import load_config, save_config
from .config.schema import LabConfig
from .errors import ConfigError, LabError, one_line_in_cells
from .lab import Lab


def load_ipython_extension(ipython) -> None:
    """`%load_ext grpo_lab`: a LabError in a cell shows as its one line (`%tb` prints the traceback)."""
    one_line_in_cells(ipython)


__all__ = [
    "Lab",
    "compare",
    "LabConfig",
    "load_config",
    "save_config",
    "LabError",
    "ConfigError",
    "StepResult",
    "Rollout",
    "Rewards",
    "Advantages",
    "LogProbs",
    "LossStats",
    "PromptBatch",
]
__version__ = "0.1.0"
