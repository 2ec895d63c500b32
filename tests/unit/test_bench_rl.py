"""bench/rl.py's pure parts, without VMs: the statistics and the report, the fork batches and
answer checks, the wheelhouse / bundle preparation and the guest worker, run on the host in a
temporary directory (the same script and client command the guests run)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import rl, rl_guest, rl_prep, rl_report

ROOT = Path(__file__).resolve().parents[2]


def _row(i, latency_s, at_s, ok=True):
    return {"i": i, "ok": ok, "latency_s": latency_s, "result_at_s": at_s}


def test_run_summary_throughput_latency_and_first_result():
    rows = [_row(i, 1.0 + i, 10.0 + i) for i in range(10)] + [_row(99, 0.1, 0.5, ok=False)]
    s = rl_report.run_summary(rows, wall_s=36.0)
    assert s["n"] == 11 and s["ok"] == 10 and s["errors"] == 1
    assert s["rollouts_per_hour_per_node"] == 1000.0  # 10 correct in 36 s
    assert s["time_to_first_result_s"] == 10.0  # the failed one's earlier answer does not count
    assert s["time_to_last_result_s"] == 19.0
    assert s["latency_p50_ms"] == 5000.0  # nearest rank: the 5th of 1..10 s
    assert s["latency_p99_ms"] == 10000.0
    assert rl_report.run_summary(rows, wall_s=36.0, nodes=2)["rollouts_per_hour_per_node"] == 500.0
    assert s["task_retries"] == 0
    rows[0]["retries"], rows[3]["retries"] = 2, 1
    assert rl_report.run_summary(rows, wall_s=36.0)["task_retries"] == 3


def test_run_summary_with_no_correct_rollout():
    s = rl_report.run_summary([_row(0, 1, 1, ok=False)], wall_s=5)
    assert s["ok"] == 0 and s["rollouts_per_hour_per_node"] == 0.0
    assert s["latency_p50_ms"] is None and s["time_to_first_result_s"] is None


def test_memory_summary_and_ratio():
    m = rl_report.memory_summary([100 * 1024, 200 * 1024], 300 * 2**20, 3)
    assert m == {"pss_per_rollout_mib": 150.0, "pss_samples": 2, "live_rollouts_at_sample": 3,
                 "memavailable_drop_per_live_rollout_mib": 100.0}
    assert rl_report.memory_summary([], None, 0)["memavailable_drop_per_live_rollout_mib"] is None
    assert rl_report.ratio({"rollouts_per_hour_per_node": 300.0}, {"rollouts_per_hour_per_node": 120.0}) == 2.5
    assert rl_report.ratio({"rollouts_per_hour_per_node": 300.0}, {"rollouts_per_hour_per_node": 0}) is None


def _result(runs):
    return {"when": "20260101T000000Z", "git": {"commit": "abc"}, "template": "base",
            "shape": {"cpu": 2, "memory_mb": 512}, "host": {"machine": "x86_64", "cpus": 2, "kernel": "k"},
            "duration_s": 100, "steps": 100, "runs": runs, "notes": ["a note"],
            "artifacts": {"packages": ["pytest"], "imports": ["pytest"], "wheels": {"a.whl": 1},
                          "wheelhouse_bytes": 2**20, "bundle_bytes": 10}}


def test_tables_and_markdown(tmp_path):
    fork = {**rl_report.run_summary([_row(i, 2.0, 5.0 + i) for i in range(4)], 20.0), "setup_s": 30.0,
            "memory": rl_report.memory_summary([80 * 1024] * 4, 4 * 90 * 2**20, 4)}
    fresh = {**rl_report.run_summary([_row(i, 40.0, 40.0 + i) for i in range(4)], 80.0), "setup_s": 35.0,
             "memory": rl_report.memory_summary([300 * 1024] * 4, None, 0)}
    runs = {"4": {"fork": fork, "fresh": fresh, "ratio": rl_report.ratio(fork, fresh)},
            "16": {"fork": fork, "fresh": {**fresh, "rollouts_per_hour_per_node": fork[
                "rollouts_per_hour_per_node"]}, "ratio": 1.0}}
    lines = rl_report.table(runs)
    assert lines[0].startswith("| N | way |")
    assert [ln.split("|")[1].strip() for ln in lines[2:]] == ["4", "4", "16", "16"]  # numeric order
    assert "| 720 |" in lines[2] and "| 80.0 | 90.0 |" in lines[2]  # 4 in 20 s; PSS; MemAvailable drop
    assert "| 180 |" in lines[3] and "| – |" in lines[3]
    ratios = rl_report.ratio_table(runs)
    assert "| 4 | 4.00× | ≥ 2× | yes |" in ratios[2]
    assert "| 16 | 1.00× | ≥ 2× | no |" in ratios[3]
    path = rl_report.write_results(_result(runs), "20260101T000000Z", tmp_path)
    assert path.name == "rl-20260101T000000Z.json"
    assert json.loads(path.read_text())["runs"]["4"]["ratio"] == 4.0
    md = path.with_suffix(".md").read_text()
    assert "## (a) / (b)" in md and "- a note" in md and "pytest" in md


def test_fork_batches_respect_the_sdk_limit():
    assert rl.batches(4) == [4]
    assert rl.batches(20) == [20]
    assert rl.batches(32) == [20, 12]
    assert rl.batches(41) == [20, 20, 1]
    with pytest.raises(ValueError):
        rl.batches(0)


def test_check_answer():
    good = rl_prep.expected_result(7, 500)
    assert rl.check_answer(dict(good, worker_pid=1), 7, 500) == ""
    assert "wrong answer" in rl.check_answer(dict(good, reward=good["reward"] + 1), 7, 500)
    assert rl.check_answer({"error": "boom"}, 7, 500) == "boom"
    assert rl_prep.expected_result(7, 500) != rl_prep.expected_result(8, 500)


def test_import_name():
    assert rl_prep.import_name("pytest") == "pytest"
    assert rl_prep.import_name("more-itertools==10.1") == "more_itertools"
    assert rl_prep.import_name("Attrs[tests]>=23") == "attrs"


def test_bundle_clones_to_the_same_commit(tmp_path):
    bundle, commit = rl_prep.make_repo_bundle(tmp_path / "w")
    assert len(commit) == 40
    again, commit2 = rl_prep.make_repo_bundle(tmp_path / "w2")
    assert commit2 == commit  # fixed author and dates: the same repo every run
    path = tmp_path / "x.bundle"
    path.write_bytes(bundle)
    subprocess.run(["git", "clone", "-q", "-b", "main", str(path), str(tmp_path / "clone")], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path / "clone"), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert head == commit
    assert (tmp_path / "clone" / "rlenv" / "__init__.py").read_text() == rl_prep.ENV_FILES["rlenv/__init__.py"]


def test_artifacts_files_and_commands(tmp_path):
    art = rl_prep.prepare(tmp_path, ["pytest"], wheels={"pytest-1-py3-none-any.whl": b"w", "a-1.whl": b"aa"})
    paths = [p for p, _ in art.files]
    assert paths == [f"{rl_prep.GUEST_WHEELS}/a-1.whl", f"{rl_prep.GUEST_WHEELS}/pytest-1-py3-none-any.whl",
                     rl_prep.GUEST_BUNDLE, rl_prep.GUEST_WORKER]
    assert art.worker == (ROOT / "bench" / "rl_guest.py").read_text()
    d = art.describe()
    assert d["wheelhouse_bytes"] == 3 and d["imports"] == ["pytest"] and d["repo_commit"] == art.commit
    cmd = rl_prep.install_command(art)
    assert "--no-index --find-links /home/user/wheelhouse pytest" in cmd and "git clone" in cmd
    assert art.commit in cmd
    start = rl_prep.worker_start_command(art)
    assert start.startswith("mkdir -p /tmp/rl && setsid python3 ") and start.endswith("&")
    assert "--import pytest" in start


def test_download_wheels_refuses_an_empty_wheelhouse(tmp_path, monkeypatch):
    monkeypatch.setattr(rl_prep.subprocess, "run", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="no wheels"):
        rl_prep.download_wheels(tmp_path / "wh", ["nothing"])


def test_client_command_quotes_and_refuses_bad_ids():
    cmd = rl_guest.client_command("/tmp/rl", {"id": "r1", "seed": 1, "note": "it's"})
    assert "/tmp/rl/out-r1" in cmd and "/tmp/rl/in" in cmd
    with pytest.raises(ValueError):
        rl_guest.client_command("/tmp/rl", {"id": "../x", "seed": 1})


def test_handle_reports_errors_without_raising(tmp_path):
    state = {"env": type("E", (), {"rollout": staticmethod(lambda seed, steps: {"reward": seed * steps})}),
             "pid": 1, "started": 0.0, "versions": {}, "commit": "c"}
    assert rl_guest.handle('{"id": "a", "seed": 2, "steps": 3}', state)["reward"] == 6
    assert rl_guest.handle("not json", state)["error"].startswith("bad task")
    assert rl_guest.handle('{"id": "a/b", "seed": 1}', state)["error"].startswith("bad task")
    missing = rl_guest.handle('{"id": "a"}', state)  # no seed: reported as the answer, with its id
    assert missing["id"] == "a" and "seed" in missing["error"] and "task_ms" in missing
    assert rl_guest.reply(str(tmp_path), {"id": "nobody"}, wait_s=0.1) is False  # no reply FIFO


def _wait_ready(root: Path, proc, seconds=60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (root / "ready").exists() and (root / "ready").stat().st_size:
            return json.loads((root / "ready").read_text())
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.05)
    raise AssertionError("worker never became ready")


def test_worker_serves_tasks_through_the_client_command(tmp_path):
    """The guest worker and client, end to end on the host: the bundle cloned, the worker
    started with the bench's own start command, tasks answered by the one warm process."""
    art = rl_prep.prepare(tmp_path / "prep", ["json"], wheels={"x.whl": b""})
    (tmp_path / "rlenv.bundle").write_bytes(art.bundle)
    repo, root, worker = tmp_path / "repo", tmp_path / "rl", tmp_path / "rl_guest.py"
    subprocess.run(["git", "clone", "-q", "-b", "main", str(tmp_path / "rlenv.bundle"), str(repo)], check=True)
    worker.write_text(art.worker)
    start = rl_prep.worker_start_command(art, python=sys.executable, worker=str(worker), repo=str(repo),
                                         root=str(root))
    subprocess.run(["bash", "-c", start], check=True, timeout=30)
    try:
        out = subprocess.run(["bash", "-c", rl_prep.ready_wait_command(str(root), seconds=60)], capture_output=True,
                             text=True, timeout=90)
        assert out.returncode == 0, out.stderr
        ready = json.loads(out.stdout)
        assert ready["commit"] == art.commit and "json" in ready["versions"]
        answers = []
        for seed in (1, 2, 3):
            task = {"id": f"t{seed}", "seed": seed, "steps": 300}
            got = subprocess.run(["bash", "-c", rl_guest.client_command(str(root), task)], capture_output=True,
                                 text=True, timeout=30)
            assert got.returncode == 0, got.stderr
            answers.append(json.loads(got.stdout))
        for seed, a in zip((1, 2, 3), answers):
            assert rl.check_answer(a, seed, 300) == "", a
            assert a["worker_pid"] == ready["pid"] and a["commit"] == art.commit
        assert not list(root.glob("out-*"))  # the client removes its reply FIFO
        bad = subprocess.run(["bash", "-c", rl_guest.client_command(str(root), {"id": "t9", "seed": "x"})],
                             capture_output=True, text=True, timeout=30)
        assert "ValueError" in json.loads(bad.stdout)["error"]
    finally:
        pid = json.loads((root / "ready").read_text())["pid"] if (root / "ready").exists() else None
        if pid:
            os.kill(pid, 9)


