"""``run_code`` in Python through the unchanged SDK: values, streaming, errors with
tracebacks, rich results (matplotlib PNG and chart, JSON, PIL), execution counts."""
from __future__ import annotations

import base64
import time

from e2b_code_interpreter.charts import BarChart, SuperChart


def test_arithmetic_in_a_fresh_context(sbx):
    ctx = sbx.create_code_context()
    execution = sbx.run_code("x = 1; x + 1", context=ctx)
    assert execution.text == "2"
    assert execution.error is None
    assert [r.is_main_result for r in execution.results] == [True]
    assert execution.execution_count == 1
    assert sbx.run_code("x", context=ctx).execution_count == 2  # silent setup cells are not counted


def test_stdout_streams_before_the_call_returns(sbx):
    seen: list = []
    t0 = time.monotonic()
    execution = sbx.run_code('print("a"); import time; time.sleep(2); print("b")',
                             on_stdout=lambda m: seen.append((m.line, time.monotonic())))
    returned = time.monotonic()
    assert [line for line, _ in seen] == ["a\n", "b\n"]
    assert returned - seen[0][1] >= 1.5, (seen, t0, returned)
    assert execution.logs.stdout == ["a\n", "b\n"]


def test_stderr_and_its_callback(sbx):
    calls: list = []
    execution = sbx.run_code("import sys; print(1, file=sys.stderr)", on_stderr=calls.append)
    assert execution.logs.stderr == ["1\n"]
    assert [c.line for c in calls] == ["1\n"] and calls[0].error is True and calls[0].timestamp


def test_exception_with_traceback(sbx):
    errors: list = []
    execution = sbx.run_code('print("pre"); 1/0', on_error=errors.append)
    assert execution.error.name == "ZeroDivisionError"
    assert execution.error.value == "division by zero"
    assert "ZeroDivisionError" in execution.error.traceback and "1/0" in execution.error.traceback
    assert "\x1b[" not in execution.error.traceback  # no terminal colours
    assert len(errors) == 1
    assert execution.logs.stdout == ["pre\n"]
    assert execution.results == []


def test_string_result_loses_its_quotes_and_indented_code_runs(sbx):
    assert sbx.run_code("'bar'").text == "bar"
    assert sbx.run_code("""
        a = 20
        a + 1
    """).text == "21"


def test_matplotlib_figure_is_a_png_and_a_chart(sbx):
    execution = sbx.run_code("""
import matplotlib.pyplot as plt
fig, ax = plt.subplots()
ax.bar(["A", "B", "C", "D"], [100, 200, 300, 400], label="Books Sold", color="blue")
ax.set_xlabel("Authors"); ax.set_ylabel("Number of Books Sold"); ax.set_title("Book Sales by Authors")
plt.show()
""")
    assert execution.error is None
    [result] = execution.results
    assert result.is_main_result is False
    assert base64.b64decode(result.png).startswith(b"\x89PNG")
    assert result.text.startswith("<Figure")
    assert not result.extra
    chart = result.chart
    assert isinstance(chart, BarChart)
    assert chart.title == "Book Sales by Authors"
    assert (chart.x_label, chart.y_label) == ("Authors", "Number of Books Sold")
    assert [e.value for e in chart.elements] == [100, 200, 300, 400]
    assert {e.group for e in chart.elements} == {"Books Sold"}
    assert '"png"' in execution.to_json()


def test_two_subplots_are_a_superchart(sbx):
    execution = sbx.run_code("""
import matplotlib.pyplot as plt
fig, (a, b) = plt.subplots(1, 2)
a.plot([1, 2, 3], [1, 4, 9]); b.bar(["x", "y"], [3, 4]); fig.suptitle("two")
plt.show()
""")
    chart = execution.results[0].chart
    assert isinstance(chart, SuperChart) and chart.title == "two" and len(chart.elements) == 2


def test_dict_result_is_json_and_display_data_is_not_main(sbx):
    assert sbx.run_code("{'a': 1, 'b': [1, 2]}").results[0].json == {"a": 1, "b": [1, 2]}
    execution = sbx.run_code("from IPython.display import display, HTML; display(HTML('<b>hi</b>')); 7")
    html, main = execution.results
    assert (html.html, html.is_main_result) == ("<b>hi</b>", False)
    assert (main.text, main.is_main_result) == ("7", True)


def test_dataframe_is_data_and_html(sbx):
    execution = sbx.run_code("""
import pandas as pd
pd.DataFrame({"n": [1, 2], "when": pd.to_datetime(["2024-01-01", "2024-01-02"]), "s": ["a", None]})
""")
    [result] = execution.results
    assert result.is_main_result and "<table" in result.html
    assert result.data["n"] == [1, 2] and result.data["s"] == ["a", None]
    assert [w[:10] for w in result.data["when"]] == ["2024-01-01", "2024-01-02"]


def test_pil_image_show_gives_a_png(sbx):
    execution = sbx.run_code("from PIL import Image; Image.new('RGB', (8, 8), 'red').show()")
    assert execution.error is None
    assert base64.b64decode(execution.results[0].png).startswith(b"\x89PNG")


def test_state_is_kept_and_counts_grow(sbx):
    first = sbx.run_code("kept = 41")
    second = sbx.run_code("kept + 1")
    assert second.text == "42"
    assert second.execution_count == first.execution_count + 1


def test_non_ascii_and_line_separators_arrive_intact(sbx):
    execution = sbx.run_code(r'print("zürich \u2028 next \u2029 end"); "日本"')
    assert execution.logs.stdout == ["zürich \u2028 next \u2029 end\n"]
    assert execution.text == "日本"


def test_a_megabyte_of_output_arrives_whole(sbx):
    execution = sbx.run_code('print("x" * 1_000_000)')
    assert "".join(execution.logs.stdout) == "x" * 1_000_000 + "\n"
