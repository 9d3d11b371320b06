"""What a guided notebook keeps out of its saved outputs: the libraries' notices that do not bear on its story.

Each one below is named, with why it cannot matter to a story; anything else a library warns of still shows.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

# TRL warns, at each of five imports, that vLLM 0.32 is past the versions it lists; the stories never run TRL's vLLM
# path (notebook 02 runs TRL's trainer with its own generate), and tests/test_trl_parity.py checks the parts used here
TRL_VLLM_VERSION = "TRL currently supports vLLM versions"
# vLLM's CPU wheel finds a Triton without a CPU backend and turns Triton off: its CPU kernels never use it
VLLM_TRITON = "Triton is installed, but doesn't include CPU backend"


def quiet_libraries() -> None:
    """Drop the notices above and, in a headless run, the loading bars (it saves each as a frozen "0%"); idempotent."""
    from transformers.utils import logging as hf_logging

    from ..models.quant import drop_log_lines, quiet_bitsandbytes
    from ..runtime import frontend_is_live

    quiet_bitsandbytes()  # bitsandbytes' `pip install kernels` notice (models/quant.py says why it cannot matter)
    warnings.filterwarnings("ignore", message=TRL_VLLM_VERSION, category=UserWarning)
    drop_log_lines("vllm.triton_utils.importing", VLLM_TRITON)
    if not frontend_is_live():  # why: a story's own from_pretrained and save_pretrained bars, not only a Lab's
        hf_logging.disable_progress_bar()


@contextmanager
def no_frozen_bars():
    """transformers' loading bars off while a headless run (papermill, nbconvert) loads: there no one watches them,
    and the notebook saves each as a frozen "0%" widget; a person's notebook and a terminal keep them."""
    from transformers.utils import logging as hf_logging

    from ..runtime import frontend_is_live

    was_on = hf_logging.is_progress_bar_enabled()
    if was_on and not frontend_is_live():
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
