"""Images from OCI registries as guest root disks (issue 11 item 2), against real services:
Debian's docker-registry on 127.0.0.1 (one open, one with htpasswd auth), skopeo, umoci,
e2fsprogs, qemu-img, and one real QEMU VM booted from the result.

The test images are made here (harness.oci_images: busybox + bash, two layers, a whiteout, an
owned file, a hard link and a symlink; and one without glibc, a static busybox and bash) with a
random token, so every session pulls and builds fresh. Two VM boots (marked ``vm``): the
glibc image, and the image without glibc or resize2fs on a disk larger than the image's; the
rest takes seconds.

The module pulls into an images dir of its own (``env.images``: its OCI store, disks and guest
images, the base image hard-linked in), removed at the end, never into the shared one
(``AENV_IMAGES_DIR``, var/images): a running node, another session or another xdist worker
pulls into that one too, and a test that counts what a pull added to the store would count their
blobs (test_layers_shared_between_images_are_stored_once once saw 6 new blobs instead of 3). One
xdist group: the registries and images are made once, not once per worker.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from envd_client import EnvdClient, EnvdError
from harness import oci_images, oci_registry
from vmm.driver import BootSpec, get_driver
from vmm.images import DEFAULT_IMAGES_DIR, GuestImage, ensure_image, find_image
from vmm.net.volume_server import mount_script
from vmm.oci import ImagePullError, OciError, disks, ensure_disk, ext4, guest_image, kmods, pull, store, tools
from vmm.templates import snapshot_dir

SHARED_IMAGES_DIR = Path(os.environ.get("AENV_IMAGES_DIR", DEFAULT_IMAGES_DIR))  # only its base image is read
TEST_RUNS = Path(__file__).resolve().parents[2] / "var" / "test-runs"  # beside var/images: hard links work
AUTH = ("aenv-tester", "s3cret-" + secrets.token_hex(4))

pytestmark = pytest.mark.xdist_group("oci-images")


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (umoci keeps file owners; the guest disk holds root-owned files)"
    lacking = tools.missing("skopeo", "umoci", "mke2fs", "debugfs", "qemu-img")
    if lacking:
        return f"not installed: {', '.join(lacking)} (scripts/setup.sh installs them)"
    return oci_registry.available() or oci_images.available()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("oci")
    plain = oci_registry.start(root / "registry")
    secured = oci_registry.start(root / "registry-auth", auth=AUTH)
    token = f"oci-{secrets.token_hex(6)}"
    work = root / "build"
    work.mkdir()
    layout = work / "layout"
    oci_images.build_layout(layout, "v1", [oci_images.busybox_layer, oci_images.app_layer(token)],
                            oci_images.DEFAULT_CONFIG, work)
    oci_images.derive_layout(layout, "v1", "v2", lambda rootfs: (rootfs / "srv/app/v2.txt").write_text("v2\n"), work)
    refs = SimpleNamespace(v1=plain.ref("t/app", "v1"), v2=plain.ref("t/app", "v2"),
                           private=secured.ref("t/private", "v1"))
    oci_images.push(layout, "v1", refs.v1)
    oci_images.push(layout, "v2", refs.v2)
    oci_images.push(layout, "v1", refs.private, credentials=AUTH)
    images = TEST_RUNS / f"oci-images-{token}"
    images.mkdir(parents=True)
    try:
        yield SimpleNamespace(plain=plain, secured=secured, token=token, refs=refs, images=images)
    finally:
        shutil.rmtree(images, ignore_errors=True)
        oci_registry.stop(plain.root)
        oci_registry.stop(secured.root)


def own_base(env) -> GuestImage:
    """The shared base image (built if missing), hard-linked into the module's images dir as
    its ``base`` (like a second node's, harness/second_node.py), with the cached
    accelerator probe: guest images made here link its kernel, initrd and tools drive."""
    shared = ensure_image(SHARED_IMAGES_DIR, "base")
    build = shared.kernel.parent
    if not (env.images / build.name).exists():
        subprocess.run(["cp", "-al", str(build), str(env.images / build.name)], check=True)
        (env.images / "base").unlink(missing_ok=True)
        (env.images / "base").symlink_to(build.name)
        if (SHARED_IMAGES_DIR / "accel.json").exists():
            shutil.copy(SHARED_IMAGES_DIR / "accel.json", env.images / "accel.json")
    return find_image(env.images, "base")


@pytest.fixture(scope="module")
def pulled(env):
    return pull(env.refs.v1, env.images, insecure=True)


def _skopeo_digest(ref: str, credentials=None) -> str:
    """What the registry serves for `ref`, asked independently of vmm.oci."""
    argv = ["skopeo", "inspect", "--tls-verify=false", "--format", "{{.Digest}}"]
    if credentials:
        argv += ["--creds", ":".join(credentials)]
    return subprocess.run([*argv, f"docker://{ref}"], capture_output=True, text=True, check=True).stdout.strip()


def test_pull_records_digest_and_config(env, pulled):
    assert pulled.digest == _skopeo_digest(env.refs.v1)  # an OCI image: stored as the registry has it
    assert pulled.ref == env.refs.v1
    assert pulled.env["AENV_OCI_TEST"] == "hello-oci" and pulled.env["PATH"].startswith("/usr/local/sbin")
    assert (pulled.workdir, pulled.user) == ("/srv/app", "0:0")
    assert pulled.cmd == ["/bin/sh", "-c", "cat /srv/app/hello.txt"] and pulled.entrypoint == []
    assert pulled.config["Labels"] == {"org.aenv.test": "1"}
    assert len(pulled.layers) == 2 and pulled.size > 0
    assert pulled.digest in store.images(env.images)
    again = pull(env.refs.v1, env.images, insecure=True)
    assert again == pulled
    assert store.load(env.images, pulled.digest).config == pulled.config


def test_pull_by_digest_is_served_from_the_store(env, pulled):
    """A digest-pinned reference already in the store needs no registry (this one has none)."""
    image = pull(f"127.0.0.1:1/t/app@{pulled.digest}", env.images)
    assert image.digest == pulled.digest and image.config == pulled.config


def test_layers_shared_between_images_are_stored_once(env, pulled):
    blobs = store.layout_dir(env.images) / "blobs" / "sha256"
    before = {p.name for p in blobs.iterdir()}
    v2 = pull(env.refs.v2, env.images, insecure=True)
    assert v2.digest != pulled.digest
    assert v2.layers[:2] == pulled.layers and len(v2.layers) == 3
    added = {p.name for p in blobs.iterdir()} - before
    # only v2's manifest, its config and its own layer: the two shared layers were already there
    assert len(added) == 3 and v2.layers[2].digest.partition(":")[2] in added and v2.hex in added


def test_credentialed_registry(env, pulled):
    image = pull(env.refs.private, env.images, credentials=AUTH, insecure=True)
    assert image.digest == pulled.digest  # the same image pushed to both registries
    with pytest.raises(ImagePullError) as e:
        pull(env.refs.private, env.images, insecure=True)
    assert e.value.kind == "unauthorized" and "authentication required" in e.value.message
    with pytest.raises(ImagePullError) as e:
        pull(env.refs.private, env.images, credentials=(AUTH[0], "wrong"), insecure=True)
    assert e.value.kind == "unauthorized"
    index = json.loads((store.layout_dir(env.images) / "index.json").read_text())
    assert not [m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"].startswith("pull-")]


@pytest.mark.parametrize("case", ["unknown tag", "unknown repository", "closed port", "unknown host", "tls",
                                  "invalid"])
def test_bad_references_give_clear_errors(env, case):
    host = env.plain.host
    ref, insecure, kind, words = {
        "unknown tag": (f"{host}/t/app:nope", True, "not_found", "manifest unknown"),
        "unknown repository": (f"{host}/t/none:v1", True, "not_found", "manifest unknown"),
        "closed port": ("127.0.0.1:1/t/app:v1", True, "unreachable", "connection refused"),
        "unknown host": ("no-such-registry.invalid/t/app:v1", True, "unreachable", "no-such-registry.invalid"),
        "tls": (f"{host}/t/app:v1", False, "unreachable", "HTTP response to HTTPS client"),
        "invalid": ("Not A/Reference", True, "invalid", "not an image reference"),
    }[case]
    with pytest.raises(ImagePullError) as e:
        pull(ref, env.images, insecure=insecure)
    assert e.value.kind == kind, e.value.message
    assert words in e.value.message
    assert ref.split("/")[0] in str(e.value) or case == "invalid"


def test_disk_is_reproducible_and_cached(env, pulled, tmp_path):
    first = ensure_disk(env.images, pulled)
    assert first.rootfs.stat().st_mode & 0o777 == 0o444
    assert first.dir == disks.disk_dir(env.images, pulled.digest)
    assert first.sha256 == ext4.sha256(first.rootfs)
    assert first.meta["prepared"]["user"] == {"name": "user", "uid": 1000, "gid": 1000, "home": "/home/user",
                                              "shell": "/bin/bash", "created": True}
    assert first.config["WorkingDir"] == "/srv/app" and first.size_mb == ext4.MIN_SIZE_MB
    again = ensure_disk(env.images, pulled)
    assert again.reused and again.dir == first.dir and again.sha256 == first.sha256
    inode = first.rootfs.stat().st_ino
    assert again.rootfs.stat().st_ino == inode  # the same file, not rebuilt
    # An independent build (another dir, another second, on tmpfs like another node's disk) gives the same
    # bytes. (The sleep: the host stamps ctimes in whole seconds too; builds within one second would hide
    # a ctime leaking into the disk.)
    for parent in (tmp_path, Path("/dev/shm")):
        time.sleep(1.1)
        out = Path(tempfile.mkdtemp(prefix="aenv-oci-out-", dir=parent))
        work = Path(tempfile.mkdtemp(prefix="aenv-oci-work-", dir=parent))
        try:
            meta = disks.build(pulled, out, work)
            assert ext4.sha256(out / "rootfs.qcow2") == meta["sha256"] == first.sha256, parent
        finally:
            shutil.rmtree(out)
            shutil.rmtree(work)


def test_disk_carries_the_guest_kernels_nfs_modules_and_nothing_more(env, pulled, tmp_path):
    """What template builds make: the base kernel's NFS client closure in /lib/modules/<release>
    (the image has no modules of its own), byte for byte the kernel's, on a disk of its own key,
    reproducible like any other."""
    base = own_base(env)
    modules = kmods.for_image(env.images, base)
    assert modules.release == base.kernel_release
    assert {"nfsv3", "nfs", "sunrpc", "lockd"} <= set(modules.modules) and len(modules.modules) < 12
    disk = ensure_disk(env.images, pulled, modules=modules)
    assert disk.dir == disks.disk_dir(env.images, pulled.digest, disks.disk_key(modules))
    assert disk.dir != disks.disk_dir(env.images, pulled.digest)  # not the disk without them
    assert disk.meta["prepared"]["kernel_modules"] == {"release": modules.release, "id": modules.id,
                                                       "modules": list(modules.modules), "added": True}
    raw, dumped = tmp_path / "check.raw", tmp_path / "dumped"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(disk.rootfs), str(raw)], check=True)
    dumped.mkdir()
    subprocess.run(["debugfs", "-R", f"rdump /lib/modules {dumped}", str(raw)], check=True, capture_output=True)
    raw.unlink()
    tree = dumped / "modules" / modules.release
    assert [p.name for p in (dumped / "modules").iterdir()] == [modules.release]
    files = sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file())
    assert files == modules.files() and "modules.dep" in files
    assert all((tree / f).read_bytes() == (modules.dir / f).read_bytes() for f in files)
    assert sum((tree / f).stat().st_size for f in files) < 8 << 20  # not the ~90 MiB tree
    nfsv3 = next(line for line in (tree / "modules.dep").read_text().splitlines() if "/nfsv3.ko:" in line)
    assert all(dep in files for dep in nfsv3.split(":")[1].split())
    out, work = Path(tempfile.mkdtemp(dir=tmp_path)), Path(tempfile.mkdtemp(dir=tmp_path))
    assert disks.build(pulled, out, work, modules=modules)["sha256"] == disk.sha256


def test_guest_image_keys_include_the_rootfs(env, pulled):
    base = own_base(env)
    disk = ensure_disk(env.images, pulled)
    name = f"oci-test-{env.token[4:]}"
    image = guest_image(env.images, disk, name=name)
    assert find_image(env.images, name) == image
    for ours, theirs in ((image.kernel, base.kernel), (image.initrd, base.initrd), (image.tools, base.tools)):
        assert ours.stat().st_ino == theirs.stat().st_ino  # hard links to the base build's files
    assert image.rootfs.stat().st_ino == disk.rootfs.stat().st_ino
    assert image.recipe_hash != base.recipe_hash
    assert guest_image(env.images, disk, name=name) == image  # idempotent
    fingerprint = {"driver": "qemu", "accel": "tcg"}
    assert snapshot_dir(env.images, image, 2, 512, 2048, fingerprint) != snapshot_dir(env.images, base, 2, 512, 2048,
                                                                                       fingerprint)
    assert find_image(env.images, "base") == base  # untouched
    with pytest.raises(OciError):
        guest_image(env.images, disk, name="base")


def _mapped_files(sh, pid: str) -> list[str]:
    """The files process `pid` (a shell expression, run in the guest) has mapped: its loader,
    libraries and executable, as /proc/<pid>/maps lists them."""
    return sh(f"tr -s ' ' < /proc/{pid}/maps | cut -d' ' -f6 | grep '^/' | sort -u").split()


def _assert_envd_runs_from_the_drive(sh) -> None:
    """A command's parent is envd: every file it maps is on the tools drive (its bootloader,
    the drive's loader and libc, the bundle's libraries), none of the image's."""
    assert sh("readlink /proc/$PPID/exe") == "/opt/aenv/envd/envd"
    mapped = _mapped_files(sh, "$PPID")
    assert "/opt/aenv/lib/ld-linux-x86-64.so.2" in mapped and "/opt/aenv/lib/libc.so.6" in mapped, mapped
    assert any(m.startswith("/opt/aenv/envd/_internal/libpython") for m in mapped), mapped
    assert any(m.startswith("/opt/aenv/envd/_internal/libssl") for m in mapped), mapped
    # anonymous memory files (memfd, /dev/zero) aside
    assert [m for m in mapped if not m.startswith(("/opt/aenv/", "/memfd:", "/dev/"))] == [], mapped


