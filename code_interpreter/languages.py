"""The languages a context can speak: the Jupyter kernel behind each, and the small silent
snippets the server runs in it (change directory, set and restore env vars).

Why one table: a language is a kernel command line plus three snippets, nothing else; the
rest of the server is language-blind. Values are quoted for the language (Python ``repr``,
JSON for JavaScript, ``shlex.quote`` for bash), so an env value or a path with a quote in
it stays data (the reference pastes them into the source unescaped)."""
from __future__ import annotations

import importlib.util
import json
import shlex
import shutil
import sys
from dataclasses import dataclass
from typing import Callable

ALIASES = {"js": "javascript", "ts": "typescript", "py": "python", "python3": "python", "sh": "bash"}
# The IPython kernel's options: no ANSI colours in tracebacks, no truncated reprs, and the
# formatters of code_interpreter.ipython_extension (charts, DataFrames, JSON, PIL images).
IPYTHON_OPTIONS = [
    "--InteractiveShell.colors=nocolor",
    "--PlainTextFormatter.max_seq_length=0",
    "--IPKernelApp.extensions=code_interpreter.ipython_extension",
]


class UnsupportedLanguage(Exception):
    """No kernel for this language in this sandbox."""


def normalize(language: str | None) -> str:
    """What the SDK sent, as the server names it: trimmed, lower-cased, aliases resolved;
    None or empty is Python."""
    name = (language or "").strip().lower() or "python"
    return ALIASES.get(name, name)


@dataclass(frozen=True)
class Language:
    name: str
    argv: Callable[[], list[str]]  # the kernel command line; "{connection_file}" filled by jupyter_client
    available: Callable[[], bool]
    chdir: Callable[[str], str]
    set_env: Callable[[dict], str]
    unset_env: Callable[[list], str]  # remove these names


def _python_argv() -> list[str]:
    return [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}", *IPYTHON_OPTIONS]


def _py_set(env: dict) -> str:
    return f"__import__('os').environ.update({env!r})"


def _py_unset(names: list) -> str:
    return f"[__import__('os').environ.pop(k, None) for k in {list(names)!r}]"


def _js_set(env: dict) -> str:
    return f"Object.assign(process.env, {json.dumps(env)});"


def _js_unset(names: list) -> str:
    return f"for (const k of {json.dumps(list(names))}) delete process.env[k];"


def _bash_set(env: dict) -> str:
    return "; ".join(f"export {k}={shlex.quote(v)}" for k, v in env.items() if k.isidentifier()) or ":"


def _bash_unset(names: list) -> str:
    names = [n for n in names if n.isidentifier()]
    return f"unset {' '.join(names)}" if names else ":"


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


LANGUAGES = {
    "python": Language(
        "python", _python_argv, lambda: _has_module("ipykernel"),
        chdir=lambda path: f"__import__('os').chdir({path!r})", set_env=_py_set, unset_env=_py_unset),
    "javascript": Language(
        "javascript", lambda: [sys.executable, "-m", "code_interpreter.js_kernel", "-f", "{connection_file}"],
        lambda: shutil.which("node") is not None,
        chdir=lambda path: f"process.chdir({json.dumps(path)});", set_env=_js_set, unset_env=_js_unset),
    "bash": Language(
        "bash", lambda: [sys.executable, "-m", "bash_kernel", "-f", "{connection_file}"],
        lambda: _has_module("bash_kernel") and shutil.which("bash") is not None,
        chdir=lambda path: f"cd {shlex.quote(path)}", set_env=_bash_set, unset_env=_bash_unset),
}


def get(language: str) -> Language:
    """The language (normalized name) if this sandbox has its kernel, else UnsupportedLanguage."""
    lang = LANGUAGES.get(language)
    if lang is None or not lang.available():
        have = ", ".join(n for n, lg in LANGUAGES.items() if lg.available())
        raise UnsupportedLanguage(f"language '{language}' is not supported here (available: {have})")
    return lang


def env_cleanup(names: list, restore: dict, lang: Language) -> str:
    """After an execution with per-execution env vars: those names removed, then the
    sandbox-wide values among them put back."""
    snippet = lang.unset_env(names)
    if restore:
        sep = "\n"
        snippet += sep + lang.set_env(restore)
    return snippet
