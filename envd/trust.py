"""Installing the node's TLS-interception CA in the guest's trust stores (``POST /aenv/trust``).

Why: the node's egress proxy ends the guest's TLS to a host that has ``network.rules`` with a
certificate from the node's CA (``vmm.egress_ca``) so it can add the rule's headers; the
guest's clients must trust that CA, wherever they look:

- the system bundle (``SYSTEM_BUNDLES``: Debian/Ubuntu/Alpine's, Fedora/RHEL's): OpenSSL,
  curl, Python's ``ssl`` default context, Go;
- every ``certifi/cacert.pem`` under the usual Python prefixes (``CERTIFI_GLOBS``): requests,
  httpx, pip and everything else that trusts only certifi's copy;
- Node.js, which trusts only its built-in list: ``NODE_EXTRA_CA_CERTS`` in the environment
  envd gives every process it starts (``ENV_FILE``, read by ``envd.state``), beside
  ``SSL_CERT_FILE`` and ``REQUESTS_CA_BUNDLE`` naming the system bundle (so a certifi
  installed later, e.g. by ``pip install`` in a new venv, is not the only list requests sees).

The CA is also kept in ``CA_FILE`` and in Debian's ``ANCHOR`` (so a later
``update-ca-certificates`` keeps it). Each copy in a bundle is one marked block; installing
again replaces any earlier aenv block (a sandbox restored or moved onto another node trusts
that node's CA, not the old one's); installing the same CA twice changes nothing. A bundle is
rewritten aside and renamed into place (its mode kept), symlinks are followed (Debian's certifi
is a link to the system bundle), and each real file is written once."""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import ssl

MARK = "# aenv egress CA"
CA_FILE = "/etc/aenv/egress-ca.pem"
ENV_FILE = "/etc/aenv/egress-trust.json"
ANCHOR = "/usr/local/share/ca-certificates/aenv-egress-ca.crt"
SYSTEM_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt",
                  "/etc/ssl/cert.pem")
CERTIFI_GLOBS = tuple(f"{prefix}/lib/python3*/{site}/certifi/cacert.pem"
                      for prefix in ("/usr", "/usr/local", "/opt/*", "/opt/*/*", "/home/*/.local", "/root/.local",
                                     "/home/*/*", "/home/*/.venv", "/root/.venv", "/code/.venv", "/app/.venv")
                      for site in ("site-packages", "dist-packages"))
_BLOCK = re.compile(re.escape(MARK) + r"[^\n]*\n-----BEGIN CERTIFICATE-----\n.*?-----END CERTIFICATE-----\n?",
                    re.DOTALL)
_PEM = re.compile(r"-----BEGIN CERTIFICATE-----\r?\n[A-Za-z0-9+/=\r\n]+-----END CERTIFICATE-----\r?\n?")


class BadCertificate(ValueError):
    """The body is not one PEM certificate."""


def checked_pem(pem: str) -> tuple[str, str]:
    """``(the certificate as one normalised PEM block, its SHA-256 hex)``."""
    if not isinstance(pem, str):
        raise BadCertificate("pem must be a string")
    blocks = _PEM.findall(pem.strip() + "\n")
    if len(blocks) != 1:
        raise BadCertificate("pem must hold exactly one PEM certificate")
    try:
        der = ssl.PEM_cert_to_DER_cert(blocks[0].replace("\r", ""))
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        probe.load_verify_locations(cadata=der)  # OpenSSL parses it: garbage in base64 fails here
    except (ValueError, ssl.SSLError) as exc:
        raise BadCertificate(f"not a PEM certificate: {exc}") from None
    if len(probe.get_ca_certs()) != 1:
        raise BadCertificate("not a CA certificate (basicConstraints CA:TRUE)")
    return ssl.DER_cert_to_PEM_cert(der), hashlib.sha256(der).hexdigest()


def _rewrite(path: str, text: str) -> None:
    """``path`` replaced whole by ``text``, keeping its mode and (as root) its owner."""
    old = os.stat(path) if os.path.exists(path) else None
    tmp = f"{path}.aenv-{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, old.st_mode & 0o7777 if old else 0o644)
    if old is not None and os.geteuid() == 0:
        os.chown(tmp, old.st_uid, old.st_gid)
    os.replace(tmp, path)


def _with_block(current: str, block: str) -> str:
    rest = _BLOCK.sub("", current)
    if rest and not rest.endswith("\n"):
        rest += "\n"
    return rest + block


def _write_small(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _rewrite(path, text)


def bundles(root: str = "/") -> list[str]:
    """The real files of every trust bundle present under ``root`` (links followed, each once)."""
    found: list[str] = []
    for pattern in (*SYSTEM_BUNDLES, *CERTIFI_GLOBS):
        for path in sorted(glob.glob(os.path.join(root, pattern.lstrip("/")))):
            real = os.path.realpath(path)
            if os.path.isfile(real) and real not in found:
                found.append(real)
    return found


def install(pem: str, root: str = "/") -> dict:
    """Trusts ``pem`` (one CA certificate) everywhere the module lists; returns
    ``{"fingerprint", "bundles": [files changed], "env": {...}}``."""
    cert, fingerprint = checked_pem(pem)
    block = f"{MARK} {fingerprint}\n{cert}"
    changed = []
    for path in bundles(root):
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            current = f.read()
        updated = _with_block(current, block)
        if updated != current:
            _rewrite(path, updated)
            changed.append(path)
    at = lambda p: os.path.join(root, p.lstrip("/"))  # noqa: E731
    _write_small(at(CA_FILE), cert)
    if os.path.isdir(os.path.dirname(at(ANCHOR))) or os.path.isdir(at("/usr/local/share")):
        _write_small(at(ANCHOR), cert)
    env = {"NODE_EXTRA_CA_CERTS": CA_FILE}
    system = next((p for p in SYSTEM_BUNDLES if os.path.isfile(at(p))), None)
    if system is not None:
        env.update({"SSL_CERT_FILE": system, "REQUESTS_CA_BUNDLE": system})
    _write_small(at(ENV_FILE), json.dumps({"fingerprint": fingerprint, "env": env}))
    return {"fingerprint": fingerprint, "bundles": changed, "env": env}


def installed_env(root: str = "/") -> dict:
    """The environment variables an earlier ``install`` asked every process to get ({} if none)."""
    try:
        with open(os.path.join(root, ENV_FILE.lstrip("/")), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    env = data.get("env") if isinstance(data, dict) else None
    return {str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {}
