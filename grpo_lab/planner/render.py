"""The plan as a table (CLI and notebook)."""

from __future__ import annotations

from .estimate import PHASES, GiB


def size(nbytes: float) -> str:
    return f"{nbytes / GiB:>8.2f} GiB" if abs(nbytes) >= GiB else f"{nbytes / 1024**2:>8.1f} MiB"


def _item(what: str, nbytes: float, note: str = "", indent: int = 2) -> str:
    return f"{' ' * indent}{what:<{46 - indent}}{size(nbytes)}{f'  {note}' if note else ''}"


def wrapped_by(config) -> str:
    """Who wraps this learner in DataParallel today: transformers' Trainer._wrap_model skips 4-bit and 8-bit models."""
    if config.model.load_in_4bit:
        return (
            "today's transformers Trainer does not wrap a 4-bit model; older versions, and any code that wraps "
            "by hand, did"
        )
    return "HF Trainer does this for a 16-bit model when it sees more than one GPU"


def _device_block(d, title_suffix: str = "", shared: str = "") -> list[str]:
    """`shared`: the device is one rank's share of host RAM; its last line says so instead of a verdict."""
    roles = ", ".join(d.roles) or "-"
    lines = [f"{d.device:<8} {roles}{title_suffix}", _item("host RAM" if shared else "capacity", d.capacity)]
    if d.line < 1.0 and not shared:  # the line this device is judged against: the host guard's, where it stops a phase
        lines.append(_item("guard's line", d.line_bytes, f"memory.host_threshold {d.line:g}: judged against this"))
    lines += [_item(i.what, i.bytes, i.note) for i in d.items if i.phase is None]
    for phase in PHASES:
        transients = [i for i in d.items if i.phase == phase]
        if transients:
            lines.append(_item(f"during {phase}:", d.phase_peak(phase), "peak = resident + these"))
            lines += [_item(i.what, i.bytes, i.note, indent=4) for i in transients]
    where = f" (during {d.peak_phase})" if d.peak_phase else ""
    lines.append(_item(f"peak{where}", d.total, shared or f"{d.fraction:.0%}  -> {d.verdict}"))
    return lines


def _sharding(plan) -> list[str]:
    """A sharded learner's line under the header, and a CPU learner's rank blocks (rank 0 whole, the others named:
    every rank holds the same), which the host block then adds up."""
    config = plan.config
    procs, gather = config.placement.learner_procs, config.generator.gather_for_generation
    how = "the whole model gathered on every rank" if gather else "one layer gathered at a time (slow)"
    lines = [
        f"learner sharded over {procs} ranks (FSDP2, 1/{procs} of every parameter and of AdamW's state each); "
        f"rollout on every rank with {how} (generator.gather_for_generation: {str(gather).lower()})",
        "",
    ]
    shares = [d for name, d in plan.ranks.items() if name not in plan.devices]
    if shares:
        lines += _device_block(shares[0], shared=f"one of {procs} processes in host RAM: the host block adds them up")
        if shares[1:]:
            lines.append("  " + ", ".join(d.device for d in shares[1:]) + ": the same as rank 0")
        lines.append("")
    return lines


def render_html(plan) -> str:
    """The plan in a notebook: one block that scrolls sideways instead of wrapping mid-word, its notes (what the plan
    leaves out, e.g. glibc's heap holes) folded away unless the host is within 10% of its capacity or over it, where
    they could change the verdict (within 10% of its line)."""
    import html

    block = f"<pre style='white-space:pre;overflow-x:auto;margin:0'>{html.escape(render(plan, notes=False))}</pre>"
    if not plan.caveats:
        return f"<div class='grpo-lab-plan'>{block}</div>"
    host = plan.devices.get("host")
    at_stake = host is not None and host.fraction > 0.9 * host.line
    notes = "".join(f"<li>{html.escape(c)}</li>" for c in plan.caveats)
    fold = (
        f"<details{' open' if at_stake else ''}><summary>notes: what this plan leaves out ({len(plan.caveats)})"
        f"</summary><ul style='margin:0'>{notes}</ul></details>"
    )
    return f"<div class='grpo-lab-plan'>{block}{fold}</div>"


def render(plan, notes: bool = True) -> str:
    config, shape = plan.config, plan.shape
    lora = shape.lora_params(config.lora.r, config.lora.target_modules)
    quant = config.model.bnb_4bit_quant_type if config.model.load_in_4bit else config.model.dtype
    lines = [
        f"memory plan: {config.model.name_or_path} ({count(shape.total_params)} params, {quant}), "
        f"LoRA r={config.lora.r} ({count(lora)}), generator {config.generator.backend}, "
        f"micro-batch {plan.micro_batch}, reference {config.reference_strategy}",
        "",
    ]
    if plan.ranks:
        lines += _sharding(plan)
    for d in plan.devices.values():
        lines += _device_block(d) + [""]
    if plan.dataparallel:
        gpus = ", ".join(plan.dataparallel)
        lines.append(f"what if the learner were wrapped in DataParallel over {gpus} ({wrapped_by(plan.config)}; P1):")
        for name, d in plan.dataparallel.items():
            lines.append(
                f"  {name}: {d.total / GiB:.2f} of {d.capacity / GiB:.2f} GiB ({d.fraction:.0%}) -> {d.verdict}"
            )
        lines.append(
            "  grpo_lab never wraps the learner, and its guard refuses a wrapped one (grpo_lab.trl_bridge for TRL)."
        )
        lines.append("")
    splits = [d.split for d in plan.devices.values() if d.split is not None]
    if splits:
        lines.append(
            f"GPU split (generator.gpu_memory_utilization: {config.generator.gpu_memory_utilization or 'null'}):"
        )
        lines += [f"  {s.describe()}" for s in splits] + [""]
    lines += [f"note: {c}" for c in plan.caveats] if notes else []
    verdict = "fits" if plan.fits else "does not fit on " + ", ".join(d.device for d in plan.failing())
    lines.append(f"verdict: {verdict}")
    if not plan.fits:
        lines.append(
            "each of these alone would make it fit: "
            + (
                "; ".join(plan.fixes)
                if plan.fixes
                else "none of grpo_lab's knobs; use a bigger device, a smaller model or shorter sequences"
            )
        )
    return "\n".join(lines)


def count(n: float) -> str:
    """A parameter count in the unit that fits it: 7.62B, 2.1M, 36.9K, 512."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'B' else 1}f}{unit}"
    return f"{n:.0f}"
