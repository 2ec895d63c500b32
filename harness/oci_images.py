"""Test images made here, without internet, pushed to a local registry (harness.oci_registry).

Why our own: the tests must not depend on Docker Hub, and must know exactly what an image
holds to check that it arrived in the guest. Images are built with ``umoci`` (init, new,
unpack to a bundle, change the rootfs, ``repack --refresh-bundle`` once per layer, ``config``)
into an OCI layout and pushed with ``skopeo copy``. Three rootfs sources:

* ``busybox_layer``: a few MiB: static busybox with its applets, the host's bash with the
  libraries it links (the E2B SDK and envd run every command as ``/bin/bash -l -c``) and glibc's
  core libraries, a passwd/group with root and nobody only (so the conversion must add
  ``user``). Seconds. glibc's loader, libm, libdl and libpthread sit at the standard paths, as
  in a glibc distro (envd itself needs none of them: vmm.toolsdrive relocates it onto the tools
  drive's loader and libraries).
* ``static_layer``: no glibc and no dynamic loader at all: static busybox and a static bash
  (Debian's bash-static, as /bin/bash: envd runs commands as ``/bin/bash -l -c``), no
  e2fsprogs, the same accounts. Like alpine or distroless-static for envd; it checks that envd
  and the root filesystem's growth need nothing from the image.
* ``debootstrap_layer``: the debootstrap rootfs the base image build caches
  (``var/images/stages/debootstrap-*/rootfs``): a real distro with its own ``user`` and sudo.
  ~400 MiB, a minute or more; used by opt-in tests only.

And minimal layers for the template builder (tests/integration/test_template_build_minimal.py):
``busybox_full_layer`` (every busybox applet, no bash, no glibc), ``sh_only_layer`` (a static
binary plus busybox as /bin/sh, nothing else) and ``no_shell_layer`` (the static binary alone),
pushed as whole images with ``push_image``.

    python -m harness.oci_images push <registry host:port> <repository:tag> [--debootstrap | --static]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
BUSYBOX = Path("/bin/busybox")
BASH_STATIC = Path("/bin/bash-static")  # Debian's bash-static
BUSYBOX_APPLETS = ["sh", "ls", "cat", "echo", "id", "whoami", "stat", "test", "mkdir", "rm", "env", "pwd", "grep",
                   "mount", "readlink", "head", "tail", "wc", "sleep", "true", "false", "uname", "touch", "chmod",
                   "sha256sum", "hostname", "ps", "find", "sed", "tr", "cut", "sort", "df"]
GLIBC_CORE = ["libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0"]  # + the loader, via bash's ldd
DEFAULT_CONFIG = {
    "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "AENV_OCI_TEST=hello-oci"],
    "workingdir": "/srv/app",
    "user": "0:0",
    "cmd": ["/bin/sh", "-c", "cat /srv/app/hello.txt"],
    "label": ["org.aenv.test=1"],
}


def available() -> str | None:
    """None if test images can be made and pushed here, else why not (a skip reason)."""
    for tool in ("umoci", "skopeo"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (scripts/setup.sh installs it)"
    if os.geteuid() != 0:
        return "making test images needs root (umoci keeps file owners)"
    if not BUSYBOX.exists():
        return "busybox-static not installed"
    return None


def run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc


def _host_libs(binary: Path) -> list[Path]:
    """The host libraries (and loader) `binary` links, as ldd resolves them."""
    libs = []
    for line in run(["ldd", str(binary)]).stdout.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) > parts.index("=>") + 1 and parts[parts.index("=>") + 1].startswith("/"):
            libs.append(Path(parts[parts.index("=>") + 1]))
        elif parts and parts[0].startswith("/"):
            libs.append(Path(parts[0]))
    return libs


def _copy_into(rootfs: Path, src: Path, dest: str, mode: int = 0o755) -> None:
    target = rootfs / dest.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src.resolve(), target)
    target.chmod(mode)


def busybox_layer(rootfs: Path) -> None:
    """A minimal userland: busybox + applets, bash + its libraries, root and nobody."""
    for d in ("bin", "etc", "srv/app", "usr/bin", "var/empty"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    _copy_into(rootfs, BUSYBOX, "/bin/busybox")
    for applet in BUSYBOX_APPLETS:
        (rootfs / "bin" / applet).symlink_to("busybox")
    bash = Path(shutil.which("bash") or "/bin/bash")
    _copy_into(rootfs, bash, "/bin/bash")
    for lib in _host_libs(bash) + [Path("/lib/x86_64-linux-gnu") / name for name in GLIBC_CORE]:
        _copy_into(rootfs, lib, str(lib))
    (rootfs / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n")
    (rootfs / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (rootfs / "etc/os-release").write_text("ID=aenv-oci-test\nNAME=\"aenv OCI test image\"\n")
    (rootfs / "srv/app/remove-me.txt").write_text("deleted by the next layer\n")


def static_available() -> str | None:
    """None if static_layer can be made here, else why not (a skip reason)."""
    return None if BASH_STATIC.exists() else "bash-static not installed (scripts/setup.sh installs it)"


def static_layer(rootfs: Path) -> None:
    """A userland without glibc or any dynamic loader: static busybox + applets, a static bash
    as /bin/bash, root and nobody; no resize2fs."""
    for d in ("bin", "etc", "srv/app", "usr/bin", "var/empty"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    _copy_into(rootfs, BUSYBOX, "/bin/busybox")
    for applet in BUSYBOX_APPLETS:
        (rootfs / "bin" / applet).symlink_to("busybox")
    _copy_into(rootfs, BASH_STATIC, "/bin/bash")
    (rootfs / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n")
    (rootfs / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (rootfs / "etc/os-release").write_text("ID=aenv-oci-static\nNAME=\"aenv OCI test image without glibc\"\n")
    (rootfs / "srv/app/remove-me.txt").write_text("deleted by the next layer\n")


STATIC_BINARY = Path("/sbin/ldconfig")  # glibc's ldconfig: static on every Debian, runs alone (--version)
PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n"
GROUP = "root:x:0:\nnogroup:x:65534:\n"


def minimal_available() -> str | None:
    """None if the minimal layers below can be made here, else why not (a skip reason)."""
    return None if STATIC_BINARY.exists() else f"{STATIC_BINARY} (a static binary) not found"


def busybox_full_layer(rootfs: Path) -> None:
    """The busybox image: static busybox with a link for every applet it has in /bin, root
    and nobody; no bash, no glibc, no /home, no useradd or adduser (Debian's busybox has
    neither)."""
    for d in ("bin", "etc", "tmp", "usr/bin", "usr/sbin", "sbin"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    _copy_into(rootfs, BUSYBOX, "/bin/busybox")
    for applet in run([str(BUSYBOX), "--list"]).stdout.split():
        if applet != "busybox" and "/" not in applet:
            (rootfs / "bin" / applet).symlink_to("busybox")
    (rootfs / "etc/passwd").write_text(PASSWD)
    (rootfs / "etc/group").write_text(GROUP)


def sh_only_layer(rootfs: Path) -> None:
    """A static binary (/usr/local/bin/app) and busybox as /bin/sh, nothing else: no other
    tool, no /etc (what distroless-with-a-shell images come down to)."""
    _copy_into(rootfs, BUSYBOX, "/bin/sh")
    _copy_into(rootfs, STATIC_BINARY, "/usr/local/bin/app")


def no_shell_layer(rootfs: Path) -> None:
    """A static binary (/usr/local/bin/app) alone: no shell at all (distroless static)."""
    _copy_into(rootfs, STATIC_BINARY, "/usr/local/bin/app")


# A small real distro for template builds (python3 for a start command, iproute2's `ss` for
# the SDK's wait_for_port, sudo, tar and coreutils for COPY): ~250 MiB, debootstrapped once.
DEBIAN_SUITE, DEBIAN_MIRROR = "bookworm", "http://deb.debian.org/debian"
DEBIAN_PACKAGES = ["python3", "iproute2", "sudo", "procps", "passwd"]
TEST_IMAGES_DIR = REPO / "var" / "test-images"


def debian_rootfs(cache: Path = TEST_IMAGES_DIR) -> Path:
    """The small Debian rootfs for build tests, made with debootstrap (minbase + the packages
    above, docs and apt lists removed) on first use and cached under ``cache`` (var/, ignored)."""
    import hashlib  # noqa: PLC0415

    key = hashlib.sha256(repr((DEBIAN_SUITE, DEBIAN_MIRROR, DEBIAN_PACKAGES, 1)).encode()).hexdigest()[:12]
    final = Path(cache) / f"debian-{key}"
    if (final / "done").is_file():
        return final / "rootfs"
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".debian-{key}-", dir=final.parent))
    try:
        run(["debootstrap", "--variant=minbase", f"--include={','.join(DEBIAN_PACKAGES)}", DEBIAN_SUITE,
             str(tmp / "rootfs"), DEBIAN_MIRROR], timeout=1800)
        run(["chroot", str(tmp / "rootfs"), "/bin/sh", "-c",
             "rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /usr/share/doc/* "
             "/usr/share/man/* /usr/share/locale/*"])
        (tmp / "done").write_text(key)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / "rootfs"


def debootstrap_rootfs(images_dir: Path) -> Path | None:
    """The newest cached debootstrap rootfs of the base image build, if any."""
    found = sorted((Path(images_dir) / "stages").glob("debootstrap-*/rootfs"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def debootstrap_layer(source: Path) -> Callable[[Path], None]:
    def layer(rootfs: Path) -> None:
        run(["cp", "-a", f"{source}/.", str(rootfs)])
        (rootfs / "srv/app").mkdir(parents=True, exist_ok=True)
        (rootfs / "srv/app/remove-me.txt").write_text("deleted by the next layer\n")
    return layer


def app_layer(token: str) -> Callable[[Path], None]:
    """The second layer: files the tests look for, and a deletion (an OCI whiteout)."""
    def layer(rootfs: Path) -> None:
        app = rootfs / "srv/app"
        app.mkdir(parents=True, exist_ok=True)
        (app / "hello.txt").write_text(f"{token}\n")
        os.link(app / "hello.txt", app / "hard.txt")
        (app / "link.txt").symlink_to("hello.txt")
        owned = app / "owned.txt"
        owned.write_text("owned by 1234\n")
        os.chown(owned, 1234, 1234)
        owned.chmod(0o640)
        (rootfs / "srv/app/remove-me.txt").unlink()
    return layer


@dataclass
class BuiltImage:
    ref: str
    token: str
    config: dict = field(default_factory=dict)


def build_layout(layout: Path, tag: str, layers: list[Callable[[Path], None]], config: dict, work: Path) -> None:
    """An OCI layout at `layout` with image `tag`: one layer per callable (each changes the
    rootfs of the previous), then the image config (env, workingdir, user, cmd, label)."""
    run(["umoci", "init", "--layout", str(layout)])
    image = f"{layout}:{tag}"
    run(["umoci", "new", "--image", image])
    bundle = work / "bundle"
    run(["umoci", "unpack", "--image", image, str(bundle)])
    for i, layer in enumerate(layers):
        layer(bundle / "rootfs")
        run(["umoci", "repack", "--refresh-bundle", "--history.created_by", f"aenv test layer {i + 1}",
             "--image", image, str(bundle)])
    argv = ["umoci", "config", "--image", image, "--author", "aenv tests"]
    for key in ("env", "cmd", "entrypoint", "label"):
        for value in config.get(key, []):
            argv += [f"--config.{key}", value]
    for key in ("workingdir", "user"):
        if config.get(key):
            argv += [f"--config.{key}", config[key]]
    run(argv)


def derive_layout(layout: Path, from_tag: str, to_tag: str, layer: Callable[[Path], None], work: Path) -> None:
    """Image `to_tag` in `layout` = image `from_tag` + one layer (its layers and config shared:
    a pull of both stores the shared blobs once)."""
    bundle = work / f"bundle-{to_tag}"
    run(["umoci", "unpack", "--image", f"{layout}:{from_tag}", str(bundle)])
    layer(bundle / "rootfs")
    run(["umoci", "repack", "--history.created_by", "aenv test derived layer", "--image", f"{layout}:{to_tag}",
         str(bundle)])


def push(layout: Path, tag: str, ref: str, credentials: tuple[str, str] | None = None) -> None:
    argv = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false"]
    if credentials:
        argv += ["--dest-creds", f"{credentials[0]}:{credentials[1]}"]
    run([*argv, f"oci:{layout}:{tag}", f"docker://{ref}"], env={**os.environ, "HOME": str(layout.parent)})


def make_test_image(registry_host: str, repository: str, tag: str, token: str,
                    credentials: tuple[str, str] | None = None, base_layer: Callable[[Path], None] = busybox_layer,
                    config: dict | None = None) -> BuiltImage:
    """Builds a two-layer test image (base_layer, then app_layer(token)) and pushes it to
    ``registry_host/repository:tag``."""
    config = config or DEFAULT_CONFIG
    with tempfile.TemporaryDirectory(prefix="aenv-oci-image-") as work:
        work = Path(work)
        build_layout(work / "layout", "img", [base_layer, app_layer(token)], config, work)
        ref = f"{registry_host}/{repository}:{tag}"
        push(work / "layout", "img", ref, credentials)
    return BuiltImage(ref=ref, token=token, config=config)


def push_image(registry_host: str, repository: str, tag: str, layers: list[Callable[[Path], None]],
               config: dict) -> BuiltImage:
    """Builds an image of ``layers`` (one each) with ``config`` and pushes it to
    ``registry_host/repository:tag`` (no app layer: the layers are the whole image)."""
    with tempfile.TemporaryDirectory(prefix="aenv-oci-image-") as work:
        work = Path(work)
        build_layout(work / "layout", "img", layers, config, work)
        ref = f"{registry_host}/{repository}:{tag}"
        push(work / "layout", "img", ref)
    return BuiltImage(ref=ref, token="", config=config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.oci_images", description=__doc__.splitlines()[0])
    parser.add_argument("cmd", choices=["push"])
    parser.add_argument("registry", help="host:port")
    parser.add_argument("name", help="repository:tag")
    parser.add_argument("--debootstrap", action="store_true")
    parser.add_argument("--static", action="store_true", help="the image without glibc (static_layer)")
    parser.add_argument("--token", default="hello from an OCI image")
    args = parser.parse_args(argv)
    reason = available()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    base = busybox_layer
    if args.static:
        if static_available():
            print(static_available(), file=sys.stderr)
            return 1
        base = static_layer
    if args.debootstrap:
        from vmm.images import DEFAULT_IMAGES_DIR  # noqa: PLC0415

        source = debootstrap_rootfs(Path(os.environ.get("AENV_IMAGES_DIR", DEFAULT_IMAGES_DIR)))
        if source is None:
            print("no debootstrap rootfs cached; build the base image first", file=sys.stderr)
            return 1
        base = debootstrap_layer(source)
    repository, _, tag = args.name.partition(":")
    image = make_test_image(args.registry, repository, tag or "latest", args.token, base_layer=base)
    print(image.ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
