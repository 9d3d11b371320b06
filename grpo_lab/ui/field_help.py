"""A config field's line under its input in the editor: a badge for when an edit applies (the legend says once what
each means, where an 80-character note under every field said it again), a CUDA-only field marked on a CPU Lab, long
help folded after its first sentence, and an applied value ticked."""

from __future__ import annotations

import html

from ..config.fields import WHEN

# when an edit applies, one word each (the editor's legend says what each means)
BADGES = {"live": "live", "rebuild": "rebuild", "load": "load-time"}
FOLD_AT = 110  # help longer than this shows its first sentence; the rest is one click away


def fold(text: str) -> tuple[str, str]:
    """A help text as (what shows, what is folded): whole when short, else cut after its first sentence (or a word)
    within FOLD_AT characters."""
    if len(text) <= FOLD_AT:
        return text, ""
    ends = [i + 1 for i, c in enumerate(text[:FOLD_AT]) if c in ".;:" and text[i + 1 : i + 2] == " " and i > 30]
    cut = ends[0] if ends else text.rfind(" ", 0, FOLD_AT)
    return text[:cut].rstrip() + " …", text[cut:].strip()


def help_html(prop: dict, applied: str = "", cuda: bool = False) -> str:
    """The field's badge (when an edit applies; `cuda`: a CUDA-only field on a CPU Lab) and its help, long help folded;
    `applied`: the value just applied, acknowledged."""
    when = prop.get("when", "live")
    badge = f"<span class='grpo-lab-badge grpo-lab-badge-{when}' title='{WHEN[when]}'>{BADGES[when]}</span>"
    if cuda:
        badge += "<span class='grpo-lab-badge grpo-lab-badge-cuda' title='this Lab runs on the CPU'>CUDA only</span>"
    ok = f"<span class='grpo-lab-ok'>&#10003; applied: {html.escape(applied, quote=False)}</span>" if applied else ""
    head, rest = (html.escape(part, quote=False) for part in fold(prop.get("description", "")))
    if not rest:
        return f"{badge}{head}{ok}"
    return f"<details><summary>{badge}{head}{ok}</summary>{rest}</details>"


def on_the_cpu(config) -> bool:
    """Whether nothing of this config runs on CUDA (its CUDA-only fields then bear on nothing: marked so)."""
    place = config.placement
    return not any(d.startswith("cuda") for d in [place.learner, *place.generator_devices()])
