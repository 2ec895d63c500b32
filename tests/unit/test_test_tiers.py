"""The tier check (tests/tiers.py, ``--require-tiers``) and scripts/test.sh's handling of
pytest's exit status 5: pytest runs in a subprocess on tiny test files in a project of its
own (its rootdir is tmp_path, so the tier paths ``tests/browser/`` etc. match its files)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import tiers

ROOT = Path(__file__).resolve().parents[2]

FILES = {
    "tests/browser/test_page.py": """
        import pytest

        @pytest.fixture
        def chromium():
            pytest.skip("/usr/bin/chromium is not installed")

        def test_page(chromium):
            pass

        def test_other_page(chromium):
            pass
    """,
    "tests/integration/test_boot.py": """
        import pytest

        @pytest.mark.vm
        def test_boots():
            pass

        @pytest.mark.vm
        def test_needs_qemu():
            pytest.skip("qemu-system-x86_64 not installed")
    """,
    "tests/unit/test_plain.py": """
        import pytest

        def test_runs():
            pass

        def test_skips_outside_any_tier():
            pytest.skip("only PostgreSQL uses a connection pool")

        @pytest.mark.xfail(reason="known")
        def test_xfails():
            assert False
    """,
    "tests/envd/test_ipv6.py": """
        import pytest

        def test_runs():
            pass

        def test_no_ipv6_here():
            pytest.skip("no IPv6")
    """,
}


def project(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    vm: boots VMs\n")
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(line[8:] for line in text.splitlines()))
    return tmp_path


def pytest_run(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PYTEST_", "DJANGO_", tiers.ALLOW_ENV)) and k != "DATABASE_URL"}
    clean.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.tiers", "-p", "no:cacheprovider",
                           "-p", "no:django", "-q", *args], cwd=cwd, env=clean, capture_output=True, text=True,
                          timeout=120)


def test_a_skipped_tier_fails_the_run_and_names_the_tier(tmp_path):
    done = pytest_run(project(tmp_path, FILES), "--require-tiers")
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stdout.splitlines()[-1]
    assert "3 passed" in last and not re.search(r"\d+ failed", last), last  # only the tier check failed
    assert "tier 'browser' ran 0 of 2 tests: 2 skipped (/usr/bin/chromium is not installed: 2) — it needs " \
           "Debian's chromium" in done.stdout
    assert "tier 'vm' ran 1 of 2 tests: 1 skipped (qemu-system-x86_64 not installed: 1)" in done.stdout
    # a skip outside every tier, an allowed reason (no IPv6) and an xfail fail nothing
    assert not re.search(r"^tier '(envd|unit)'", done.stdout, re.MULTILINE), done.stdout
    assert re.search(r"tiers: browser 0 ran 2 skipped, envd 1 ran, vm 1 ran 1 skipped", done.stdout), done.stdout


def test_the_same_run_passes_without_require_tiers(tmp_path):
    """A narrowed run (scripts/test.sh with arguments): the skips are shown, not failed."""
    done = pytest_run(project(tmp_path, FILES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not checked: the run was narrowed" in done.stdout and "tier 'browser' ran 0 of 2" in done.stdout


def test_only_skips_outside_the_tiers_pass(tmp_path):
    files = {k: v for k, v in FILES.items() if k in ("tests/unit/test_plain.py", "tests/envd/test_ipv6.py")}
    done = pytest_run(project(tmp_path, files), "--require-tiers")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tiers: envd 1 ran" in done.stdout


def test_the_workers_of_xdist_tag_what_the_controller_counts(tmp_path):
    done = pytest_run(project(tmp_path, FILES), "--require-tiers", "-n", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "tier 'browser' ran 0 of 2 tests: 2 skipped (/usr/bin/chromium is not installed: 2)" in done.stdout
    assert "tier 'vm' ran 1 of 2 tests: 1 skipped (qemu-system-x86_64 not installed: 1)" in done.stdout
    assert "tiers: browser 0 ran 2 skipped, envd 1 ran, vm 1 ran 1 skipped" in done.stdout  # the allowed skip: none


def test_every_test_of_a_postgresql_run_is_in_the_postgres_tier(tmp_path):
    files = {"tests/unit/test_db.py": FILES["tests/unit/test_plain.py"]}
    done = pytest_run(project(tmp_path, files), "--require-tiers", DATABASE_URL="postgres://u@127.0.0.1:1/x")
    assert done.returncode == 1, done.stdout + done.stderr
    # the xfail ran too
    assert "tier 'postgres' ran 2 of 3 tests: 1 skipped (only PostgreSQL uses a connection pool: 1)" in done.stdout
    on_sqlite = pytest_run(tmp_path, "--require-tiers", DATABASE_URL="sqlite:///x.sqlite3")
    assert on_sqlite.returncode == 0, on_sqlite.stdout + on_sqlite.stderr


def test_the_allow_variable_lets_the_named_tiers_skip(tmp_path):
    project(tmp_path, FILES)
    done = pytest_run(tmp_path, "--require-tiers", **{tiers.ALLOW_ENV: "browser, vm"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tier 'browser' ran 0 of 2 tests: 2 skipped (/usr/bin/chromium is not installed: 2) — allowed by " \
           f"{tiers.ALLOW_ENV}" in done.stdout
    one = pytest_run(tmp_path, "--require-tiers", **{tiers.ALLOW_ENV: "browser"})
    assert one.returncode == 1 and "tier 'vm' ran 1 of 2" in one.stdout
    typo = pytest_run(tmp_path, "--require-tiers", **{tiers.ALLOW_ENV: "vms"})
    assert typo.returncode == 4 and "unknown tier(s) vms" in typo.stderr, typo.stdout + typo.stderr


def test_a_run_that_collects_nothing_keeps_exit_status_5(tmp_path):
    """scripts/test.sh decides whether 5 is fine (a narrowed pass) or not."""
    done = pytest_run(project(tmp_path, FILES), "--require-tiers", "-k", "no_such_test")
    assert done.returncode == 5, done.stdout + done.stderr


def test_the_tier_paths_exist():
    """A renamed test file must not silently leave its tier."""
    for name, tier in tiers.TIERS.items():
        for rel in tier.paths:
            assert (ROOT / rel).is_dir() if rel.endswith("/") else (ROOT / rel).is_file(), (name, rel)


# Test files that skip on purpose outside every tier: why the skip is not a missing tier.
OUTSIDE_THE_TIERS = {
    "tests/integration/conftest.py": "its registry fixture serves only vm-marked tests (template builds, TS SDK)",
    "tests/unit/test_api_concurrency.py": "a PostgreSQL-only test: skips on SQLite, in the postgres tier on PostgreSQL",
    "tests/unit/test_node_db_roles.py": "PostgreSQL roles: its role tests skip on SQLite and run in the postgres tier "
                                        "(the PostgreSQL pass)",
    "tests/unit/test_node_join_kubernetes.py": "its one skip is the Kubernetes join with a PostgreSQL role: it "
                                               "runs in the postgres tier (the PostgreSQL pass)",
    "tests/unit/test_deploy_k8s.py": "its one skip compares the test's kustomize renderer with kubectl's, which no "
                                     "Debian or PyPI package provides; every check of the manifests always runs",
}
SKIP_CALL = re.compile(r"pytest\.skip\(|mark\.skipif\(|importorskip\(")


def test_every_test_file_that_skips_is_in_a_tier():
    """A new "cannot run here" skip must name its tier (tests/tiers.py), or it would hide."""
    loose = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if path.name == "test_test_tiers.py" or not SKIP_CALL.search(text):
            continue
        # a conftest's fixtures skip the tests of its directory
        nodeid = rel.replace("conftest.py", "test_x.py")
        markers = {"vm"} if "pytestmark = pytest.mark.vm" in text or "pytestmark = [pytest.mark.vm" in text else set()
        if not tiers.tiers_of(nodeid, markers, "sqlite") and rel not in OUTSIDE_THE_TIERS:
            loose.append(rel)
    assert not loose, f"these files skip tests but are in no tier of tests/tiers.py: {loose}"


def test_a_conftest_skip_outside_the_tiers_would_be_found(tmp_path):
    assert tiers.tiers_of("tests/unit/test_x.py", set(), "sqlite") == []
    assert tiers.tiers_of("tests/browser/test_x.py", set(), "sqlite") == ["browser"]
    assert tiers.tiers_of("tests/vmm/test_oci_images.py::test_pull", set(), "sqlite") == ["vm", "oci"]
    assert tiers.tiers_of("tests/unit/test_x.py::t", {"vm"}, "postgresql") == ["vm", "postgres"]


# ---------------------------------------------------------------- scripts/test.sh's passes

def copied_test_sh(tmp_path: Path) -> Path:
    """scripts/test.sh alone in a directory of its own: sourced there, a broken "sourced, it
    only defines its functions" would fail at once (no setup.sh beside it) instead of
    installing and running the whole suite."""
    copy = tmp_path / "scripts" / "test.sh"
    copy.parent.mkdir()
    copy.write_text((ROOT / "scripts" / "test.sh").read_text())
    return copy


def run_pass(tmp_path: Path, narrowed: int, exit_status: int) -> tuple[int, str]:
    """scripts/test.sh's run_pass on a command that exits with `exit_status`: the run's status."""
    script = (f'source "$1"; run_pass "a pass" {narrowed} bash -c "exit {exit_status}"; '
              'run_pass "a good pass" 0 true; echo "status=$status"')
    done = subprocess.run(["bash", "-c", script, "_", str(copied_test_sh(tmp_path))], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().rpartition("=")[2]), done.stderr


@pytest.mark.parametrize(("narrowed", "exit_status", "expected"), [
    (1, 5, 0),  # the caller's arguments selected none of this pass
    (0, 5, 5),  # an un-narrowed pass (or the PostgreSQL one) that ran nothing
    (0, 0, 0),
    (1, 1, 1),
    (0, 2, 2),
])
def test_no_tests_collected_is_fine_only_for_a_narrowed_pass(tmp_path, narrowed, exit_status, expected):
    status, stderr = run_pass(tmp_path, narrowed, exit_status)
    assert status == expected
    if expected == 5:
        assert "a pass: no tests collected (exit status 5), and this pass must run tests" in stderr


def test_sourcing_test_sh_runs_nothing(tmp_path):
    done = subprocess.run(["bash", "-c", 'cd / && source "$1" && declare -F | grep -c "run_pass\\|main" && pwd',
                           "_", str(copied_test_sh(tmp_path))], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2", "/"] and "==>" not in done.stdout


def test_test_sh_requires_the_tiers_only_when_not_narrowed(tmp_path):
    """The pytest command lines test.sh would run, with its installs and passes replaced by echoes."""
    copy = copied_test_sh(tmp_path)

    def commands(*args: str) -> list[str]:
        script = ('source "$1"; shift; install_test_dependencies() { :; }; run_pass() { shift 2; echo "$*"; }; '
                  'main "$@"')
        # an AENV_HOME of its own: main writes its logs there (the real one's may be in use by a
        # scripts/test.sh whose pass runs this test)
        done = subprocess.run(["bash", "-c", script, "_", str(copy), *args], capture_output=True, text=True, timeout=30,
                              env={**os.environ, "AENV_HOME": str(tmp_path / "var")})
        assert done.returncode == 0, done.stderr
        return [line for line in done.stdout.splitlines() if "pytest" in line and not line.startswith("==>")]

    full = commands()
    assert len(full) == 3 and all("--require-tiers" in c for c in full), full
    narrowed = commands("tests/unit/test_states.py")
    assert len(narrowed) == 3 and ["--require-tiers" in c for c in narrowed] == [False, False, True], narrowed
    assert all(c.endswith("tests/unit/test_states.py") for c in narrowed[:2])


def _main_with_a_fake_pytest(tmp_path: Path, failing: str) -> subprocess.CompletedProcess:
    """test.sh's main with its installs left out and a `.venv/bin/pytest` that writes its
    arguments to the output and fails when they contain `failing`."""
    copy = copied_test_sh(tmp_path)
    fake = tmp_path / ".venv" / "bin" / "pytest"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/bash\necho "pytest $*"\n'
                    f'case "$*" in *"{failing}"*) echo "the {failing} run failed"\n'
                    f'  echo "FAILED tests/fake.py::test_in_{failing.split()[-1].strip("-")} - boom"; exit 1;; esac\n')
    fake.chmod(0o755)
    fake_mkdocs = fake.parent / "mkdocs"
    fake_mkdocs.write_text("#!/bin/sh\nexit 0\n")
    fake_mkdocs.chmod(0o755)
    script = 'source "$1"; install_test_dependencies() { :; }; main'
    return subprocess.run(["bash", "-c", script, "_", str(copy)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "AENV_HOME": str(tmp_path / "var")})


@pytest.mark.parametrize("failing", ["not vm", "--database-tests-only", "-m vm and"])
def test_a_failure_beside_the_vm_pass_fails_the_run_and_is_shown(tmp_path, failing):
    """The passes without VMs run in the background beside the VM pass: their failure must still
    fail the run, be named, and their output be shown (after the VM pass's)."""
    names = {"not vm": "tests without VMs", "--database-tests-only": "unit tests on PostgreSQL",
             "-m vm and": "tests with VMs"}
    done = _main_with_a_fake_pytest(tmp_path, failing)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"==> failed: {names[failing]} (exit status 1)" in done.stderr
    assert f"the {failing} run failed" in done.stdout
    # the failed test by name among the run's last lines (a CI page may show only the tail)
    tail = done.stderr.splitlines()[-2:]
    assert f"==>   FAILED tests/fake.py::test_in_{failing.split()[-1].strip('-')} - boom" in tail, tail
    lines = [line for line in done.stdout.splitlines() if line.startswith("pytest ")]
    assert len(lines) == 3 and "-m vm and" in lines[0], lines  # the VM pass's output first, then the log
    assert "--database-tests-only" in lines[2]


def test_every_pass_passing_passes_the_run(tmp_path):
    done = _main_with_a_fake_pytest(tmp_path, "nothing fails")
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "==> failed" not in done.stderr
    log = tmp_path / "var" / "test-logs" / "beside-the-vm-pass.log"  # under the run's AENV_HOME
    assert "--database-tests-only" in log.read_text()


def test_the_run_ends_saying_where_its_time_went(tmp_path):
    done = _main_with_a_fake_pytest(tmp_path, "nothing fails")
    times = [line for line in done.stdout.splitlines() if line.startswith("==> time, ")]
    steps = [line.removeprefix("==> time, ").rsplit(":", 1)[0] for line in times]
    assert steps == ["test dependencies", "docs site", "waiting for the compose images",
                     "waiting for the template prebuild", "tests with VMs",
                     "beside the VM pass: tests without VMs", "beside the VM pass: unit tests on PostgreSQL",
                     "the whole run"], times
    assert all(line.endswith(" s") and line.rsplit(":", 1)[1].strip()[:-2].isdigit() for line in times), times
