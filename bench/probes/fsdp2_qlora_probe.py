"""FSDP2 (`fully_shard`) over grpo_lab's QLoRA learner, checked the way a sharded GRPO learner would use it (issue 14,
P3, P5).

Extends bench/probes/fsdp2_probe.py. For each case (a `bnb_4bit_quant_storage`: uint8 default, bfloat16, float32; the
FSDP root: the `PeftModel` or the transformers model under it; gradient checkpointing: non-reentrant as grpo_lab,
reentrant, off) it loads the built-in tiny Qwen2 4-bit (nf4, double quant, float32 compute, layout pinned as grpo_lab
does) with LoRA on all linear layers (A and B random, so every LoRA gradient is non-zero), in 2 gloo processes, one
torch thread each, and checks: load (what the 4-bit parameter is), `fully_shard` per decoder layer then the root (no
`mp_policy`), forward + backward of a GRPO-like loss (minus the sum of token log-probs) on each rank's half of the
batch, the LoRA gradients against one process on the whole batch (FSDP2 averages over ranks: world x sharded grad
== one-process grad), greedy generation through the sharded model and with every FSDP module unsharded, training
again after both, host RSS per rank, and P5's reference-model variants (adapter disabled on the sharded policy, an
unsharded copy, a deepcopy of the sharded policy, a copy left on another device type, a copy sharded like the policy,
and a sharded reference run by one rank only).

    GRPO_LAB_CACHE=/tmp/glc_fsdp .venv/bin/python -m bench.probes.fsdp2_qlora_probe      # all cases (~3 min, 2 cores)
    GRPO_LAB_CACHE=/tmp/glc_fsdp .venv/bin/python -m bench.probes.fsdp2_qlora_probe uint8/inner/nonreentrant  # one case
    GRPO_PROBE_MODEL=qwen2-152k ...   # Qwen2.5's 152k vocabulary on the tiny body (memory: embedding and head dominate)

Prints a table; writes bench/results/fsdp2_qlora_probe[-MODEL].json if bench/results/ exists. Each case's two ranks
are killed after GRPO_PROBE_TIMEOUT seconds (default 240); the gloo timeout is 30 s, so a mismatched collective fails
rather than hangs.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

WORLD = 2
MODEL = os.environ.get("GRPO_PROBE_MODEL", "tiny-qwen2")
# case name -> (storage, FSDP root, gradient checkpointing)
CASES = {
    f"{s}/{root}/nonreentrant": (s, root, "nonreentrant")
    for root in ("inner", "peft")
    for s in ("uint8", "bfloat16", "float32")
}
CASES["uint8/inner/reentrant"] = ("uint8", "inner", "reentrant")
CASES["uint8/inner/off"] = ("uint8", "inner", "off")
ONE_RANK_CASE = (
    "uint8/inner/nonreentrant"  # the only case that also runs a sharded reference on rank 0 alone (waits 30 s)
)


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def param_mib(model) -> float:
    """Bytes this rank holds in parameters (a DTensor's local shard; bnb's quant state, kept outside them, excluded)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total / 2**20


class PeakRss:
    """Samples RSS every 2 ms in a thread: the peak inside a backward. why not ru_maxrss: it only grows, and a
    spawned child starts with its parent's (Linux keeps it across exec)."""

    def __enter__(self):
        self.peak, self._stop = rss_mib(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_mib())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mib())


def load_base(storage: str):
    """The base as grpo_lab's learner.load_base builds it, with `bnb_4bit_quant_storage` set."""
    from bench.loaders import load_4bit_base
    from grpo_lab.models.quant import quiet_bitsandbytes

    quiet_bitsandbytes()
    return load_4bit_base(MODEL, storage)


