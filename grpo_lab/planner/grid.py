"""The fit frontier's grid: its three axes (completion length x num_generations x micro-batch) from range arguments
(`64,128,256` or `LO:HI`), each with the config's own value in it. Bad input is one LabError naming the argument."""

from __future__ import annotations

from typing import Optional

from ..errors import LabError

Point = tuple[int, int, Optional[int]]  # (max_completion_length, num_generations, micro_batch_size; None = whole batch)
FIELDS = ("generator.max_completion_length", "grpo.num_generations", "grpo.micro_batch_size")
RANGE_HELP = "a comma list (e.g. 64,128,256) or LO:HI, the doublings from LO up to HI (e.g. 64:1024)"


def micro_label(micro: Optional[int]) -> str:
    return "whole batch" if micro is None else str(micro)


def micro_order(micro: Optional[int]) -> float:
    return float("inf") if micro is None else micro  # the whole batch is the largest pass


def _positive(raw, name: str) -> int:
    if isinstance(raw, bool):  # why: int(True) is 1, and a stray flag is not a length
        raise LabError(f"{name}: got {raw}; give whole numbers, not true/false")
    text = str(raw).strip()
    try:
        value = int(text)
    except ValueError:
        raise LabError(f"{name}: {text!r} is not a whole number; give {RANGE_HELP}") from None
    if value <= 0:
        raise LabError(f"{name}: got {text}; every value must be a whole number of 1 or more")
    return value


def parse_range(text: str, name: str) -> list[int]:
    """`64,128,256` or `LO:HI` (LO, 2 LO, 4 LO, ... up to HI inclusive) as sorted values without repeats; bad input is
    one LabError naming `name` (the flag or argument)."""
    text = (text or "").strip()
    if not text:
        raise LabError(f"{name}: empty; give {RANGE_HELP}")
    if ":" in text:
        lo_text, _, hi_text = text.partition(":")
        lo, hi = _positive(lo_text, name), _positive(hi_text, name)
        if lo > hi:
            raise LabError(f"{name}: {text!r} is inverted ({lo} > {hi}); give LO:HI with LO <= HI, e.g. {hi}:{lo}")
        values = []
        while lo <= hi:
            values.append(lo)
            lo *= 2
        return values
    parts = [part.strip() for part in text.split(",")]
    if "" in parts:
        raise LabError(f"{name}: {text!r} has an empty item; give {RANGE_HELP}")
    return sorted({_positive(part, name) for part in parts})


def _values(given, name: str, default: list) -> list:
    """A range argument as a list of positive ints: a range string, a sequence, or None for `default`."""
    if given is None:
        return default
    if isinstance(given, str):
        return parse_range(given, name)
    if isinstance(given, int):
        given = [given]
    values = list(given)
    if not values:
        raise LabError(f"{name}: empty; give at least one value, e.g. [64, 128] or '64:1024'")
    return sorted({_positive(v, name) for v in values})


def grid(
    config, lengths=None, generations=None, micro_batches=None
) -> tuple[list[int], list[int], list[Optional[int]]]:
    """The three axes, sorted, without repeats, each with the config's own value in it (so the current point is a
    cell). Defaults: lengths the powers of two from 64 up to max(1024, current); generations 2, 4, 8, 16; micro-batches
    the current one alone."""
    length, gens, micro = (
        config.generator.max_completion_length,
        config.grpo.num_generations,
        config.grpo.micro_batch_size,
    )
    top = max(1024, length)
    powers = [2**k for k in range(6, top.bit_length()) if 2**k <= top]
    lengths = sorted({*_values(lengths, "lengths", powers), length})
    generations = sorted({*_values(generations, "generations", [2, 4, 8, 16]), gens})
    micros = sorted({*_values(micro_batches, "micro_batches", []), micro}, key=micro_order)
    return lengths, generations, micros
