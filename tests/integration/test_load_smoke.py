"""The load generator of bench/load.py (issue 27), small: a few virtual clients of the async
SDK cycle create → commands → pause → resume → check → kill against the session's stack for
a few seconds. Every call must be ok or a clean admission refusal (503 + Retry-After): 0
unexpected errors, and at least one whole cycle."""
import asyncio

import pytest

from bench.load_client import Settings, run_clients
from bench.load_report import summarize

pytestmark = [pytest.mark.vm, pytest.mark.slow]


def test_a_few_clients_for_a_few_seconds_make_no_unexpected_error(stack):
    conn = {"api_url": stack.api_url, "sandbox_url": stack.sandbox_url, "api_key": stack.api_key,
            "request_timeout": 600.0, "retries": 0}
    rec = asyncio.run(run_clients(3, 20.0, Settings(commands=5, metadata={"bench": "load-smoke"}), conn, ramp_s=2.0))
    s = summarize(rec, 20.0)
    print(f"{s['cycles']} cycles, {s['ops_ok']} calls ok, {s['admission_refusals']} refusals")
    assert s["unexpected_errors"] == 0, {op: v["error_messages"] for op, v in s["ops"].items() if v["errors"]}
    assert s["cycles"] >= 1 and s["cleanup_failures"] == []
    assert s["ops"]["command"]["ok"] >= 5 and s["ops"]["resume"]["ok"] >= 1
