"""What bench/rl.py's setup carries into a sandbox, made on the host (guests have no route to
host services, so the setup is self-contained): a wheelhouse of a small pure-Python package
and its dependencies (``pip download`` from the host's PyPI mirror), a git repo of a tiny
RL environment as a ``git bundle``, and the warm worker (bench/rl_guest.py); plus the
shell commands that install, clone and start the worker in the guest."""
from __future__ import annotations

import hashlib
import importlib.util
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

GUEST_HOME = "/home/user"
GUEST_WHEELS = f"{GUEST_HOME}/wheelhouse"
GUEST_BUNDLE = f"{GUEST_HOME}/rlenv.bundle"
GUEST_REPO = f"{GUEST_HOME}/rlenv"
GUEST_WORKER = f"{GUEST_HOME}/rl_guest.py"
GUEST_ROOT = "/tmp/rl"

# The environment repo: a deterministic random walk on a ring (the rollout's "task"), a test.
ENV_FILES = {
    "rlenv/__init__.py": '''"""A tiny deterministic environment: a walk on a ring of SIZE cells; reaching cell 0 pays 1,
every other step costs 0.01. A rollout plays a seeded random policy for ``steps`` steps."""
import random

SIZE = 17
ACTIONS = (-1, 1, 2)


def step(pos, action):
    pos = (pos + action) % SIZE
    return pos, (1.0 if pos == 0 else -0.01)


def rollout(seed, steps):
    rng = random.Random(seed)
    pos, total, visits = 0, 0.0, 0
    for _ in range(steps):
        pos, reward = step(pos, rng.choice(ACTIONS))
        total += reward
        visits += reward > 0
    return {"seed": seed, "steps": steps, "reward": round(total, 6), "goal_visits": visits, "final_pos": pos}
''',
    "tests/test_rlenv.py": '''import rlenv


def test_deterministic():
    assert rlenv.rollout(3, 100) == rlenv.rollout(3, 100)


def test_step_wraps():
    assert rlenv.step(rlenv.SIZE - 1, 1) == (0, 1.0)
''',
    "README.md": "# rlenv\n\nA toy environment for aenv's RL benchmark (bench/rl.py).\n",
}


@dataclass
class Artifacts:
    wheels: dict[str, bytes]  # file name → wheel
    bundle: bytes
    commit: str
    worker: str  # rl_guest.py's source
    packages: list[str]
    imports: list[str]
    files: list[tuple[str, bytes | str]] = field(default_factory=list)

    def __post_init__(self):
        self.files = [(f"{GUEST_WHEELS}/{name}", data) for name, data in sorted(self.wheels.items())]
        self.files += [(GUEST_BUNDLE, self.bundle), (GUEST_WORKER, self.worker)]

    def describe(self) -> dict:
        return {"packages": self.packages, "imports": self.imports,
                "wheels": {n: len(d) for n, d in sorted(self.wheels.items())},
                "wheelhouse_bytes": sum(len(d) for d in self.wheels.values()),
                "bundle_bytes": len(self.bundle), "repo_commit": self.commit,
                "worker_sha256": hashlib.sha256(self.worker.encode()).hexdigest()[:16]}


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@aenv.invalid", "GIT_COMMITTER_NAME": "bench",
           "GIT_COMMITTER_EMAIL": "bench@aenv.invalid", "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z", "HOME": str(repo), "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          env=env, timeout=60).stdout


def make_repo_bundle(work: Path, files: dict[str, str] = ENV_FILES) -> tuple[bytes, str]:
    """A git repo of ``files`` (one commit on ``main``, fixed author and date) as a bundle;
    (bundle bytes, commit)."""
    repo = work / "rlenv-src"
    repo.mkdir(parents=True)
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "rlenv: a ring walk")
    commit = _git(repo, "rev-parse", "HEAD").strip()
    bundle = work / "rlenv.bundle"
    _git(repo, "bundle", "create", str(bundle), "main")
    return bundle.read_bytes(), commit


def download_wheels(dest: Path, packages: list[str], python_version: str = "3.11") -> dict[str, bytes]:
    """``pip download`` of ``packages`` and their dependencies as wheels for the guest's Python
    (pure-Python wheels; the host's pip configuration names the mirror)."""
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version",
                    python_version, "-d", str(dest), *packages], check=True, timeout=600,
                   capture_output=True, text=True)
    wheels = {p.name: p.read_bytes() for p in sorted(dest.glob("*.whl"))}
    if not wheels:
        raise RuntimeError(f"pip download of {packages} gave no wheels")
    return wheels


def prepare(work: Path, packages: list[str], imports: list[str] | None = None,
            wheels: dict[str, bytes] | None = None) -> Artifacts:
    bundle, commit = make_repo_bundle(work)
    if wheels is None:
        wheels = download_wheels(work / "wheelhouse", packages)
    worker = (Path(__file__).with_name("rl_guest.py")).read_text()
    return Artifacts(wheels=wheels, bundle=bundle, commit=commit, worker=worker, packages=packages,
                     imports=imports if imports is not None else [import_name(p) for p in packages])


def import_name(package: str) -> str:
    """The module a requirement installs (good enough for the small packages used here)."""
    name = package.split("[")[0]
    for sep in "=<>!~ ;":
        name = name.split(sep)[0]
    return name.strip().lower().replace("-", "_")


def install_command(art: Artifacts, user_install: bool = True) -> str:
    """Installs the wheelhouse offline and clones the bundle (in the guest, as ``user``)."""
    q = shlex.quote
    user = " --user" if user_install else ""
    pkgs = " ".join(q(p) for p in art.packages)
    return (f"set -e; python3 -m pip install -q{user} --no-index --find-links {q(GUEST_WHEELS)} {pkgs}; "
            f"rm -rf {q(GUEST_REPO)}; git clone -q -b main {q(GUEST_BUNDLE)} {q(GUEST_REPO)}; "
            f"test \"$(git -C {q(GUEST_REPO)} rev-parse HEAD)\" = {q(art.commit)}")


def worker_start_command(art: Artifacts, python: str = "python3", worker: str = GUEST_WORKER,
                         repo: str = GUEST_REPO, root: str = GUEST_ROOT) -> str:
    """Starts the warm worker detached (its own session, so it outlives envd's command)."""
    q = shlex.quote
    imports = " ".join(f"--import {q(m)}" for m in art.imports)
    return (f"mkdir -p {q(root)} && setsid {q(python)} {q(worker)} --root {q(root)} --repo {q(repo)} {imports} "
            f"> {q(root)}/worker.log 2>&1 < /dev/null &")


def ready_wait_command(root: str = GUEST_ROOT, seconds: float = 300) -> str:
    """Waits until the worker has written ``ready`` and prints it; the worker's log on failure."""
    tries = int(seconds / 0.1)
    q = shlex.quote
    return (f"for i in $(seq {tries}); do if [ -s {q(root)}/ready ]; then cat {q(root)}/ready; exit 0; fi; "
            f"sleep 0.1; done; cat {q(root)}/worker.log >&2; exit 1")


def expected_result(seed: int, steps: int, files: dict[str, str] = ENV_FILES) -> dict:
    """The rollout's answer computed on the host from the same environment source (each guest
    result is checked against it)."""
    spec = importlib.util.spec_from_loader("rlenv_host", loader=None)
    mod = importlib.util.module_from_spec(spec)
    exec(compile(files["rlenv/__init__.py"], "rlenv/__init__.py", "exec"), mod.__dict__)  # noqa: S102
    return mod.rollout(seed, steps)
