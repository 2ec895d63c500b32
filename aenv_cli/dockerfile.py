"""Reads a Dockerfile into the steps of E2B's template build API (spec e2b-templates.md
§3), the way the E2B SDK's ``Template.from_dockerfile`` does, so ``aenv template build``
needs no SDK and no Docker.

What a Dockerfile may hold (anything else is refused with the line it is on):

- ``FROM image [AS name]``: one stage only (a second ``FROM`` or ``COPY --from`` is
  refused); ``ARG`` before ``FROM`` only serves ``$VAR`` in the image (Docker's scope);
  ``--platform`` is ignored with a warning.
- ``RUN``: shell form (kept as written, for ``bash -l -c``) or JSON exec form (quoted and
  joined); ``--mount=type=cache``, ``--network`` and ``--security`` are ignored with a
  warning, other mounts refused. Heredocs (``<<EOF``) are refused.
- ``COPY`` / ``ADD``: ``--chown=user[:group]``, ``--chmod=0755`` (``--link`` ignored);
  several sources give one COPY step each, and then the destination must end in ``/``.
  ``ADD`` of a URL or of a tar archive is refused (``ADD`` never unpacks here).
- ``ENV k=v ...`` and the legacy ``ENV k v``: one ENV step each; ``ARG k=default``
  becomes an ENV step with the default, an ``ARG`` without one is skipped.
- ``WORKDIR``, ``USER``: one step each.
- ``CMD`` / ``ENTRYPOINT`` (shell or exec form, combined by Docker's rules): the start
  command; its ready command is ``sleep 20`` unless the caller gives one.
- ``EXPOSE``, ``LABEL``, ``MAINTAINER``, ``STOPSIGNAL``, ``VOLUME``: ignored with a
  warning (a template has no such metadata). ``SHELL`` is refused (steps always run in
  ``bash -l -c``), as are ``HEALTHCHECK``, ``ONBUILD`` and unknown instructions.

Like ``from_dockerfile``, the steps start with ``USER root`` + ``WORKDIR /`` (Docker's
defaults) and end with ``USER user`` + ``WORKDIR /home/user`` (E2B's) unless the
Dockerfile set them.

Variables: ``$VAR`` / ``${VAR}`` / ``${VAR:-x}`` / ``${VAR:+x}`` in FROM, COPY, WORKDIR
and USER are replaced by the values ``ARG`` and ``ENV`` gave them earlier in the file;
a variable it does not know (say ``$HOME``, from the image) is left as written. ENV
values are substituted the same way and keep unknown references for the builder, which
expands them (an escaped ``\\$`` stays ``\\$``, a literal dollar for it). RUN commands
and the start command are left to the shell."""
from __future__ import annotations

import json
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from pathlib import PurePosixPath

