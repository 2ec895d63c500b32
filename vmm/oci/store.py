"""Pulls images from OCI registries into one content-addressed, node-local OCI image layout.

Why one shared layout (``<images_dir>/oci/layout``, the OCI image-layout format: ``index.json``
plus ``blobs/sha256/<hex>``): blobs are files named by their digest, so images that share base
layers store them once, and skopeo skips a blob the layout already has instead of downloading
it again. Each pulled image is one ``index.json`` entry named ``sha256-<hex>`` after its
manifest digest, which is what everything downstream (vmm.oci.disks) is keyed by: a tag moves,
a digest does not.

Pulling is ``skopeo copy docker://<ref> oci:<layout>:<tmp>`` for linux/amd64 (a multi-platform
image resolves to its amd64 manifest); skopeo writes OCI manifests (a Docker schema 2 image is
converted, deterministically, so ``digest`` is the digest of the manifest as stored here, not
necessarily the registry's). The temporary entry is then renamed to the digest. Credentials go
to skopeo in a private auth file (never on a command line other users can read); without them
the registry is asked anonymously (``--src-no-creds``: no credentials of the host's user leak
into a pull). One pull, removal or gc at a time per layout (an flock): skopeo and we rewrite
``index.json``.

    python -m vmm.oci pull <ref> [--insecure] [--username U --password-stdin]
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from vmm.oci import reference, tools
from vmm.oci.errors import ImagePullError, OciError
from vmm.oci.filelock import locked

PLATFORM = ("linux", "amd64")  # aenv guests are x86_64
PULL_TIMEOUT = 3600.0
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",)
REF_ANNOTATION = "org.opencontainers.image.ref.name"
_HEX = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Layer:
    digest: str
    size: int
    media_type: str


@dataclass(frozen=True)
class PulledImage:
    """An image in the node's layout: its manifest digest, what its config says, its layers."""

    digest: str                       # "sha256:<hex>" of the manifest as stored
    layout: Path                      # the OCI layout that holds it
    config: dict = field(default_factory=dict)  # the image config's "config": Env, WorkingDir, User, Cmd, ...
    layers: tuple[Layer, ...] = ()
    created: str = ""
    ref: str = ""                     # what was asked for, normalised ("" when loaded by digest)

    @property
    def hex(self) -> str:
        return self.digest.split(":", 1)[1]

    @property
    def layout_ref(self) -> str:
        """The entry name in the layout (``oci:<layout>:<this>`` for skopeo, umoci)."""
        return f"sha256-{self.hex}"

    @property
    def size(self) -> int:
        """Compressed bytes of all layers."""
        return sum(layer.size for layer in self.layers)

    @property
    def env(self) -> dict[str, str]:
        """Env as a mapping (a later duplicate wins, as in a container)."""
        out = {}
        for item in self.config.get("Env") or []:
            k, _, v = item.partition("=")
            out[k] = v
        return out

    @property
    def workdir(self) -> str:
        return self.config.get("WorkingDir") or ""

    @property
    def user(self) -> str:
        return self.config.get("User") or ""

    @property
    def cmd(self) -> list[str]:
        return list(self.config.get("Cmd") or [])

    @property
    def entrypoint(self) -> list[str]:
        return list(self.config.get("Entrypoint") or [])

    def to_json(self) -> dict:
        return {"digest": self.digest, "ref": self.ref, "created": self.created, "config": self.config,
                "layers": [{"digest": x.digest, "size": x.size, "mediaType": x.media_type} for x in self.layers]}


def layout_dir(images_dir: Path) -> Path:
    return Path(images_dir).absolute() / "oci" / "layout"


def _locked(layout: Path):
    return locked(layout.parent / "layout.lock")


def _read_index(layout: Path) -> dict:
    try:
        return json.loads((layout / "index.json").read_text())
    except FileNotFoundError:
        return {"schemaVersion": 2, "manifests": []}
    except ValueError as e:
        raise OciError(f"{layout}/index.json is not valid JSON: {e}") from None


def _write_index(layout: Path, index: dict) -> None:
    tmp = layout / f".index.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(index))
    os.replace(tmp, layout / "index.json")


def _blob(layout: Path, digest: str) -> bytes:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or not _HEX.match(hexpart):
        raise OciError(f"unsupported digest {digest!r}")
    try:
        return (layout / "blobs" / "sha256" / hexpart).read_bytes()
    except FileNotFoundError:
        raise OciError(f"blob {digest} missing from {layout}") from None


