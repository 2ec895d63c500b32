"""The pure part of a template build (no VM, no database): what each step means, its
cache key, and the build context a step leaves behind.

Why pure: E2B's semantics (spec §4) are a handful of small rules — the context (user,
workdir, env vars) a step sees, which steps a ``force`` flag rebuilds, how COPY turns
``src``/``dest`` into paths, how ENV values expand — and they must be right before any VM
runs. ``agent.builder.steps`` turns them into commands inside the build VM."""
from __future__ import annotations

import hashlib
import posixpath
import re
from dataclasses import dataclass, field

# E2B's builder appends these to a PATH an ENV step sets (spec §4.2).
STANDARD_PATH = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
DEFAULT_USER = "user"
# Bump when the meaning of a cached layer changes (the builder's scripts, the key format).
CACHE_VERSION = "1"

_GLOB = re.compile(r"[*?\[]")
_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}\$?$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_VAR = re.compile(r"\\\$|\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_MODE = re.compile(r"^[0-7]{1,4}$")


class StepError(Exception):
    """A step that cannot run as written (bad arguments): the build fails at that step."""


@dataclass
class Context:
    """What the next step runs with: E2B's build context. ``workdir`` "" means unset (the
    user's home)."""

    user: str = "root"
    workdir: str = ""
    env: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"user": self.user, "workdir": self.workdir, "env": dict(self.env)}

    @classmethod
    def from_json(cls, data: dict | None) -> "Context":
        data = data or {}
        return cls(user=str(data.get("user") or "root"), workdir=str(data.get("workdir") or ""),
                   env={str(k): str(v) for k, v in (data.get("env") or {}).items()})

    def copy(self) -> "Context":
        return Context.from_json(self.to_json())


def home_of(user: str) -> str:
    """The home a user gets here (root's, or ``useradd --create-home``'s)."""
    return "/root" if user == "root" else f"/home/{user}"


def cwd_of(ctx: Context) -> str:
    return ctx.workdir or home_of(ctx.user)


def command_env(ctx: Context) -> dict[str, str]:
    """The env vars a step's command gets: the context's, a PATH they set completed with the
    standard directories."""
    env = dict(ctx.env)
    if "PATH" in env:
        parts = [p for p in env["PATH"].split(":") if p]
        env["PATH"] = ":".join(parts + [p for p in STANDARD_PATH if p not in parts])
    return env


# ------------------------------------------------------------------ keys and force

def digest(*parts: str) -> str:
    return hashlib.sha256(";".join(parts).encode()).hexdigest()


def base_key(team_id: str, base: str) -> str:
    """The key of the build's starting point. Team-scoped: a layer is only ever reused by
    the team that made it (a COPY's files hash is chosen by the client)."""
    return digest("aenv-layer", CACHE_VERSION, f"team:{team_id}", base)


def step_key(parent: str, step: dict) -> str:
    """E2B's chain key: the parent's key, the step's type, its args and its files hash."""
    return digest(parent, step["type"], " ".join(step.get("args") or []), step.get("files_hash") or "")


def forced_from(steps: list[dict], force: bool) -> int:
    """The 0-based index of the first step that must be rebuilt: a top-level ``force``
    rebuilds everything, a step's ``force`` that step and every later one (their keys miss
    anyway once one layer is new). ``len(steps)``: nothing is forced."""
    if force:
        return 0
    return next((i for i, s in enumerate(steps) if s.get("force")), len(steps))


@dataclass(frozen=True)
class Planned:
    """One step of the build, with its 1-based number (E2B's ``reason.step``) and key."""

    number: int
    total: int
    step: dict
    key: str
    forced: bool

    @property
    def kind(self) -> str:
        return {"ADD": "COPY", "ARG": "ENV"}.get(self.step["type"], self.step["type"])

    @property
    def label(self) -> str:
        args = " ".join(self.step.get("args") or [])
        return f"[builder {self.number}/{self.total}] {self.step['type']} {args}".rstrip()


def plan(base: str, steps: list[dict], force: bool) -> list[Planned]:
    first_forced = forced_from(steps, force)
    out, key = [], base
    for i, step in enumerate(steps):
        key = step_key(key, step)
        out.append(Planned(i + 1, len(steps), step, key, i >= first_forced))
    return out


# ------------------------------------------------------------------ the step kinds

def check_user(name: str) -> str:
    name = (name or "").strip()
    if not _NAME.match(name):
        raise StepError(f"invalid user name {name!r}")
    return name


def workdir_after(ctx: Context, arg: str) -> str:
    """WORKDIR: relative paths join the current workdir (or /)."""
    arg = (arg or "").strip()
    if not arg:
        raise StepError("WORKDIR needs a path")
    return posixpath.normpath(posixpath.join(ctx.workdir or "/", arg))


def env_pairs(args: list[str]) -> list[tuple[str, str]]:
    if len(args) < 2 or len(args) % 2:
        raise StepError("ENV needs key and value pairs")
    pairs = list(zip(args[0::2], args[1::2]))
    for key, _ in pairs:
        if not _ENV_KEY.match(key):
            raise StepError(f"invalid environment variable name {key!r}")
    return pairs


def expand(value: str, env: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` replaced from ``env`` (unset: empty), ``\\$`` kept as a
    literal ``$``; nothing is executed (``$(…)`` and backticks stay text)."""
    def one(m: re.Match) -> str:
        if m.group(0) == "\\$":
            return "$"
        return env.get(m.group(1) or m.group(2), "")

    return _VAR.sub(one, value)


def owner_of(arg: str, ctx: Context) -> str:
    """COPY's owner: ``u`` → ``u:u``, ``u:g`` as given, "" → the context user's."""
    arg = (arg or "").strip() or ctx.user
    user, _, group = arg.partition(":")
    check_user(user)
    if group:
        check_user(group)
    return f"{user}:{group or user}"


def mode_of(arg: str) -> str:
    arg = (arg or "").strip()
    if arg and not _MODE.match(arg):
        raise StepError(f"invalid mode {arg!r} (an octal number like 0755)")
    return arg


@dataclass(frozen=True)
class CopyPlan:
    """COPY ``src`` ``dest``: ``source`` is the path inside the archive (src cut before its
    first glob character), ``dest`` absolute; ``into``: dest ends with "/" (a file goes
    into it)."""

    source: str
    dest: str
    into: bool
    owner: str
    mode: str


def copy_plan(args: list[str], ctx: Context) -> CopyPlan:
    if len(args) < 2 or not args[0] or not args[1]:
        raise StepError("COPY needs a source and a destination")
    src, dest = args[0], args[1]
    cut = _GLOB.search(src)
    source = src[:cut.start()] if cut else src
    source = posixpath.normpath(source or ".").lstrip("/")
    if source == ".." or source.startswith("../"):
        raise StepError(f"COPY source {src!r} leaves the build context")
    into = dest.endswith("/")
    path = dest if dest.startswith("/") else posixpath.join(cwd_of(ctx), dest)
    path = posixpath.normpath(path)
    return CopyPlan(source=source, dest=path, into=into, owner=owner_of(args[2] if len(args) > 2 else "", ctx),
                    mode=mode_of(args[3] if len(args) > 3 else ""))
