"""Template builds end to end: the unchanged E2B Python SDK builds a template from an OCI
image in a local registry (Debian's docker-registry on 127.0.0.1, holding an image made
here from a small debootstrap rootfs), the node's builder runs the steps in a real VM,
and a sandbox created from the template has the copied files, the env var, the workdir,
the user and the start command's server already running (reached through the data
plane), and mounts a volume (the image has no kernel modules: the build gave its disk the guest
kernel's NFS client). Also: a rebuild reuses every cached layer, a failing RUN fails at its step with
its exit status and output, a failed rebuild leaves the previous build in service,
``fromTemplate`` builds on a built template, tags, exists and delete."""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template, Volume, wait_for_port
from e2b.exceptions import BuildException

from harness import oci_registry

pytestmark = [pytest.mark.vm, pytest.mark.timeout(2400)]

# `registry` and `app_image` (the pushed test image) are session fixtures in conftest.py


@pytest.fixture
def context(tmp_path):
    root = tmp_path / "ctx"
    (root / "site").mkdir(parents=True)
    (root / "site" / "index.html").write_text("<h1>built by aenv</h1>\n")
    (root / "site" / "nested").mkdir()
    (root / "site" / "nested" / "deep.txt").write_text("deep\n")
    (root / "tool.sh").write_text("#!/bin/sh\necho tool-ran\n")
    return root


def definition(image: str, context: Path, then: str = "") -> Template:
    t = (Template(file_context_path=str(context)).from_image(image)
         .copy("site/", "/srv/site")
         .copy("tool.sh", "/usr/local/bin/", user="root", mode=0o755)
         .run_cmd("echo built-as-$(whoami) > /home/user/built.txt")
         .set_envs({"GREETING": "hello from the template", "APP_HOME": "/srv/site"})
         .run_cmd('test "$GREETING" = "hello from the template"')
         .set_workdir("/srv/site"))
    if then:
        t = t.run_cmd(then)
    return t.set_start_cmd("python3 -m http.server 8000", wait_for_port(8000))


def _build(template: Template, name: str, **kwargs):
    lines: list[str] = []
    t0 = time.monotonic()
    info = Template.build(template, name, on_build_logs=lambda e: lines.append(e.message), **kwargs)
    return info, lines, time.monotonic() - t0


