"""The TRL bridge: grpo_lab's protection and memory view for people who keep TRL's GRPOTrainer.

    from grpo_lab.trl_bridge import prepare_trainer
    with prepare_trainer(trainer) as watch:      # learner unwrapped, reference placed, phases watched
        trainer.train()
    print(watch.table())

- No DataParallel (P1): HF Trainer wraps the model in `nn.DataParallel` whenever `args.n_gpu > 1`
  (transformers >= 5 skips 4/8-bit models, not bf16 ones), scattering the log-prob pass over every
  visible GPU, the generator's included. Inside the context the trainer sees one GPU; a model
  that is already wrapped is unwrapped.
- Reference model (P5): placed on the policy's device and put in eval mode with gradients off;
  one that cannot be moved (e.g. left on the meta device) is refused with the fix.
- Memory: the same sampler, phase timeline, tables and plots as a Lab, with TRL's phases
  (generate, rewards, logprobs, loss, backward, optimizer).
Everything it changes on the trainer is restored on exit, except an undone DataParallel wrap.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Optional

import torch

from .checks.guard import WRAPPERS
from .errors import LabError
from .memory import LeakDetector, MemorySampler, format_table
from .memory.timeline import Timeline

try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - transformers is a core dependency
    TrainerCallback = object


class MemoryWatch(TrainerCallback):
    """A TrainerCallback feeding grpo_lab's sampler and timeline from TRL's phases."""

    def __init__(self, devices: list[str], sample_hz: float = 20.0, host_threshold: float = 0.95):
        self.timeline = Timeline()
        self.memory = MemorySampler(devices, sample_hz, host_threshold)
        self.timeline.listeners.append(self.memory)
        self.leaks = LeakDetector()
        self.step = 0

    # optimizer phase comes from the Trainer's own callback events
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.timeline.end()
        self.timeline.begin("optimizer", state.global_step)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.timeline.end()

    def on_step_end(self, args, state, control, **kwargs):
        rows = self.memory.rows_for(self.step)
        from .memory.leaks import end_of_step

        self.leaks.observe(end_of_step(rows))
        self.step = state.global_step

    def on_train_begin(self, args, state, control, **kwargs):
        self.memory.start()

    def on_train_end(self, args, state, control, **kwargs):
        self.memory.stop()

    def marked(self, name: str, fn, when=lambda: True):
        """Wrap a trainer method so that its outermost call is phase `name`."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self.timeline.open is not None or not when():
                return fn(*args, **kwargs)
            with self.timeline.phase(name, self.step):
                return fn(*args, **kwargs)

        return wrapper

    def table(self, step: Optional[int] = None) -> str:
        steps = sorted({r["step"] for r in self.memory.phase_rows})
        return format_table(self.memory.rows_for(steps[-1] if step is None else step)) if steps else "(no phases yet)"

    def phases(self) -> list[str]:
        return list(dict.fromkeys(r.phase for r in self.timeline.records))


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def place_reference(trainer) -> Optional[tuple]:
    """P5: the reference model on the policy's device, in eval mode, frozen. Returns what to restore."""
    ref = getattr(trainer, "ref_model", None)
    if ref is None:
        return None
    policy_device, ref_device = _device_of(trainer.model), _device_of(ref)
    restore = (ref, ref_device, ref.training, {n: p.requires_grad for n, p in ref.named_parameters()})
    if ref_device != policy_device:
        if ref_device.type == "meta":
            raise LabError(
                f"reference model: it is on the meta device (no weights were loaded), the policy on "
                f"{policy_device}; load it with real weights, or use beta=0 / a PEFT policy (adapter-disabled "
                "reference)"
            )
        try:
            ref.to(policy_device)  # why (P5): its log-probs are consumed next to the policy's
        except (RuntimeError, ValueError) as err:
            raise LabError(
                f"reference model: cannot move it from {ref_device} to the policy's {policy_device} "
                f"({str(err).splitlines()[0]}); load it on {policy_device}"
            ) from None
    ref.eval()
    ref.requires_grad_(False)
    return restore


def _restore_reference(saved) -> None:
    if saved is None:
        return
    ref, device, training, grads = saved
    ref.to(device)  # why: hand the GPU memory back as it was before the block
    ref.train(training)
    for name, p in ref.named_parameters():
        p.requires_grad_(grads[name])


@contextmanager
def prepare_trainer(trainer, sample_hz: float = 20.0, host_threshold: float = 0.95):
    """Guard and watch a TRL GRPOTrainer for the duration of the block (see the module docstring)."""
    args = trainer.args
    saved_n_gpu = args._n_gpu if hasattr(args, "_n_gpu") else None
    if isinstance(trainer.model_wrapped, WRAPPERS):
        trainer.model_wrapped = trainer.model  # undo a wrap that already happened
    if saved_n_gpu is not None and saved_n_gpu > 1:
        args._n_gpu = 1  # why: Trainer wraps in DataParallel when n_gpu > 1 (P1)
    saved_ref = place_reference(trainer)

    device = _device_of(trainer.model)
    devices = ["cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"]
    watch = MemoryWatch(devices, sample_hz, host_threshold)
    patched = {
        "_generate": watch.marked("generate", trainer._generate),
        "_calculate_rewards": watch.marked("rewards", trainer._calculate_rewards),
        "_get_per_token_logps_and_entropies": watch.marked(
            "logprobs", trainer._get_per_token_logps_and_entropies, when=lambda: not torch.is_grad_enabled()
        ),
        "compute_loss": watch.marked("loss", trainer.compute_loss),
    }
    accelerator_backward = trainer.accelerator.backward
    for name, fn in patched.items():
        setattr(trainer, name, fn)
    trainer.accelerator.backward = watch.marked("backward", accelerator_backward)
    trainer.add_callback(watch)
    try:
        yield watch
    finally:
        watch.timeline.end()
        watch.memory.stop()
        trainer.remove_callback(watch)
        trainer.accelerator.backward = accelerator_backward
        for name in patched:
            trainer.__dict__.pop(name, None)  # back to the class's methods
        if saved_n_gpu is not None:
            args._n_gpu = saved_n_gpu
        _restore_reference(saved_ref)  # (an undone DataParallel wrap is not put back: it is the bug)