def test_worker_serve_max_tasks_in_process(tmp_path):
    """serve() in a child process with max_tasks: it answers exactly that many and returns."""
    root = tmp_path / "rl"
    code = ("import sys; sys.path.insert(0, %r); import rl_guest\n"
            "state = {'env': type('E', (), {'rollout': staticmethod(lambda s, n: {'reward': s + n})}), 'pid': 1, "
            "'started': 0.0, 'versions': {}, 'commit': '', 'load_ms': 0}\n"
            "print(rl_guest.serve(%r, state, max_tasks=2))" % (str(ROOT / "bench"), str(root)))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(root, proc)
        for i in range(2):
            got = subprocess.run(["bash", "-c", rl_guest.client_command(str(root), {"id": f"m{i}", "seed": i,
                                                                                      "steps": 10})],
                                 capture_output=True, text=True, timeout=30)
            assert json.loads(got.stdout)["reward"] == i + 10
        out, _ = proc.communicate(timeout=30)
        assert out.strip() == "2"
    finally:
        if proc.poll() is None:
            proc.kill()


class _FlakySandbox:
    """commands.run raises the SDK's SandboxUnreachableException ``fails`` times, then answers."""

    def __init__(self, fails, exc=None):
        from e2b.exceptions import SandboxUnreachableException

        self.fails, self.calls = fails, 0
        self.exc = exc or SandboxUnreachableException("port is not open")
        self.commands = self

    def run(self, cmd, **kw):
        self.calls += 1
        if self.calls <= self.fails:
            raise self.exc
        return type("R", (), {"stdout": cmd})()


def test_run_retrying_retries_only_unreachable(monkeypatch):
    from e2b.exceptions import SandboxUnreachableException

    monkeypatch.setattr(rl.time, "sleep", lambda s: None)
    bench = rl.Bench(stack=None, art=None, steps=1, retries=2)
    row = {}
    sbx = _FlakySandbox(2)
    assert bench.run_retrying(sbx, "echo", row).stdout == "echo"
    assert row["retries"] == 2 and sbx.calls == 3
    with pytest.raises(SandboxUnreachableException):
        bench.run_retrying(_FlakySandbox(3), "echo", {})
    other = _FlakySandbox(1, exc=RuntimeError("command failed"))
    with pytest.raises(RuntimeError):
        bench.run_retrying(other, "echo", {})
    assert other.calls == 1  # anything else is not retried
    no_retry = rl.Bench(stack=None, art=None, steps=1)
    with pytest.raises(SandboxUnreachableException):
        no_retry.run_retrying(_FlakySandbox(1), "echo", {})
