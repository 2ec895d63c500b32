"""Tiers of the test suite that must run on a test machine, and the check that they did.

Why: a test that cannot run here (no QEMU, not root, no netns, no chromium, no node, no
PostgreSQL) skips, and a skip passes. A machine missing one of those would skip a whole tier
and still report success. With ``--require-tiers`` (what ``scripts/test.sh`` passes to a run
the caller did not narrow with arguments), any skipped test of a tier below fails the run, with
one line per tier: ``tier 'vm' ran 0 of 141 tests: 141 skipped (qemu-system-x86_64 not
installed: 141)``.

A test belongs to a tier by its ``vm`` mark, its file or directory, or (``postgres``) by the run's
database; a test can be in several. Skips a machine of the CI kind may genuinely have (no IPv6,
a filesystem without user xattrs, tests that refuse to run as root) are listed in
``ALLOWED_SKIPS`` and never fail the check. ``AENV_TEST_ALLOW_SKIP_TIERS=vm,browser`` (comma
separated tier names) lets those tiers skip on a machine that cannot run them; they are still
reported. CI does not set it (``.ci/run`` unsets it).

In pytest-xdist runs the workers tag each test's report with its tiers (``user_properties``) and
the controller, which receives every report, counts and decides."""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field

import pytest

ALLOW_ENV = "AENV_TEST_ALLOW_SKIP_TIERS"
PROPERTY = "aenv_tiers"


@dataclass(frozen=True)
class Tier:
    needs: str                       # what the machine must have: part of the failure line
    marker: str | None = None        # tests with this mark
    paths: tuple[str, ...] = ()      # test files, or directories ending in "/", relative to the rootdir
    database: str | None = None      # every test of a run on this database vendor


TIERS: dict[str, Tier] = {
    "vm": Tier("QEMU, root and the base guest image (scripts/setup.sh)", marker="vm", paths=("tests/vmm/",)),
    "network": Tier("root, nft and nsenter: the netns network backend (and its egress proxy: mitmproxy in "
                    ".venv-egress, scripts/setup.sh)",
                    paths=("tests/unit/test_vmm_slot_pool.py", "tests/unit/test_vmm_host_table.py",
                           "tests/unit/test_vmm_slots.py", "tests/unit/test_vmm_net_ingress.py",
                           "tests/unit/test_vmm_net_policy.py", "tests/unit/test_vmm_net_conntrack.py",
                           "tests/unit/test_cluster_layout.py", "tests/unit/test_pool_routes.py",
                           "tests/unit/test_vmm_net_dns.py", "tests/unit/test_vmm_host_firewall.py",
                           "tests/unit/test_vmm_net_egress.py", "tests/unit/test_vmm_net_egress_upstream.py",
                           "tests/unit/test_vmm_net_dns_servers.py", "tests/unit/test_networld_probe.py",
                           "tests/integration/test_egress_domains.py",
                           "tests/integration/test_network_e2e.py", "tests/integration/test_network_faults.py",
                           "tests/integration/test_network_with_docker.py",
                           "tests/integration/test_cluster.py")),
    "postgres": Tier("PostgreSQL on 127.0.0.1:5432 (scripts/test.sh starts it)", database="postgresql",
                     paths=("tests/integration/test_cluster.py",)),
    "browser": Tier("Debian's chromium and the xterm.js packages (scripts/setup_frontend.sh)",
                    paths=("tests/browser/",)),
    "ts-sdk": Tier("node and the npm E2B SDKs (scripts/setup_ts_sdk.sh, scripts/setup_ts_code_interpreter.sh)",
                   paths=("tests/integration/test_ts_sdk.py", "tests/code_interpreter/test_js_sdk.py",
                          "tests/unit/test_ts_sdk_api.py")),
    "old-sdk": Tier("the pre-2.51 Python SDK, e2b==2.45.1, in its own venv (scripts/test.sh installs it and sets "
                    "AENV_OLD_SDK_PYTHON)", paths=("tests/unit/test_old_sdk_calls.py",)),
    "code-interpreter": Tier("node for the JavaScript kernel and the Jupyter kernels (the test extra)",
                             paths=("tests/code_interpreter/",)),
    "envd": Tier("root and a 'user' account (envd runs commands as both)", paths=("tests/envd/",)),
    "oci": Tier("root, skopeo, umoci and docker-registry (scripts/setup.sh)",
                paths=("tests/vmm/test_oci_images.py", "tests/unit/test_oci_prepare.py")),
    "volumes": Tier("root and nfs-ganesha with rpcbind (scripts/setup.sh): the volume server and its confinement",
                    paths=("tests/unit/test_volume_server_confinement.py", "tests/unit/test_volume_limits.py")),
    "compose": Tier("Docker's engine (Debian's docker.io, which scripts/setup.sh installs and starts) and "
                    "debootstrap: deploy/compose.yaml started for real", paths=("tests/compose/",)),
    "host-tools": Tier("root and the host tools scripts/setup.sh and the test extra install (patchelf, readelf, "
                       "resize2fs, debugfs, qemu-img, busybox-static, docker-compose, systemd-analyze, shellcheck, unshare, "
                       "redis-server) "
                       "and the base image's root file system stage",
                       paths=("tests/unit/test_toolsdrive.py", "tests/unit/test_vmm_ready_made.py",
                              "tests/unit/test_deploy.py", "tests/unit/test_builder_scripts.py",
                              "tests/unit/test_shell_scripts.py", "tests/unit/test_host_venv.py",
                              "tests/unit/test_broker_acl.py", "tests/unit/test_broker_transport.py",
                              "tests/unit/test_result_store.py",
                              "tests/unit/test_task_signing.py",
                              "tests/unit/test_oci_kmods.py", "tests/unit/test_syscall_fence.py",
                              "tests/unit/test_fuzz_stateful.py")),
}

