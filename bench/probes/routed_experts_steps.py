"""The routed experts across GRPO steps: each rollout's decoding steps, the time spent in the experts modules and the
bytes dequantized a decoding step, the codes' permutations to and from the fused kernel's layout
(models/experts_gemv.py) and each phase's seconds.

`--profile`: one builtin:tiny-moe decoding step (8 rows x top-2) through a layer each way, repeated in a tight loop:
CPU microseconds a call and torch.profiler's ATen ops; then the same call repeated inside a rollout, whole and held.
`--tiny`: builtin:tiny-moe in bfloat16, a Lab's steps 1, 2, 3 (8 rows x 32 sampled tokens; rollout, then the rest
of the step) each way: every expert of a layer dequantized (bitsandbytes' parametrization under transformers'
grouped_mm, the first build), the routed experts dequantized (models/routed_experts.py), fused from their codes with
the kernel's layout put back by each training forward (`experts_gemv.KERNEL_LAYOUT_KEPT` off) and kept (on), and
every layer's experts held for the rollout (models/held_experts.py). `--alternate`: the whole and held ways again,
their Labs open together and each step taken by both in turn, and each step's held / whole ratio printed: decoding
steps' CPU time, and with the held copy's making (held_experts.held_weights, timed in the rollout) added to the held
way's, which it does once a rollout for its decoding steps. Alone (`--alternate`), rollout 1 is the process's first;
each Lab's load made the held kernels (held_experts.warm, timed: printed beside rollout 1, and added to it too).
`--layer`: one experts layer of Qwen3-30B-A3B's shape (bench/probes/routed_experts.py), rollout -> training ->
rollout -> training -> rollout (a rollout: 4 decoding steps of 8 rows x top-8, fused; training: a forward of 64
rows with gradients and its backward, which dequantizes the routed experts again), the layout put back and kept.

    OMP_NUM_THREADS=1 python -m bench.probes.routed_experts_steps --profile --tiny --alternate --layer
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from grpo_lab.models import experts_gemv, held_experts

WAYS = ("whole", "dequantize", "fused, put back", "fused, kept", "held")


class Meter:
    """Hooks on each experts module and on bitsandbytes' dequantize: a decoding step's forward (no gradients, at most
    `rows` tokens) timed, and the bytes it dequantized; the time spent permuting the codes in place and reading
    permuted slices back into a routed dequantize's temporary, by phase."""

    def __init__(self, experts: list, rows: int):
        from bitsandbytes import functional

        self.rows, self.layers, self.phase, self.decoding = rows, len(experts), "rollout", False
        self.totals: dict = {}
        self.hooks = [m.register_forward_pre_hook(self.pre) for m in experts]
        self.hooks += [m.register_forward_hook(self.post) for m in experts]
        self.functional, self.dequantize, self.permute = functional, functional.dequantize_4bit, None
        functional.dequantize_4bit = self.counted
        self.permute, experts_gemv.permute_experts = experts_gemv.permute_experts, self.timed_permute
        self.unpack, experts_gemv.unpacked_slices = experts_gemv.unpacked_slices, self.timed_unpack
        self.making, held_experts.held_weights = held_experts.held_weights, self.timed_making

    def add(self, key: str, value: float) -> None:
        self.totals[key] = self.totals.get(key, 0) + value

    def pre(self, module, args):
        self.decoding = not torch.is_grad_enabled() and args[0].shape[0] <= self.rows
        self.start, self.cpu = time.perf_counter(), time.thread_time()

    def post(self, module, args, out):
        cpu, wall = time.thread_time() - self.cpu, time.perf_counter() - self.start  # (both clocks first)
        if self.decoding:
            self.add("decode_s", wall)
            self.add("decode_cpu_s", cpu)  # (this thread's CPU: what a busy machine adds not)
            self.add("decode_calls", 1)
        elif not torch.is_grad_enabled() and self.phase == "rollout":  # (the prompts' prefill, either way)
            self.add("prefill_cpu_s", cpu)
        self.decoding = False

    def timed_making(self, *args, **kwargs):
        """held_experts.held_weights timed (the held copy checked, and made once a rollout: counted with its steps)."""
        start = time.thread_time()
        out = self.making(*args, **kwargs)
        self.add(f"making_{self.phase}_cpu_s", time.thread_time() - start)
        return out

    def counted(self, *args, **kwargs):
        out = self.dequantize(*args, **kwargs)
        if self.decoding:
            self.add("decode_bytes", out.numel() * out.element_size())
        return out

    def timed_permute(self, *args, **kwargs):
        start = time.perf_counter()
        self.permute(*args, **kwargs)
        self.add(f"permute_{self.phase}_s", time.perf_counter() - start)

    def timed_unpack(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.unpack(*args, **kwargs)
        self.add(f"slices_back_{self.phase}_s", time.perf_counter() - start)  # (a routed dequantize's temporary)
        return out

    def take(self) -> dict:
        totals, self.totals = self.totals, {}
        steps = totals.pop("decode_calls", 0) // self.layers
        totals["decode_steps"], totals["decode_bytes_per_step"] = steps, totals.pop("decode_bytes", 0) // max(steps, 1)
        totals["decode_experts_s_per_step"] = totals.get("decode_s", 0) / max(steps, 1)
        totals["decode_experts_cpu_s_per_step"] = totals.get("decode_cpu_s", 0) / max(steps, 1)
        # why the making too: what a rollout does once for its decoding steps (the held copy) is their cost
        once = totals.get("decode_cpu_s", 0) + totals.get("making_rollout_cpu_s", 0)
        totals["decode_and_making_cpu_s_per_step"] = once / max(steps, 1)
        return totals

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.functional.dequantize_4bit, experts_gemv.permute_experts = self.dequantize, self.permute
        experts_gemv.unpacked_slices, held_experts.held_weights = self.unpack, self.making


@contextlib.contextmanager
def way(name: str, experts: list):
    """`name` (WAYS) for these experts modules: the fused ways with the held experts (held_experts.py) left out, at
    the fused kernel's own cut-off."""
    from bench.probes.routed_experts import only
    from grpo_lab.models import routed_experts

    kept, paths = experts_gemv.KERNEL_LAYOUT_KEPT, dict(routed_experts.EXPERT_PATHS)
    experts_gemv.KERNEL_LAYOUT_KEPT = name == "fused, kept"
    if name == "whole":
        for m in experts:
            m.config._experts_implementation = "grouped_mm"
    if name.startswith("fused"):
        del routed_experts.EXPERT_PATHS["held"]
    try:
        with only("dequantize") if name == "dequantize" else contextlib.nullcontext():
            yield
    finally:
        experts_gemv.KERNEL_LAYOUT_KEPT = kept
        routed_experts.EXPERT_PATHS.clear()
        routed_experts.EXPERT_PATHS.update(paths)


def tiny(steps: int, ways=WAYS, alternate: bool = False) -> None:
    """builtin:tiny-moe's Lab steps each way, a Lab a way; `alternate`: the Labs open together, each step taken by
    every way in turn (so a busy machine's load falls on the ways alike)."""
    opened, warm = [], held_experts.warm
    held_experts.warm, LOADS[:] = timed_warm(warm), []
    try:
        for name in ways if alternate else []:
            opened.append(open_way(name))
        for name in [] if alternate else ways:
            opened[:] = [open_way(name)]
            for step in range(1, steps + 1):
                one_step(*opened[0], name, step, "tiny")
            close_way(*opened.pop())
        for step in range(1, steps + 1) if alternate else []:
            records = [one_step(*way_, name, step, "alternate") for name, way_ in zip(ways, opened)]
            ratios(*records)
    finally:
        held_experts.warm = warm
        for way_ in opened:
            close_way(*way_)


LOADS: list = []  # held_experts.warm's CPU seconds at each Lab's load (the held kernels made, once a process)


def timed_warm(warm):
    def timed(modules):
        start = time.thread_time()
        out = warm(modules)
        LOADS.append(time.thread_time() - start)
        return out

    return timed


def open_way(name: str) -> tuple:
    from grpo_lab import Lab

    knobs = ["model.name_or_path=builtin:tiny-moe", "model.dtype=bfloat16", "model.bnb_4bit_compute_dtype=bfloat16"]
    knobs += ["generator.max_completion_length=32", "grpo.num_generations=8", "grpo.prompts_per_step=1"]
    torch.manual_seed(0)
    lab = Lab("tiny-cpu", overrides=knobs, reward_funcs=["length"]).load()
    experts = [m for m in lab.learner.model.modules() if hasattr(m, "experts_fused")]
    return lab, experts, Meter(experts, rows=8)


def one_step(lab, experts, meter, name: str, step: int, label: str) -> None:
    with way(name, experts):
        meter.phase, start = "rollout", time.perf_counter()
        lab.rollout()
        middle, meter.phase = time.perf_counter(), "training"
        lab.step()
    record = {label: name, "step": step, "rollout_s": middle - start}
    record |= {"training_s": time.perf_counter() - middle, **meter.take()}
    print("JSON " + json.dumps(record), flush=True)
    return record


def ratios(whole: dict, held: dict) -> None:
    """One step's held / whole ratios of the experts' time a decoding step."""
    base = whole["decode_experts_cpu_s_per_step"]
    cpu, once = held["decode_experts_cpu_s_per_step"] / base, held["decode_and_making_cpu_s_per_step"] / base
    wall = held["decode_experts_s_per_step"] / whole["decode_experts_s_per_step"]
    print(
        f"rollout {held['step']}: held / whole, CPU {cpu:.3f}, with the making {once:.3f} (goal 0.3), wall {wall:.3f}"
    )
    if held["step"] == 1:  # why: the load made the held kernels this rollout would have (held_experts.warm)
        loads = ", ".join(f"{s * 1e3:.2f}" for s in LOADS)
        made = (held["decode_and_making_cpu_s_per_step"] * held["decode_steps"] + sum(LOADS)) / held["decode_steps"]
        print(f"load: held kernels made in {loads} ms CPU (each Lab's load, once a process); rollout 1 with them "
              f"too: {made / base:.3f}")  # fmt: skip


def close_way(lab, experts, meter) -> None:
    meter.close()
    lab.close()


def layer(sequences: int) -> None:
    from bench.probes.routed_experts import one_layer

    experts, config = one_layer()
    experts.redequantize = True  # why: a learner's backward reads the routed experts again (or checkpointing's forward)
    meter = Meter([experts], rows=8)
    g = torch.Generator().manual_seed(0)

    def batch(rows: int):
        hidden = torch.randn(rows, config.hidden_size, generator=g, dtype=torch.bfloat16)
        index = torch.stack([torch.randperm(config.num_experts, generator=g)[:8] for _ in range(rows)])
        return hidden, index, torch.softmax(torch.randn(rows, 8, generator=g), -1).to(torch.bfloat16)

    for name in ("fused, put back", "fused, kept"):
        experts_gemv.blockwise(experts)  # (each way from the blockwise codes)
        meter.take()
        with way(name, [experts]):
            for phase in ["rollout", "training"] * sequences + ["rollout"]:
                meter.phase, start = phase, time.perf_counter()
                if phase == "rollout":
                    with torch.no_grad():
                        for _ in range(4):
                            experts(*batch(8))
                else:
                    hidden, index, weights = batch(64)
                    experts(hidden.requires_grad_(True), index, weights).float().square().sum().backward()
                record = {"layer": name, "phase": phase, "seconds": time.perf_counter() - start, **meter.take()}
                print("JSON " + json.dumps(record), flush=True)
    meter.close()


def profile(calls: int = 300) -> None:
    """One decoding step (8 rows x top-2) through builtin:tiny-moe's first experts layer, each way: this thread's CPU
    microseconds a call (the least of 5 rounds), torch.profiler's ATen ops a call and the three that take the most."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiled

    from grpo_lab.config.models_and_devices import ModelSection
    from grpo_lab.models.learner import load_base
    from grpo_lab.models.source import resolve_model_path

    path = resolve_model_path("builtin:tiny-moe")
    model = load_base(ModelSection(name_or_path=path, dtype="bfloat16", bnb_4bit_compute_dtype="bfloat16"), "cpu")
    module, g = model.get_decoder().layers[0].mlp.experts, torch.Generator().manual_seed(0)
    args = (torch.randn(8, module.config.hidden_size, generator=g).to(torch.bfloat16),
            torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(8)]),
            torch.softmax(torch.randn(8, 2, generator=g), -1).to(torch.bfloat16))  # fmt: skip
    for name in ("whole", "dequantize", "fused, put back", "held"):
        with way(name, [module]), torch.no_grad():
            for _ in range(20):
                module(*args)
            rounds = []
            for _ in range(5):
                start = time.thread_time()
                for _ in range(calls):
                    module(*args)
                rounds.append((time.thread_time() - start) / calls)
            with profiled(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(20):
                    module(*args)
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        record = {"profile": name, "cpu_us": min(rounds) * 1e6, "aten_ops": sum(e.count for e in ops) / 20,
                  "top": [(e.key, e.count // 20, e.self_cpu_time_total / 20) for e in ops[:3]]}  # fmt: skip
        module.config._experts_implementation = "grpo_lab_routed_4bit"
        print("JSON " + json.dumps(record), flush=True)


def in_rollout(calls: int = 300) -> None:
    """The same layer call repeated `calls` times inside a rollout (a hook on the first experts layer at its tenth
    decoding step), whole and held: this thread's CPU microseconds a call, against the rollout's own decoding steps
    (where the rest of the model runs between two calls of a layer)."""
    lab, experts, meter = open_way("held")
    meter.close()
    module, seen = experts[0], []

    def repeat(mod, args, out):
        seen.append(1)
        if len(seen) != 10 or torch.is_grad_enabled():
            return
        for name in ("whole", "held"):
            module.config._experts_implementation = "grouped_mm" if name == "whole" else "grpo_lab_routed_4bit"
            for _ in range(20):
                module(*args)
            start = time.thread_time()
            for _ in range(calls):
                module(*args)
            print("JSON " + json.dumps({"in_rollout": name, "cpu_us": (time.thread_time() - start) / calls * 1e6}))

    hook = module.register_forward_hook(repeat)
    try:
        lab.rollout()
    finally:
        hook.remove()
        lab.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="builtin:tiny-moe's Lab steps, each way")
    parser.add_argument("--layer", action="store_true", help="one 30B-A3B layer, the layout put back and kept")
    parser.add_argument("--profile", action="store_true", help="one tiny-moe layer call each way, then in a rollout")
    parser.add_argument("--alternate", action="store_true", help="tiny-moe's whole and held ways, step by step")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"bfloat16; fused kernel: {experts_gemv.gemv_kernel()}", flush=True)
    if args.profile:
        profile()
        in_rollout()
    if args.tiny:
        tiny(args.steps)
    if args.alternate:
        tiny(args.steps, ("whole", "held"), alternate=True)
    if args.layer:
        layer(2)


if __name__ == "__main__":
    main()
