"""Does PyTorch's FSDP2 (`fully_shard`) shard grpo_lab's QLoRA learner, with the bitsandbytes we ship? (issue 14)

For each `bnb_4bit_quant_storage` (uint8: bitsandbytes' default; bfloat16; float32) it loads the built-in tiny
model 4-bit (nf4, double quant) with LoRA on all linear layers, in 2 gloo processes (CPU), applies
`fully_shard` to every decoder layer and then the root, and runs one forward + backward of a log-prob loss on
half the batch per rank; it compares the LoRA gradients (FSDP2's reduce-scatter averages over ranks: the whole
batch's mean loss) with one process on the whole batch, and tries greedy generation two ways: through the sharded
model (each layer gathered per forward), and after `unshard()` (full parameters for the whole generate).

    GRPO_LAB_CACHE=/tmp/glc python -m bench.probes.fsdp2_probe [STORAGE ...]   # a line per storage; JSON in
        # bench/results/
    GRPO_PROBE_MODEL=qwen2-152k ...    # Qwen2.5's 152k vocabulary on the tiny body: the embedding and head dominate
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

STORAGES = tuple(sys.argv[1:]) or ("uint8", "bfloat16", "float32")


def load(storage: str, seed: int = 0):
    from bench.loaders import load_4bit_base, with_lora

    return with_lora(load_4bit_base(os.environ.get("GRPO_PROBE_MODEL", "tiny-qwen2"), storage), seed)


def batch():
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 300, (4, 24), generator=g)


def loss_of(model, ids):
    import torch

    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).mean()


def lora_grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad and p.grad is not None:
            g = p.grad
            g = g.full_tensor() if hasattr(g, "full_tensor") else g  # a DTensor's whole gradient
            out[name.replace("_fsdp_wrapped_module.", "")] = g.detach().clone()
    return out


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def rank_main(rank: int, world: int, storage: str, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=120))
    result = {"rank": rank, "storage": storage}
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

        model = load(storage)
        result["rss_loaded_mib"] = rss_mib()
        causal_lm = model.base_model.model  # the transformers model: PeftModel.forward and .generate both reach it
        for layer in causal_lm.model.layers:
            fully_shard(layer)
        fully_shard(causal_lm)  # why the inner model as root: PeftModel.generate calls it, not PeftModel.forward
        register_fsdp_forward_method(causal_lm, "generate")  # why: the root's hooks must wrap generate too
        fsdp_modules = [m for m in causal_lm.modules() if isinstance(m, FSDPModule)]
        result["rss_sharded_mib"] = rss_mib()
        result["shard"] = "ok"
        ids = batch()
        mine = ids.chunk(world)[rank]
        loss = loss_of(model, mine)
        result["loss"] = loss.item()
        loss.backward()
        result["rss_after_backward_mib"] = rss_mib()
        grads = {k: v.tolist() for k, v in lora_grads(model).items()}  # averaged over ranks: the whole batch's mean
        result["backward"] = "ok"
        prompt = ids[:2, :8]
        with torch.no_grad():
            try:  # generation through the sharded model: every layer all-gathered per decoding step
                sharded = model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, use_cache=True)
                result["generate_sharded"] = sharded[:, 8:].tolist()
            except Exception as err:
                result["generate_sharded"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            try:  # the gather: full parameters for the whole generate, resharded after
                for m in fsdp_modules:
                    m.set_reshard_after_forward(False)
                    m.unshard()
                result["rss_gathered_mib"] = rss_mib()
                gathered = model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, use_cache=True)
                result["generate_gathered"] = gathered[:, 8:].tolist()
            except Exception as err:
                result["generate_gathered"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            finally:
                for m in fsdp_modules:
                    m.reshard()
                    m.set_reshard_after_forward(True)
        model.zero_grad(set_to_none=True)
        loss_of(model, mine).backward()  # training still works after both generations
        again = lora_grads(model)
        result["backward_after_generate_equal"] = all(torch.equal(again[k], torch.tensor(grads[k])) for k in grads)
        if rank == 0:
            Path(out_dir, f"grads-{storage}.json").write_text(json.dumps(grads))
    except Exception as err:
        result["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
        result["where"] = traceback.format_exc().splitlines()[-3:]
    Path(out_dir, f"rank{rank}-{storage}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def single(storage: str) -> dict:
    import torch

    torch.set_num_threads(1)
    model = load(storage)
    ids = batch()
    halves = [loss_of(model, half).item() for half in ids.chunk(2)]
    loss_of(model, ids).backward()
    with torch.no_grad():
        tokens = model.generate(input_ids=ids[:2, :8], max_new_tokens=8, do_sample=False, use_cache=True)[
            :, 8:
        ].tolist()
    return {"grads": {k: v.tolist() for k, v in lora_grads(model).items()}, "tokens": tokens, "half_losses": halves}


def main() -> None:
    import tempfile

    import torch
    import torch.multiprocessing as mp

    rows, port = [], 29_611
    for storage in STORAGES:
        out_dir = tempfile.mkdtemp(prefix="fsdp2-probe-")
        reference = single(storage)
        start = time.perf_counter()
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=rank_main, args=(r, 2, storage, port, out_dir)) for r in range(2)]
        port += 1
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
            if p.is_alive():
                p.kill()
        ranks = [
            json.loads(Path(out_dir, f"rank{r}-{storage}.json").read_text())
            if Path(out_dir, f"rank{r}-{storage}.json").exists()
            else {"error": "no result (hung or crashed)"}
            for r in range(2)
        ]
        row = {"storage": storage, "seconds": round(time.perf_counter() - start, 1), "ranks": ranks}
        grads_file = Path(out_dir, f"grads-{storage}.json")
        if grads_file.exists():
            sharded = json.loads(grads_file.read_text())
            common = sorted(set(sharded) & set(reference["grads"]))
            row["lora_grads_compared"] = len(common)
            row["lora_grads_missing"] = len(set(reference["grads"]) ^ set(sharded))
            row["max_abs_grad_diff"] = (
                max((torch.tensor(sharded[k]) - torch.tensor(reference["grads"][k])).abs().max().item() for k in common)
                if common
                else None
            )
            row["max_abs_grad"] = (
                max(torch.tensor(reference["grads"][k]).abs().max().item() for k in common) if common else None
            )
        row["single_process_tokens"] = reference["tokens"]
        row["single_process_half_losses"] = reference["half_losses"]
        row["sharded_losses"] = [r.get("loss") for r in ranks]
        rows.append(row)
        r0 = ranks[0]
        rss_keys = ("rss_loaded_mib", "rss_sharded_mib", "rss_after_backward_mib", "rss_gathered_mib")
        print(
            f"{storage:9s} shard={r0.get('shard', '-')} backward={r0.get('backward', '-')} "
            f"loss {row['sharded_losses']} vs {row['single_process_half_losses']} "
            f"grads {row.get('lora_grads_compared')} (+{row.get('lora_grads_missing')} unmatched) "
            f"diff={row.get('max_abs_grad_diff')} (max |g| {row.get('max_abs_grad')}) "
            f"single gen={reference['tokens']} sharded gen="
            f"{'same' if r0.get('generate_sharded') == reference['tokens'] else r0.get('generate_sharded')} "
            f"gathered gen="
            f"{'same' if r0.get('generate_gathered') == reference['tokens'] else r0.get('generate_gathered')} "
            f"backward after generate equal={r0.get('backward_after_generate_equal')} "
            f"rss MiB loaded/sharded/backward/gathered={[round(r0.get(k, 0)) for k in rss_keys]} "
            f"error={r0.get('error', '')} {r0.get('where', '')}",
            flush=True,
        )
    import bitsandbytes
    import peft
    import transformers

    report = {
        "versions": {
            "torch": torch.__version__,
            "bitsandbytes": bitsandbytes.__version__,
            "peft": peft.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
        },
        "rows": rows,
    }
    results = Path(__file__).resolve().parents[1] / "results"
    if results.is_dir():
        (results / f"fsdp2_probe-{os.environ.get('GRPO_PROBE_MODEL', 'tiny-qwen2')}.json").write_text(
            json.dumps(report, indent=1)
        )
    print(json.dumps(report["versions"]))


if __name__ == "__main__":
    main()
