"""The settings a sandbox is created with, as one value.

Why: a sandbox derived from another (a fork child; later a restore that keeps its
source's settings) must carry all of them. Copying field by field at each place that
derives a sandbox is how a fork child once lost ``auto_pause_memory``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass(frozen=True)
class SandboxOptions:
    metadata: dict = field(default_factory=dict)
    env_vars: dict = field(default_factory=dict)
    secure: bool = False
    # at the end of the TTL: pause (True) or kill; a pause keeps memory unless auto_pause_memory is False
    auto_pause: bool = True
    auto_pause_memory: bool = True
    # traffic to a paused sandbox resumes it
    auto_resume: bool = False
    allow_internet_access: bool | None = None
    network: dict | None = None

    def fields(self) -> dict:
        """The Sandbox model fields these options set (dicts copied: rows never share them)."""
        values = asdict(self)
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in values.items()}

    @classmethod
    def of(cls, sandbox) -> "SandboxOptions":
        """The options a sandbox row was created with (what a derived sandbox inherits)."""
        return cls(**{f.name: getattr(sandbox, f.name) for f in fields(cls)})
