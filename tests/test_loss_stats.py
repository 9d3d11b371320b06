"""LossStats as a cell shows it (issue 51): the dataclass's one line of 17-digit floats wrapped mid-word ("gra|d",
"l|ogprob_kl", "No|ne"); now rounded `name value` pairs in lines of at most 80 columns, broken between pairs."""

import re
from dataclasses import fields

from grpo_lab.algo.containers import LossStats


def test_loss_stats_read_as_rounded_pairs_in_short_lines_broken_between_fields():
    stats = LossStats(
        loss=0.018370723351836205,
        kl=None,
        clip_fraction=0.0,
        logprob_mismatch=4.0810846257954836e-07,
        logprob_kl=-6.386211940220424e-09,
        num_tokens=168,
        is_ratio_min=0.9123456789,
        is_ratio_mean=1.0000001,
        is_ratio_max=None,
    )
    text = repr(stats)
    lines = text.splitlines()
    assert text.startswith("<LossStats  loss 0.01837  kl None") and text.endswith(">") and len(lines) > 1
    assert all(len(line) <= 80 for line in lines), lines
    pairs = [p for line in lines for p in line.strip("<>").split("  ") if p.strip()][1:]  # past "<LossStats"
    assert [p.split(" ")[0] for p in pairs] == [f.name for f in fields(LossStats)]  # every field, whole, in order
    assert all(len(p.split(" ")) == 2 for p in pairs), pairs  # a line never ends inside a pair
    assert {"logprob_mismatch 4.081e-07", "is_ratio_mean 1", "num_tokens 168", "is_ratio_max None"} <= set(pairs)
    assert not re.search(r"\d{6,}", text)  # no 17-digit floats (4 significant digits: 0.01837)
    assert str(stats) == text