@pytest.mark.vm
def test_boot_a_vm_from_the_pulled_image(env, pulled, tmp_path):
    if not shutil.which("qemu-system-x86_64"):
        pytest.skip("qemu-system-x86_64 not installed")
    disk = ensure_disk(env.images, pulled, modules=kmods.for_image(env.images, own_base(env)))
    name = f"oci-test-{env.token[4:]}"
    image = guest_image(env.images, disk, name=name)
    driver = get_driver("qemu", tmp_path / "home", env.images)
    sid = f"oci-{env.token[4:]}"
    info = driver.boot(BootSpec(sid, image=image.name))
    try:
        with EnvdClient.at(info.envd_host, info.envd_port, timeout=60, stream_idle_timeout=60) as envd:
            def sh(command: str, user: str = "root") -> str:
                result = envd.run(command, user=user, stdin=None)
                assert result.ok, (command, result.exit_code, result.stdout, result.stderr)
                return result.stdout.decode().strip()

            assert sh("cat /srv/app/hello.txt") == env.token
            assert sh("cat /srv/app/hard.txt; readlink /srv/app/link.txt") == f"{env.token}\nhello.txt"
            assert sh("test ! -e /srv/app/remove-me.txt && echo gone") == "gone"  # the second layer's whiteout
            assert sh("stat -c '%u:%g %a' /srv/app/owned.txt") == "1234:1234 640"
            assert sh("grep ^ID= /etc/os-release") == "ID=aenv-oci-test"
            assert sh("whoami; id -u; pwd; echo $HOME", user="user") == "user\n1000\n/home/user\n/home/user"
            assert sh("touch ~/written && stat -c %U ~/written", user="user") == "user"
            assert sh("grep ' /opt/aenv ' /proc/mounts | cut -d' ' -f3,4 | cut -c1-6") == "ext4 r"
            assert sh("hostname; grep -c '^127.0.0.1 localhost' /etc/hosts") == "aenv\n1"
            assert sh("cat /etc/sudoers.d/aenv-user") == "user ALL=(ALL:ALL) NOPASSWD: ALL"
            assert sh("grep ' / ' /proc/mounts | cut -d' ' -f3,4 | cut -c1-6") == "ext4 r"
            _assert_envd_runs_from_the_drive(sh)
            # what envd starts runs on the image's own userland: its bash with the image's glibc
            bash_maps = _mapped_files(sh, "$$")
            assert "/lib/x86_64-linux-gnu/libc.so.6" in bash_maps and "/bin/bash" in bash_maps, bash_maps
            assert [m for m in bash_maps if m.startswith("/opt/aenv")] == [], bash_maps
            # the volume mount's NFS check passes: the image has no modprobe, the drive's busybox
            # loads the disk's modules with aenv's kernel
            assert sh("command -v modprobe || echo none") == "none"
            assert "nfs" not in sh("cat /proc/filesystems").split()
            sh(mount_script([]))
            assert "nfs" in sh("cat /proc/filesystems").split()
            assert {"nfsv3", "nfs", "sunrpc", "lockd"} <= set(sh("cut -d' ' -f1 /proc/modules").split())
    finally:
        driver.kill(sid)
    assert not (tmp_path / "home" / "sandboxes" / sid).exists()
    meta = json.loads((image.kernel.parent / "image.json").read_text())
    assert meta["oci"]["digest"] == pulled.digest and meta["oci"]["config"]["Env"] == pulled.config["Env"]