# Skips that say something about the machine no setup script changes, not about a missing
# tier: they never fail the check (reason regex -> why it is fine).
ALLOWED_SKIPS: dict[str, str] = {
    r"^runs as root here": "tests of refusing to install as a non-root user (CI runs as root)",
    r"^no IPv6$": "a machine without IPv6 on loopback",
    r"^cannot listen on \[::1\]": "a machine without IPv6 on loopback",
    r"does not support user xattrs$": "a filesystem under /home/user without user xattrs",
}


def database_vendor() -> str:
    """The run's database as Django names its vendor ("sqlite", "postgresql")."""
    try:
        from django.conf import settings  # noqa: PLC0415

        if settings.configured:
            return settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1].replace("sqlite3", "sqlite")
    except Exception:  # noqa: BLE001 - no Django here: the settings' source decides
        pass
    url = os.environ.get("DATABASE_URL", "")
    return "postgresql" if url.split(":", 1)[0] in ("postgres", "postgresql", "pgsql") else "sqlite"


def tiers_of(nodeid: str, markers: set[str], vendor: str) -> list[str]:
    path = nodeid.split("::", 1)[0]
    found = []
    for name, tier in TIERS.items():
        if ((tier.marker and tier.marker in markers) or (tier.database and tier.database == vendor)
                or any(path == p or (p.endswith("/") and path.startswith(p)) for p in tier.paths)):
            found.append(name)
    return found


def allowed(reason: str) -> bool:
    return any(re.search(pattern, reason) for pattern in ALLOWED_SKIPS)


def skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


@dataclass
class TierCount:
    ran: set = field(default_factory=set)
    skipped: dict = field(default_factory=dict)  # nodeid -> reason

    def line(self, name: str) -> str:
        total = len(self.ran | set(self.skipped))
        reasons = Counter(self.skipped.values()).most_common()
        shown = "; ".join(f"{reason}: {n}" for reason, n in reasons[:3])
        more = f"; {len(reasons) - 3} more reasons" if len(reasons) > 3 else ""
        return f"tier '{name}' ran {len(self.ran)} of {total} tests: {len(self.skipped)} skipped ({shown}{more})"


def allowed_tiers(value: str | None) -> set[str]:
    names = {n.strip() for n in (value or "").split(",") if n.strip()}
    unknown = names - set(TIERS)
    if unknown:
        raise pytest.UsageError(f"{ALLOW_ENV}: unknown tier(s) {', '.join(sorted(unknown))}; "
                                f"known: {', '.join(TIERS)}")
    return names


class TierCheck:
    """The pytest plugin: tags each test with its tiers, counts per tier what ran and what
    skipped, and (``--require-tiers``, not in an xdist worker) fails the run on a tier's skip."""

    def __init__(self, config):
        self.config = config
        self.required = config.getoption("--require-tiers")
        self.allowed = allowed_tiers(os.environ.get(ALLOW_ENV))
        self.is_worker = hasattr(config, "workerinput")
        self.counts: dict[str, TierCount] = {}
        self.failures: list[str] = []

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        vendor = database_vendor()
        for item in items:
            names = tiers_of(item.nodeid, {m.name for m in item.iter_markers()}, vendor)
            if names:
                item.user_properties.append((PROPERTY, ",".join(names)))

    def pytest_runtest_logreport(self, report):
        if self.is_worker:
            return
        names = next((v for k, v in report.user_properties if k == PROPERTY), "")
        if not names:
            return
        for name in names.split(","):
            count = self.counts.setdefault(name, TierCount())
            if report.skipped and not hasattr(report, "wasxfail"):
                reason = skip_reason(report)
                if not allowed(reason):
                    count.skipped[report.nodeid] = reason
            elif report.when == "call" or report.failed:
                count.ran.add(report.nodeid)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session):
        if self.is_worker or not self.required:
            return
        for name, count in self.counts.items():
            count.ran -= set(count.skipped)  # a test that errored in teardown after skipping still skipped
            if count.skipped and name not in self.allowed:
                self.failures.append(count.line(name) + f" — it needs {TIERS[name].needs}")
        if self.failures and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.is_worker or not self.counts:
            return
        tr = terminalreporter
        if self.required:
            tr.section("tiers that must run here")
            tr.line("tiers: " + ", ".join(f"{name} {len(c.ran)} ran" + (f" {len(c.skipped)} skipped" if c.skipped else "")
                                          for name, c in sorted(self.counts.items())))
            for line in self.failures:
                tr.line(line, red=True, bold=True)
            for name in sorted(self.allowed & {n for n, c in self.counts.items() if c.skipped}):
                tr.line(f"{self.counts[name].line(name)} — allowed by {ALLOW_ENV}", yellow=True)
        else:
            skipped = [self.counts[n].line(n) for n in sorted(self.counts) if self.counts[n].skipped]
            if skipped:
                tr.section("tiers with skipped tests (not checked: the run was narrowed)")
                for line in skipped:
                    tr.line(line, yellow=True)


def pytest_addoption(parser):
    parser.addoption("--require-tiers", action="store_true",
                     help="fail the run when a test of a tier that must run here (tests/tiers.py) skipped; "
                          "scripts/test.sh passes it unless its arguments narrowed the run")


def pytest_configure(config):
    config.pluginmanager.register(TierCheck(config), "aenv-tier-check")
