"""What the SDK reads from ``POST /execute``: one JSON object per line (spec
e2b-code-interpreter.md §2.2-§2.3), made from Jupyter kernel messages.

Why its own module: the wire format is the contract with the unchanged SDKs and is pure
(no kernel, no HTTP), so it is tested on its own. Two details matter more than they look:
every line is ASCII-only JSON (the Python SDK splits lines like ``str.splitlines``, so a
raw U+2028 inside a string would cut an event in two), and a ``result`` carries only the
SDK's known format keys at the top level (the JS SDK turns unknown top-level keys into
extra formats): other MIME types go under ``extra``."""
from __future__ import annotations

import json
from datetime import datetime, timezone

# Jupyter MIME type -> the result field the SDKs know (the value is passed as the kernel sent it).
FORMATS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "text/latex": "latex",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}


def line(event: dict) -> bytes:
    """One event as a wire line: compact, ASCII-only JSON and a single ``\\n``."""
    return json.dumps(event, ensure_ascii=True, separators=(",", ":"), default=str).encode() + b"\n"


def strip_quotes(text: str) -> str:
    """The reference's rule for ``text/plain``: a repr of a string (``'bar'`` or ``"bar"``)
    loses its two quote characters, so ``os.getenv('FOO')`` reads ``bar``."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def result(bundle: dict, is_main_result: bool) -> dict:
    """A ``result`` event from a MIME bundle (``execute_result``: the main result;
    ``display_data``: not)."""
    event: dict = {"type": "result", "is_main_result": is_main_result}
    extra = {}
    for mime, value in (bundle or {}).items():
        field = FORMATS.get(mime)
        if field is None:
            extra[mime] = value
        elif value is not None:
            event[field] = strip_quotes(value) if field == "text" and isinstance(value, str) else value
    event["extra"] = extra
    return event


def iso_timestamp(date) -> str:
    """A Jupyter header date (a datetime, or already a string) as ISO-8601 with a zone."""
    if isinstance(date, datetime):
        return (date if date.tzinfo else date.replace(tzinfo=timezone.utc)).isoformat()
    if date:
        return str(date)
    return datetime.now(timezone.utc).isoformat()


def stream(name: str, text: str, date=None) -> dict:
    return {"type": "stdout" if name == "stdout" else "stderr", "text": text, "timestamp": iso_timestamp(date)}


def error(name: str, value: str, traceback) -> dict:
    """An ``error`` event; a kernel that names no error (bash_kernel: only the exit status
    as the value) gets ``Error``."""
    if isinstance(traceback, (list, tuple)):
        traceback = "\n".join(str(t) for t in traceback)
    return {"type": "error", "name": str(name or "Error"), "value": str(value), "traceback": str(traceback or "")}


def execution_count(count: int) -> dict:
    return {"type": "number_of_executions", "execution_count": count}


KEEPALIVE = {"type": "keepalive"}
END = {"type": "end_of_execution"}


class Translator:
    """Turns the kernel messages of one execution (already matched by parent id) into
    events; at most one ``error`` per execution (the SDK's tests count them)."""

    def __init__(self):
        self.errored = False
        self.done = False

    def __call__(self, msg: dict) -> list[dict]:
        kind = msg.get("msg_type") or msg.get("header", {}).get("msg_type")
        content = msg.get("content") or {}
        date = msg.get("header", {}).get("date")
        if kind == "execute_input":
            return [execution_count(int(content.get("execution_count") or 0))]
        if kind == "stream":
            return [stream(content.get("name", "stdout"), content.get("text", ""), date)]
        if kind in ("execute_result", "display_data"):
            return [result(content.get("data") or {}, kind == "execute_result")]
        if kind == "error":
            return self.error(content.get("ename", "Error"), content.get("evalue", ""), content.get("traceback"))
        if kind == "status" and content.get("execution_state") == "idle":
            self.done = True
        return []

    def reply(self, content: dict) -> list[dict]:
        """The ``execute_reply``: its error if no ``error`` message came (some kernels only
        reply), an abort as ExecutionAborted."""
        status = content.get("status")
        if status == "error":
            return self.error(content.get("ename", "Error"), content.get("evalue", ""), content.get("traceback"))
        if status == "aborted":
            return self.error("ExecutionAborted", "Execution was aborted", "")
        return []

    def error(self, name: str, value: str, traceback) -> list[dict]:
        if self.errored:
            return []
        self.errored = True
        return [error(name, value, traceback)]