@pytest.mark.vm
def test_an_image_without_glibc_or_resize2fs(env, tmp_path):
    """envd runs whatever the root disk holds (here: no glibc, no loader, static busybox and
    bash), and a disk larger than the image's is grown at boot without the image's resize2fs."""
    if not shutil.which("qemu-system-x86_64"):
        pytest.skip("qemu-system-x86_64 not installed")
    reason = oci_images.static_available()
    if reason:
        pytest.skip(reason)
    layout = tmp_path / "layout"
    oci_images.build_layout(layout, "static", [oci_images.static_layer, oci_images.app_layer(env.token)],
                            oci_images.DEFAULT_CONFIG, tmp_path)
    ref = env.plain.ref("t/static", "v1")
    oci_images.push(layout, "static", ref)
    pulled = pull(ref, env.images, insecure=True)
    own_base(env)
    disk = ensure_disk(env.images, pulled)
    name = f"oci-static-{env.token[4:]}"
    image = guest_image(env.images, disk, name=name)
    grown_mb = disk.size_mb + 1024
    driver = get_driver("qemu", tmp_path / "home", env.images)
    sid = f"ocis-{env.token[4:]}"
    info = driver.boot(BootSpec(sid, image=image.name, disk_size_mb=grown_mb))
    try:
        with EnvdClient.at(info.envd_host, info.envd_port, timeout=60, stream_idle_timeout=60) as envd:
            def sh(command: str, user: str = "root") -> str:
                result = envd.run(command, user=user, stdin=None)
                assert result.ok, (command, result.exit_code, result.stdout, result.stderr)
                return result.stdout.decode().strip()

            assert envd.health()
            assert sh("grep ^ID= /etc/os-release") == "ID=aenv-oci-static"
            # no dynamic loader and no C library anywhere on the root filesystem
            assert sh("find / -xdev \\( -name 'ld-linux*' -o -name 'ld-musl*' -o -name 'libc.so*' \\) | wc -l") == "0"
            assert sh("command -v resize2fs || echo none") == "none"
            assert sh("cat /srv/app/hello.txt") == env.token
            assert sh("whoami; id -u; pwd", user="user") == "user\n1000\n/home/user"
            _assert_envd_runs_from_the_drive(sh)
            # the commands run the image's static bash, with nothing of the drive mapped or in the env
            assert sh("echo ${BASH_VERSINFO[0]}") == "5"
            assert _mapped_files(sh, "$$") == ["/bin/bash"]
            assert sh("env | grep -c '^LD_' || true") == "0"
            # files, through envd's HTTP API and seen by the image's tools
            entry = envd.write_file("notes/hello.txt", f"written {env.token}\n".encode(), user="user")
            assert entry["path"] == "/home/user/notes/hello.txt"
            assert envd.read_file("/home/user/notes/hello.txt", user="user") == f"written {env.token}\n".encode()
            assert sh("cat ~/notes/hello.txt; stat -c %U ~/notes/hello.txt", user="user") == \
                f"written {env.token}\nuser"
            assert envd.read_file("/srv/app/hello.txt") == f"{env.token}\n".encode()
            # the root filesystem was grown to the sandbox disk (the image's disk is disk.size_mb)
            root_dev = sh("grep ' / ' /proc/mounts | cut -d' ' -f1")
            assert int(sh(f"cat /sys/class/block/{root_dev.rsplit('/', 1)[-1]}/size")) * 512 == grown_mb << 20
            total_mb = int(sh("df -k / | tail -1 | tr -s ' ' | cut -d' ' -f2")) // 1024
            assert grown_mb * 0.9 < total_mb <= grown_mb, (total_mb, disk.size_mb, grown_mb)
            # Without /bin/bash envd still starts other programs, but the SDK's commands
            # (/bin/bash -l -c) fail with a clear error instead of a hang.
            def start_sh(script: str) -> str:
                events = list(envd.start("/bin/sh", ["-c", script], user="root"))
                assert events[-1].kind == "end" and events[-1].exit_code == 0, events
                return b"".join(e.data for e in events if e.kind == "data").decode().strip()

            assert start_sh("mv /bin/bash /bin/bash.off && echo moved") == "moved"
            try:
                with pytest.raises(EnvdError) as e:
                    envd.run("true", stdin=None)
                assert e.value.code == "invalid_argument" and "/bin/bash" in e.value.message, e.value
            finally:
                assert start_sh("mv /bin/bash.off /bin/bash && echo back") == "back"
            assert sh("echo bash again") == "bash again"
    finally:
        driver.kill(sid)
    assert not (tmp_path / "home" / "sandboxes" / sid).exists()


