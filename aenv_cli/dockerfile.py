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
and the start command are left to the shell.

This module converts instructions into steps; splitting the file into instructions and
words (Docker's lexical rules) is ``dockerfile_syntax``'s."""
from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from .dockerfile_syntax import (NAME, DockerfileError, Instruction, Lexer, has_heredoc, parse_exec_form,
                               read_instructions, split_flags)

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


# --------------------------------------------------------------------------- the file


class _Converter:
    """One pass over the instructions: the steps, the variables known so far (for
    ``$VAR``), whether USER / WORKDIR were set, the last CMD and ENTRYPOINT."""

    def __init__(self, escape: str):
        self.known: dict[str, str | None] = {}
        self.lexer = Lexer(escape, self.known)
        self.steps: list[Step] = [Step("USER", ["root"]), Step("WORKDIR", ["/"])]
        self.warnings: list[str] = []
        self.user_set = self.workdir_set = False
        self.cmd_form: tuple[bool, list[str]] | None = None
        self.entrypoint_form: tuple[bool, list[str]] | None = None

    def warn(self, line: int, message: str) -> None:
        self.warnings.append(f"line {line}: {message}")

    def remember(self, key: str, value: str) -> None:
        self.known[key] = None if "$" in value else value

    def convert(self, instructions: list[Instruction]) -> Recipe:
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

    def instruction(self, ins: Instruction) -> None:
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

    def no_flags(self, ins: Instruction) -> str:
        flags, rest = split_flags(ins.rest)
        if flags:
            raise DockerfileError(f"{ins.keyword} takes no flags (--{flags[0][0]})", ins.line)
        return rest

    def from_(self, ins: Instruction) -> str:
        flags, rest = split_flags(ins.rest)
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

    def run(self, ins: Instruction) -> None:
        flags, rest = split_flags(ins.rest)
        for name, value in flags:
            if name == "mount" and "type=cache" not in (value or "").split(","):
                raise DockerfileError(f"RUN --mount={value} is not supported (only type=cache, ignored)", ins.line)
            if name not in ("mount", "network", "security"):
                raise DockerfileError(f"unknown RUN flag --{name}", ins.line)
            self.warn(ins.line, f"RUN --{name} is ignored")
        words = parse_exec_form(rest)
        if words is not None:
            command = shlex.join(words)
        else:
            if has_heredoc(rest):
                raise DockerfileError("heredocs (<<EOF) are not supported: put the script in a file, COPY it and "
                                      "RUN it", ins.line)
            command = rest
        if not command.strip():
            raise DockerfileError("RUN needs a command", ins.line)
        self.steps.append(Step("RUN", [command], ins.line))

    def copy(self, ins: Instruction) -> None:
        kw = ins.keyword
        flags, rest = split_flags(ins.rest)
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
        words = parse_exec_form(rest)
        if words is None:
            if has_heredoc(rest):
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

    def env(self, ins: Instruction) -> None:
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
            if not NAME.fullmatch(key):
                raise DockerfileError(f"ENV name {key!r} is not a valid variable name", ins.line)
            self.remember(key, value)
            args += [key, value]
        self.steps.append(Step("ENV", args, ins.line))

    def args(self, ins: Instruction) -> list[tuple[str, str | None]]:
        rest = self.no_flags(ins)
        words = self.lexer.words(rest, ins.line, shell_dollar=True)
        if not words:
            raise DockerfileError("ARG needs a name", ins.line)
        out = []
        for word in words:
            key, eq, value = word.partition("=")
            if not NAME.fullmatch(key):
                raise DockerfileError(f"ARG name {key!r} is not a valid variable name", ins.line)
            out.append((key, value if eq else None))
        return out

    def arg(self, ins: Instruction) -> None:
        args = []
        for key, value in self.args(ins):
            if value is None:  # no default: nothing to set (the name stays unknown)
                self.known.setdefault(key, None)
                continue
            self.remember(key, value)
            args += [key, value]
        if args:
            self.steps.append(Step("ENV", args, ins.line))

    def single(self, ins: Instruction) -> str:
        rest = self.no_flags(ins)
        value = (self.lexer.words(rest, ins.line, split=False) or [""])[0]
        if not value.strip():
            raise DockerfileError(f"{ins.keyword} needs an argument", ins.line)
        return value.strip()

    def workdir(self, ins: Instruction) -> None:
        self.steps.append(Step("WORKDIR", [self.single(ins)], ins.line))
        self.workdir_set = True

    def user(self, ins: Instruction) -> None:
        self.steps.append(Step("USER", [self.single(ins)], ins.line))
        self.user_set = True

    def command(self, ins: Instruction) -> tuple[bool, list[str]]:
        rest = self.no_flags(ins)
        words = parse_exec_form(rest)
        return (True, words) if words is not None else (False, [rest] if rest else [])

    def cmd(self, ins: Instruction) -> None:
        self.cmd_form = self.command(ins)

    def entrypoint(self, ins: Instruction) -> None:
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
    instructions, escape = read_instructions(text)
    return _Converter(escape).convert(instructions)
