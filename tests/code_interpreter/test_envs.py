"""Env vars: the sandbox's own (envd ``GET /envs``, asked with the request's access token)
in every context, and per-execution ones that last one cell and then give way to the
sandbox's value again."""
from __future__ import annotations

import httpx

from .conftest import SANDBOX_ENV


def test_sandbox_env_vars_in_every_context(sbx):
    assert sbx.run_code("import os; os.getenv('SBX_VAR')").text == "from-the-sandbox"
    assert sbx.run_code("import os; print(os.environ['QUOTED'])").logs.stdout == [SANDBOX_ENV["QUOTED"] + "\n"]
    ctx = sbx.create_code_context()
    assert sbx.run_code("import os; os.getenv('SBX_VAR')", context=ctx).text == "from-the-sandbox"
    assert sbx.run_code("process.env.SBX_VAR", language="javascript").text == "from-the-sandbox"
    assert "".join(sbx.run_code("echo $SBX_VAR", language="bash").logs.stdout) == "from-the-sandbox\n"


def test_per_execution_env_vars_last_one_cell(sbx):
    assert sbx.run_code("import os; os.getenv('FOO')", envs={"FOO": "bar"}).text == "bar"
    assert sbx.run_code("import os; os.getenv('FOO', 'default')").text == "default"
    assert sbx.run_code("import os; os.getenv('SBX_VAR')", envs={"SBX_VAR": "once"}).text == "once"
    assert sbx.run_code("import os; os.getenv('SBX_VAR')").text == "from-the-sandbox"
    tricky = "it's \"both\" \\ quotes"
    assert sbx.run_code("import os; print(os.getenv('TRICKY'))", envs={"TRICKY": tricky}).logs.stdout == [tricky + "\n"]


def test_per_execution_env_vars_in_javascript_and_bash(sbx):
    assert sbx.run_code("process.env.FOO", language="javascript", envs={"FOO": "js"}).text == "js"
    assert sbx.run_code("String(process.env.FOO)", language="javascript").text == "undefined"
    out = sbx.run_code('echo "[$FOO]"', language="bash", envs={"FOO": "a b"}).logs.stdout
    assert out == ["[a b]\n"]
    assert sbx.run_code('echo "[$FOO]"', language="bash").logs.stdout == ["[]\n"]


def test_the_access_token_goes_to_envd(server, envd_stub):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        ctx = client.post("/contexts", json={}).json()
        client.post("/execute", json={"code": "1", "context_id": ctx["id"]}, headers={"X-Access-Token": "tok-1"})
    assert "tok-1" in envd_stub.tokens
