"""bench/suite/suite_time.py reads a fresh clone's `.ci/run` console into the suite's figure (issue 57): each pass's
wall time from its session start to its summary, pytest's own seconds, the demo seeds' median as the machine's speed,
and whether every test passed."""

from __future__ import annotations

import pytest

from bench.suite.suite_time import read_console

BAR = "=" * 20


def console(failed: str = "") -> list[tuple[float, str]]:
    lines = [
        (1.0, "Resolved 210 packages"),
        (50.0, f"{BAR} test session starts {BAR}"),
        (60.0, f"{BAR} slowest 30 durations {BAR}"),
        (60.1, "61.42s call     tests/test_demo_learns.py::test_the_demo_learns_to_answer_on_seeds_0_to_4[4]"),
        (60.2, "63.98s call     tests/test_demo_learns.py::test_the_demo_does_not_rise_without_learning"),
        (60.3, "52.10s call     tests/test_demo_learns.py::test_the_demo_learns_to_answer_on_seeds_0_to_4[0]"),
        (60.4, "57.59s call     tests/test_demo_learns.py::test_the_demo_learns_to_answer_on_seeds_0_to_4[3]"),
        (60.5, "33.34s setup    tests/test_demo_learns.py::test_the_demo_learns_to_answer_on_seeds_0_to_4[1]"),
        (760.0, f"{BAR} 1493 passed, 19 skipped, 17 warnings in 711.10s (0:11:51) {BAR}"),
        (770.0, f"{BAR} test session starts {BAR}"),
        (1215.5, f"{BAR} {failed}96 passed in 443.33s (0:07:23) {BAR}"),
        (1216.0, f"{BAR} test session starts {BAR}"),
        (1394.0, f"{BAR} 6 passed, 108 deselected in 177.05s (0:02:57) {BAR}"),
    ]
    return lines


def test_each_pass_is_timed_from_its_start_to_its_summary_and_the_seeds_call_times_give_the_speed():
    read = read_console(console())
    assert list(read["passes"]) == ["xdist", "solo", "alone"]
    assert [p["wall_s"] for p in read["passes"].values()] == [710.0, 445.5, 178.0]
    assert [p["pytest_s"] for p in read["passes"].values()] == [711.10, 443.33, 177.05]
    assert read["passes"]["alone"]["summary"] == "6 passed, 108 deselected"
    assert read["demo_seed_call_s"] == 57.6  # the seeds' calls only: not the control, not a setup
    assert read["every_test_passed"]


def test_a_failed_test_or_an_error_in_any_pass_is_not_a_green_run():
    assert not read_console(console("1 failed, "))["every_test_passed"]
    assert not read_console(console("2 errors, "))["every_test_passed"]
    assert not read_console([(0.0, "no pytest ran")])["every_test_passed"]


def test_a_console_of_lines_without_times_still_gives_pytest_s_seconds():
    read = read_console([(None, line) for _, line in console()])
    assert [p["wall_s"] for p in read["passes"].values()] == [None, None, None]
    assert read["passes"]["solo"]["pytest_s"] == 443.33


def test_more_summaries_than_scripts_test_sh_has_passes_is_refused():
    with pytest.raises(ValueError, match="4 pytest summaries in one console: expected at most 3"):
        read_console(console() + console()[-2:])


def test_the_console_the_script_writes_is_read_back_with_its_line_times():
    from bench.suite.suite_time import console_lines

    timed = "".join(f"{at:9.1f} {line}\n" for at, line in console())
    assert console_lines(timed) == console()
    plain = "".join(f"{line}\n" for _, line in console())
    assert console_lines(plain) == [(None, line) for _, line in console()]


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--cores", "0"], "--cores 0: give 1 to "),
        (["--cores", "999"], "--cores 999: give 1 to "),
        (["--parse", "console.log"], "--parse needs --total-s"),
    ],
)
def test_a_bad_option_is_one_line_and_exit_2_before_anything_is_cloned(argv, says, capsys):
    from bench.suite.suite_time import main

    with pytest.raises(SystemExit) as ended:
        main(argv)
    err = capsys.readouterr().err
    assert ended.value.code == 2 and says in err and err.strip().splitlines()[-1].count(says) == 1, err
