"""The syntax of a Dockerfile, for ``dockerfile``: its logical instructions (parser
directives, continuations, comments) and Docker's word rules (quotes, the escape
character, ``$VAR`` references), plus the error both this and the conversion raise.

Apart from ``dockerfile`` so the conversion into build steps reads as rules per
instruction, with the character-level lexing here."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEREDOC = re.compile(r"<<-?\s*[\"']?[A-Za-z_][A-Za-z0-9_]*")


class DockerfileError(ValueError):
    """A Dockerfile aenv cannot turn into a template; says why and on which line (what
    ``dockerfile.parse`` raises, for its syntax and for what it cannot convert)."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.message, self.line = message, line

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}" if self.line else self.message


@dataclass
class Instruction:
    """One logical instruction: its keyword (upper case), the text after it, the line it starts on."""

    keyword: str
    rest: str
    line: int


# --------------------------------------------------------------------------- lines


def _directives(lines: list[str]) -> str:
    """The escape character the parser directives at the top choose (``\\`` or a backtick)."""
    escape = "\\"
    for raw in lines:
        m = re.match(r"^\s*#\s*([A-Za-z]+)\s*=\s*(\S+)\s*$", raw)
        if not m:
            break
        if m.group(1).lower() == "escape":
            if m.group(2) not in ("\\", "`"):
                raise DockerfileError(f"invalid escape directive {m.group(2)!r}: \\ or ` expected", 1)
            escape = m.group(2)
    return escape


def read_instructions(text: str) -> tuple[list[Instruction], str]:
    """The logical instructions (continuations joined, comments dropped) with the line
    each starts on, and the escape character."""
    lines = text.lstrip("\ufeff").splitlines()
    escape = _directives(lines)
    continued = re.compile(re.escape(escape) + r"[ \t]*$")
    out: list[Instruction] = []
    current: str | None = None
    start = 0
    for number, raw in enumerate(lines, start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (current is not None and not stripped):
            continue  # comments anywhere, blank lines inside a continuation
        if current is None:
            if not stripped:
                continue
            start, current, raw = number, "", raw.lstrip()
        body, n = continued.subn("", raw)
        current += body
        if not n:
            out.append(_split(current, start))
            current = None
    if current is not None and current.strip():
        out.append(_split(current, start))
    return out, escape


def _split(text: str, line: int) -> Instruction:
    keyword, rest = (re.split(r"\s+", text.strip(), maxsplit=1) + [""])[:2]
    return Instruction(keyword.upper(), rest.strip(), line)


# --------------------------------------------------------------------------- words


class Lexer:
    """Docker's word rules: quotes removed, the escape character takes the next one
    literally, ``$VAR`` replaced from ``known`` (a None value: unknown) or kept."""

    def __init__(self, escape: str, known: dict[str, str | None]):
        self.escape, self.known = escape, known

    def words(self, text: str, line: int, *, split: bool = True, shell_dollar: bool = False) -> list[str]:
        """``text`` as words (one word with its spaces when ``split`` is False).
        ``shell_dollar``: an escaped ``$`` stays ``\\$`` (a value a shell expands later)."""
        words: list[str] = []
        word: list[str] = []
        started = False
        i, n = 0, len(text)
        literal_dollar = "\\$" if shell_dollar else "$"
        while i < n:
            ch = text[i]
            if ch.isspace() and split:
                if started:
                    words.append("".join(word))
                    word, started = [], False
                i += 1
                continue
            started = True
            if ch == self.escape:
                if i + 1 < n:
                    word.append(literal_dollar if text[i + 1] == "$" else text[i + 1])
                i += 2
            elif ch == "'":
                end = text.find("'", i + 1)
                if end < 0:
                    raise DockerfileError("unterminated single quote", line)
                word.append(text[i + 1:end].replace("$", literal_dollar) if shell_dollar else text[i + 1:end])
                i = end + 1
            elif ch == '"':
                i += 1
                while True:
                    if i >= n:
                        raise DockerfileError("unterminated double quote", line)
                    c = text[i]
                    if c == '"':
                        i += 1
                        break
                    if c == self.escape and i + 1 < n and text[i + 1] in ('"', "$", self.escape):
                        word.append(literal_dollar if text[i + 1] == "$" else text[i + 1])
                        i += 2
                    elif c == "$":
                        value, i = self._variable(text, i, line)
                        word.append(value)
                    else:
                        word.append(c)
                        i += 1
            elif ch == "$":
                value, i = self._variable(text, i, line)
                word.append(value)
            else:
                word.append(ch)
                i += 1
        if started:
            words.append("".join(word))
        return words

    def substitute(self, text: str, line: int) -> str:
        """Only the ``$VAR`` references of ``text`` replaced (a JSON-form word)."""
        out, i = [], 0
        while i < len(text):
            if text[i] == "$":
                value, i = self._variable(text, i, line)
                out.append(value)
            else:
                out.append(text[i])
                i += 1
        return "".join(out)

    def _variable(self, text: str, i: int, line: int) -> tuple[str, int]:
        """The value of the reference at ``text[i] == '$'`` and where it ends; the
        reference as written when its value is not known."""
        if not text.startswith("${", i):
            m = NAME.match(text, i + 1)
            if not m:
                return "$", i + 1
            value = self.known.get(m.group(0))
            return (text[i:m.end()] if value is None else value), m.end()
        end = text.find("}", i)
        if end < 0:
            raise DockerfileError("missing '}' in a ${...} reference", line)
        inner = text[i + 2:end]
        m = NAME.match(inner)
        if not m:
            raise DockerfileError(f"bad substitution ${{{inner}}}", line)
        modifier = inner[m.end():]
        op = modifier[:2] if modifier.startswith(":") else modifier[:1]
        if op not in ("", ":-", "-", ":+", "+"):
            raise DockerfileError(f"unsupported modifier in ${{{inner}}} (:-, -, :+ and + are)", line)
        value = self.known.get(m.group(0))
        if value is None:
            return text[i:end + 1], end + 1
        word = modifier[len(op):]
        result = {"": value, ":-": value or word, "-": value, ":+": word if value else "", "+": word}[op]
        return result, end + 1


def parse_exec_form(rest: str) -> list[str] | None:
    """The words of a JSON exec form (``["a", "b"]``), or None for the shell form."""
    if not rest.startswith("["):
        return None
    try:
        value = json.loads(rest)
    except ValueError:
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


def split_flags(rest: str) -> tuple[list[tuple[str, str | None]], str]:
    """Leading ``--name[=value]`` words, and the rest."""
    flags = []
    while rest.startswith("--"):
        word, rest = (re.split(r"\s+", rest, maxsplit=1) + [""])[:2]
        name, eq, value = word[2:].partition("=")
        flags.append((name, value if eq else None))
    return flags, rest


def has_heredoc(rest: str) -> bool:
    """``<<WORD`` outside quotes (a here-string ``<<<`` is not one)."""
    quote = None
    for i, ch in enumerate(rest):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif rest.startswith("<<", i) and not rest.startswith("<<<", i) and (i == 0 or rest[i - 1] != "<"):
            if _HEREDOC.match(rest, i):
                return True
    return False
