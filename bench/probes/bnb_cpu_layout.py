"""HF rollout time with bitsandbytes' AVX-512-BF16 packed CPU layout vs grpo_lab's pinned training layout.

bitsandbytes >= 0.48 repacks a `Linear4bit`'s nf4 weights into a CPU inference layout on the layer's
first eval/no-grad forward (on CPUs with avx512_bf16) and then computes with a bf16 kernel; a training
forward on that layout fails in autograd. Two ways for a learner to live with it:

  A (grpo_lab): never repack; `lab.rollout()` as is (`grpo_lab.models.quant.pin_training_layout`).
  B: repack every 4-bit layer for the rollout, use the packed bf16 kernel, then restore the training
     layout of every layer before the next training forward. B's time = repack + rollout + restore.

Both run on the same loaded Lab (one per compute dtype, loaded side by side), the same prompt and the
same sampling seed; each round runs every dtype x choice, in an order reversed every other round;
medians over rounds after a warm-up. The warm-up's B rollout lets
bitsandbytes's own forward do the repack (flag on, nothing else); timed rounds repack eagerly with the
same `_convert_weight_packed_for_cpu` call so the repack is timed apart.

Restoring: bitsandbytes' `_convert_weight_packed_for_cpu_inverse` restores the nibble order exactly,
but not the quantization constants (the repack rounds absmax to bf16; the inverse re-quantizes nested
absmax with a new offset, and leaves non-nested absmax transposed in bf16), so its dequantized weights
differ from the originals. B's timed restore therefore runs that inverse for the weight nibbles only
and puts back the constants saved before the repack (exact; checked bit for bit). bnb's full inverse
is measured once at the end: its time, its weight error, and whether training still works after it.

    .venv/bin/python bench/probes/bnb_cpu_layout.py --threads 1
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

# why before torch: OpenMP reads it once, for torch and bitsandbytes' kernels alike. On a shared 2-core
# machine 2 threads measure the scheduler (OpenMP barriers waiting on preempted threads), not the kernels.
if __name__ == "__main__" and "--threads" in sys.argv:
    os.environ["OMP_NUM_THREADS"] = sys.argv[sys.argv.index("--threads") + 1]

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `python bench/probes/bnb_cpu_layout.py` works too
from bench.shapes import build_model  # noqa: E402

QS_FIELDS = ("absmax", "dtype", "nested", "offset", "state2")  # what the repack changes in a QuantState
REPACK_MARKS = ("original_dtype", "original_nested", "original_qshape", "original_storage_type")


def linear4bit_layers(model) -> list:
    from bitsandbytes.nn import Linear4bit

    return [m for m in model.modules() if isinstance(m, Linear4bit)]


def is_packed(layer) -> bool:
    return bool(getattr(layer.weight.quant_state, "packing_format_for_cpu", False))


class PackedLayout:
    """Choice B's switch: packed bf16 layout for a rollout, training layout restored after it."""

    def __init__(self, model):
        self.layers = linear4bit_layers(model)
        self.saved: list[dict] = []

    def allow(self) -> None:
        """Flag on and constants saved; bnb's forward repacks on the layer's first eval/no-grad call."""
        self.saved = []
        for layer in self.layers:
            qs = layer.weight.quant_state
            self.saved.append({k: getattr(qs, k) for k in QS_FIELDS if hasattr(qs, k)})
            layer.support_avx512bf16_for_cpu = True

    def repack(self) -> None:
        """The conversion bnb's `Linear4bit.forward` does, done now (so it is timed apart from the rollout)."""
        from bitsandbytes.functional import _convert_weight_packed_for_cpu

        self.allow()
        for layer in self.layers:
            # the QuantState is converted in place: module.quant_state and weight.quant_state stay one object
            layer.weight.data, _ = _convert_weight_packed_for_cpu(layer.weight.data, layer.weight.quant_state)

    def restore(self) -> None:
        """Training layout back, exactly: bnb's inverse for the nibble order, saved constants for the rest."""
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        for layer, saved in zip(self.layers, self.saved):
            layer.support_avx512bf16_for_cpu = False
            qs = layer.weight.quant_state
            if not getattr(qs, "packing_format_for_cpu", False):
                continue
            scratch = copy.copy(qs)
            scratch.original_nested = False  # why: permute the nibbles only; absmax comes from `saved`
            layer.weight.data, _ = _convert_weight_packed_for_cpu_inverse(layer.weight.data, scratch)
            for k in QS_FIELDS:
                if k in saved:
                    setattr(qs, k, saved[k])
                elif hasattr(qs, k):
                    delattr(qs, k)
            qs.packing_format_for_cpu = False
            for k in REPACK_MARKS:
                if hasattr(qs, k):
                    delattr(qs, k)
        self.saved = []

    def restore_with_bnb_inverse(self) -> None:
        """bitsandbytes' own inverse, as `Linear4bit._save_to_state_dict` uses it (lossy for absmax)."""
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        for layer in self.layers:
            layer.support_avx512bf16_for_cpu = False
            if is_packed(layer):
                layer.weight.data, layer.weight.quant_state = _convert_weight_packed_for_cpu_inverse(
                    layer.weight.data, layer.weight.quant_state
                )
        self.saved = []


