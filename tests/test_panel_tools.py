"""Issue 67's tool figures where a person reads a run: the panel's log line per step, a step result's table in a cell
and the run report (the one `grpo-lab run` writes, a resumed run's too: from metrics.jsonl's lines) each show the step's
tool calls per row, its failed calls and its turns, and a vllm step's prefix cache hit rate beside them (none on hf:
nothing shown). A Lab with tools on the real hf backend, the first turn's call
forced (test_tools.forced_call): one call per row to `add`, which answers, or to `explode`, which raises."""

import re

import pytest
from test_tools import TEMPLATE, add, call_text, explode, forced_call, tool_lab  # noqa: F401 (forced_call: a fixture)


@pytest.mark.parametrize("tool, failed", [("add", "0.00"), ("explode", "1.00")])
def test_the_panels_log_a_step_table_and_the_report_show_tool_calls_failures_and_turns(
    tiny_config,
    forced_call,  # noqa: F811 (test_tools' fixture)
    tmp_path,
    tool,
    failed,
):
    from grpo_lab.algo.containers import StepResult
    from grpo_lab.memory.report import write_report
    from grpo_lab.ui.reprs import step_html

    lab = tool_lab(tiny_config, ["length"], tools=(add, explode))
    try:
        forced_call(lab.learner.tokenizer, call_text(tool, '{"a": 2, "b": 3}' if tool == "add" else '{"x": 1}'))
        panel = lab.ui()
        panel.controls.run(1).join(300)
        result = lab.history[-1]
        assert (result.tool_calls_per_row, result.tool_failure_frequency) == (1.0, float(failed))
        # the panel's log: the step's line carries its tool calls per row, failures and turns
        line = [x for x in panel.controls.log_text().splitlines() if x.startswith(f"step {result.step}:")]
        turns = f"{result.turns_mean:.2f}"  # 2 when the call's result came back, 1 when it was left out (too long)
        assert line and f"tools 1.00/row (failed {failed}), {turns} turns" in line[0], panel.controls.log_text()
        # a step result in a cell: its table has the tool columns
        page = step_html(result)
        for name, value in [("tool calls/row", "1.00"), ("failed/row", failed), ("turns/row", turns)]:
            assert f">{name}</th>" in page and f">{value}</td>" in page, (name, value)
        assert f">{float(failed):.0%}</td>" in page
        # the report, from this session's steps and from metrics.jsonl's lines (what a resumed run reads back)
        for history in (lab.history, [StepResult.from_metrics(r.metrics()) for r in lab.history]):
            report = write_report(tmp_path / "report.html", lab.memory, history).read_text()
            assert "<h2>Tool calls per step</h2>" in report
            tools = report.split("<h2>Tool calls per step</h2>")[1].split("</table>")[0]
            assert tools.count("<tr>") == 1 + len(history)  # the header and one row per step
            for r in history:
                assert f">{r.step}</td>" in tools
            assert f">{failed}</td>" in tools and f">{turns}</td>" in tools
        # hf measures no prefix cache: no figure anywhere (not a 0)
        assert result.prefix_cache_hit_rate is None and "prefix cache" not in line[0] + page + report
        # a vllm step's metrics line (its rollout's prompt tokens read from the prefix cache): the same three places
        cached = StepResult.from_metrics({**result.metrics(), "prefix_cache_hit_rate": 0.875})
        assert cached.summary() == f"{line[0]}  prefix cache 88%"  # the panel's log line is the step's summary()
        assert ">prefix cache hit</th>" in step_html(cached) and ">88%</td>" in step_html(cached)
        report = write_report(tmp_path / "report.html", lab.memory, [cached]).read_text()
        tools = report.split("<h2>Tool calls per step</h2>")[1].split("</table>")[0]
        assert re.findall(r"<th[^>]*>([^<]*)</th>", tools)[-1] == "prefix cache hit"
        assert re.findall(r"<td[^>]*>([^<]*)</td>", tools)[-1] == "88%"
    finally:
        lab.close()


def test_a_run_without_tools_has_no_tool_figures(loaded_lab, tmp_path):
    from grpo_lab.algo.containers import StepResult
    from grpo_lab.memory.report import write_report
    from grpo_lab.ui.reprs import step_html

    lab = loaded_lab()
    try:
        result = lab.step()
        assert result.tool_calls_per_row is None and "tools" not in result.summary()
        assert "tool calls/row" not in step_html(result)
        report = write_report(tmp_path / "r.html", lab.memory, lab.history).read_text()
        assert "Tool calls per step" not in report and "prefix cache" not in report.lower()
        # vllm without tools measures its prefix cache too (a group's rows share their prompt): a table of it alone
        cached = StepResult.from_metrics({**result.metrics(), "step": result.step + 1, "prefix_cache_hit_rate": 0.5})
        assert cached.summary().endswith("  prefix cache 50%") and "tools" not in cached.summary()
        page = step_html(cached)
        assert ">prefix cache hit</th>" in page and ">50%</td>" in page and "tool calls/row" not in page
        report = write_report(tmp_path / "r.html", lab.memory, lab.history + [cached]).read_text()
        table = report.split("<h2>Prefix cache hits per step</h2>")[1].split("</table>")[0]
        assert re.findall(r"<th[^>]*>([^<]*)</th>", table) == ["step", "prefix cache hit"]
        assert re.findall(r"<td[^>]*>([^<]*)</td>", table) == [str(cached.step), "50%"]  # hf's step: no row
    finally:
        lab.close()


def test_grpo_lab_runs_report_has_each_steps_tool_calls_and_failures(tiny_config, forced_call, tmp_path):  # noqa: F811
    """`grpo-lab run` with its tool named in the config (module:function): report.html tables the step's calls."""
    import yaml

    from grpo_lab.cli import main

    config = tiny_config(
        model={"chat_template": TEMPLATE},
        generator={"max_completion_length": 120, "max_prompt_length": 1024, "tools": ["test_tools:explode"]},
        grpo={"beta": 0.0, "num_generations": 2, "prompts_per_step": 2},
        data={"rewards": ["length"]},
    )
    (tmp_path / "tools.yaml").write_text(yaml.safe_dump(config))
    from transformers import AutoTokenizer

    forced_call(AutoTokenizer.from_pretrained(config["model"]["name_or_path"]), call_text("explode", '{"x": 1}'))
    out = tmp_path / "run"
    assert main(["run", str(tmp_path / "tools.yaml"), "--steps", "1", "--out", str(out), "--quiet", "--force"]) == 0
    report = (out / "report.html").read_text()
    tools = report.split("<h2>Tool calls per step</h2>")[1].split("</table>")[0]
    heads = re.findall(r"<th[^>]*>([^<]*)</th>", tools)
    rows = [re.findall(r"<td[^>]*>([^<]*)</td>", row) for row in tools.split("<tr>")[2:]]
    assert heads == ["step", "tool calls/row", "failed/row", "failed %", "turns/row"], heads
    assert len(rows) == 1 and rows[0][:4] == ["0", "1.00", "1.00", "100%"], rows  # each row's one call failed
