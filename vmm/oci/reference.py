"""Image references as users write them (``python:3.11``, ``ghcr.io/o/r@sha256:…``), normalised.

Why our own parser: a reference is checked before any tool runs (a typo is an ``invalid``
pull error, not a registry round trip), its registry host is needed to file credentials under
the right key of an auth file, and a reference pinned by digest can be served from the local
store without asking the registry. The grammar and the normalisation are Docker's (the
distribution ``reference`` package): no host means ``docker.io``, a single-component Docker
Hub name gets ``library/``, no tag and no digest means ``:latest``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vmm.oci.errors import ImagePullError

DEFAULT_REGISTRY = "docker.io"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*(?::[0-9]+)?"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_PATH = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_DOMAIN_RE = re.compile(rf"^{_DOMAIN}$")
_TAG_RE = re.compile(rf"^{_TAG}$")
_DIGEST_RE = re.compile(rf"^{_DIGEST}$")


@dataclass(frozen=True)
class ImageRef:
    registry: str      # "docker.io", "127.0.0.1:5000", "ghcr.io"
    repository: str    # "library/python", "org/app"
    tag: str = ""      # "" when pinned by digest only
    digest: str = ""   # "sha256:<hex>" or ""

    def __str__(self) -> str:
        return (f"{self.registry}/{self.repository}" + (f":{self.tag}" if self.tag else "")
                + (f"@{self.digest}" if self.digest else ""))

    @property
    def transport(self) -> str:
        """The reference as skopeo's docker transport takes it."""
        return f"docker://{self}"


def parse(text: str) -> ImageRef:
    """Parses and normalises an image reference; raises ImagePullError(kind="invalid")."""
    original = text
    text = (text or "").strip()
    if text.startswith("docker://"):
        text = text[len("docker://"):]
    if not text or len(text) > 4096 or any(c.isspace() for c in text):
        raise ImagePullError(original, "invalid", "not an image reference (empty, too long or with spaces)")
    name, digest = text, ""
    if "@" in text:
        name, digest = text.split("@", 1)
        if not _DIGEST_RE.match(digest):
            raise ImagePullError(original, "invalid", f"invalid digest {digest!r} (expected sha256:<hex>)")
    tag = ""
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = name.rsplit(":", 1)
        if not _TAG_RE.match(tag):
            raise ImagePullError(original, "invalid", f"invalid tag {tag!r}")
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, rest
        if not _DOMAIN_RE.match(registry):
            raise ImagePullError(original, "invalid", f"invalid registry host {registry!r}")
    else:
        registry, path = DEFAULT_REGISTRY, name
    if not _PATH.match(path):
        raise ImagePullError(original, "invalid", f"invalid repository name {path!r} "
                                                  "(lowercase letters, digits and . _ - separators)")
    if registry == DEFAULT_REGISTRY and "/" not in path:
        path = f"library/{path}"
    if len(f"{registry}/{path}") > 255:
        raise ImagePullError(original, "invalid", "repository name longer than 255 characters")
    if not tag and not digest:
        tag = "latest"
    return ImageRef(registry=registry, repository=path, tag=tag, digest=digest.lower())