def load(images_dir: Path, digest: str, ref: str = "") -> PulledImage:
    """The image with manifest `digest` from the node's layout; raises OciError if absent."""
    layout = layout_dir(images_dir)
    name = f"sha256-{digest.partition(':')[2]}"
    if not any((m.get("annotations") or {}).get(REF_ANNOTATION) == name
               for m in _read_index(layout).get("manifests", [])):
        raise OciError(f"image {digest} is not in {layout} (pull it first)")
    return _describe(layout, digest, ref)


def _describe(layout: Path, digest: str, ref: str) -> PulledImage:
    manifest = json.loads(_blob(layout, digest))
    media_type = manifest.get("mediaType", MANIFEST_TYPES[0])
    if media_type not in MANIFEST_TYPES:
        raise OciError(f"{digest}: unsupported manifest type {media_type}")
    config = json.loads(_blob(layout, manifest["config"]["digest"]))
    if (config.get("os"), config.get("architecture")) not in (PLATFORM, ("", "")):
        raise OciError(f"{digest} is a {config.get('os')}/{config.get('architecture')} image; "
                       f"aenv guests are {'/'.join(PLATFORM)}")
    layers = tuple(Layer(x["digest"], int(x.get("size", 0)), x.get("mediaType", "")) for x in manifest.get("layers", []))
    return PulledImage(digest=digest, layout=layout, config=config.get("config") or {}, layers=layers,
                       created=config.get("created") or "", ref=ref)


def _auth_file(directory: Path, registry: str, credentials: tuple[str, str]) -> Path:
    """A containers-auth.json for one registry, readable by us only."""
    user, password = credentials
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    path = directory / "auth.json"
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"auths": {registry: {"auth": token}}}, f)
    return path


_MSG = re.compile(r'msg="((?:[^"\\]|\\.)*)"')


