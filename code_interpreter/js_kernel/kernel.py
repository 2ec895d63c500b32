"""A Jupyter kernel for JavaScript on the guest's own Node.js: an ipykernel "wrapper
kernel" that runs ``driver.js`` in a child ``node`` and relays cells to it.

Why our own: the npm kernels (ijavascript, tslab) need zeromq's native addon, built for
one Node ABI and fetched as prebuilt binaries; this one needs only ``node`` on PATH (and
ipykernel, which the Python kernel brings). The Jupyter side (messages, execution counts,
interrupts as SIGINT to the process group, which includes the node child) is ipykernel's.

Output of the cell (console, ``process.stdout.write``) comes from the driver on a pipe of
its own (a pipe whose fd is its argument), in order with the cell's end; output that child processes write straight
to the inherited stdout/stderr is relayed too. If ``node`` exits, so does the kernel: the
server sees the dead kernel, restarts it and ends the cell with ``ContextRestarting``; that is
also what an interrupt comes to when the cell does not stop within ``KILL_AFTER_SECONDS``
(a loop after an ``await`` runs outside the reach of Node's SIGINT handling)."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from ipykernel.kernelbase import Kernel

DRIVER = Path(__file__).with_name("driver.js")
WAIT_SECONDS = 0.2
KILL_AFTER_SECONDS = 10.0  # an interrupted cell still running then: node is killed (the kernel restarts)


class JavaScriptKernel(Kernel):
    implementation = "aenv-javascript"
    implementation_version = "1.0"
    language = "javascript"
    language_version = "node"
    language_info = {"name": "javascript", "mimetype": "application/javascript", "file_extension": ".js"}
    banner = "aenv JavaScript kernel (Node.js)"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._events: queue.Queue = queue.Queue()
        self._cell = 0
        self._start_node()

    def _start_node(self) -> None:
        control_r, control_w = os.pipe()
        self._node = subprocess.Popen(
            ["node", str(DRIVER), str(control_w)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, pass_fds=(control_w,))
        os.close(control_w)
        threading.Thread(target=self._read_control, args=(os.fdopen(control_r, "rb"),), daemon=True).start()
        for name, pipe in (("stdout", self._node.stdout), ("stderr", self._node.stderr)):
            threading.Thread(target=self._read_raw, args=(name, pipe), daemon=True).start()
        first = self._events.get(timeout=60)
        if first.get("t") != "ready":
            raise RuntimeError(f"node did not start: {first}")

    def _read_control(self, pipe) -> None:
        for raw in pipe:
            try:
                self._events.put(json.loads(raw))
            except ValueError:
                continue
        self._events.put({"t": "exit"})

    def _read_raw(self, name: str, pipe) -> None:
        for chunk in iter(lambda: pipe.read1(65536), b""):
            self._events.put({"t": "stream", "name": name, "text": chunk.decode(errors="replace")})

    def _stream(self, name: str, text: str, silent: bool) -> None:
        if not silent and text:
            self.send_response(self.iopub_socket, "stream", {"name": name, "text": text})

    def do_execute(self, code, silent, store_history=True, user_expressions=None, allow_stdin=False,
                   *, cell_meta=None, cell_id=None):
        while not self._events.empty():  # output of earlier cells' timers, after their end
            event = self._events.get_nowait()
            if event.get("t") == "exit":
                self._node_gone()
        self._cell += 1
        cell = self._cell
        self._node.stdin.write((json.dumps({"id": cell, "code": code}) + "\n").encode())
        self._node.stdin.flush()
        interrupted_at = None
        while True:
            try:
                event = self._events.get(timeout=WAIT_SECONDS)
            except queue.Empty:
                if interrupted_at is not None and time.monotonic() - interrupted_at > KILL_AFTER_SECONDS:
                    self._node.kill()  # a loop after an await: nothing else stops it
                continue
            except KeyboardInterrupt:  # the interrupt reached node too (same process group)
                interrupted_at = interrupted_at or time.monotonic()
                continue
            kind = event.get("t")
            if kind == "stream":
                self._stream(event["name"], event["text"], silent)
            elif kind == "exit":
                self._node_gone()
            elif kind == "done" and event.get("id") == cell:
                break
        if event.get("error"):
            err = event["error"]
            if not silent:
                self.send_response(self.iopub_socket, "error", err)
            return {"status": "error", "execution_count": self.execution_count, **err}
        if not silent and event.get("text") is not None:
            self.send_response(self.iopub_socket, "execute_result", {
                "execution_count": self.execution_count, "data": {"text/plain": event["text"]}, "metadata": {}})
        return {"status": "ok", "execution_count": self.execution_count, "payload": [], "user_expressions": {}}

    def _node_gone(self) -> None:
        sys.stderr.write("aenv javascript kernel: node exited; the kernel exits too\n")
        sys.stderr.flush()
        os._exit(1)

    def do_shutdown(self, restart):
        try:
            self._node.kill()
        except OSError:
            pass
        return {"status": "ok", "restart": restart}
