"""Contexts: the SDK's unit of state. A context is one kernel of one language with its own
variables, working directory and lock (cells of one context run one after another,
different contexts in parallel), listed in creation order.

The default context of a language (what ``run_code(language=…)`` without a context uses)
is made on first use; Python's and JavaScript's are made at start, and the server reports
healthy only once they run, so a template snapshot holds warm kernels. A removed default
is made again on its language's next use (the reference leaves a dangling id).

An execution (``Execution``) runs as a task of its own, not inside the HTTP request: the
request only reads its events. When the client goes away (an SDK timeout closes the
connection) the request sets the execution's ``stop`` and the task interrupts the kernel
and waits for the cell to end before the next cell of the context may start."""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from . import envs, events, languages
from .kernel import Kernel

log = logging.getLogger(__name__)

DEFAULT_LANGUAGES = ("python", "javascript")


class ContextNotFound(Exception):
    pass


class ContextFailed(Exception):
    """A context could not be made (unknown language, a kernel that did not start)."""


@dataclass
class Context:
    id: str
    language: str
    cwd: str
    kernel: Kernel
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sandbox_env: dict | None = None  # set in the kernel on its first execution (None: not yet)

    def to_json(self) -> dict:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


def kernel_env(base: dict | None = None) -> dict:
    """What kernels start with: the server's environment, this Python's bin first on PATH
    (``pip`` and ``python`` in a cell are the kernel's own)."""
    env = dict(os.environ if base is None else base)
    bindir = str(Path(sys.executable).parent)
    path = env.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    if bindir not in path.split(":"):
        env["PATH"] = f"{bindir}:{path}"
    env.pop("AENV_CI_ENVD_URL", None)
    return env


class Contexts:
    def __init__(self, runtime_dir: Path, default_cwd: str = "/home/user", envd_url: str | None = None,
                 preload: list[str] | None = None):
        self.runtime_dir = Path(runtime_dir)
        self.default_cwd = default_cwd
        self.envd_url = envd_url
        self.preload = preload or []
        self.contexts: dict[str, Context] = {}  # insertion order = creation order
        self.defaults: dict[str, str] = {}  # language -> context id
        self._default_lock = asyncio.Lock()
        self.ready = False

    # -- lifecycle --------------------------------------------------------------------

    async def start_defaults(self, langs=DEFAULT_LANGUAGES) -> None:
        """Python's and JavaScript's default contexts (those this sandbox has kernels for),
        started in parallel; then the Python preloads. Raises if one fails."""
        wanted = [name for name in langs if languages.LANGUAGES[name].available()]
        made = await asyncio.gather(*(self._make(name, self.default_cwd) for name in wanted))
        for ctx in made:  # in the order asked, whatever finished first
            self._add(ctx, default=True)
        if self.preload and "python" in self.defaults:
            await self.contexts[self.defaults["python"]].kernel.run(preload_code(self.preload), silent=True)
        self.ready = True

    async def close(self) -> None:
        await asyncio.gather(*(ctx.kernel.shutdown() for ctx in self.contexts.values()), return_exceptions=True)
        self.contexts.clear()
        self.defaults.clear()

    async def _make(self, language: str, cwd: str) -> Context:
        try:
            lang = languages.get(language)
        except languages.UnsupportedLanguage as exc:
            raise ContextFailed(str(exc)) from None
        if not os.path.isdir(cwd):
            raise ContextFailed(f"cwd {cwd!r} is not a directory")
        kernel = Kernel(lang, cwd, kernel_env(), self.runtime_dir)
        try:
            await kernel.start()
        except Exception as exc:  # noqa: BLE001 - reported to the caller as the reason
            await kernel.shutdown()
            raise ContextFailed(f"the {language} kernel did not start: {exc}") from exc
        return Context(id=str(uuid.uuid4()), language=language, cwd=cwd, kernel=kernel)

    def _add(self, ctx: Context, default: bool = False) -> None:
        self.contexts[ctx.id] = ctx
        if default:
            self.defaults[ctx.language] = ctx.id

    # -- the API's verbs --------------------------------------------------------------

    async def create(self, language: str | None, cwd: str | None) -> Context:
        ctx = await self._make(languages.normalize(language), cwd or self.default_cwd)
        self._add(ctx)
        return ctx

    def list(self) -> list[Context]:
        return list(self.contexts.values())

    def get(self, context_id: str) -> Context:
        ctx = self.contexts.get(context_id)
        if ctx is None:
            raise ContextNotFound(f"Context {context_id} not found")
        return ctx

    async def default_for(self, language: str | None) -> Context:
        name = languages.normalize(language)
        async with self._default_lock:  # two first uses make one context
            ctx = self.contexts.get(self.defaults.get(name, ""))
            if ctx is None:
                ctx = await self._make(name, self.default_cwd)
                self._add(ctx, default=True)
            return ctx

    async def restart(self, context_id: str) -> None:
        ctx = self.get(context_id)
        await ctx.kernel.restart()
        ctx.sandbox_env = None  # the new process has none of what was set in the old one

    async def remove(self, context_id: str) -> None:
        ctx = self.get(context_id)
        del self.contexts[context_id]
        if self.defaults.get(ctx.language) == context_id:
            del self.defaults[ctx.language]
        await ctx.kernel.shutdown()

    def execute(self, ctx: Context, code: str, env_vars: dict | None, access_token: str | None) -> "Execution":
        return Execution(self, ctx, code, env_vars or {}, access_token)


