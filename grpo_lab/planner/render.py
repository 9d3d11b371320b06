"""The plan as a table: plain text at 120 columns for the CLI and `print(lab.plan())` (notes wrapped at words inside
their column), HTML tables that fit a notebook's output for `lab.plan()` in a cell."""

from __future__ import annotations

import html
from typing import Union

from ..memory.tables import TEXT_WIDTH, Column, Table, size_text, wrap_line
from .estimate import PHASES, planned_lora

Block = Union[str, Table]  # a line of prose, or a device's table
ITEM_WIDTH = 44  # the item column (indented 2 under its device): every device's block lines up in the text


size = size_text  # a planned size as the plots write a limit: GiB with 2 decimals from 1 GiB up, else MiB


def wrapped_by(config) -> str:
    """Who wraps this learner in DataParallel today: transformers' Trainer._wrap_model skips 4-bit and 8-bit models."""
    if config.model.load_in_4bit:
        return (
            "today's transformers Trainer does not wrap a 4-bit model; older versions, and any code that wraps "
            "by hand, did"
        )
    return "HF Trainer does this for a 16-bit model when it sees more than one GPU"


def _device_block(d, title_suffix: str = "", shared: str = "") -> Table:
    """`shared`: the device is one rank's share of host RAM; its last line says so instead of a verdict."""
    roles = ", ".join(d.roles) or "-"
    rows = [["host RAM" if shared else "capacity", size(d.capacity), ""]]
    if d.line < 1.0 and not shared:  # the line this device is judged against: the host guard's, where it stops a phase
        rows.append(["guard's line", size(d.line_bytes), f"memory.host_threshold {d.line:g}: judged against this"])
    rows += [[i.what, size(i.bytes), i.note] for i in d.items if i.phase is None]
    for phase in PHASES:
        transients = [i for i in d.items if i.phase == phase]
        if transients:
            rows.append([f"during {phase}:", size(d.phase_peak(phase)), "peak = resident + these"])
            rows += [[f"  {i.what}", size(i.bytes), i.note] for i in transients]
    where = f" (during {d.peak_phase})" if d.peak_phase else ""
    rows.append([f"peak{where}", size(d.total), shared or f"{d.fraction:.0%}  -> {d.verdict}"])
    columns = [Column("item", min_width=ITEM_WIDTH), Column("planned", numeric=True), Column("note", wraps=True)]
    return Table(columns, rows, title=f"{d.device:<8} {roles}{title_suffix}", strong={len(rows) - 1}, indent=2)


def _sharding(plan) -> list[Block]:
    """A sharded learner's line under the header, and a CPU learner's rank blocks (rank 0 whole, the others named:
    every rank holds the same), which the host block then adds up."""
    config = plan.config
    procs, gather = config.placement.learner_procs, config.generator.gather_for_generation
    how = "the whole model gathered on every rank" if gather else "one layer gathered at a time (slow)"
    out: list[Block] = [
        f"learner sharded over {procs} ranks (FSDP2, 1/{procs} of every parameter and of AdamW's state each); "
        f"rollout on every rank with {how} (generator.gather_for_generation: {str(gather).lower()})",
        "",
    ]
    shares = [d for name, d in plan.ranks.items() if name not in plan.devices]
    if shares:
        shared = f"one of {procs} processes in host RAM: the host block adds them up"
        out.append(_device_block(shares[0], shared=shared))
        if shares[1:]:
            out.append("  " + ", ".join(d.device for d in shares[1:]) + ": the same as rank 0")
        out.append("")
    return out


def blocks(plan) -> list[Block]:
    """The plan but its notes and verdict: the header, each device's table, the DataParallel what-if, the GPU split."""
    config, shape = plan.config, plan.shape
    lora = planned_lora(shape, config)
    quant = config.model.bnb_4bit_quant_type if config.model.load_in_4bit else config.model.dtype
    out: list[Block] = [
        f"memory plan: {config.model.name_or_path} ({count(shape.total_params)} params, {quant}), "
        f"LoRA r={config.lora.r} ({count(lora)}), generator {config.generator.backend}, "
        f"micro-batch {plan.micro_batch}, reference {config.reference_strategy}",
        *([plan.prompts] if plan.prompts else []),
        *([plan.turns] if plan.turns else []),
        "",
    ]
    if plan.ranks:
        out += _sharding(plan)
    for d in plan.devices.values():
        out += [_device_block(d), ""]
    if plan.dataparallel:
        gpus = ", ".join(plan.dataparallel)
        out.append(f"what if the learner were wrapped in DataParallel over {gpus} ({wrapped_by(plan.config)}; P1):")
        out += [
            f"  {name}: {size(d.total)} of {size(d.capacity)} ({d.fraction:.0%}) -> {d.verdict}"
            for name, d in plan.dataparallel.items()
        ]
        out += [
            "  grpo_lab never wraps the learner, and its guard refuses a wrapped one (grpo_lab.trl_bridge for TRL).",
            "",
        ]
    splits = [d.split for d in plan.devices.values() if d.split is not None]
    if splits:
        share = config.generator.gpu_memory_utilization or "null"
        out.append(f"GPU split (generator.gpu_memory_utilization: {share}):")
        out += [f"  {s.describe()}" for s in splits] + [""]
    return out


def verdict_lines(plan) -> list[str]:
    verdict = "fits" if plan.fits else "does not fit on " + ", ".join(d.device for d in plan.failing())
    lines = [f"verdict: {verdict}"]
    if not plan.fits:
        lines.append(
            "each of these alone would make it fit: "
            + (
                "; ".join(plan.fixes)
                if plan.fixes
                else "none of grpo_lab's knobs; use a bigger device, a smaller model or shorter sequences"
            )
        )
    return lines


def render(plan, notes: bool = True, width: int = TEXT_WIDTH) -> str:
    """The plan as text no wider than `width` (a line runs past it only where one word is longer)."""
    lines = [b.text(width, header=False) if isinstance(b, Table) else wrap_line(b, width) for b in blocks(plan)]
    lines += [wrap_line(f"note: {c}", width) for c in plan.caveats] if notes else []
    lines += [wrap_line(line, width) for line in verdict_lines(plan)]
    return "\n".join(lines)


def render_html(plan) -> str:
    """The plan in a notebook: each device a table whose notes wrap in their own column (it fits the output, nothing
    scrolls sideways), its notes (what the plan leaves out, e.g. glibc's heap holes) folded away unless the host is
    within 10% of its capacity or over it, where they could change the verdict."""
    parts = [
        b.html() if isinstance(b, Table) else f"<div style='margin:2px 0'>{html.escape(b, quote=False)}</div>"
        for b in blocks(plan)
        if b != ""
    ]
    if plan.caveats:
        host = plan.devices.get("host")
        at_stake = host is not None and host.fraction > 0.9 * host.line  # (within 10% of its line)
        items = "".join(f"<li>{html.escape(c)}</li>" for c in plan.caveats)
        parts.append(
            f"<details{' open' if at_stake else ''}><summary>notes: what this plan leaves out ({len(plan.caveats)})"
            f"</summary><ul style='margin:0'>{items}</ul></details>"
        )
    parts += [f"<div style='margin:2px 0'><b>{html.escape(v, quote=False)}</b></div>" for v in verdict_lines(plan)]
    return f"<div class='grpo-lab-plan' style='max-width:100%;overflow-wrap:break-word'>{''.join(parts)}</div>"


def count(n: float) -> str:
    """A parameter count in the unit that fits it: 7.62B, 2.1M, 36.9K, 512."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'B' else 1}f}{unit}"
    return f"{n:.0f}"
