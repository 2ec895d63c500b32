"""E2B's template name grammar: ``[namespace "/"] alias [":" tag]`` (spec §5.1).

Trimmed and lower-cased; ``namespace`` and ``alias`` are ``[a-z0-9_-]+``, a tag is
``[a-z0-9_.-]+``. ``:default`` means "no explicit tag". A tag may hold a build id when
a name is *resolved* (``name:<buildID>``), never when one is *assigned*."""
from __future__ import annotations

import re
import secrets
import string
import uuid
from dataclasses import dataclass

PART = re.compile(r"^[a-z0-9_-]+$")
TAG = re.compile(r"^[a-z0-9_.-]+$")
MAX_NAME = 128
DEFAULT_TAG = "default"
ID_ALPHABET = string.ascii_lowercase + string.digits


class InvalidName(ValueError):
    """A name, alias or tag outside the grammar; the message says what is wrong."""


@dataclass(frozen=True)
class Name:
    namespace: str | None
    alias: str
    tag: str | None  # None: no explicit tag (also for ":default")

    def __str__(self) -> str:
        text = f"{self.namespace}/{self.alias}" if self.namespace else self.alias
        return f"{text}:{self.tag}" if self.tag else text


def parse(ref: str) -> Name:
    """``ref`` as a Name; InvalidName if it is not one."""
    if not isinstance(ref, str):
        raise InvalidName("a name must be a string")
    text = ref.strip().lower()
    if not text:
        raise InvalidName("a name must not be empty")
    if len(text) > MAX_NAME:
        raise InvalidName(f"a name must be at most {MAX_NAME} characters")
    namespace = None
    rest = text
    if "/" in rest:
        namespace, rest = rest.split("/", 1)
        if not PART.match(namespace):
            raise InvalidName(f"invalid namespace '{namespace}': use lowercase letters, digits, '-' and '_'")
    tag = None
    if ":" in rest:
        rest, tag = rest.split(":", 1)
        tag = check_tag(tag, assigning=False)
    if not PART.match(rest):
        raise InvalidName(f"invalid alias '{rest}': use lowercase letters, digits, '-' and '_'")
    return Name(namespace, rest, None if tag == DEFAULT_TAG else tag)


def check_tag(tag: str, *, assigning: bool = True) -> str:
    """A tag, normalised; InvalidName if it is not one (or, when ``assigning``, looks like
    a build id, which would shadow ``name:<buildID>``)."""
    if not isinstance(tag, str):
        raise InvalidName("a tag must be a string")
    tag = tag.strip().lower()
    if not tag or not TAG.match(tag):
        raise InvalidName(f"invalid tag '{tag}': use lowercase letters, digits, '.', '-' and '_'")
    if assigning and is_uuid(tag):
        raise InvalidName(f"invalid tag '{tag}': a tag must not look like a build ID")
    return tag


def is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except (ValueError, TypeError, AttributeError):
        return False
    return True


def new_template_id() -> str:
    """20 characters of ``[a-z0-9]`` like E2B's, starting with "t" (snapshots start with
    "s", sandboxes with "i": an id alone says what it names)."""
    return "t" + "".join(secrets.choice(ID_ALPHABET) for _ in range(19))