def load_policy(storage: str, gc: str):
    from bench.loaders import with_lora

    base = load_base(storage)
    # why init_lora_weights=False: B random too, so the A gradients are not all zero and the comparison covers them
    model = with_lora(base, seed=0, init_lora_weights=False)  # why the seed: the same LoRA init in every process
    if gc != "off":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": gc == "reentrant"})
    model.train()  # why: checkpointing is only active in train mode; dropout is 0
    return model


def describe_4bit(model) -> dict:
    from bitsandbytes.nn import Linear4bit

    layer = next(m for m in model.modules() if isinstance(m, Linear4bit))
    w = layer.weight
    local = w.to_local() if hasattr(w, "to_local") else w  # a DTensor's shape is the global one
    return {
        "param_type": type(w).__name__,
        "dtype": str(w.dtype).removeprefix("torch."),
        "shape": list(w.shape),
        "local_shape": list(local.shape),
        "requires_grad": w.requires_grad,
        "quant_state_on_param": getattr(w, "quant_state", None) is not None,
    }


def batch():
    import torch

    return torch.randint(3, 300, (4, 24), generator=torch.Generator().manual_seed(1))


def token_logprobs(model, ids):
    import torch

    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, L-1]


def grpo_like_loss(model, ids):
    return -token_logprobs(model, ids).sum()  # GRPO with every advantage 1 and no length normalisation


def lora_grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # a DTensor's whole gradient
            out[name] = g.detach().clone()
    return out


def greedy(model, ids):
    import torch

    model.eval()  # why: checkpointing (train mode) turns the KV cache off; a rollout runs in eval mode
    try:
        with torch.no_grad():
            return model.generate(input_ids=ids[:2, :8], max_new_tokens=8, do_sample=False, use_cache=True)[
                :, 8:
            ].tolist()
    finally:
        model.train()


def attempt(result: dict, key: str, fn):
    """Run one check; its value, or its error as one line, goes in `result[key]`."""
    try:
        result[key] = fn()
        return result[key]
    except Exception as err:
        result[key] = "ERROR " + one_line(err)
        result.setdefault("tracebacks", {})[key] = traceback.format_exc().splitlines()[-4:]
        return None


def ran(fn, *args) -> str:
    fn(*args)
    return "ran"


def shard(model, root: str):
    from torch.distributed.fsdp import FSDPModule, fully_shard

    causal_lm = model.base_model.model
    for layer in causal_lm.model.layers:
        fully_shard(layer)  # why per layer: one all-gather per decoder layer in forward, resharded after
    top = causal_lm if root == "inner" else model
    fully_shard(top)  # the root owns the embedding, final norm and head (and, root=peft, nothing more)
    return top, [m for m in model.modules() if isinstance(m, FSDPModule)]


def gathered_generate(model, fsdp_modules, ids, result):
    """P3's gather: every FSDP module unsharded for the whole generate (full weights on each rank), then resharded."""
    try:
        for m in fsdp_modules:
            m.set_reshard_after_forward(False)  # why: otherwise the first decoding step's post-forward reshards
            m.unshard()
        result["rss_gathered_mib"], result["param_gathered_mib"] = rss_mib(), param_mib(model)
        return greedy(model, ids)
    finally:  # why finally: a failed generate must still leave the model sharded and training-ready (P3)
        for m in fsdp_modules:
            m.reshard()
            m.set_reshard_after_forward(True)


def is_sharded(model) -> bool:
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in model.parameters())


