"""Activation offload (`model.activation_offload`): gradient checkpointing whose saved layer inputs wait in pinned host
memory instead of on the GPU, as Unsloth's offloaded gradient checkpointing does.

With plain checkpointing every decoder layer's input stays on the GPU until backward: layers x tokens x hidden x 2
bytes (Qwen3-8B at 32K tokens: 9 GiB), the learner's largest term at long completions. Here each layer's input is
copied to the host on a side CUDA stream as the forward pass goes; backward brings a layer's input back while the
layer after it recomputes (a prefetch one layer ahead, on the side stream), so on the GPU at most two layers' inputs
are resident. torch's `save_on_cpu` was the library candidate: it moves every tensor autograd saves (not only the
checkpoint's inputs) and copies on the compute stream with no prefetch, so backward waits on each copy.

The function is transformers' own hook: each GradientCheckpointingLayer calls `_gradient_checkpointing_func(layer,
hidden_states)`, which `attach` points here. The recompute runs under the forward's autocast and RNG state.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch


class Offloaded:
    """One layer input on the host, with the events that say when its copies are done."""

    def __init__(self, host: torch.Tensor, copied: Optional[torch.cuda.Event]):
        self.host = host
        self.copied = copied  # the device-to-host copy's event (None on the CPU)
        self.prefetched: Optional[torch.Tensor] = None  # brought back ahead of its layer's recompute
        self.fetched: Optional[torch.cuda.Event] = None


class ActivationOffload:
    """The checkpoint function of one model's decoder layers on `device`; holds the side stream and the stack of inputs
    awaiting backward (weak references: a graph freed without backward frees its inputs)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.waiting: list[weakref.ref] = []
        self.offloaded_bytes = 0  # the last pass's host bytes (the plan's host line, measured)

    def __call__(self, function, hidden_states: torch.Tensor, *args):
        if not torch.is_grad_enabled():  # why: a no-grad pass (reference, rollout) has no backward to save for
            return function(hidden_states, *args)
        anchor = torch.empty(0, requires_grad=True)  # why: backward runs even when no input requires grad
        return _OffloadedLayer.apply(self, function, hidden_states, anchor, *args)

    def to_host(self, x: torch.Tensor) -> Offloaded:
        self.waiting = [ref for ref in self.waiting if ref() is not None]
        if not self.waiting:
            self.offloaded_bytes = 0
        self.offloaded_bytes += x.numel() * x.element_size()
        if self.stream is None:  # a CPU learner: a separate host copy (the path's test; it saves nothing there)
            handle = Offloaded(x.detach().clone(), None)
        else:
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # why: x is written on the compute stream
            with torch.cuda.stream(self.stream):
                host.copy_(x.detach(), non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.stream)
            x.record_stream(self.stream)  # why: x's block is not reused before the copy has read it
            handle = Offloaded(host, copied)
        self.waiting.append(weakref.ref(handle))
        return handle

    def to_device(self, handle: Offloaded) -> torch.Tensor:
        """The layer input back on the device, for its recompute; starts bringing back the one backward needs next."""
        self.waiting = [ref for ref in self.waiting if ref() is not None and ref() is not handle]
        if self.stream is None:
            x = handle.host
        elif handle.prefetched is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(handle.fetched)
            x = handle.prefetched
            x.record_stream(current)  # why: allocated on the side stream, used and freed on the compute stream
        else:
            torch.cuda.current_stream(self.device).wait_event(handle.copied)
            x = handle.host.to(self.device, non_blocking=True)
        handle.prefetched = None  # why: the handle must not keep a second device copy alive
        if self.waiting:
            self.prefetch(self.waiting[-1]())
        return x.detach()

    def prefetch(self, handle: Optional[Offloaded]) -> None:
        """Copy `handle` back on the side stream while the compute stream recomputes the layer after it."""
        if handle is None or self.stream is None or handle.prefetched is not None:
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(handle.copied)
            handle.prefetched = handle.host.to(self.device, non_blocking=True)
            handle.fetched = torch.cuda.Event()
            handle.fetched.record(self.stream)


class _OffloadedLayer(torch.autograd.Function):
    """A reentrant checkpoint (forward without a graph, recompute in backward) whose saved input is on the host."""

    @staticmethod
    def forward(ctx, offload: ActivationOffload, function, hidden_states, anchor, *args):
        device_type = hidden_states.device.type
        ctx.offload, ctx.function, ctx.args = offload, function, args
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.rng = _rng_state(hidden_states.device)
        ctx.saved = offload.to_host(hidden_states)
        with torch.no_grad():
            return function(hidden_states, *args)

    @staticmethod
    def backward(ctx, grad_output):
        hidden_states = ctx.offload.to_device(ctx.saved).requires_grad_(True)
        ctx.saved = None  # why: the host copy is used once
        device_type, enabled, dtype = ctx.autocast
        devices = [hidden_states.device] if hidden_states.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            _set_rng_state(ctx.rng, hidden_states.device)  # why: dropout recomputes the mask the forward drew
            with torch.autocast(device_type, dtype=dtype, enabled=enabled):
                output = ctx.function(hidden_states, *ctx.args)
        torch.autograd.backward(output, grad_output)
        return (None, None, hidden_states.grad, None) + (None,) * len(ctx.args)


def _rng_state(device: torch.device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def attach(model, device) -> ActivationOffload:
    """Point every checkpointed decoder layer of `model` (checkpointing already enabled) at one ActivationOffload."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    offload = ActivationOffload(device)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer._gradient_checkpointing_func = offload
    model.grpo_lab_activation_offload = offload  # why: the plan's host line is checked against offloaded_bytes
    return offload