def test_build_create_run_rebuild_fail_and_delete(sdk_env, app_image, context, monkeypatch):
    name = f"e2e-app-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("E2B_VOLUME_API_URL", sdk_env.api_url)
    assert Template.exists(name) is False
    info, lines, first_s = _build(definition(app_image.ref, context), f"{name}:v1", tags=["extra"], cpu_count=2,
                                  memory_mb=1024)
    assert {"v1", "extra"} <= set(info.tags)
    assert any(line.startswith(f"[base] FROM {app_image.ref}") for line in lines), lines[:5]
    assert any("[builder 1/" in line for line in lines) and any(line == "Template is ready" for line in lines)
    assert not any(line.startswith("CACHED") for line in lines)
    assert Template.exists(name) and Template.exists(f"{name}:v1") and not Template.exists(f"{name}:nope")

    vol = Volume.create(f"oci-{uuid.uuid4().hex[:8]}")
    vol.write_file("/seed.txt", "from the content API")
    sbx = Sandbox.create(f"{name}:v1", timeout=300, volume_mounts={"/mnt/data": vol})
    try:
        # the image (Debian minbase) has no kernel modules and no modprobe: the build put the
        # guest kernel's NFS client on its disk, the drive's busybox loaded it
        assert sbx.commands.run("cat /mnt/data/seed.txt").stdout.strip() == "from the content API"
        sbx.commands.run("echo from-the-oci-template > /mnt/data/guest.txt")
        assert vol.read_file("/guest.txt").strip() == "from-the-oci-template"
        assert sbx.commands.run("ls /lib/modules/*/kernel/fs/nfs").stdout.split() == ["nfs.ko", "nfsv3.ko"]
        assert sbx.commands.run("pwd").stdout.strip() == "/srv/site"  # WORKDIR persists
        assert sbx.commands.run("whoami").stdout.strip() == "user"
        assert sbx.commands.run("echo $GREETING").stdout.strip() == "hello from the template"  # ENV persists
        assert sbx.commands.run("cat /home/user/built.txt").stdout.strip() == "built-as-user"
        assert sbx.files.read("/srv/site/nested/deep.txt") == "deep\n"
        assert sbx.commands.run("stat -c '%U %a' /usr/local/bin/tool.sh && tool.sh").stdout.split() == \
            ["root", "755", "tool-ran"]
        assert sbx.commands.run("stat -c %U /srv/site/index.html").stdout.strip() == "user"
        assert sbx.commands.run(f"cat /srv/app/hello.txt").stdout.strip() == app_image.token  # the image's files
        # the start command was running in the snapshot: nothing started it in this sandbox
        assert "http.server" in sbx.commands.run("ps -eo args").stdout
        url = f"{os.environ['E2B_SANDBOX_URL']}/index.html"
        page = httpx.get(url, headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"}, timeout=30)
        assert page.status_code == 200 and "built by aenv" in page.text
    finally:
        sbx.kill()
    Volume.destroy(vol.volume_id)

    info2, lines2, second_s = _build(definition(app_image.ref, context), f"{name}:v1")
    assert info2.template_id == info.template_id and info2.build_id != info.build_id
    cached = [line for line in lines2 if line.startswith("CACHED [builder")]
    assert len(cached) == 6 and cached[-1].startswith("CACHED [builder 6/6] WORKDIR"), lines2  # every step reused
    assert second_s < first_s, (first_s, second_s, lines2)
    assert any(line.startswith("CACHED [finalize] template snapshot") for line in lines2)  # no VM booted
    assert not any("booting the build VM" in line for line in lines2), lines2
    _, lines3, _ = _build(definition(app_image.ref, context), f"{name}:v1", skip_cache=True)
    assert not any(line.startswith("CACHED") for line in lines3) and "Template is ready" in lines3  # force

    broken = definition(app_image.ref, context, then="echo about to fail >&2; exit 3")
    with pytest.raises(BuildException) as failed:
        _build(broken, f"{name}:v1")
    assert "exit status 3" in str(failed.value) and "about to fail" in str(failed.value)
    still = Sandbox.create(f"{name}:v1", timeout=120)  # the previous ready build is still in service
    try:
        assert still.commands.run("cat /home/user/built.txt").stdout.strip() == "built-as-user"
    finally:
        still.kill()

    child = f"{name}-child"
    _build(Template().from_template(f"{name}:v1").run_cmd("test -f /srv/site/index.html && echo child > child.txt")
           .set_user("root"), child)
    sbx = Sandbox.create(child, timeout=120)
    try:
        assert sbx.commands.run("cat child.txt").stdout.strip() == "child"  # in the inherited workdir
        assert sbx.commands.run("whoami").stdout.strip() == "root"  # USER persists
        assert "http.server" in sbx.commands.run("ps -eo args").stdout  # the inherited start command
    finally:
        sbx.kill()

    headers = {"X-API-Key": os.environ["E2B_API_KEY"]}
    api = os.environ["E2B_API_URL"]
    for template in (child, name):
        assert httpx.delete(f"{api}/templates/{template}", headers=headers, timeout=60).status_code == 204
    assert Template.exists(name) is False


def test_aenv_template_build_from_a_dockerfile(sdk_env, app_image, tmp_path):
    """The CLI parses an e2b.Dockerfile, uploads its COPY sources, prints the live log and
    exits 0; the template's sandbox has what the file said (CMD running as the start command)."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    ctx = tmp_path / "cli-ctx"
    (ctx / "data").mkdir(parents=True)
    (ctx / "data" / "note.txt").write_text("from the dockerfile\n")
    (ctx / "e2b.Dockerfile").write_text(
        f"FROM {app_image.ref}\n"
        "ENV MODE=cli \\\n    OTHER=two\n"
        "COPY --chown=user data/ /opt/data/\n"
        'RUN echo "mode=$MODE" > /opt/data/mode.txt\n'
        "WORKDIR /opt/data\n"
        'CMD ["python3", "-m", "http.server", "8001"]\n')
    name = f"e2e-cli-{uuid.uuid4().hex[:6]}"
    aenv = Path(sys.executable).with_name("aenv")
    out = subprocess.run([str(aenv), "template", "build", str(ctx), "--name", name,
                          "--ready-cmd", '[ -n "$(ss -Htln sport = :8001)" ]'],
                         capture_output=True, text=True, timeout=1200, env=dict(os.environ, NO_COLOR="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"[base] FROM {app_image.ref}" in out.stdout and "Template is ready" in out.stdout
    sbx = Sandbox.create(name, timeout=120)
    try:
        assert sbx.commands.run("pwd").stdout.strip() == "/opt/data"
        assert sbx.commands.run("cat note.txt mode.txt").stdout.split("\n")[:2] == ["from the dockerfile", "mode=cli"]
        assert sbx.commands.run("stat -c %U note.txt").stdout.strip() == "user"
        assert "http.server 8001" in sbx.commands.run("ps -eo args").stdout
    finally:
        sbx.kill()
    removed = subprocess.run([str(aenv), "template", "rm", name], capture_output=True, text=True, timeout=120)
    assert removed.returncode == 0, removed.stdout + removed.stderr


def test_private_registry_credentials_and_missing_images(sdk_env, app_image, tmp_path):
    """fromImageRegistry: the right credentials pull from a registry that needs them; wrong or
    no credentials, and a tag the registry does not have, fail the build at its base with a
    reason that says which."""
    import secrets  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    creds = ("aenv-builder", f"pw-{secrets.token_hex(6)}")
    root = tmp_path / "registry-auth"
    reg = oci_registry.start(root, auth=creds)
    try:
        private = f"{reg.host}/private/app:v1"
        subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false",
                        "--dest-creds", ":".join(creds), f"docker://{app_image.ref}", f"docker://{private}"],
                       check=True, capture_output=True, env={**os.environ, "HOME": str(tmp_path)})
        name = f"e2e-private-{uuid.uuid4().hex[:6]}"
        for template in (Template().from_image(private, username=creds[0], password="wrong"),
                         Template().from_image(private)):
            with pytest.raises(BuildException) as refused:
                Template.build(template.run_cmd("true"), name)
            assert "refused the credentials" in str(refused.value), str(refused.value)
        with pytest.raises(BuildException) as missing:
            Template.build(Template().from_image(f"{reg.host}/private/app:no-such-tag",
                                                 username=creds[0], password=creds[1]).run_cmd("true"), name)
        assert "no such image" in str(missing.value), str(missing.value)
        Template.build(Template().from_image(private, username=creds[0], password=creds[1])
                       .run_cmd("cp /srv/app/hello.txt /home/user/hello.txt"), name)
        sbx = Sandbox.create(name, timeout=120)
        try:
            assert sbx.commands.run("cat /home/user/hello.txt").stdout.strip() == app_image.token
        finally:
            sbx.kill()
        gone = httpx.delete(f"{os.environ['E2B_API_URL']}/templates/{name}",
                            headers={"X-API-Key": os.environ["E2B_API_KEY"]}, timeout=60)
        assert gone.status_code == 204
    finally:
        oci_registry.stop(root)
