"""Where aenv is and which key to use: the one place that decides it.

Each setting comes from the first of: a global flag (``--api-url``, ``--sandbox-url``,
``--api-key``), ``AENV_*``, ``E2B_*`` (the SDK's variables: one set of exports serves
both), the credentials file ``aenv auth`` writes, a default. The file's key and data
plane URL are used only with the file's own API URL, so pointing ``E2B_API_URL``
elsewhere never sends the stored key to another server.

The file is TOML, ``url`` / ``api_key`` as AgentENV's ``aenv`` writes them (so one file
serves both) plus ``sandbox_url``, at ``<user config dir>/aenv/credentials``: XDG on
Linux (``$XDG_CONFIG_HOME`` or ``~/.config``), ``~/Library/Application Support`` on
macOS. It is written atomically, readable by the user only."""
from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from .errors import AUTH, CliError

if TYPE_CHECKING:
    from pathlib import Path

DEFAULT_API_URL = "http://127.0.0.1:3000"
API_PORT, DATA_PLANE_PORT = 3000, 3001  # scripts/up.sh: daphne (API) and uvicorn (data plane)
FILE_KEYS = {"api_url": "url", "sandbox_url": "sandbox_url", "api_key": "api_key"}
VARIABLES = {"api_url": ("AENV_API_URL", "E2B_API_URL"), "sandbox_url": ("AENV_SANDBOX_URL", "E2B_SANDBOX_URL"),
             "api_key": ("AENV_API_KEY", "E2B_API_KEY")}


class Config:
    """The settings in force, and where each came from (``sources``: setting -> flag,
    variable name, file or default). A plain class: dataclasses alone would add a
    sixth to ``aenv --help``'s start-up."""

    __slots__ = ("api_url", "sandbox_url", "api_key", "sources")

    def __init__(self, api_url: str, sandbox_url: str, api_key: str, sources: dict | None = None):
        self.api_url, self.sandbox_url, self.api_key = api_url, sandbox_url, api_key
        self.sources = sources or {}

    def __eq__(self, other) -> bool:
        return isinstance(other, Config) and (self.api_url, self.sandbox_url, self.api_key) == (
            other.api_url, other.sandbox_url, other.api_key)

    def __repr__(self) -> str:
        return f"Config(api_url={self.api_url!r}, sandbox_url={self.sandbox_url!r}, api_key=...)"


def credentials_path() -> Path:
    from pathlib import Path  # noqa: PLC0415 - only when the file is needed
    from platformdirs import user_config_dir  # noqa: PLC0415

    return Path(user_config_dir("aenv", appauthor=False)) / "credentials"


def _toml():
    if sys.version_info >= (3, 11):
        import tomllib  # noqa: PLC0415
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # noqa: PLC0415
    return tomllib


def read_credentials(path: Path | None = None) -> dict:
    """The file's settings by our names ({} when there is no file); CliError naming the
    file when it cannot be parsed."""
    path = path or credentials_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CliError(f"reading {path}: {exc.strerror}") from None
    toml = _toml()
    try:
        data = toml.loads(text)
    except toml.TOMLDecodeError as exc:
        raise CliError(f"parsing {path}: {exc}") from None
    return {ours: str(data[theirs]) for ours, theirs in FILE_KEYS.items() if isinstance(data.get(theirs), str)}


def write_credentials(settings: dict, path: Path | None = None) -> Path:
    """Writes ``settings`` (our names) as the credentials file, atomically, mode 0600."""
    path = path or credentials_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # TOML basic strings take JSON's escapes; ensure_ascii leaves only \\uXXXX for the rest.
    text = "".join(f"{FILE_KEYS[k]} = {json.dumps(settings[k])}\n" for k in FILE_KEYS if settings.get(k))
    import tempfile  # noqa: PLC0415 - only when writing

    fd, tmp = tempfile.mkstemp(prefix=".credentials-", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def remove_credentials(path: Path | None = None) -> bool:
    path = path or credentials_path()
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def default_sandbox_url(api_url: str) -> str:
    """The data plane next to ``api_url``: port 3001 for an API on 3000 (scripts/up.sh),
    else the same URL (one address behind a proxy that routes both)."""
    parts = urlsplit(api_url)
    if parts.port == API_PORT:
        host = parts.netloc.rsplit(":", 1)[0]
        return urlunsplit(parts._replace(netloc=f"{host}:{DATA_PLANE_PORT}"))
    return api_url


def resolve(flags: dict | None = None, environ=None, *, need_key: bool = True, path: Path | None = None) -> Config:
    """The settings in force (see the module docstring); CliError (exit 3) without a key
    when ``need_key``."""
    flags = {k: v for k, v in (flags or {}).items() if v}
    environ = os.environ if environ is None else environ
    values, sources = {}, {}
    for name, variables in VARIABLES.items():
        if name in flags:
            values[name], sources[name] = flags[name], "flag"
            continue
        for var in variables:
            if environ.get(var):
                values[name], sources[name] = environ[var], var
                break
    stored: dict = {}
    if len(values) < len(VARIABLES):
        stored = read_credentials(path)
    if "api_url" not in values:
        if stored.get("api_url"):
            values["api_url"], sources["api_url"] = stored["api_url"], "file"
        else:
            values["api_url"], sources["api_url"] = DEFAULT_API_URL, "default"
    api_url = values["api_url"].rstrip("/")
    same_server = stored.get("api_url", "").rstrip("/") == api_url
    for name in ("sandbox_url", "api_key"):
        if name not in values and same_server and stored.get(name):
            values[name], sources[name] = stored[name], "file"
    if "sandbox_url" not in values:
        values["sandbox_url"], sources["sandbox_url"] = default_sandbox_url(api_url), "default"
    if need_key and not values.get("api_key"):
        where = credentials_path() if path is None else path
        raise CliError(f"not authenticated: run `aenv auth`, or set E2B_API_KEY (no key in {where})", AUTH)
    return Config(api_url, values["sandbox_url"].rstrip("/"), values.get("api_key", ""), sources)
