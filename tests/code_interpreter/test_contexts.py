"""Contexts through the SDK: isolation, listing, cwd, restart, remove; the JavaScript
(our Node.js kernel) and bash contexts; languages this sandbox does not have."""
from __future__ import annotations

import pytest
from e2b import NotFoundException, SandboxException
from e2b_code_interpreter import Context


def test_a_second_context_is_isolated_and_listed_last(sbx):
    sbx.run_code("isolated = 1")
    ctx = sbx.create_code_context()
    execution = sbx.run_code("isolated", context=ctx)
    assert execution.error.name == "NameError"
    listed = sbx.list_code_contexts()
    assert listed[-1].id == ctx.id
    assert (listed[-1].language, listed[-1].cwd) == ("python", ctx.cwd)
    assert {"python", "javascript"} <= {c.language for c in listed}
    assert [c.language for c in listed[:2]] == ["python", "javascript"]  # the defaults, made at start


def test_default_cwd_and_an_explicit_one(sbx, server, tmp_path):
    assert sbx.run_code("import os; os.getcwd()").text == str(server.cwd)
    ctx = sbx.create_code_context(cwd=str(tmp_path))
    assert ctx.cwd == str(tmp_path)
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == str(tmp_path)


def test_restart_clears_state_and_keeps_the_id_and_cwd(sbx, tmp_path):
    ctx = sbx.create_code_context(cwd=str(tmp_path))
    sbx.run_code("x = 5", context=ctx)
    sbx.restart_code_context(ctx)
    execution = sbx.run_code("x", context=ctx)
    assert execution.error.name == "NameError" and "'x' is not defined" in execution.error.value
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == str(tmp_path)
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]


def test_remove_then_use_is_not_found(sbx):
    ctx = sbx.create_code_context()
    sbx.remove_code_context(ctx.id)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
    with pytest.raises(NotFoundException):
        sbx.run_code("1", context=ctx)
    with pytest.raises(NotFoundException):
        sbx.restart_code_context(ctx)
    with pytest.raises(NotFoundException):
        sbx.remove_code_context(ctx)


def test_unknown_context_and_unknown_language(sbx):
    with pytest.raises(NotFoundException):
        sbx.run_code("1", context=Context("nope", "python", "/"))
    with pytest.raises(SandboxException, match="500.*cobol"):
        sbx.run_code("1", language="cobol")
    with pytest.raises(SandboxException, match="500"):
        sbx.create_code_context(language="cobol")


def test_javascript(sbx):
    execution = sbx.run_code("console.log('hi')", language="javascript")
    assert execution.logs.stdout == ["hi\n"] and execution.results == [] and execution.error is None
    assert sbx.run_code("1 + 1", language="js").text == "2"
    sbx.run_code("var kept = 40", language="JavaScript")
    assert sbx.run_code("kept + 2", language="javascript").text == "42"
    assert sbx.run_code("await new Promise((r) => setTimeout(() => r('later'), 50))",
                        language="javascript").text == "later"
    assert sbx.run_code("process.cwd()", language="javascript").text == sbx.run_code("import os; os.getcwd()").text
    failed = sbx.run_code("console.error('oops'); throw new TypeError('bad')", language="javascript")
    assert failed.logs.stderr == ["oops\n"]
    assert (failed.error.name, failed.error.value) == ("TypeError", "bad")
    assert "cell-" in failed.error.traceback and "driver.js" not in failed.error.traceback


def test_javascript_context_of_its_own(sbx):
    ctx = sbx.create_code_context(language="js")
    assert ctx.language == "javascript"
    sbx.run_code("var only = 1", context=ctx)
    assert sbx.run_code("typeof only", context=ctx).text == "number"
    assert sbx.run_code("typeof only", language="javascript").text == "undefined"


def test_bash(sbx, server):
    execution = sbx.run_code("echo hello; pwd", language="bash")
    assert execution.logs.stdout == ["hello\n", f"{server.cwd}\n"] and execution.error is None
    failed = sbx.run_code("ls /nonexistent-dir", language="bash")
    assert "No such file" in "".join(failed.logs.stdout)
    assert (failed.error.name, failed.error.value) == ("Error", "2")  # bash_kernel: the exit status
    sbx.run_code("KEPT=abc", language="bash")
    assert "".join(sbx.run_code("echo $KEPT", language="bash").logs.stdout) == "abc\n"
