"""A build's starting point (E2B's ``base`` phase): what the build VM boots and the
context its first step sees.

- ``fromImage``: the image is pulled from its registry into the node's OCI layout
  (``vmm.oci``: skopeo, with the request's credentials), made a root disk identified by
  its content digest and the boot kernel's NFS client modules (``vmm.oci.kmods``: what
  its sandboxes mount volumes with), and booted with aenv's kernel, initrd and tools
  drive. Context: user root, no workdir, the image config's env vars (E2B's rule).
- ``fromTemplate``: a ready build's template snapshot, whose disk layers the VM boots on
  (fetched from the snapshot store like a restore's, so any node can build on it);
  its context and its start / ready commands are inherited. A template without builds
  (``base``) boots its image; a snapshot of the team boots its disk.

Either way the cache key of the base names the content (the image digest and the disk
converter, or the base build's id) and the team."""
from __future__ import annotations

import ipaddress
import logging
import socket
from urllib.parse import urlsplit
from dataclasses import dataclass, field
from pathlib import Path

from agent.builder import images, plan
from agent.builder.guest import StepFailed

log = logging.getLogger(__name__)

BOOT_IMAGE = "base"  # the vmm image whose kernel, initrd and tools drive boot an OCI image's disk


@dataclass
class Base:
    image: str  # the vmm image whose kernel, initrd and tools drive boot the VM
    layers: list[str] | None  # disk chain to boot on (base first); None: the image's own rootfs
    ctx: plan.Context
    id: str  # what the base is, for its cache key
    start_cmd: str = ""
    ready_cmd: str = ""
    details: dict = field(default_factory=dict)  # kept in the build's result


def _host_port(registry: str) -> tuple[str, int]:
    try:
        parts = urlsplit(f"//{registry}")
        return parts.hostname or "", parts.port or 443
    except ValueError:
        return "", 443


def listed(registry: str, names: list[str]) -> bool:
    """``registry`` (host[:port]) is in ``names`` by itself or by its host."""
    return registry in names or _host_port(registry)[0] in names