@pytest.mark.slow
def test_a_real_distribution_image(env, tmp_path):
    """The debootstrap rootfs of the base image build (~400 MiB, Debian with its own `user`
    and sudo) as an image: its user is kept, and a rebuild elsewhere is byte-identical."""
    source = oci_images.debootstrap_rootfs(SHARED_IMAGES_DIR)
    if source is None:
        pytest.skip("no debootstrap rootfs cached (build the base image first)")
    ref = env.plain.ref("t/debian", env.token)
    layout = tmp_path / "layout"
    oci_images.build_layout(layout, "deb", [oci_images.debootstrap_layer(source), oci_images.app_layer(env.token)],
                            oci_images.DEFAULT_CONFIG, tmp_path)
    oci_images.push(layout, "deb", ref)
    image = pull(ref, env.images, insecure=True)
    disk = ensure_disk(env.images, image)
    user = disk.meta["prepared"]["user"]
    assert user == {"name": "user", "uid": 1000, "gid": 1000, "home": "/home/user", "shell": "/bin/bash",
                    "created": False}
    assert disk.meta["used_bytes"] > 200 << 20
    raw = tmp_path / "check.raw"
    subprocess.run(["qemu-img", "convert", "-O", "raw", str(disk.rootfs), str(raw)], check=True)
    def debugfs(request: str) -> str:
        return subprocess.run(["debugfs", "-R", request, str(raw)], capture_output=True, text=True).stdout
    assert "Mode:  04755" in debugfs("stat /usr/bin/sudo")  # setuid kept
    assert debugfs("cat /srv/app/hello.txt").strip() == env.token
    assert "NOPASSWD" in debugfs("cat /etc/sudoers.d/aenv-user")
    raw.unlink()
    out, work = Path(tempfile.mkdtemp(dir=tmp_path)), Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        assert disks.build(image, out, work)["sha256"] == disk.sha256
    finally:
        shutil.rmtree(work)
