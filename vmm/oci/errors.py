"""Errors of the OCI image path (pull, unpack, guest disk).

Why a module of their own: callers (the template builder, the node, the API) turn them into a
build status and a message the user can act on, so they must be importable without the tools
and carry what went wrong in words, not only an exit code.
"""

from __future__ import annotations


class OciError(Exception):
    """Something on the OCI image path failed (a tool, a bad image, a bad local store)."""


class ToolMissing(OciError):
    """A host tool (skopeo, umoci, mke2fs, debugfs, qemu-img) is not installed."""


class ImagePullError(OciError):
    """An image could not be pulled. ``kind`` says why, for callers that map it to a status:

    ``invalid``      the reference is not a valid image reference
    ``not_found``    the registry answered, but has no such repository, tag or digest
    ``unauthorized`` the registry refused the credentials (or needs some and got none)
    ``unreachable``  no registry answered there (unknown host, refused, TLS mismatch)
    ``failed``       anything else (the registry's or skopeo's message says what)

    ``message`` is the registry's own words where there are some (skopeo's last error line).
    """

    KINDS = ("invalid", "not_found", "unauthorized", "unreachable", "failed")

    def __init__(self, ref: str, kind: str, message: str):
        assert kind in self.KINDS, kind
        self.ref = ref
        self.kind = kind
        self.message = message
        super().__init__(f"cannot pull {ref}: {message}")