DEFAULT_READY_CMD = "sleep 20"  # what from_dockerfile gives a CMD / ENTRYPOINT
IGNORED = {"EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "VOLUME"}
REFUSED = {
    "SHELL": "SHELL is not supported: template steps always run with bash -l -c",
    "HEALTHCHECK": "HEALTHCHECK is not supported: use --ready-cmd for the template's ready check",
    "ONBUILD": "ONBUILD is not supported",
}
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tbz", ".tar.xz", ".txz", ".tar.zst")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)
_CHMOD = re.compile(r"^[0-7]{3,4}$")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEREDOC = re.compile(r"<<-?\s*[\"']?[A-Za-z_][A-Za-z0-9_]*")


class DockerfileError(ValueError):
    """A Dockerfile aenv cannot turn into a template; says why and on which line."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.message, self.line = message, line

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}" if self.line else self.message


@dataclass
class Step:
    """One step of the build API: ``type`` (COPY, RUN, ENV, WORKDIR, USER) and ``args``
    as the wire has them (COPY: ``[src, dest, owner, mode]``); ``line`` is where it came
    from (0: added by aenv)."""

    type: str
    args: list[str]
    line: int = 0


@dataclass
class Recipe:
    """A parsed Dockerfile: the base image, the steps, the start command (None when the
    file has no CMD / ENTRYPOINT) and warnings about what was ignored."""

    from_image: str
    steps: list[Step]
    start_cmd: str | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def copies(self) -> list[Step]:
        return [s for s in self.steps if s.type == "COPY"]


@dataclass
class _Instruction:
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


def _instructions(text: str) -> tuple[list[_Instruction], str]:
    """The logical instructions (continuations joined, comments dropped) with the line
    each starts on, and the escape character."""
    lines = text.lstrip("\ufeff").splitlines()
    escape = _directives(lines)
    continued = re.compile(re.escape(escape) + r"[ \t]*$")
    out: list[_Instruction] = []
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


def _split(text: str, line: int) -> _Instruction:
    keyword, rest = (re.split(r"\s+", text.strip(), maxsplit=1) + [""])[:2]
    return _Instruction(keyword.upper(), rest.strip(), line)


# --------------------------------------------------------------------------- words


class _Lexer:
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
            m = _NAME.match(text, i + 1)
            if not m:
                return "$", i + 1
            value = self.known.get(m.group(0))
            return (text[i:m.end()] if value is None else value), m.end()
        end = text.find("}", i)
        if end < 0:
            raise DockerfileError("missing '}' in a ${...} reference", line)
        inner = text[i + 2:end]
        m = _NAME.match(inner)
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


def _exec_form(rest: str) -> list[str] | None:
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


def _flags(rest: str) -> tuple[list[tuple[str, str | None]], str]:
    """Leading ``--name[=value]`` words, and the rest."""
    flags = []
    while rest.startswith("--"):
        word, rest = (re.split(r"\s+", rest, maxsplit=1) + [""])[:2]
        name, eq, value = word[2:].partition("=")
        flags.append((name, value if eq else None))
    return flags, rest


def _has_heredoc(rest: str) -> bool:
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


# --------------------------------------------------------------------------- the file


class _Converter:
    """One pass over the instructions: the steps, the variables known so far (for
    ``$VAR``), whether USER / WORKDIR were set, the last CMD and ENTRYPOINT."""

    def __init__(self, escape: str):
        self.known: dict[str, str | None] = {}
        self.lexer = _Lexer(escape, self.known)
        self.steps: list[Step] = [Step("USER", ["root"]), Step("WORKDIR", ["/"])]
        self.warnings: list[str] = []
        self.user_set = self.workdir_set = False
        self.cmd_form: tuple[bool, list[str]] | None = None
        self.entrypoint_form: tuple[bool, list[str]] | None = None

    def warn(self, line: int, message: str) -> None:
        self.warnings.append(f"line {line}: {message}")

    def remember(self, key: str, value: str) -> None:
        self.known[key] = None if "$" in value else value

    def convert(self, instructions: list[_Instruction]) -> Recipe:
        froms = [i for i in instructions if i.keyword == "FROM"]
        if not froms:
            raise DockerfileError("the Dockerfile has no FROM instruction")
        if len(froms) > 1:
            raise DockerfileError("multi-stage Dockerfiles are not supported (a second FROM; "
                                  f"the first is on line {froms[0].line})", froms[1].line)
        image = None
        for ins in instructions:
            if image is None and ins.keyword not in ("FROM", "ARG"):
                raise DockerfileError(f"{ins.keyword} before FROM", ins.line)
            if ins.keyword == "FROM":
                image = self.from_(ins)
            elif image is None:  # ARG before FROM: only for the image reference
                for name, value in self.args(ins):
                    if value is None:
                        self.known.setdefault(name, None)
                    else:
                        self.remember(name, value)
            else:
                self.instruction(ins)
        if not self.user_set:
            self.steps.append(Step("USER", ["user"]))
        if not self.workdir_set:
            self.steps.append(Step("WORKDIR", ["/home/user"]))
        return Recipe(image, self.steps, self.start_cmd(), self.warnings)

    def instruction(self, ins: _Instruction) -> None:
        kw = ins.keyword
        handlers = {"RUN": self.run, "COPY": self.copy, "ADD": self.copy, "ENV": self.env, "ARG": self.arg,
                    "WORKDIR": self.workdir, "USER": self.user, "CMD": self.cmd, "ENTRYPOINT": self.entrypoint}
        if kw in handlers:
            handlers[kw](ins)
        elif kw in IGNORED:
            self.warn(ins.line, f"{kw} is ignored (a template has no such metadata)")
        elif kw in REFUSED:
            raise DockerfileError(REFUSED[kw], ins.line)
        else:
            raise DockerfileError(f"unknown or unsupported instruction {kw}", ins.line)

    def no_flags(self, ins: _Instruction) -> str:
        flags, rest = _flags(ins.rest)
        if flags:
            raise DockerfileError(f"{ins.keyword} takes no flags (--{flags[0][0]})", ins.line)
        return rest

    def from_(self, ins: _Instruction) -> str:
        flags, rest = _flags(ins.rest)
        for name, _value in flags:
            if name != "platform":
                raise DockerfileError(f"unknown FROM flag --{name}", ins.line)
            self.warn(ins.line, "FROM --platform is ignored (the node's architecture is used)")
        words = self.lexer.words(rest, ins.line)
        if len(words) == 3 and words[1].lower() == "as":
            pass  # the stage name does not matter in a single stage
        elif len(words) != 1:
            raise DockerfileError("FROM takes an image and optionally AS <name>", ins.line)
        if not words[0] or "$" in words[0]:
            raise DockerfileError(f"FROM {words[0]!r}: not an image reference (an undefined ARG?)", ins.line)
        return words[0]

    def run(self, ins: _Instruction) -> None:
        flags, rest = _flags(ins.rest)
        for name, value in flags:
            if name == "mount" and "type=cache" not in (value or "").split(","):
                raise DockerfileError(f"RUN --mount={value} is not supported (only type=cache, ignored)", ins.line)
            if name not in ("mount", "network", "security"):
                raise DockerfileError(f"unknown RUN flag --{name}", ins.line)
            self.warn(ins.line, f"RUN --{name} is ignored")
        words = _exec_form(rest)
        if words is not None:
            command = shlex.join(words)
        else:
            if _has_heredoc(rest):
                raise DockerfileError("heredocs (<<EOF) are not supported: put the script in a file, COPY it and "
                                      "RUN it", ins.line)
            command = rest
        if not command.strip():
            raise DockerfileError("RUN needs a command", ins.line)
        self.steps.append(Step("RUN", [command], ins.line))

    def copy(self, ins: _Instruction) -> None:
        kw = ins.keyword
        flags, rest = _flags(ins.rest)
        owner = mode = ""
        for name, value in flags:
            if name in ("chown", "chmod") and not value:
                raise DockerfileError(f"{kw} --{name} needs a value", ins.line)
            if name == "chown":
                owner = self.lexer.words(value, ins.line, split=False)[0]
            elif name == "chmod":
                resolved = self.lexer.words(value, ins.line, split=False)[0]
                if not _CHMOD.match(resolved):
                    raise DockerfileError(f"{kw} --chmod={value}: an octal mode such as 0755 expected", ins.line)
                mode = f"{int(resolved, 8):04o}"
            elif name == "from":
                raise DockerfileError(f"{kw} --from is not supported (multi-stage builds are not)", ins.line)
            elif name == "link":
                self.warn(ins.line, f"{kw} --link is ignored")
            else:
                raise DockerfileError(f"{kw} --{name} is not supported", ins.line)
        words = _exec_form(rest)
        if words is None:
            if _has_heredoc(rest):
                raise DockerfileError(f"heredocs (<<EOF) in {kw} are not supported: put the content in a file",
                                      ins.line)
            words = self.lexer.words(rest, ins.line)
        else:
            words = [self.lexer.substitute(w, ins.line) for w in words]
        if len(words) < 2:
            raise DockerfileError(f"{kw} needs a source and a destination", ins.line)
        *sources, dest = words
        if len(sources) > 1 and not dest.endswith("/"):
            raise DockerfileError(f"{kw} with several sources needs a destination ending in '/'", ins.line)
        for src in sources:
            if kw == "ADD" and _URL.match(src):
                raise DockerfileError(f"ADD from a URL is not supported ({src}): RUN curl it", ins.line)
            if kw == "ADD" and src.lower().endswith(ARCHIVE_SUFFIXES):
                raise DockerfileError(f"ADD does not unpack archives here ({src}): COPY it and RUN tar", ins.line)
            if PurePosixPath(src).is_absolute() or posixpath.normpath(src).split("/")[0] == "..":
                raise DockerfileError(f"{kw} source {src!r} must be a path inside the build context", ins.line)
            self.steps.append(Step("COPY", [src, dest, owner, mode], ins.line))

    def env(self, ins: _Instruction) -> None:
        rest = self.no_flags(ins)
        first = rest.split(None, 1)
        if not first:
            raise DockerfileError("ENV needs a name and a value", ins.line)
        pairs: list[tuple[str, str]] = []
        if "=" not in first[0]:  # legacy: ENV key the value
            if len(first) < 2:
                raise DockerfileError(f"ENV {first[0]} needs a value (ENV key=value or ENV key value)", ins.line)
            pairs.append((first[0], self.lexer.words(first[1], ins.line, split=False, shell_dollar=True)[0]))
        else:
            for word in self.lexer.words(rest, ins.line, shell_dollar=True):
                key, eq, value = word.partition("=")
                if not eq:
                    raise DockerfileError(f"ENV {word!r}: key=value expected (do not mix the two forms)", ins.line)
                pairs.append((key, value))
        args = []
        for key, value in pairs:
            if not _NAME.fullmatch(key):
                raise DockerfileError(f"ENV name {key!r} is not a valid variable name", ins.line)
            self.remember(key, value)
            args += [key, value]
        self.steps.append(Step("ENV", args, ins.line))

    def args(self, ins: _Instruction) -> list[tuple[str, str | None]]:
        rest = self.no_flags(ins)
        words = self.lexer.words(rest, ins.line, shell_dollar=True)
        if not words:
            raise DockerfileError("ARG needs a name", ins.line)
        out = []
        for word in words:
            key, eq, value = word.partition("=")
            if not _NAME.fullmatch(key):
                raise DockerfileError(f"ARG name {key!r} is not a valid variable name", ins.line)
            out.append((key, value if eq else None))
        return out

    def arg(self, ins: _Instruction) -> None:
        args = []
        for key, value in self.args(ins):
            if value is None:  # no default: nothing to set (the name stays unknown)
                self.known.setdefault(key, None)
                continue
            self.remember(key, value)
            args += [key, value]
        if args:
            self.steps.append(Step("ENV", args, ins.line))

    def single(self, ins: _Instruction) -> str:
        rest = self.no_flags(ins)
        value = (self.lexer.words(rest, ins.line, split=False) or [""])[0]
        if not value.strip():
            raise DockerfileError(f"{ins.keyword} needs an argument", ins.line)
        return value.strip()

    def workdir(self, ins: _Instruction) -> None:
        self.steps.append(Step("WORKDIR", [self.single(ins)], ins.line))
        self.workdir_set = True

    def user(self, ins: _Instruction) -> None:
        self.steps.append(Step("USER", [self.single(ins)], ins.line))
        self.user_set = True

    def command(self, ins: _Instruction) -> tuple[bool, list[str]]:
        rest = self.no_flags(ins)
        words = _exec_form(rest)
        return (True, words) if words is not None else (False, [rest] if rest else [])

    def cmd(self, ins: _Instruction) -> None:
        self.cmd_form = self.command(ins)

    def entrypoint(self, ins: _Instruction) -> None:
        self.entrypoint_form = self.command(ins)

    def start_cmd(self) -> str | None:
        """Docker's rules: an exec-form ENTRYPOINT gets CMD's words appended (a shell-form
        CMD as ``/bin/sh -c <cmd>``), a shell-form ENTRYPOINT ignores CMD, else CMD."""
        command = None
        if self.entrypoint_form is not None:
            exec_form, words = self.entrypoint_form
            if exec_form:
                words = list(words)
                if self.cmd_form is not None:
                    cmd_exec, cmd_words = self.cmd_form
                    words += cmd_words if cmd_exec else (["/bin/sh", "-c", cmd_words[0]] if cmd_words else [])
                command = shlex.join(words) if words else None
            else:
                command = words[0] if words else None
        elif self.cmd_form is not None:
            exec_form, words = self.cmd_form
            command = (shlex.join(words) if exec_form else words[0]) if words else None
        return command if command and command.strip() else None


def parse(text: str) -> Recipe:
    """The recipe of the Dockerfile ``text``; DockerfileError with the line otherwise."""
    instructions, escape = _instructions(text)
    return _Converter(escape).convert(instructions)
