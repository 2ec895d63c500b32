"""The envd ASGI application: routing, access-token checks, /health, /init, /metrics, /files, RPC."""

import asyncio
import json
import logging
import os
import time

from . import files_http, oserrors, trust
from .auth import UNAUTHORIZED_MESSAGE as UNAUTHORIZED, AuthError, check_signature, token_matches
from .clock import maybe_set_clock
from .connect import ConnectError
from .entropy import credit, decode_seed
from .filesystem_service import FilesystemService
from .processes import ProcessManager
from .process_service import ProcessService
from .rpc import Context, parse_keepalive, parse_timeout_ms, send_error, serve
from .usage import CpuMeter, disk_usage, read_memory
from .watchers import pump_all
from .users import UnknownUser, request_user, username_from_basic_auth

log = logging.getLogger("envd.app")

# Host-driver endpoint (no token: it reveals nothing and only flushes dirty pages to disk), called
# before a filesystem-only pause so no write still in the guest page cache is lost.
SYNC_PATH = "/aenv/sync"
TRUST_PATH = "/aenv/trust"


def _headers(scope):
    out = {}
    for key, value in scope.get("headers", ()):
        out[key.decode("latin-1").lower()] = value.decode("latin-1")
    return out


async def _empty(send, status):
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b""})


async def _read_small_body(receive, limit=1 << 20):
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise files_http.HTTPError(400, "client disconnected")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise files_http.HTTPError(413, "body too large")
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


