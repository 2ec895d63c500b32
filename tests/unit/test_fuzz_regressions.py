"""Regressions of what the fuzz tests (test_fuzz_hostile.py, test_fuzz_stateful.py) found, each on
the in-process app: fast, and failing without its fix."""
import base64

import pytest

pytestmark = pytest.mark.django_db(transaction=True)

DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("path", ["/v2/sandboxes", "/volumes", "/secrets", "/v3/templates"])
async def test_deeply_nested_json_body_is_400(api, assert_error, path):
    """Was a 500: DRF turned only ValueError into a parse error, and json raised RecursionError."""
    assert_error(await api.post(path, content=DEEP, headers={"Content-Type": "application/json"}), 400)


async def test_deeply_nested_page_tokens_are_400(api, assert_error):
    """The same RecursionError from an opaque token's JSON: nextToken and the logs' cursor."""
    token = base64.urlsafe_b64encode(b"[" * 5000 + b"]" * 5000).decode().rstrip("=")
    assert_error(await api.get("/v2/sandboxes", params={"nextToken": token}), 400)


@pytest.mark.parametrize("steps", [[None], [[]], [1], ["RUN"]])
async def test_build_steps_that_are_not_objects_are_400(api, assert_error, steps):
    """Was a 500 (an item of ``steps`` that is not an object reached the step serializer's
    ``to_internal_value``)."""
    made = await api.post("/v3/templates", json={"name": "fuzz-steps", "cpuCount": 1, "memoryMB": 512})
    assert made.status_code == 202, made.text
    body = made.json()
    assert_error(await api.post(f"/v2/templates/{body['templateID']}/builds/{body['buildID']}",
                                json={"fromTemplate": "base", "steps": steps}), 400)


@pytest.mark.parametrize("body", [
    b'{"templateID": "base", "metadata": {"\\u0000": "x"}}',
    b'{"templateID": "base", "envVars": {"A\\u0000B": "x"}}',
    b'{"templateID": "base", "envVars": {"\\ud800": "x"}}',
    b'{"templateID": "base", "network": {"maskRequestHost": "\\u0000"}}',
    b'{"templateID": "base", "volumeMounts": [{"name": "\\udfff", "path": "/mnt"}]}',
])
async def test_nul_and_surrogates_in_keys_and_json_fields_are_400(api, nodes_mock, assert_error, body):
    """Were accepted (201) on SQLite and a 500 on PostgreSQL (NUL in jsonb): DRF's CharField
    refuses them in values, not in a dict's keys or inside JSON fields."""
    assert_error(await api.post("/v2/sandboxes", content=body, headers={"Content-Type": "application/json"}),
                 400, "NUL or unpaired surrogates")
    nodes_mock.client.boot_sandbox.assert_not_called()


@pytest.mark.parametrize("env", [{"A=B": "x"}, {"": "x"}, {"=": ""}])
async def test_env_var_names_a_process_cannot_hold_are_400(api, nodes_mock, assert_error, env):
    """Were accepted: ``A=B`` reached the guest as variable ``A`` with value ``B=x``."""
    assert_error(await api.post("/v2/sandboxes", json={"templateID": "base", "envVars": env}), 400, "envVars")
    nodes_mock.client.boot_sandbox.assert_not_called()


@pytest.mark.parametrize("query", [
    "/sandboxes/{id}/logs?start=562949953421311", "/sandboxes/{id}/logs?start=9223372036854775808",
    "/v2/sandboxes/{id}/logs?cursor=1624858945359485075456", "/sandboxes/{id}/metrics?start=874698957585",
    "/sandboxes/{id}/metrics?start=1&end=2408819529047206990446592",
])
async def test_timestamps_past_year_9999_are_400(api, assert_error, query):
    """Were 500s (found by the long stateful walk): a start, end or cursor past what a date
    can say overflowed datetime. (The query is checked before the sandbox is looked up.)"""
    assert_error(await api.get(query.format(id="inope")), 400)


async def test_build_log_offsets_and_cursors_past_the_bounds_are_400(api, assert_error):
    made = (await api.post("/v3/templates", json={"name": "fuzz-bounds", "cpuCount": 1, "memoryMB": 512})).json()
    base = f"/templates/{made['templateID']}/builds/{made['buildID']}"
    assert_error(await api.get(f"{base}/status", params={"logsOffset": 2**63}), 400)
    assert_error(await api.get(f"{base}/logs", params={"cursor": 2**63}), 400)
