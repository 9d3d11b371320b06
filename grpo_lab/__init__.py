"""grpo_lab: stepwise GRPO on 4-bit LoRA models, with the memory of every phase in view."""

from .models.quant import quiet_bitsandbytes

quiet_bitsandbytes()  # before anything imports bitsandbytes (README: CPU notes)

from .algo.containers import Advantages, LogProbs, LossStats, PromptBatch, Rewards, Rollout, StepResult
from .comparison import compare
from .config.loading import load_config, save_config
from .config.schema import LabConfig
from .errors import ConfigError, LabError, one_line_in_cells
from .lab import Lab

one_line_in_cells()  # a refusal in a notebook cell is its one line (errors.py)

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
