"""The DataParallel guard (P1). grpo_lab never wraps the learner; this refuses one that was wrapped
(by HF Trainer when it sees more than one GPU, or by hand) or whose parameters sit on devices
outside the plan, with what happened and how to fix it, before a step can spill onto the
generator's GPU."""

from __future__ import annotations

import torch

from ..errors import LabError

WRAPPERS = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)


def check_learner(model, planned: list[str], field: str = "placement.learner") -> None:
    if isinstance(model, WRAPPERS):
        raise LabError(
            f"{field}: the learner is wrapped in {type(model).__name__}, which replicates it onto every "
            "visible GPU, the generator's included (P1: HF Trainer does this when n_gpu > 1); unwrap it "
            "(model.module), limit CUDA_VISIBLE_DEVICES, or use grpo_lab.trl_bridge.prepare_trainer"
        )
    allowed = {torch.device(d) for d in planned}  # config devices are normalised: 'cpu' or 'cuda:N'
    stray = sorted({str(p.device) for p in model.parameters() if p.device not in allowed and p.device.type != "meta"})
    if stray:
        raise LabError(
            f"{field}: learner parameters sit on {stray}, outside the plan {sorted(planned)} (a device_map "
            "spread the model?); load it on one device or change the placement"
        )
