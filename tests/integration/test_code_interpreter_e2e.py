"""The unchanged ``e2b-code-interpreter`` SDK against the live stack and real VMs: the
``code-interpreter-v1`` template (built by aenv's builder in the session's stack: every
step comes from the node's layer cache once it was built on this machine) is the SDK's
default template; its server answers on guest port 49999 through the data plane.

One sandbox serves most tests (CI time); forks continue from its kernels' state."""
from __future__ import annotations

import base64
import time

import httpx
import pytest
from e2b import TimeoutException
from e2b_code_interpreter import Sandbox

pytestmark = [pytest.mark.vm, pytest.mark.timeout(5400)]

TEMPLATE = "code-interpreter-v1"


@pytest.fixture(scope="module")
def template(stack):
    """The template, built or found up to date (``manage.py ensure_system_templates``)."""
    t0 = time.monotonic()
    out = stack.manage("ensure_system_templates", timeout=5400)
    print(f"ensure_system_templates: {time.monotonic() - t0:.1f}s\n{out[-3000:]}")
    return TEMPLATE


@pytest.fixture(scope="module")
def sbx(template, stack):
    mp = pytest.MonkeyPatch()
    mp.setenv("E2B_API_URL", stack.api_url)
    mp.setenv("E2B_SANDBOX_URL", stack.sandbox_url)
    mp.setenv("E2B_API_KEY", stack.api_key)
    mp.delenv("E2B_DEBUG", raising=False)
    t0 = time.monotonic()
    sandbox = Sandbox.create(envs={"SBX_VAR": "from-create"}, timeout=1800)  # the SDK's default template
    print(f"create: {time.monotonic() - t0:.2f}s")
    yield sandbox
    sandbox.kill()
    mp.undo()


def test_default_template_and_arithmetic(sbx):
    info = sbx.get_info()
    assert info.template_id == TEMPLATE or info.name == TEMPLATE
    t0 = time.monotonic()
    execution = sbx.run_code("x = 1; x + 1")
    first_ms = (time.monotonic() - t0) * 1000
    assert execution.text == "2" and execution.error is None
    assert execution.execution_count == 1  # a fresh sandbox: the template's kernel ran nothing visible
    print(f"first run_code: {first_ms:.0f} ms")


def test_print_streams_before_the_call_returns(sbx):
    seen: list = []
    execution = sbx.run_code('print("a"); import time; time.sleep(2); print("b")',
                             on_stdout=lambda m: seen.append((m.line, time.monotonic())))
    returned = time.monotonic()
    assert [line for line, _ in seen] == ["a\n", "b\n"]
    assert returned - seen[0][1] >= 1.5
    assert execution.logs.stdout == ["a\n", "b\n"]


def test_exception_with_traceback(sbx):
    execution = sbx.run_code('print("pre"); 1/0')
    assert (execution.error.name, execution.error.value) == ("ZeroDivisionError", "division by zero")
    assert "ZeroDivisionError" in execution.error.traceback
    assert execution.logs.stdout == ["pre\n"]


def test_matplotlib_chart_is_a_png(sbx):
    execution = sbx.run_code("""
import matplotlib.pyplot as plt
plt.bar(["A", "B", "C"], [3, 1, 2]); plt.title("sales")
plt.show()
""")
    assert execution.error is None
    [result] = execution.results
    assert base64.b64decode(result.png).startswith(b"\x89PNG")
    assert result.chart is not None and result.chart.title == "sales"


def test_pandas_dataframe_and_numpy(sbx):
    execution = sbx.run_code("import pandas as pd, numpy as np; pd.DataFrame({'a': np.arange(3)})")
    result = execution.results[0]
    assert result.data == {"a": [0, 1, 2]} and "<table" in result.html


def test_variables_kept_and_a_separate_context_isolated(sbx):
    sbx.run_code("kept = 41")
    assert sbx.run_code("kept + 1").text == "42"
    ctx = sbx.create_code_context()
    assert sbx.run_code("kept", context=ctx).error.name == "NameError"
    assert sbx.list_code_contexts()[-1].id == ctx.id
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "/home/user"


def test_timeout_interrupts_the_kernel_and_state_survives(sbx):
    sbx.run_code("before_timeout = 'alive'")
    with pytest.raises(TimeoutException):
        sbx.run_code("import time; time.sleep(300)", timeout=3)
    t0 = time.monotonic()
    assert sbx.run_code("1 + 1", timeout=20).text == "2"
    assert time.monotonic() - t0 < 15  # interrupted, not waited out
    assert sbx.run_code("before_timeout").text == "alive"


