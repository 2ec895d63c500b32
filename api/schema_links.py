"""OpenAPI links in the served schema: which answer's id feeds which operation.

Why: a client reading the schema (and schemathesis' stateful fuzzing, tests/unit/test_fuzz_stateful.py)
learns how calls chain: a sandbox made by create, connect, resume or fork is the one that get,
pause, connect, snapshot, fork, kill, network, timeout and refresh take; a snapshot's id is a
template to create from; a volume's, a secret's and a template build's ids are their routes'.
A drf-spectacular postprocessing hook, so the links follow the generated paths (an operation
that is not served gets no link to it)."""
from __future__ import annotations

SANDBOX = "$response.body#/sandboxID"
FORKED = "$response.body#/0/sandbox/sandboxID"  # POST /sandboxes/{id}/fork answers a list
SNAPSHOT = "$response.body#/snapshotID"
VOLUME = "$response.body#/volumeID"
SECRET = "$response.body#/secretID"

# Operations that take a sandbox's id as {sandbox_id}.
ON_SANDBOX = (
    "sandbox_get", "sandbox_pause", "sandbox_connect", "sandbox_connect_v2", "sandbox_resume",
    "sandbox_snapshot_create", "sandbox_fork", "sandbox_update_network", "sandbox_set_timeout",
    "sandbox_refresh", "sandbox_logs", "sandbox_logs_v2", "sandbox_metrics", "events_sandbox", "sandbox_kill",
)
ON_SNAPSHOT = ("snapshot_get", "template_get", "snapshot_delete")
ON_VOLUME = ("volume_get", "volume_delete")
ON_SECRET = ("secret_get", "secret_update", "secret_versions", "secret_delete")

# (operation, status) → [(link name, target operation, parameters, request body or None)]
def _sandbox_links(expr: str) -> list:
    return [(f"{target}", target, {"sandbox_id": expr}, None) for target in ON_SANDBOX]


LINKS: dict[tuple[str, str], list] = {
    ("sandboxes_create_v2", "201"): _sandbox_links(SANDBOX),
    ("sandboxes_create_v1", "201"): _sandbox_links(SANDBOX),
    ("sandbox_connect", "200"): _sandbox_links(SANDBOX),
    ("sandbox_connect", "201"): _sandbox_links(SANDBOX),
    ("sandbox_connect_v2", "200"): _sandbox_links(SANDBOX),
    ("sandbox_connect_v2", "201"): _sandbox_links(SANDBOX),
    ("sandbox_resume", "201"): _sandbox_links(SANDBOX),
    ("sandbox_fork", "201"): _sandbox_links(FORKED),
    ("sandbox_snapshot_create", "201"): [
        *[(target, target, {"snapshot_id" if target.startswith("snapshot") else "template_id": SNAPSHOT}, None)
          for target in ON_SNAPSHOT],
        # a snapshot is a template: a sandbox made from it
        ("create_from_snapshot", "sandboxes_create_v2", {}, {"templateID": SNAPSHOT}),
    ],
    ("volumes_create", "201"): [(target, target, {"volume_id": VOLUME}, None) for target in ON_VOLUME],
    ("secrets_create", "201"): [(target, target, {"secret_id": SECRET}, None) for target in ON_SECRET],
    ("template_build_request_v3", "202"): [
        (target, target, {"template_id": "$response.body#/templateID", "build_id": "$response.body#/buildID"}, None)
        for target in ("template_build_start_v2", "template_build_get", "template_build_status",
                       "template_build_logs")
    ],
}


def add_links(result, generator, request, public):
    """drf-spectacular postprocessing hook: ``links`` on the answers listed in ``LINKS``."""
    operations = {}
    for item in result.get("paths", {}).values():
        for method, op in item.items():
            if isinstance(op, dict) and "operationId" in op:
                operations[op["operationId"]] = op
    for (source, status), links in LINKS.items():
        response = operations.get(source, {}).get("responses", {}).get(status)
        if response is None:
            continue
        out = response.setdefault("links", {})
        for name, target, parameters, body in links:
            if target not in operations:
                continue
            link = {"operationId": target}
            if parameters:
                link["parameters"] = dict(parameters)
            if body is not None:
                link["requestBody"] = dict(body)
            out[name] = link
    return result