class EnvdApp:
    """ASGI callable. One instance per envd process; holds all sandbox state."""

    def __init__(self, settings, port_forwarder=None):
        self.settings = settings
        # envd.port_forward.PortForwarder (re-exposes loopback-only services) or None; started
        # with the app, its first scan runs one period later, when the server is listening.
        self.port_forwarder = port_forwarder
        self.processes = None
        self.methods = None
        self.fs_service = FilesystemService(settings)
        self.cpu_meter = CpuMeter()

    def _ensure_started(self):
        # The process manager needs the running loop, which exists only once serving.
        if self.methods is None:
            self.processes = ProcessManager(asyncio.get_running_loop())
            self.methods = {}
            self.methods.update(ProcessService(self.settings, self.processes).methods())
            self.methods.update(self.fs_service.methods())
            if self.port_forwarder is not None:
                self.port_forwarder.start()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    self._ensure_started()
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    if self.port_forwarder is not None:
                        self.port_forwarder.close()
                    if self.processes is not None:
                        self.processes.kill_all()  # an intentional stop takes its children along
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        self._ensure_started()
        pump_all()  # earlier requests' fs changes reach watchers before this one runs
        headers = _headers(scope)
        path = scope["path"]
        method = scope["method"]
        if self.port_forwarder is not None and path not in ("/health", "/metrics"):
            self.port_forwarder.poke()  # someone's work: listeners are scanned every second for a while
        try:
            if path == "/health":
                await _empty(send, 204)
                return
            if path == SYNC_PATH and method == "POST":
                await self._sync(send)
                return
            if path == "/files":
                self._authorize_files(scope, headers, method)
                if method == "GET":
                    await files_http.download(scope, receive, send, self.settings, headers)
                elif method == "POST":
                    await files_http.upload(scope, receive, send, self.settings, headers)
                else:
                    raise files_http.HTTPError(405, f"method {method} not allowed")
                return
            self._authorize(headers)
            if path == "/init" and method == "POST":
                await self._init(receive, send)
                return
            if path == TRUST_PATH and method == "POST":
                await self._trust(receive, send)
                return
            if path == "/metrics" and method == "GET":
                await files_http.send_json(send, 200, await self._metrics())
                return
            if path == "/envs" and method == "GET":
                await files_http.send_json(send, 200, self.settings.env())
                return
            rpc = self.methods.get(path)
            if rpc is not None and method == "POST":
                await self._rpc(rpc, scope, receive, send, headers)
                return
            raise files_http.HTTPError(404, f"{method} {path} not found")
        except files_http.HTTPError as err:
            await files_http.send_http_error(send, err)
        except OSError as exc:
            # the kernel's refusal of a file operation is the caller's to act on (envd.oserrors)
            status = oserrors.http_status(exc)
            if status >= 500:
                log.exception("request %s %s failed", method, path)
            text = "not enough disk space" if status == 507 else oserrors.message(exc)
            await files_http.send_json(send, status, {"code": status, "message": text})

    # -- auth ---------------------------------------------------------------
    def _authorize(self, headers):
        token = self.settings.access_token
        if token and not token_matches(token, headers.get("x-access-token")):
            raise files_http.HTTPError(401, UNAUTHORIZED)

    def _authorize_files(self, scope, headers, method):
        token = self.settings.access_token
        if not token or token_matches(token, headers.get("x-access-token")):
            return
        params = files_http.query_params(scope)
        if "signature" not in params:
            raise files_http.HTTPError(401, UNAUTHORIZED)
        operation = "read" if method == "GET" else "write"
        try:
            check_signature(token, params.get("path", ""), operation, params.get("username", ""),
                            params.get("signature"), params.get("signature_expiration"))
        except AuthError as exc:
            raise files_http.HTTPError(401, str(exc)) from None

    # -- /init --------------------------------------------------------------
    async def _init(self, receive, send):
        body = await _read_small_body(receive)
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            raise files_http.HTTPError(400, "invalid JSON body") from None
        if not isinstance(data, dict):
            raise files_http.HTTPError(400, "body must be a JSON object")
        env_vars = data.get("envVars")
        if env_vars is not None:
            if not isinstance(env_vars, dict) or not all(isinstance(v, str) for v in env_vars.values()):
                raise files_http.HTTPError(400, "envVars must be an object of strings")
        seed = None
        if data.get("entropySeed") is not None:
            try:
                seed = decode_seed(data["entropySeed"])
            except ValueError as exc:
                raise files_http.HTTPError(400, str(exc)) from None
        self.settings.load_template_defaults()
        if env_vars is not None:
            self.settings.env_vars = dict(env_vars)
        if data.get("accessToken"):
            self.settings.access_token = str(data["accessToken"])
        if data.get("defaultUser"):
            self.settings.default_user = str(data["defaultUser"])
        if data.get("defaultWorkdir"):
            self.settings.default_workdir = str(data["defaultWorkdir"])
        # The answer goes first, then the clock step and the entropy credit (together ~70 ms of
        # a guest just restored under TCG, on every create and resume). Both are synchronous and
        # neither raises, so this event loop serves no other request until they are done: every
        # envd call after /init sees the new clock and the reseeded RNG, as before.
        await _empty(send, 204)
        if data.get("timestamp"):
            maybe_set_clock(str(data["timestamp"]), self.settings.set_clock)
        if seed is not None:
            credit(seed, self.settings.credit_entropy)

    # -- /aenv/trust ----------------------------------------------------------
    async def _trust(self, receive, send):
        """``{"pem"}``: the node's TLS-interception CA, trusted from now on (``envd.trust``);
        200 with what was changed. After the token check: only the node (or the sandbox's owner)."""
        body = await _read_small_body(receive)
        try:
            data = json.loads(body or b"{}")
        except ValueError:
            raise files_http.HTTPError(400, "invalid JSON body") from None
        if not isinstance(data, dict):
            raise files_http.HTTPError(400, "body must be a JSON object")
        try:
            done = await asyncio.get_running_loop().run_in_executor(
                None, trust.install, data.get("pem"), self.settings.trust_root)
        except trust.BadCertificate as exc:
            raise files_http.HTTPError(400, str(exc)) from None
        self.settings.trust_env = done["env"]
        await files_http.send_json(send, 200, done)

    # -- /metrics -----------------------------------------------------------
    async def _metrics(self) -> dict:
        """E2B's envd ``Metrics``: the guest's CPU busy % since the previous call (the
        node samples every few seconds), memory and the root filesystem, in bytes;
        ``mem_cache`` (the page cache) feeds the API's ``memCache``."""
        if self.cpu_meter.needs_window():
            self.cpu_meter.baseline()
            await asyncio.sleep(self.cpu_meter.window)
        cpu = self.cpu_meter.percent()
        memory = read_memory()
        disk_used, disk_total = disk_usage("/")
        return {"ts": int(time.time()), "cpu_count": os.cpu_count() or 1, "cpu_used_pct": cpu,
                "mem_total": memory.total, "mem_used": memory.used, "mem_cache": memory.cache,
                "disk_used": disk_used, "disk_total": disk_total}

    async def _sync(self, send):
        """Flushes every filesystem (sync(2)) in a thread; answers 204 once it returned."""
        started = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, os.sync)
        log.info("sync done in %.0f ms", (time.monotonic() - started) * 1000)
        await _empty(send, 204)

    # -- RPC ------------------------------------------------------------------
    async def _rpc(self, rpc, scope, receive, send, headers):
        try:
            try:
                user = request_user(self.settings, username_from_basic_auth(headers.get("authorization")))
            except UnknownUser as exc:
                raise ConnectError("unauthenticated", str(exc)) from None
            timeout_ms = parse_timeout_ms(headers.get("connect-timeout-ms"))
        except ConnectError as err:
            await send_error(send, err)
            return
        deadline = time.monotonic() + timeout_ms / 1000 if timeout_ms else None
        ctx = Context(headers, user, deadline, parse_keepalive(headers.get("keepalive-ping-interval")))
        await serve(rpc, scope, receive, send, ctx)

