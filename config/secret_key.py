"""Django's SECRET_KEY, unique to each installation.

Why: a fixed default key in the source would let anyone forge what this installation
signs (sessions, password-reset tokens, signed values). The first start generates a
random key under AENV_HOME (owner-only), every later start and every other process of
the installation reuses it; ``DJANGO_SECRET_KEY`` still wins. The old public default is
refused outside debug mode, wherever it comes from.
"""
import os
import secrets
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

# The key every installation shared before keys were generated: public, never valid.
PUBLIC_DEFAULT_KEY = "aenv-dev-insecure-change-me"
KEY_FILE_NAME = "secret_key"


class InsecureSecretKey(ImproperlyConfigured):
    """The configured key is the public default (or empty) and debug mode is off."""


def _read(path: Path) -> str:
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)  # a key others can read is no secret
    return path.read_text().strip()


def _generate(path: Path) -> str:
    """Writes a new key unless another process won the race; returns the key on disk.
    The file appears whole (written aside, then hard-linked into place), so a
    concurrent reader never sees a half-written key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{KEY_FILE_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(50) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process of this installation wrote it first: use theirs
    finally:
        tmp.unlink(missing_ok=True)
    return _read(path)


def load_secret_key(home: Path, from_env: str | None, debug: bool) -> str:
    """The key to use: the environment's if set, else the one kept under ``home``
    (generated on first use)."""
    if from_env:
        key = from_env
    else:
        path = Path(home) / KEY_FILE_NAME
        key = _read(path) if path.exists() else _generate(path)
    if (not key or key == PUBLIC_DEFAULT_KEY) and not debug:
        raise InsecureSecretKey(
            "refusing to start: the secret key is the public default 'aenv-dev-insecure-change-me' (or empty). "
            f"Unset DJANGO_SECRET_KEY to use the generated key in {Path(home) / KEY_FILE_NAME}, or set it to a "
            "long random value.")
    return key