def test_env_vars(sbx):
    assert sbx.run_code("import os; os.getenv('SBX_VAR')").text == "from-create"
    assert sbx.run_code("import os; os.getenv('FOO')", envs={"FOO": "bar"}).text == "bar"
    assert sbx.run_code("import os; os.getenv('FOO', 'default')").text == "default"
    assert sbx.run_code("import os; os.getenv('SBX_VAR')", envs={"SBX_VAR": "once"}).text == "once"
    assert sbx.run_code("import os; os.getenv('SBX_VAR')").text == "from-create"


def test_javascript_and_bash(sbx):
    assert sbx.run_code("console.log('hi')", language="javascript").logs.stdout == ["hi\n"]
    assert sbx.run_code("1 + 1", language="js").text == "2"
    assert sbx.run_code("process.env.SBX_VAR", language="javascript").text == "from-create"
    assert sbx.run_code("echo $((6 * 7)); whoami", language="bash").logs.stdout == ["42\n", "root\n"]


def test_commands_and_files_still_work(sbx):
    assert sbx.commands.run("python3 -c 'print(3 * 3)'").stdout.strip() == "9"
    sbx.run_code("open('/home/user/from_kernel.txt', 'w').write('written by a cell')")
    assert sbx.files.read("/home/user/from_kernel.txt") == "written by a cell"


PYC_CHECK = """
import importlib.util, os, sys, sysconfig
site = sysconfig.get_paths()["purelib"]
total = stale = 0
for package in ("numpy", "pandas", "matplotlib", "ipykernel"):
    for dirpath, dirnames, filenames in os.walk(os.path.join(site, package)):
        dirnames[:] = [d for d in dirnames if d not in ("tests", "test")]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            source = os.path.join(dirpath, name)
            try:
                with open(importlib.util.cache_from_source(source), "rb") as f:
                    header = f.read(16)
            except FileNotFoundError:
                stale += 1
                continue
            st = os.stat(source)
            total += 1
            flags = int.from_bytes(header[4:8], "little")
            if flags == 0 and header[8:16] != ((int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
                                               + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")):
                stale += 1
print(total, stale)
"""


def test_the_venv_is_byte_compiled_for_the_guest(sbx):
    """Every module of the big packages has a .pyc (made on the host where it can, else in
    the build VM) that the guest's python takes as current: no import compiles again."""
    sbx.files.write("/tmp/pyc_check.py", PYC_CHECK)
    total, stale = map(int, sbx.commands.run("/opt/code-interpreter/venv/bin/python /tmp/pyc_check.py").stdout.split())
    assert total > 500 and stale == 0, (total, stale)


def test_health_through_the_data_plane(sbx, stack):
    r = httpx.get(f"{stack.sandbox_url}/health", headers={"E2b-Sandbox-Id": sbx.sandbox_id,
                                                           "E2b-Sandbox-Port": "49999"}, timeout=30)
    assert (r.status_code, r.json()) == (200, "OK")


def test_forks_continue_from_the_parents_kernels(sbx):
    sbx.run_code("state = [1, 2, 3]")
    ctx = sbx.create_code_context()
    sbx.run_code("z = 7", context=ctx)
    sbx.run_code("var jsState = 'js-parent'", language="javascript")
    children = sbx.fork(count=2, timeout=600)
    try:
        assert all(isinstance(c, Sandbox) for c in children), children
        a, b = children
        assert a.run_code("sum(state)").text == "6"
        assert a.run_code("z", context=ctx).text == "7"
        assert a.run_code("jsState", language="javascript").text == "js-parent"
        assert ctx.id in [c.id for c in a.list_code_contexts()]
        a.run_code("state.append(4)")
        assert a.run_code("len(state)").text == "4"
        assert b.run_code("len(state)").text == "3"  # siblings do not share memory
        assert sbx.run_code("len(state)").text == "3"  # nor the parent
        with pytest.raises(TimeoutException):
            b.run_code("import time; time.sleep(300)", timeout=3)
        assert b.run_code("sum(state)", timeout=20).text == "6"
    finally:
        for c in children:
            if isinstance(c, Sandbox):
                c.kill()
