"""One Jupyter kernel, driven directly with ``jupyter_client`` (no Jupyter server): start,
run a cell while turning its messages into SDK events, interrupt, restart, shut down.

Why no Jupyter server: the SDK never talks Jupyter; one process owning the kernels over
ZeroMQ (IPC sockets: no TCP ports to pick, nothing to reconnect after a snapshot restore or
a fork) is the whole plumbing, and an interrupt is a signal to the kernel's process group.

A cell ends when the kernel goes ``idle`` for it. While it runs, ``run`` watches a
``stop`` event (the client went away or timed out): it interrupts the kernel (again every
few seconds until the cell ends), so the variables survive; a kernel process that dies is
restarted under the same context and the cell ends with ``ContextRestarting``."""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import time
import uuid
from pathlib import Path
from typing import Callable

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from . import events
from .languages import Language

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5  # how often a waiting cell looks at its stop event and the kernel process
ALIVE_EVERY = 2.0  # how often it checks that the kernel process still runs
REINTERRUPT_SECONDS = 5.0  # a cell that ignored an interrupt gets another one this often
READY_TIMEOUT = float(os.environ.get("AENV_CI_KERNEL_READY_TIMEOUT", "120"))  # a start under TCG is slow
REPLY_TIMEOUT = 10.0

SPEC_PREFIX = "aenv-"  # our spec names (jupyter_client would turn a plain "python" into "python3")
RESTARTED = ("ContextRestarting", "Context was restarted")


class KernelDied(Exception):
    """The kernel process exited and could not be brought back."""


class _Specs(KernelSpecManager):
    """Kernel specs from our language table instead of kernel.json files on disk."""

    languages: dict = {}

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        lang: Language = self.languages[kernel_name.removeprefix(SPEC_PREFIX)]
        return KernelSpec(argv=lang.argv(), display_name=lang.name, language=lang.name, interrupt_mode="signal",
                          resource_dir="", env={})


class Kernel:
    def __init__(self, language: Language, cwd: str, env: dict, runtime_dir: Path):
        self.language = language
        self.cwd = cwd
        self.env = env
        self.runtime_dir = runtime_dir
        self.km: AsyncKernelManager | None = None
        self.client = None
        self.generation = 0  # bumped on every restart: a running cell sees it and ends

    async def start(self) -> None:
        specs = _Specs()
        specs.languages = {self.language.name: self.language}
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        name = uuid.uuid4().hex[:12]
        self.km = AsyncKernelManager(kernel_name=SPEC_PREFIX + self.language.name, kernel_spec_manager=specs, transport="ipc",
                                     ip=str(self.runtime_dir / f"k-{name}"),
                                     connection_file=str(self.runtime_dir / f"k-{name}.json"))
        await self.km.start_kernel(cwd=self.cwd, env=self.env)
        await self._connect()

    async def _connect(self) -> None:
        if self.client is not None:
            self.client.stop_channels()
        self.client = self.km.client()
        self.client.start_channels(hb=False)  # no heartbeat thread: a snapshot or a pause would look like a dead kernel
        try:
            await self.client.wait_for_ready(timeout=READY_TIMEOUT)
        except RuntimeError as exc:
            raise KernelDied(f"the {self.language.name} kernel did not start: {exc}") from None

    async def alive(self) -> bool:
        return self.km is not None and await self.km.is_alive()

    async def interrupt(self) -> None:
        try:
            await self.km.interrupt_kernel()
        except Exception:  # noqa: BLE001 - a dead kernel is handled by the running cell's watch
            log.exception("interrupting the %s kernel failed", self.language.name)

    async def restart(self) -> None:
        """Same context, fresh process (state gone); a running cell ends with ContextRestarting."""
        self.generation += 1
        await self.km.restart_kernel(now=True)
        await self._connect()

    async def shutdown(self) -> None:
        self.generation += 1
        if self.client is not None:
            self.client.stop_channels()
        if self.km is not None:
            try:
                await self.km.shutdown_kernel(now=True)
            except Exception:  # noqa: BLE001 - already gone
                log.exception("shutting down the %s kernel failed", self.language.name)

    async def run(self, code: str, emit: Callable[[dict], None] | None = None, silent: bool = False,
                  stop: asyncio.Event | None = None) -> bool:
        """Runs ``code`` as one cell; every event goes to ``emit``. True if it ended without
        an error. ``silent``: not counted, not in the history, no output events."""
        translate = events.Translator()
        emit = emit or (lambda _event: None)
        generation = self.generation
        msg_id = self.client.execute(code, silent=silent, store_history=not silent, allow_stdin=False,
                                     stop_on_error=not silent)
        interrupted_at = None
        last_alive_check = time.monotonic()
        while not translate.done:
            if self.generation != generation:  # restarted (API or watchdog) under us
                for e in translate.error(*RESTARTED, ""):
                    emit(e)
                return False
            if stop is not None and stop.is_set():
                now = time.monotonic()
                if interrupted_at is None or now - interrupted_at >= REINTERRUPT_SECONDS:
                    interrupted_at = now
                    await self.interrupt()
            try:
                msg = await self.client.get_iopub_msg(timeout=POLL_SECONDS)
            except queue.Empty:
                if time.monotonic() - last_alive_check >= ALIVE_EVERY:
                    last_alive_check = time.monotonic()
                    if not await self.alive():
                        await self._died(translate, emit)
                        return False
                continue
            if (msg.get("parent_header") or {}).get("msg_id") != msg_id:
                continue  # late output of an earlier cell, or another client's
            for e in translate(msg):
                if not silent or e["type"] == "error":
                    emit(e)
        reply = await self._reply(msg_id)
        if reply is not None:
            for e in translate.reply(reply):
                emit(e)
        return not translate.errored

    async def _reply(self, msg_id: str) -> dict | None:
        end = time.monotonic() + REPLY_TIMEOUT
        while time.monotonic() < end:
            try:
                msg = await self.client.get_shell_msg(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                return None
            if (msg.get("parent_header") or {}).get("msg_id") == msg_id:
                return msg.get("content") or {}
        return None

    async def _died(self, translate: events.Translator, emit) -> None:
        log.warning("the %s kernel died during a cell; restarting it", self.language.name)
        for e in translate.error(*RESTARTED, ""):
            emit(e)
        try:
            await self.restart()
        except Exception as exc:  # noqa: BLE001
            raise KernelDied(f"the {self.language.name} kernel died and did not restart: {exc}") from exc