def preload_code(modules: list[str]) -> str:
    """A silent cell that imports ``modules`` into the kernel's module cache (never into the
    user's namespace), so a first ``import pandas`` in a sandbox is instant."""
    return ("def __aenv_preload():\n"
            "    import importlib\n"
            f"    for name in {list(modules)!r}:\n"
            "        try:\n"
            "            importlib.import_module(name)\n"
            "        except Exception:\n"
            "            pass\n"
            "__aenv_preload()\n"
            "del __aenv_preload\n")


class Execution:
    """One ``run_code``: a task that waits for the context, sets the env vars, runs the cell
    and restores the env vars; the HTTP response reads ``next_event`` until None."""

    def __init__(self, contexts: Contexts, ctx: Context, code: str, env_vars: dict, access_token: str | None):
        self.contexts, self.ctx, self.code, self.env_vars = contexts, ctx, code, env_vars
        self.access_token = access_token
        self.queue: asyncio.Queue = asyncio.Queue()
        self.stop = asyncio.Event()
        self.ended = False
        self.task = asyncio.create_task(self._main())

    async def next_event(self, timeout: float) -> dict | None:
        """The next event; KEEPALIVE after ``timeout`` s of silence; None at the end."""
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return events.KEEPALIVE

    def abandon(self) -> None:
        """The client went away: interrupt the cell (if it is still running or waiting)."""
        self.stop.set()

    async def _main(self) -> None:
        ctx = self.ctx
        try:
            async with ctx.lock:
                if self.stop.is_set():  # gone while waiting for the context: never started
                    return
                lang, kernel = ctx.kernel.language, ctx.kernel
                if ctx.sandbox_env is None:
                    ctx.sandbox_env = await envs.sandbox_env(self.access_token, self.contexts.envd_url)
                    if ctx.sandbox_env:
                        await kernel.run(lang.set_env(ctx.sandbox_env), silent=True)
                if self.env_vars:
                    await kernel.run(lang.set_env(self.env_vars), silent=True)
                try:
                    await kernel.run(self.code, self._emit, stop=self.stop)
                except Exception as exc:  # noqa: BLE001 - e.g. a kernel that died and did not come back
                    log.exception("execution in context %s failed", ctx.id)
                    self._emit(events.error("UnexpectedEndOfExecution", f"the execution failed: {exc}", ""))
                finally:
                    self._end()
                if self.env_vars:
                    restore = {k: ctx.sandbox_env[k] for k in self.env_vars if k in (ctx.sandbox_env or {})}
                    await kernel.run(languages.env_cleanup(list(self.env_vars), restore, lang), silent=True)
        except Exception as exc:  # noqa: BLE001 - after the headers every failure is an event
            log.exception("execution in context %s failed", ctx.id)
            self._emit(events.error("UnexpectedEndOfExecution", f"the execution failed: {exc}", ""))
            self._end()

    def _emit(self, event: dict) -> None:
        if not self.ended:
            self.queue.put_nowait(event)

    def _end(self) -> None:
        """``end_of_execution`` and the end of the stream, once."""
        if not self.ended:
            self.queue.put_nowait(events.END)
            self.queue.put_nowait(None)
            self.ended = True