def reference_checks(model, fsdp_modules, storage, mine, result, rank, one_rank: bool):
    """P5: reference log-probs on this rank's half, the policy's base (adapter off) being the exact answer."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    ref = {}
    with torch.no_grad():

        def adapter_disabled():
            with model.disable_adapter():
                return token_logprobs(model, mine)

        base_lp = attempt(ref, "adapter_disabled_on_sharded_policy", adapter_disabled)
        if base_lp is not None:
            ref["adapter_disabled_on_sharded_policy"] = "ok"
            result["ref_logprobs"] = base_lp.tolist()
        before = rss_mib()
        plain = load_base(storage)
        plain.eval()
        ref["unsharded_copy_mib"] = {"rss_delta": round(rss_mib() - before, 1), "params": round(param_mib(plain), 1)}
        lp = attempt(ref, "unsharded_copy", lambda: token_logprobs(plain, mine))
        if lp is not None and base_lp is not None:
            ref["unsharded_copy"] = f"ok, max abs diff vs adapter-disabled {(lp - base_lp).abs().max().item():.2e}"
        # the only other device type on a CPU-only machine: can a loaded 4-bit copy be moved there at all?
        attempt(ref, "copy_moved_to_meta_device", lambda: ran(copy.deepcopy(plain).to, "meta"))
        attempt(ref, "deepcopy_of_sharded_policy", lambda: ran(token_logprobs, copy.deepcopy(model), mine))
        for layer in plain.model.layers:
            fully_shard(layer)
        fully_shard(plain)
        plain.eval()
        ref["sharded_copy_param_mib"] = round(param_mib(plain), 1)
        lp = attempt(ref, "copy_sharded_like_policy", lambda: token_logprobs(plain, mine))
        if lp is not None and base_lp is not None:
            ref["copy_sharded_like_policy"] = (
                f"ok, max abs diff vs adapter-disabled {(lp - base_lp).abs().max().item():.2e}"
            )
        if one_rank:  # a notebook driving rank 0 only: the sharded reference waits for a peer that never comes
            dist.barrier()
            if rank == 0:
                start = time.perf_counter()
                attempt(ref, "sharded_copy_run_by_rank0_only", lambda: ran(token_logprobs, plain, mine))
                ref["sharded_copy_run_by_rank0_only"] += f" (after {time.perf_counter() - start:.0f} s)"
            else:
                time.sleep(40)  # why: rank 1 makes no collective, as an idle worker would
    result["reference"] = ref


def rank_main(rank: int, case: str, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    storage, root, gc = CASES[case]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=30))
    result = {"rank": rank, "case": case}
    try:
        model = load_policy(storage, gc)
        result["rss_loaded_mib"], result["param_loaded_mib"] = rss_mib(), param_mib(model)
        result["param_loaded"] = describe_4bit(model)
        top, fsdp_modules = attempt(result, "shard", lambda: shard(model, root)) or (None, [])
        if top is None:
            return
        result["shard"] = f"ok ({len(fsdp_modules)} FSDP modules)"
        result["param_sharded"] = describe_4bit(model)
        result["rss_sharded_mib"], result["param_sharded_mib"] = rss_mib(), param_mib(model)
        ids = batch()
        mine = ids.chunk(WORLD)[rank]  # why: each rank its own half of the batch, as a data-parallel learner
        with PeakRss() as peak:

            def backward():
                loss = grpo_like_loss(model, mine)
                loss.backward()
                return loss.item()

            result["loss"] = attempt(result, "backward", backward)
        result["rss_backward_peak_mib"] = peak.peak
        grads = lora_grads(model)
        result["lora_grads"] = len(grads)
        attempt(result, "generate_sharded", lambda: greedy(model, ids))
        if root == "peft":  # PeftModel.generate skips PeftModel.forward: patch it as a forward method and retry
            from torch.distributed.fsdp import register_fsdp_forward_method

            register_fsdp_forward_method(model, "generate")
            attempt(result, "generate_sharded_registered", lambda: greedy(model, ids))
        attempt(result, "generate_gathered", lambda: gathered_generate(model, fsdp_modules, ids, result))
        result["resharded_after_gather"] = is_sharded(model)
        model.zero_grad(set_to_none=True)
        attempt(result, "backward_again", lambda: grpo_like_loss(model, mine).backward() or "ok")
        again = lora_grads(model)
        result["backward_again_grads_equal"] = bool(again) and all(torch.equal(again[k], grads[k]) for k in grads)
        result["rss_end_mib"] = rss_mib()
        reference_checks(model, fsdp_modules, storage, mine, result, rank, one_rank=case == ONE_RANK_CASE)
        if rank == 0:
            torch.save(grads, Path(out_dir, "grads.pt"))
    except Exception as err:
        result["error"] = one_line(err)
        result["where"] = traceback.format_exc().splitlines()[-4:]
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, default=str))
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def single_process(storage: str) -> dict:
    """The reference answer: one process, the whole batch, same LoRA init; checkpointing as grpo_lab (non-reentrant)."""
    import torch

    torch.set_num_threads(1)
    model = load_policy(storage, "nonreentrant")
    ids = batch()
    loss = grpo_like_loss(model, ids)
    loss.backward()
    with torch.no_grad(), model.disable_adapter():
        ref = [token_logprobs(model, half) for half in ids.chunk(WORLD)]
    return {
        "grads": lora_grads(model),
        "tokens": greedy(model, ids),
        "loss": loss.item(),
        "half_losses": [grpo_like_loss(model, h).item() for h in ids.chunk(WORLD)],
        "ref_logprobs": ref,
        "param_loaded": describe_4bit(model),
    }


def run_case(case: str, port: int, single: dict) -> dict:
    import torch
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix="fsdp2-qlora-")
    ctx, start = mp.get_context("spawn"), time.perf_counter()
    procs = [ctx.Process(target=rank_main, args=(r, case, port, out_dir)) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = start + float(os.environ.get("GRPO_PROBE_TIMEOUT", 240))
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.perf_counter()))
        if p.is_alive():  # why: a gloo deadlock must not hang the probe; the row says so
            p.kill()
            p.join()
    ranks = []
    for r in range(WORLD):
        f = Path(out_dir, f"rank{r}.json")
        ranks.append(
            json.loads(f.read_text())
            if f.exists()
            else {"error": "no result: hung past the timeout and killed, or crashed"}
        )
    row = {
        "case": case,
        "seconds": round(time.perf_counter() - start, 1),
        "ranks": ranks,
        "exitcodes": [p.exitcode for p in procs],
    }
    if Path(out_dir, "grads.pt").exists():
        sharded = torch.load(Path(out_dir, "grads.pt"))
        ref = single["grads"]
        common = sorted(set(sharded) & set(ref))
        row["lora_grads_compared"], row["lora_grads_unmatched"] = len(common), len(set(sharded) ^ set(ref))
        if common:  # FSDP2 averages the ranks' gradients: WORLD x that is the whole batch's sum-loss gradient
            row["max_abs_grad_diff"] = max((WORLD * sharded[k] - ref[k]).abs().max().item() for k in common)
            row["max_abs_grad"] = max(ref[k].abs().max().item() for k in common)
            row["max_rel_grad_diff"] = max(
                ((WORLD * sharded[k] - ref[k]).norm() / ref[k].norm()).item() for k in common
            )
            row["zero_grad_tensors"] = sum(int(not ref[k].any()) for k in common)
    lps = [r.get("ref_logprobs") for r in ranks]
    if all(lps):
        row["ref_logprob_max_abs_diff"] = max(
            (torch.tensor(lp) - s).abs().max().item() for lp, s in zip(lps, single["ref_logprobs"])
        )
    row["loss_diff_vs_single_halves"] = [
        abs(r["loss"] - h) if isinstance(r.get("loss"), float) else None for r, h in zip(ranks, single["half_losses"])
    ]
    for key in ("generate_sharded", "generate_sharded_registered", "generate_gathered"):
        got = ranks[0].get(key)
        if got is not None:
            row[key] = "same as 1 process" if got == single["tokens"] else got
    return row


def short(value, width=34) -> str:
    text = str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def print_table(rows: list[dict], singles: dict) -> None:
    print("\nQ1 load (one process):")
    for storage, s in singles.items():
        print(f"  {storage:9s} ok  {s['param_loaded']}")
    head = (
        "case",
        "shard",
        "bwd",
        "loss d",
        "grad max|d|",
        "rel",
        "gen sharded",
        "gen gathered",
        "resh",
        "bwd2=",
        "RSS load/shard/bwdpk/gath MiB",
        "params load/shard/gath MiB",
    )
    print("\nQ2-5 (2 gloo ranks; rank 0 shown):")
    print(" | ".join(head))
    for row in rows:
        r0 = row["ranks"][0]
        gen = row.get("generate_sharded", "-")
        if "generate_sharded_registered" in row:
            gen = f"{short(gen, 22)} / registered: {short(row['generate_sharded_registered'], 18)}"
        rss = "/".join(
            str(round(r0[k])) if isinstance(r0.get(k), float) else "-"
            for k in ("rss_loaded_mib", "rss_sharded_mib", "rss_backward_peak_mib", "rss_gathered_mib")
        )
        params = "/".join(
            f"{r0[k]:.1f}" if isinstance(r0.get(k), float) else "-"
            for k in ("param_loaded_mib", "param_sharded_mib", "param_gathered_mib")
        )
        loss_d = max((d for d in row["loss_diff_vs_single_halves"] if d is not None), default=None)
        print(
            " | ".join(
                str(x)
                for x in (
                    row["case"],
                    short(r0.get("shard", r0.get("error", "-")), 40),
                    "ok" if isinstance(r0.get("backward"), float) else short(r0.get("backward")),
                    f"{loss_d:.1e}" if loss_d is not None else "-",
                    f"{row['max_abs_grad_diff']:.1e} (|g|<={row['max_abs_grad']:.2g}, {row['lora_grads_compared']} "
                    "tensors)"
                    if "max_abs_grad_diff" in row
                    else "-",
                    f"{row['max_rel_grad_diff']:.1e}" if "max_rel_grad_diff" in row else "-",
                    gen,
                    short(row.get("generate_gathered", "-")),
                    r0.get("resharded_after_gather", "-"),
                    r0.get("backward_again_grads_equal", "-"),
                    rss,
                    params,
                )
            )
        )
        if r0.get("error"):
            print(f"    error: {r0['error']}  {r0.get('where', '')}")
    print("\nQ6 reference (P5), per case (rank 0):")
    for row in rows:
        ref = row["ranks"][0].get("reference", {})
        print(f"  {row['case']}: ref log-prob max |d| vs 1 process {row.get('ref_logprob_max_abs_diff', '-')}")
        for k, v in ref.items():
            if k != "tracebacks":
                print(f"    {k}: {v}")


def main() -> None:
    import torch

    torch.set_num_threads(1)
    chosen = sys.argv[1:] or list(CASES)
    unknown = [c for c in chosen if c not in CASES]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    singles, rows = {}, []
    for i, case in enumerate(chosen):
        storage = CASES[case][0]
        if storage not in singles:
            singles[storage] = single_process(storage)
        rows.append(run_case(case, 29_700 + i, singles[storage]))
        print(f"done {case} in {rows[-1]['seconds']} s", flush=True)
    print_table(rows, singles)
    import bitsandbytes
    import peft
    import transformers

    versions = {
        "torch": torch.__version__,
        "bitsandbytes": bitsandbytes.__version__,
        "peft": peft.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }
    print(json.dumps(versions))
    results = Path(__file__).resolve().parents[1] / "results"
    if results.is_dir():
        suffix = "" if MODEL == "tiny-qwen2" else f"-{MODEL}"
        report = {
            "model": MODEL,
            "versions": versions,
            "rows": rows,
            "single_process": {
                s: {k: v for k, v in d.items() if k in ("tokens", "loss", "half_losses", "param_loaded")}
                for s, d in singles.items()
            },
        }
        (results / f"fsdp2_qlora_probe{suffix}.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