def check_module_agrees(layers) -> None:
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

    for layer in layers:
        fix_4bit_weight_quant_state_from_module(layer)  # a no-op while the weight keeps its QuantState
        assert layer.quant_state is None or layer.quant_state is layer.weight.quant_state, (
            "module/weight quant state differ"
        )
        assert not is_packed(layer) and not layer.support_avx512bf16_for_cpu


def dequantized(layers) -> list[torch.Tensor]:
    from bitsandbytes.functional import dequantize_4bit

    return [dequantize_4bit(m.weight.data, m.weight.quant_state).clone() for m in layers]


def weights_error(layers, originals) -> tuple[bool, float]:
    now = dequantized(layers)
    exact = all(torch.equal(a, b) for a, b in zip(originals, now))
    return exact, max((a.float() - b.float()).abs().max().item() for a, b in zip(originals, now))


def train_forward_backward(lab, rollout) -> tuple[float, float]:
    """One training forward + backward; (loss, LoRA grad norm). Gradients are dropped, no update.
    Advantages are set to -1..1 (a random model's completions all get the same reward: zero gradient)."""
    from grpo_lab.algo.containers import Advantages

    n = len(rollout)
    advantages = Advantages(values=torch.linspace(-1, 1, n), group_mean=torch.zeros(n), group_std=torch.ones(n))
    from grpo_lab.algo import grpo as phases

    # the phase functions themselves (not the Lab's lifecycle): a measurement with made-up advantages, no update
    stats = phases.backward(
        lab.learner, rollout, advantages, phases.logprobs(lab.learner, lab.reference, rollout, lab.config), lab.config
    ).stats
    grads = [p.grad for p in lab.learner.model.parameters() if p.requires_grad and p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item() if grads else 0.0
    lab.learner.optimizer.zero_grad(set_to_none=True)
    assert stats.loss == stats.loss and norm > 0 and norm == norm, (stats.loss, norm)
    return stats.loss, norm


def logprob_gap(ra, rb) -> tuple[float, float, float]:
    """Sampler log-probs of A vs B on tokens where both sampled the same completion so far:
    (max |diff|, mean |diff|, fraction of A's completion tokens compared)."""
    w = min(ra.completion_ids.shape[1], rb.completion_ids.shape[1])  # padded widths differ if one stopped early
    same = (ra.completion_ids[:, :w] == rb.completion_ids[:, :w]).long().cumprod(dim=1).bool()
    mask = same & ra.completion_mask[:, :w].bool() & rb.completion_mask[:, :w].bool()
    diff = (ra.sampler_logprobs[:, :w] - rb.sampler_logprobs[:, :w]).abs()[mask]
    if not diff.numel():
        return 0.0, 0.0, 0.0
    return diff.max().item(), diff.mean().item(), mask.sum().item() / ra.completion_mask.sum().item()


def clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def since(start, end=None) -> tuple[float, float]:
    end = end or clock()
    return end[0] - start[0], end[1] - start[1]


def seeded_rollout(lab, seed: int):
    torch.manual_seed(seed)
    return lab.rollout()


class Case:
    """One loaded Lab (one compute dtype) with its choice-B switch, original weights and timings."""

    def __init__(self, path: str, compute_dtype: str, args):
        from grpo_lab import Lab, load_config

        cfg = load_config(
            "tiny-cpu",
            [
                f"model.name_or_path={path}",
                f"model.bnb_4bit_compute_dtype={compute_dtype}",
                "memory.sample_hz=0",
                "grpo.num_generations=8",
                "grpo.prompts_per_step=1",
                f"generator.max_completion_length={args.tokens}",
                f"generator.temperature={args.temperature}",
                "grpo.beta=0.04",
                "reference.strategy=adapter-disabled",
            ],
        )
        self.lab = lab = Lab(cfg).load()
        batch = lab.prompts.next_batch(1)
        lab.prompts.next_batch = lambda size: batch  # every rollout samples the same prompt
        self.layout = PackedLayout(lab.learner.model)
        self.layers = self.layout.layers
        assert self.layers and not any(map(is_packed, self.layers))
        self.originals = dequantized(self.layers)
        self.out = {
            "layers": len(self.layers),
            "A": [],
            "B": [],
            "repack": [],
            "rollout_B": [],
            "restore": [],
            "ratio": [],
            "gap": [],
        }
        self.runs = {}

    def warm_up(self, seed: int) -> None:
        """One rollout each way; B's lets bnb's own forward repack (flag on, lab.rollout(), nothing else)."""
        seeded_rollout(self.lab, seed)
        self.layout.allow()
        seeded_rollout(self.lab, seed)
        self.out["lazy_repacked"] = sum(map(is_packed, self.layers))
        self.layout.restore()
        check_module_agrees(self.layers)

    def run(self, choice: str, seed: int) -> None:
        """One timed rollout; wall and process CPU seconds (with one thread, CPU time is what other
        processes on a shared machine cannot inflate)."""
        out, lab, layout = self.out, self.lab, self.layout
        gc.collect()
        t0 = clock()
        if choice == "A":
            self.runs["A"] = seeded_rollout(lab, seed)
            out["A"].append(since(t0))
            return
        layout.repack()
        t1 = clock()
        self.runs["B"] = seeded_rollout(lab, seed)
        t2 = clock()
        layout.restore()
        out["repack"].append(since(t0, t1))
        out["rollout_B"].append(since(t1, t2))
        out["restore"].append(since(t2))
        out["B"].append(since(t0))
        check_module_agrees(self.layers)

    def end_round(self) -> None:
        (aw, ac), (bw, bc) = self.out["A"][-1], self.out["B"][-1]
        self.out["ratio"].append((bw / aw, bc / ac))
        self.out["gap"].append(logprob_gap(self.runs["A"], self.runs["B"]))

    def verify(self) -> dict:
        out, lab, layout, layers, originals, runs = (
            self.out,
            self.lab,
            self.layout,
            self.layers,
            self.originals,
            self.runs,
        )
        out["tokens"] = int(runs["A"].completion_lengths.sum())
        # B is a correct alternative: the restored layers dequantize to the original weights, and train
        out["exact_after_restore"], _ = weights_error(layers, originals)
        out["train_after_restore"] = train_forward_backward(lab, runs["B"])
        # sampler vs learner log-probs (the adapter-disabled reference equals the learner: LoRA B is still zero)
        for choice in "AB":
            ref = lab.logprobs(runs[choice]).ref
            mask = runs[choice].completion_mask.bool()
            d = (runs[choice].sampler_logprobs - ref).abs()[mask]
            out[f"learner_gap_{choice}"] = (d.max().item(), d.mean().item())
        # why the restore is needed: a training forward on the packed layout fails
        layout.repack()
        try:
            train_forward_backward(lab, runs["B"])
            out["train_on_packed"] = "works"
        except Exception as err:  # noqa: BLE001 - reported, not handled
            out["train_on_packed"] = f"fails ({type(err).__name__})"
        lab.learner.optimizer.zero_grad(set_to_none=True)
        layout.restore()
        out["exact_after_failed_train"], _ = weights_error(layers, originals)
        # bitsandbytes' own inverse, once (last: it changes the weights)
        layout.repack()
        t0 = time.perf_counter()
        layout.restore_with_bnb_inverse()
        out["bnb_inverse_s"] = time.perf_counter() - t0
        check_module_agrees(layers)
        out["bnb_inverse_exact"], out["bnb_inverse_err"] = weights_error(layers, originals)
        try:
            train_forward_backward(lab, runs["B"])
            out["train_after_bnb_inverse"] = "works"
        except Exception as err:  # noqa: BLE001
            out["train_after_bnb_inverse"] = f"fails ({type(err).__name__}: {str(err)[:80]})"
        lab.close()
        return out


def main() -> None:
    import bitsandbytes
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per sequence (8 sequences)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after the warm-up")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="bnb_4bit_compute_dtype values")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="OpenMP threads (default: torch's choice)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    flags = open("/proc/cpuinfo").read().split()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, bitsandbytes {bitsandbytes.__version__}, "
        f"avx512_bf16 {'avx512_bf16' in flags}, {os.cpu_count()} CPUs, threads {torch.get_num_threads()} "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})"
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), args.hidden, args.layers, args.vocab)
        cases = {dtype: Case(tmp, dtype, args) for dtype in args.dtypes}
        for case in cases.values():
            case.warm_up(args.seed)
        # why interleaved: other processes share the machine; each round runs every dtype and choice, order swapped
        for r in range(args.rounds):
            order = [(d, c) for d in args.dtypes for c in "AB"]
            for dtype, choice in order if r % 2 == 0 else order[::-1]:
                cases[dtype].run(choice, args.seed + 1 + r)
            for case in cases.values():
                case.end_round()
        results = {dtype: case.verify() for dtype, case in cases.items()}

    def med(values, i=None) -> str:
        if i is not None:
            return f"{statistics.median(v[i] for v in values):.2f}"
        return f"{statistics.median(v[0] for v in values):.3f} / {statistics.median(v[1] for v in values):.3f}"

    print(
        f"model: random Qwen2, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; nf4 (double quant) + "
        "LoRA r=8; "
        f"8 sequences x {args.tokens} new tokens, temperature {args.temperature}, seeded; {args.rounds} rounds; "
        "seconds as wall / process CPU, medians"
    )
    print(
        "| compute dtype | 4-bit layers | rounds | A: pinned, rollout s | B: repack s | B: rollout s | B: restore s | "
        "B: total s | median ratio B/A wall | median ratio B/A CPU | sampler log-prob max / mean abs diff A vs B "
        "(tokens compared) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype, o in results.items():
        gmax = max(g[0] for g in o["gap"])
        gmean = statistics.mean(g[1] for g in o["gap"])
        frac = statistics.mean(g[2] for g in o["gap"])
        print(
            f"| {dtype} | {o['layers']} | {len(o['A'])} | {med(o['A'])} | {med(o['repack'])} | {med(o['rollout_B'])} | "
            f"{med(o['restore'])} | {med(o['B'])} | {med(o['ratio'], 0)} | **{med(o['ratio'], 1)}** | "
            f"{gmax:.3g} / {gmean:.3g} ({frac:.0%}) |"
        )
    print()
    for dtype, o in results.items():
        print(
            f"{dtype}: lazy repack by bnb's forward: {o['lazy_repacked']}/{o['layers']} layers; "
            f"restored weights bit-exact: {o['exact_after_restore']}; training fwd+bwd after restore: "
            f"loss {o['train_after_restore'][0]:.4g}, grad norm {o['train_after_restore'][1]:.3g}; "
            f"training on the packed layout: {o['train_on_packed']} (bit-exact after restoring: "
            f"{o['exact_after_failed_train']})"
        )
        print(
            f"{dtype}: sampler vs learner log-prob |diff| max / mean: A {o['learner_gap_A'][0]:.3g} / "
            f"{o['learner_gap_A'][1]:.3g}, B {o['learner_gap_B'][0]:.3g} / {o['learner_gap_B'][1]:.3g}"
        )
        print(
            f"{dtype}: bnb's _convert_weight_packed_for_cpu_inverse: {o['bnb_inverse_s']:.3f} s, bit-exact "
            f"{o['bnb_inverse_exact']}, max |dequantized weight diff| {o['bnb_inverse_err']:.3g}; training after it: "
            f"{o['train_after_bnb_inverse']}"
        )
        print(
            f"{dtype}: per-round wall/CPU s A {[(round(w, 2), round(c, 2)) for w, c in o['A']]}, "
            f"B {[(round(w, 2), round(c, 2)) for w, c in o['B']]}; completion tokens {o['tokens']}"
        )


if __name__ == "__main__":
    main()