def check_registry_address(registry: str, private_allowed: list[str], resolve=socket.getaddrinfo) -> None:
    """The node pulls on the user's behalf, so a registry must not be a way into the node's
    own networks (its database, broker, API, metadata service, a private range): one that
    resolves to anything but public addresses is refused unless the operator lists it
    (``AENV_PRIVATE_REGISTRIES``). Redirects a registry answers with (blob storage) are
    followed by skopeo and not checked here."""
    if listed(registry, private_allowed):
        return
    host, port = _host_port(registry)
    try:
        addresses = {info[4][0] for info in resolve(host, port, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return  # not resolvable: the pull fails with the registry's own words
    inner = sorted(a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_global)
    if inner:
        raise StepFailed(f"registry {registry} is on a private or local address ({', '.join(inner)}); builds may "
                         "pull from it only if the operator lists it in AENV_PRIVATE_REGISTRIES")


def insecure_registry(registry: str, allowed: list[str]) -> bool:
    """Plain-HTTP (or unverified TLS) registries: loopback ones, as Docker treats them, and
    those the operator lists (``AENV_INSECURE_REGISTRIES``, host or host:port)."""
    try:
        host = urlsplit(f"//{registry}").hostname or ""
    except ValueError:
        return False
    if host == "localhost":
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    return listed(registry, allowed)


def credentials_of(registry: dict | None) -> tuple[str, str] | None:
    """``fromImageRegistry`` → (username, password). AWS and GCP registries need their
    cloud's token exchange, which aenv does not do: the build fails saying so."""
    if not registry:
        return None
    kind = registry.get("type")
    if kind == "registry":
        return str(registry.get("username") or ""), str(registry.get("password") or "")
    raise StepFailed(f"fromImageRegistry type {kind!r} is not supported by aenv (only 'registry': "
                     "a username and password)")


def from_image(ref: str, registry: dict | None, images_dir: Path, insecure_list: list[str], say,
               private_allowed: list[str] = ()) -> Base:
    from vmm.oci import ImagePullError, OciError, ensure_disk, pull
    from vmm.oci import reference

    try:
        parsed = reference.parse(ref)
        check_registry_address(parsed.registry, list(private_allowed))
        creds = credentials_of(registry)
        pulled = pull(ref, images_dir, credentials=creds,
                      insecure=insecure_registry(parsed.registry, insecure_list), progress=say)
    except ImagePullError as exc:
        hint = {"unauthorized": "the registry refused the credentials (fromImageRegistry)",
                "not_found": "the registry has no such image", "unreachable": "no registry answered",
                "invalid": "not a valid image reference"}.get(exc.kind, "the pull failed")
        raise StepFailed(f"error pulling image {ref}: {hint}: {exc.message}") from None
    images.touch(images_dir, pulled.digest)  # the newest in the image cache while its disk is made
    modules = kernel_modules(images_dir, say)
    try:
        disk = ensure_disk(images_dir, pulled, progress=say, modules=modules)
        images.touch(images_dir, pulled.digest)
    except OciError as exc:
        raise StepFailed(f"error preparing image {ref} as a root disk: {exc}") from None
    ctx = plan.Context(user="root", workdir="", env=dict(pulled.env))
    # The disk is the VM's whole root; kernel, initrd and tools drive are the node's own
    # (``BOOT_IMAGE``'s): what a template snapshot then needs of another node is only those.
    return Base(image=BOOT_IMAGE, layers=[str(disk.rootfs)], ctx=ctx, id=f"image:{pulled.digest};disk:{disk.id}",
                details={"from_image": ref, "digest": pulled.digest, "disk": disk.id,
                         "kernel_modules": modules.id if modules is not None else ""})


def kernel_modules(images_dir: Path, say):
    """The boot kernel's NFS client modules for the disk (vmm.oci.kmods), or None: then the
    build goes on, and its sandboxes' volume mounts are refused (the log says so)."""
    from vmm.images import ImageNotFound, find_image
    from vmm.oci import OciError, kmods

    try:
        return kmods.for_image(images_dir, find_image(images_dir, BOOT_IMAGE), progress=say)
    except (OciError, ImageNotFound) as exc:
        log.warning("no NFS client modules for OCI disks: %s", exc)
        say(f"no NFS client modules of the guest kernel ({exc}): sandboxes of this template cannot mount volumes")
        return None


def from_template(source: dict, store, images_dir: Path) -> Base:
    """``source``: the start body's resolved ``fromTemplate`` (``lifecycle.templates.
    start.node_spec``): a build (its result), a snapshot, or an image."""
    from template_builds.models import TemplateBuild
    from vmm.images import ImageNotFound, find_image

    ref = source.get("ref") or source.get("template_id") or "?"
    if source.get("build_id"):
        build = TemplateBuild.objects.filter(pk=source["build_id"]).first()
        result = (build.result or {}) if build is not None else {}
        snapshot_id = build.snapshot_id if build is not None else None
        if not snapshot_id:
            raise StepFailed(f"error getting base template {ref}: its build has no snapshot, you may need to "
                             "rebuild it first")
        manifest = _manifest(store, snapshot_id, ref)
        ctx = plan.Context.from_json(result.get("context"))
        return Base(image=result.get("image") or manifest.machine.get("image") or "base",
                    layers=list(manifest.layers), ctx=ctx, id=f"template-build:{source['build_id']}",
                    start_cmd=build.start_cmd, ready_cmd=build.ready_cmd,
                    details={"from_template": ref, "base_build": str(source["build_id"])})
    if source.get("snapshot_id"):
        manifest = _manifest(store, source["snapshot_id"], ref)
        return Base(image=manifest.machine.get("image") or "base", layers=list(manifest.layers),
                    ctx=plan.Context(user=plan.DEFAULT_USER), id=f"snapshot:{source['snapshot_id']}",
                    details={"from_template": ref, "base_snapshot": source["snapshot_id"]})
    name = source.get("image") or "base"
    try:
        image = find_image(images_dir, name)
    except ImageNotFound as exc:
        raise StepFailed(f"error getting base template {ref}: {exc}") from None
    return Base(image=name, layers=None, ctx=plan.Context(user=plan.DEFAULT_USER),
                id=f"image-build:{name}:{image.recipe_hash}", details={"from_template": ref, "image": name})


def _manifest(store, snapshot_id: str, ref: str):
    from vmm.driver import SnapshotManifest

    try:
        return SnapshotManifest.load(store.local_dir(snapshot_id))
    except Exception as exc:  # noqa: BLE001 - missing files, a failed download: the same for the user
        raise StepFailed(f"error getting base template {ref}: its files are not available ({exc}); "
                         "you may need to rebuild it first") from None