def _registry_message(stderr: str) -> str:
    """skopeo's fatal line without its logging frame (``time=… level=fatal msg="…"``)."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    if not lines:
        return "skopeo failed without a message"
    m = _MSG.search(lines[-1])
    text = m.group(1).encode().decode("unicode_escape") if m else lines[-1]
    return text.strip()


def classify(message: str) -> str:
    """The ImagePullError kind of a skopeo/registry error message."""
    low = message.lower()
    if any(s in low for s in ("unauthorized", "authentication required", "denied", "invalid username/password",
                              "incorrect username or password")):
        return "unauthorized"
    if any(s in low for s in ("manifest unknown", "name unknown", "not found", "blob unknown",
                              "no image found in manifest list", "no matching manifest")):
        return "not_found"
    if any(s in low for s in ("pinging container registry", "connection refused", "no such host", "i/o timeout",
                              "network is unreachable", "server gave http response to https client",
                              "x509:", "tls:", "connection reset", "no route to host")):
        return "unreachable"
    return "failed"


def pull(image_ref: str, images_dir: Path, credentials: tuple[str, str] | None = None,
         insecure: bool = False, progress=lambda m: None, timeout: float = PULL_TIMEOUT) -> PulledImage:
    """Pulls `image_ref` (linux/amd64) into the node's layout and returns what it holds.

    credentials: (username, password) for the registry, else anonymous. insecure: the
    registry is plain HTTP or has a certificate the host does not trust (skopeo's
    ``--src-tls-verify=false``: HTTPS without verification, then HTTP). A reference pinned by
    a digest the layout already has is answered without the network. Raises ImagePullError
    (kind and the registry's message) or ToolMissing."""
    ref = reference.parse(image_ref)
    layout = layout_dir(images_dir)
    if ref.digest:
        try:
            return load(images_dir, ref.digest, ref=str(ref))
        except OciError:
            pass
    tools.which("skopeo")
    layout.parent.mkdir(parents=True, exist_ok=True)
    with _locked(layout), tempfile.TemporaryDirectory(prefix=".pull-", dir=layout.parent) as work:
        work = Path(work)
        tmp_name = f"pull-{os.getpid()}-{secrets.token_hex(4)}"
        argv = ["skopeo", "copy", "--quiet", "--override-os", PLATFORM[0], "--override-arch", PLATFORM[1],
                "--digestfile", str(work / "digest"), f"--src-tls-verify={'false' if insecure else 'true'}"]
        if credentials:
            argv[2:2] = ["--src-authfile", str(_auth_file(work, ref.registry, credentials))]
        else:
            argv[2:2] = ["--src-no-creds"]
        progress(f"pulling {ref}")
        try:
            proc = tools.run([*argv, ref.transport, f"oci:{layout}:{tmp_name}"], check=False, timeout=timeout,
                             env={"HOME": str(work), "XDG_RUNTIME_DIR": str(work)})
            message = _registry_message(proc.stderr) if proc.returncode != 0 else ""
        except OciError as e:  # timed out
            message = str(e)
        index = _read_index(layout)
        entries = [m for m in index.get("manifests", [])
                   if (m.get("annotations") or {}).get(REF_ANNOTATION) != tmp_name]
        if message:  # a failed pull leaves no entry (its blobs go with the next gc())
            if len(entries) != len(index.get("manifests", [])):
                _write_index(layout, {**index, "manifests": entries})
            raise ImagePullError(str(ref), classify(message), message)
        digest = (work / "digest").read_text().strip()
        if not digest.startswith("sha256:") or not _HEX.match(digest[7:]):
            raise ImagePullError(str(ref), "failed", f"skopeo reported an unexpected digest {digest!r}")
        name = f"sha256-{digest[7:]}"
        copied = [m for m in index.get("manifests", [])
                  if (m.get("annotations") or {}).get(REF_ANNOTATION) == tmp_name]
        if len(copied) != 1 or copied[0]["digest"] != digest:
            raise ImagePullError(str(ref), "failed", f"skopeo left no single entry for {digest} in {layout}")
        entry = {**copied[0], "annotations": {**copied[0].get("annotations", {}), REF_ANNOTATION: name}}
        entries = [m for m in entries if (m.get("annotations") or {}).get(REF_ANNOTATION) != name] + [entry]
        _write_index(layout, {**index, "manifests": entries})
        try:
            image = _describe(layout, digest, str(ref))
        except OciError as e:
            raise ImagePullError(str(ref), "failed", str(e)) from None
    progress(f"pulled {ref} as {digest} ({len(image.layers)} layers, {image.size / 2**20:.1f} MiB)")
    return image


def images(images_dir: Path) -> list[str]:
    """The manifest digests the node's layout holds."""
    out = []
    for m in _read_index(layout_dir(images_dir)).get("manifests", []):
        name = (m.get("annotations") or {}).get(REF_ANNOTATION, "")
        if name == f"sha256-{m['digest'].partition(':')[2]}":
            out.append(m["digest"])
    return out


def remove(images_dir: Path, digest: str) -> bool:
    """Drops the image's entry from the layout (its blobs go with the next gc()); True if it was there."""
    layout = layout_dir(images_dir)
    name = f"sha256-{digest.partition(':')[2]}"
    with _locked(layout):
        index = _read_index(layout)
        keep = [m for m in index.get("manifests", []) if (m.get("annotations") or {}).get(REF_ANNOTATION) != name]
        if len(keep) == len(index.get("manifests", [])):
            return False
        _write_index(layout, {**index, "manifests": keep})
        return True


def gc(images_dir: Path) -> int:
    """Deletes blobs no entry of the layout reaches (left by removed images or failed pulls);
    returns how many. Entries of interrupted pulls (``pull-<pid>-…`` whose process is gone)
    are dropped first."""
    layout = layout_dir(images_dir)
    blobs = layout / "blobs" / "sha256"
    if not blobs.is_dir():
        return 0
    with _locked(layout):
        index = _read_index(layout)
        entries = []
        for m in index.get("manifests", []):
            name = (m.get("annotations") or {}).get(REF_ANNOTATION, "")
            if name.startswith("pull-") and not Path(f"/proc/{name.split('-')[1]}").exists():
                continue
            entries.append(m)
        if len(entries) != len(index.get("manifests", [])):
            _write_index(layout, {**index, "manifests": entries})
        live: set[str] = set()
        for m in entries:
            live.add(m["digest"])
            try:
                manifest = json.loads(_blob(layout, m["digest"]))
            except (OciError, ValueError):
                continue
            live.add(manifest.get("config", {}).get("digest", ""))
            live.update(x.get("digest", "") for x in manifest.get("layers", []))
        removed = 0
        for p in blobs.iterdir():
            if f"sha256:{p.name}" not in live:
                p.unlink()
                removed += 1
        return removed
