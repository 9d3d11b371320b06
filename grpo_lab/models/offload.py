"""Optimizer offload: AdamW whose fp32 master weights and two moments live in host RAM, as in
DeepSpeed's CPU Adam (without its fused kernel). The GPU keeps only the LoRA weights and their
gradients; each update copies gradients to the host, steps there, and copies weights back."""

from __future__ import annotations

import torch


class HostAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float, weight_decay: float = 0.0, **kwargs):
        self.device_params = [p for p in params]
        # why host: 12 bytes per LoRA parameter (fp32 master + 2 moments) leave the GPU
        self.master = [p.detach().to("cpu", torch.float32, copy=True) for p in self.device_params]
        self.inner = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay, **kwargs)
        super().__init__(self.master, dict(lr=lr, weight_decay=weight_decay))
        self.param_groups, self.state = self.inner.param_groups, self.inner.state

    @torch.no_grad()
    def step(self, closure=None):
        for p, m in zip(self.device_params, self.master):
            # why: AdamW runs where its state is, so the gradient travels to the host (4 bytes per LoRA param)
            m.grad = None if p.grad is None else p.grad.detach().to("cpu", torch.float32)
        self.inner.step()
        for p, m in zip(self.device_params, self.master):
            p.copy_(m.to(p.device, p.dtype, non_blocking=True))  # why: the device copy is what forward passes read
            m.grad = None  # why: the host copy of the gradient is used once

    def zero_grad(self, set_to_none: bool = True):
        for p in self.device_params:
            p.grad = None

    def state_dict(self):
        return {"inner": self.inner.state_dict(), "master": [m.clone() for m in self.master]}

    def load_state_dict(self, state):
        with torch.no_grad():
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
        self.inner.load_state_dict(state["inner"])
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
