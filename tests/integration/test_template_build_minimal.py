"""Template builds from minimal images (issue 20, item 1): images without bash, ``dirname``,
``useradd``, ``/home`` or a config WORKDIR/USER that makes sense still build, as E2B's
builder would, and a sandbox of each runs commands as the template's user in its working
directory; an image without any shell fails at its first step saying so.

The images are made here (harness.oci_images) and pushed to the session's local registry:

* ``busybox``: static busybox with a few applets (no ``dirname``), bash and glibc, root and
  nobody only, no WORKDIR or USER: the image of the report, whose build failed at finalize
  with ``mkdir: can't create directory ''``. Its template adds an account in an image that
  has neither useradd nor adduser.
* ``busybox-static``: every busybox applet, no bash, no glibc; config WORKDIR a directory
  that does not exist. Steps run with ``/bin/sh`` (ENV expands against root's sh login
  env) until a step installs bash (as ``apk add bash`` would on alpine): the next runs
  with it, and the SDK's commands (``/bin/bash -l -c``) work in the sandbox.
* ``sh-only``: a static binary and busybox as ``/bin/sh``, nothing else (no /etc); config
  USER a uid without a passwd entry. Its sandbox has no bash for the SDK's commands (envd
  starts what it is asked for), so the test asks envd for ``/bin/sh -l -c``.
* ``no-shell``: the static binary alone.

One build each (a TCG VM boot, a few steps, a template snapshot), on the session's stack."""
from __future__ import annotations

import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx
import pytest
from e2b import Sandbox, Template

from envd_client import EnvdClient
from harness import oci_images

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1800)]

PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DRIVE_BUSYBOX = "/opt/aenv/bin/busybox"
SHAPE = {"cpu_count": 1, "memory_mb": 256}


@dataclass
class Case:
    name: str
    layers: list[Callable[[Path], None]]
    config: dict
    steps: Callable[[Template], Template]
    user: str = ""  # expected in a sandbox of the template ("": the build fails)
    uid: int = 0
    home: str = ""
    cwd: str = ""
    tools: str = ""  # prefix for whoami / id (the drive's busybox where the image has none)
    shell: str = "/bin/bash"  # what the sandbox has to run commands with
    files: dict[str, str] = field(default_factory=dict)  # path -> content, in the sandbox


CASES = [
    Case("busybox", [oci_images.busybox_layer], {"env": [PATH_ENV]},
         lambda t: (t.copy("notes.txt", "notes/")  # as `user`, into /home/user/notes/
                    .set_user("app")  # no useradd, no adduser: the account is written directly
                    .run_cmd("echo built-as-$(whoami) > built.txt")),
         user="app", uid=1001, home="/home/app", cwd="/home/app",
         files={"/home/app/built.txt": "built-as-app\n", "/home/user/notes/notes.txt": "a note\n"}),
    Case("busybox-static", [oci_images.busybox_full_layer], {"env": [PATH_ENV], "workingdir": "/does/not/exist"},
         lambda t: (t.set_envs({"GREETING": "hello from $HOME"})  # root's login env: /root
                    .run_cmd('test "$GREETING" = "hello from /root" && test ! -e /does/not/exist '
                             '&& echo "ran in $(pwd) as $(whoami)" > ran.txt')
                    .copy("bash", "/bin/bash", user="root", mode=0o755)
                    .run_cmd("echo ${BASH_VERSINFO[0]} > bash.txt")),
         user="user", uid=1000, home="/home/user", cwd="/home/user",
         files={"/home/user/ran.txt": "ran in /home/user as user\n", "/home/user/bash.txt": "5\n"}),
    Case("sh-only", [oci_images.sh_only_layer], {"user": "4242"},
         lambda t: (t.set_workdir("/srv/work")
                    .run_cmd("echo made > made.txt && /usr/local/bin/app --version > version.txt")),
         user="user", uid=1000, home="/home/user", cwd="/srv/work", tools=f"{DRIVE_BUSYBOX} ", shell="/bin/sh",
         files={"/srv/work/made.txt": "made\n"}),
    Case("no-shell", [oci_images.no_shell_layer], {"env": [PATH_ENV]}, lambda t: t.run_cmd("true")),
]


@pytest.fixture(scope="module")
def images(registry):
    reason = oci_images.minimal_available() or oci_images.static_available()
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:8]
    return {c.name: oci_images.push_image(registry.host, f"aenv-test/minimal-{c.name}", tag, c.layers, c.config).ref
            for c in CASES}


@pytest.fixture
def context(tmp_path):
    (tmp_path / "notes.txt").write_text("a note\n")
    shutil.copyfile(oci_images.BASH_STATIC, tmp_path / "bash")
    return tmp_path


def _run(stack, sbx: Sandbox, shell: str, command: str) -> str:
    """``command``'s stdout in the sandbox, as its default user: the SDK's way where the
    template has bash, ``<shell> -l -c`` through envd where it has not."""
    if shell == "/bin/bash":
        return sbx.commands.run(command).stdout
    with EnvdClient.through_proxy(stack.sandbox_url, sbx.sandbox_id, access_token=sbx._envd_access_token) as envd:
        events = list(envd.start(shell, ["-l", "-c", command], stdin=False, deadline=60))
    assert events[-1].kind == "end" and events[-1].exit_code == 0, events
    return b"".join(e.data for e in events if e.kind == "data" and e.stream == "stdout").decode()


def _wait(info, deadline_s: float = 1200):
    """The build's final status (build_in_background + polling, so the reason's step is seen)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        status = Template.get_build_status(info)
        if str(getattr(status.status, "value", status.status)) in ("ready", "error"):
            return status
        time.sleep(2)
    raise AssertionError(f"build {info.build_id} did not finish in {deadline_s}s")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_minimal_image_builds_and_runs_as_the_template_user(sdk_env, images, context, case):
    name = f"minimal-{case.name}-{uuid.uuid4().hex[:6]}"
    template = case.steps(Template(file_context_path=str(context)).from_image(images[case.name]))
    t0 = time.monotonic()
    status = _wait(Template.build_in_background(template, name, **SHAPE))
    took = time.monotonic() - t0
    state = str(getattr(status.status, "value", status.status))
    reason = status.reason
    try:
        if not case.user:
            assert state == "error", status
            assert reason.step == "1", reason
            assert reason.message.startswith("the image has no /bin/sh"), reason.message
            return
        assert state == "ready", f"{case.name}: {reason} after {took:.0f}s"
        sbx = Sandbox.create(name, timeout=120)
        try:
            got = _run(sdk_env, sbx, case.shell, f'echo "$({case.tools}whoami)|$({case.tools}id -u)|$HOME|$(pwd)"')
            assert got.strip() == f"{case.user}|{case.uid}|{case.home}|{case.cwd}"
            for path, text in case.files.items():
                assert sbx.files.read(path) == text, path
            if case.name == "sh-only":
                assert sbx.files.read("/srv/work/version.txt").startswith("ldconfig")
        finally:
            sbx.kill()
    finally:
        gone = httpx.delete(f"{sdk_env.api_url}/templates/{name}", headers={"X-API-Key": sdk_env.api_key},
                            timeout=60)
        assert gone.status_code in (204, 404), gone.text
