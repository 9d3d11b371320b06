"""The leak detector (issue 51 item 6): warm-up and one-off jumps raise no alarm, a steady leak does.
Real Labs on the tiny model keep real tensors (a first-time cache, a leak) through a reward function."""

import random
from pathlib import Path

import pytest
import torch

from grpo_lab import Lab
from grpo_lab.memory import LeakDetector
from grpo_lab.memory.leaks import end_of_step
from grpo_lab.memory.readers import MiB

HERE = Path(__file__).resolve().parent
_kept: list[torch.Tensor] = []  # what the planted rewards below keep alive
_calls = [0]


def first_time_cache_29mib(prompts, completions, **kwargs):
    """Keeps 29 MiB once, on its third call (step 2): the quickstart's jump, then nothing more."""
    _calls[0] += 1
    if _calls[0] == 3:
        _kept.append(torch.ones(29 * MiB // 4))  # ones, not empty: the pages are touched, so RSS grows
    return [0.0 for _ in completions]


def leak_8mib(prompts, completions, **kwargs):
    """Keeps an 8 MiB tensor per call, one call a step: a real leak."""
    _kept.append(torch.ones(8 * MiB // 4))
    return [0.0 for _ in completions]


@pytest.fixture
def planted(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))  # why: the rewards are imported as 'test_leaks:<name>'
    _kept.clear()
    _calls[0] = 0
    yield
    _kept.clear()  # why: give the planted memory back before the next test


def flags(series_mib: list[float], **kwargs) -> list[list[str]]:
    detector = LeakDetector(**kwargs)
    return [detector.observe({"host": v * MiB}) for v in series_mib]


def test_quickstart_series_with_one_jump_is_not_a_leak():
    # measured: notebooks/01_quickstart.ipynb, 7 steps, flagged at steps 5 and 6 by the mean change
    assert not any(flags([687.5, 688.1, 717.4, 717.6, 717.9, 718.1, 718.2]))


def test_one_late_jump_in_a_slowly_rising_window_is_kept_quiet_by_the_median():
    """Every step rises a little, then one late jump (a cell's first figure after four quiet steps): the window rises
    at every step (rising: 1.0), its later half outgrows its earlier half (sustained) and its mean change is 6.4 MiB,
    over the 4 MiB floor; only the median change, 0.5 MiB, says its typical step does not grow."""
    series = [600, 600.5, 601, 601.5, 602, 632]
    changes = [b - a for a, b in zip(series, series[1:])]
    assert sum(changes) / len(changes) >= 4  # the mean alone would flag it
    assert flags(series) == [[]] * 6
    assert flags([*series[:-1], 602 + 5 * 5])[-1] == []  # still one step's jump, at any size
    assert flags([600 + 5 * i for i in range(6)])[-1] == ["host"]  # the same mean, every step: a leak


def test_warm_up_then_flat_is_not_a_leak():
    warm_up = [600, 640, 660, 670, 675, 678, 680, 681] + [681.2 + 0.1 * i for i in range(20)]
    assert not any(flags(warm_up))


def test_noisy_flat_is_not_a_leak():
    noise = random.Random(0)
    assert not any(flags([700 + noise.uniform(-3, 3) for _ in range(50)]))


def test_steady_growth_broken_by_one_large_free_is_not_a_leak():
    assert not any(flags([600, 605, 610, 580, 585, 590, 595]))  # 4 of 5 steps grow 5 MiB, the window shrinks


def test_steady_growth_is_a_leak_from_the_first_full_window():
    rising = flags([100 + 10 * i for i in range(8)], window=4)
    assert rising[:4] == [[]] * 4 and all(f == ["host"] for f in rising[4:])


def test_noisy_steady_growth_is_a_leak():
    noise = random.Random(0)
    series = [600 + 8 * i + noise.uniform(-2, 2) for i in range(12)]
    assert all(f == ["host"] for f in flags(series)[5:])


def test_leak_after_warm_up_and_a_jump_is_still_found():
    series = [600, 640, 660, 661, 700, 701] + [701 + 8 * i for i in range(1, 10)]
    assert flags(series)[-1] == ["host"]


def test_real_lab_with_the_quickstarts_jump_raises_no_alarm_over_25_steps(tiny_config, planted):
    lab = Lab(tiny_config(data={"rewards": ["exact_answer", "test_leaks:first_time_cache_29mib"]})).load()
    try:
        results = [lab.step() for _ in range(25)]
    finally:
        lab.close()
    host = [end_of_step(r.memory)["host"] / MiB for r in results]
    assert host[2] - host[1] > 25, host  # the planted 29 MiB shows in RSS, as the quickstart's jump did
    assert not any(r.leaks for r in results), [r.leaks for r in results]


def test_real_lab_with_a_planted_8mib_leak_trips_on_host_within_the_window(tiny_config, planted):
    lab = Lab(tiny_config(data={"rewards": ["exact_answer", "test_leaks:leak_8mib"]})).load()
    try:
        flagged = [lab.step().leaks for _ in range(7)]  # the quickstart's 7 steps
    finally:
        lab.close()
    assert not any(flagged[:5])  # the default window of 5 changes needs 6 steps
    assert all("host" in f for f in flagged[5:]), flagged


@pytest.mark.slow
def test_quickstart_notebook_seven_steps_raise_no_alarm(tiny_model, tmp_path):
    """The run of issue 51 (flagged at its 6th and 7th steps before): the quickstart's own cells with steps=5 (a
    walk, a step, the snapshot, then 5 steps), and one cell more that prints every step's verdict."""
    import nbformat
    from test_notebooks import ROOT, printed, run_notebook

    nb = nbformat.read(ROOT / "notebooks" / "01_quickstart.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("print('verdicts:', [r.leaks for r in lab.history])"))
    nbformat.write(nb, tmp_path / "in.ipynb")
    text = printed(run_notebook(tmp_path / "in.ipynb", tmp_path / "out.ipynb", ROOT, {"steps": 5}))
    assert "verdicts: [[], [], [], [], [], [], []]" in text, text[-500:]
