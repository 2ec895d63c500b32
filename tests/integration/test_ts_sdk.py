"""End to end with real VMs: the official E2B TypeScript SDK (npm `e2b`, newest 2.x,
installed at test time into var/node/e2b-ts/ by scripts/setup_ts_sdk.sh) drives the
stack from Node's own test runner. The tests are the ESM files in tests/ts/; this module
runs them against the shared `stack` and requires that node reported passes and no
failures. tests/ts/template.test.mjs (template builds) runs on its own, given the
session's local-registry image (`app_image`, conftest.py) in AENV_TEST_IMAGE."""
import os
import re
import shutil
import subprocess
import time

import httpx
import pytest

from harness.stack import ROOT

pytestmark = pytest.mark.vm

TS_DIR = ROOT / "tests" / "ts"
SDK_DIR = ROOT / "var" / "node" / "e2b-ts"
NODE_TIMEOUT = 900  # s; the suite takes a few minutes under TCG on 2 cores
TEMPLATE_TESTS = "template.test.mjs"  # run on its own, with the registry image and a longer timeout
TEMPLATE_TIMEOUT = 1800  # s; four builds of about a minute each, and their sandboxes

# node's end-of-run summary: "ℹ pass 12" (spec reporter) or "# pass 12" (TAP)
SUMMARY = re.compile(r"^\s*(?:ℹ|#)\s*(tests|pass|fail|cancelled|skipped|todo)\s+(\d+)\s*$", re.MULTILINE)


def _sandbox_ids(stack) -> set[str]:
    """Every sandbox of the stack's team, running or paused (all pages)."""
    ids, token = set(), None
    while True:
        params = {"limit": 100, **({"nextToken": token} if token else {})}
        resp = httpx.get(f"{stack.api_url}/v2/sandboxes", params=params, headers=stack.headers(), timeout=30)
        resp.raise_for_status()
        ids |= {s["sandboxID"] for s in resp.json()}
        token = resp.headers.get("x-next-token")
        if not token:
            return ids


def _node_version(node: str) -> tuple[int, ...]:
    out = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout
    return tuple(int(x) for x in re.findall(r"\d+", out)[:3])


@pytest.fixture(scope="module")
def node():
    """Node.js with the TypeScript SDK installed (scripts/setup_ts_sdk.sh, idempotent)."""
    path = shutil.which("node")
    if path is None:
        pytest.skip("node is not installed (scripts/setup_ts_sdk.sh installs it with apt-get)")
    # returns at once when a satisfying e2b is already installed
    setup = subprocess.run([str(ROOT / "scripts" / "setup_ts_sdk.sh")], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "AENV_TS_SDK_DIR": str(SDK_DIR)}, timeout=600)
    assert setup.returncode == 0, f"scripts/setup_ts_sdk.sh failed:\n{setup.stdout}\n{setup.stderr}"
    return path


def _run_node_tests(node: str, stack, files: list[str], timeout: int, **extra_env) -> dict[str, int]:
    """Runs `files` under `node --test` against the stack; asserts node reported passes and
    no failures, and that the files killed every sandbox they created. The counts."""
    argv = [node, "--test", "--test-reporter=spec"]
    if _node_version(node) >= (20, 10):
        argv.append("--test-concurrency=1")  # one file at a time: few VMs at once on a small host
    argv += files

    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update(
        E2B_API_URL=stack.api_url,
        E2B_SANDBOX_URL=stack.sandbox_url,
        E2B_API_KEY=stack.api_key,
        AENV_E2B_TS_DIR=str(SDK_DIR),  # tests/ts/helpers.mjs imports the SDK from here
        NO_COLOR="1",
        **extra_env,
    )
    before = _sandbox_ids(stack)
    started = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        pytest.fail(f"node --test did not finish in {timeout} s:\n{out}")
    elapsed = time.monotonic() - started
    output = proc.stdout + ("\n[stderr]\n" + proc.stderr if proc.stderr.strip() else "")
    print(f"\n$ {' '.join(argv)}\n{output}\nTS SDK tests: exit {proc.returncode} in {elapsed:.1f} s")

    counts = {k: int(v) for k, v in SUMMARY.findall(proc.stdout)}
    assert {"pass", "fail"} <= counts.keys(), f"no summary from node --test:\n{output}"
    assert counts["fail"] == 0, f"{counts['fail']} TypeScript SDK test(s) failed:\n{output}"
    assert counts.get("cancelled", 0) == 0, f"{counts['cancelled']} TypeScript SDK test(s) cancelled:\n{output}"
    assert counts["pass"] > 0, f"node reported no passed tests:\n{output}"
    assert proc.returncode == 0, f"node --test exited with {proc.returncode}:\n{output}"
    # the files' after hooks killed every sandbox they created
    left = _sandbox_ids(stack) - before
    assert not left, f"the TypeScript tests left sandboxes behind: {sorted(left)}"
    return counts


def _template_ids(stack) -> set[str]:
    resp = httpx.get(f"{stack.api_url}/templates", headers=stack.headers(), timeout=30)
    resp.raise_for_status()
    return {t["templateID"] for t in resp.json()}


@pytest.mark.timeout(NODE_TIMEOUT + 300)
def test_typescript_sdk_suite(node, stack, tls_ingress):
    files = sorted(str(p.relative_to(ROOT)) for p in TS_DIR.glob("*.test.mjs") if p.name != TEMPLATE_TESTS)
    assert files, f"no *.test.mjs files in {TS_DIR}"
    # host routing (tests/ts/killed.test.mjs): the TLS terminator as the SDK's proxy, its CA trusted
    counts = _run_node_tests(node, stack, files, NODE_TIMEOUT, AENV_TEST_INGRESS_PROXY=tls_ingress.connect_url,
                             NODE_EXTRA_CA_CERTS=str(tls_ingress.ca_file))
    assert counts.get("skipped", 0) == 0, f"{counts['skipped']} TypeScript test(s) skipped"


@pytest.mark.timeout(TEMPLATE_TIMEOUT + 300)
def test_typescript_sdk_template_builds(node, stack, app_image):
    """tests/ts/template.test.mjs on its own (builds take minutes under TCG), from the
    session's registry image; it must skip nothing and delete the templates it built."""
    before = _template_ids(stack)
    counts = _run_node_tests(node, stack, [str((TS_DIR / TEMPLATE_TESTS).relative_to(ROOT))], TEMPLATE_TIMEOUT,
                             AENV_TEST_IMAGE=app_image.ref)
    assert counts.get("skipped", 0) == 0, f"{counts['skipped']} template test(s) skipped"
    left = _template_ids(stack) - before
    assert not left, f"the TypeScript template tests left templates behind: {sorted(left)}"
