"""``process.Process`` RPC handlers: translate protobuf requests to ProcessManager calls."""

import os
import signal as _signal

from .connect import ConnectError
from .proto import process_pb2 as pb
from .rpc import CLIENT_STREAM, SERVER_STREAM, UNARY, Method
from .users import base_env, ensure_home, resolve_path

_SIGNALS = {pb.SIGNAL_SIGKILL: _signal.SIGKILL, pb.SIGNAL_SIGTERM: _signal.SIGTERM}


def _select(manager, selector):
    which = selector.WhichOneof("selector")
    if which == "tag":
        return manager.get(tag=selector.tag)
    return manager.get(pid=selector.pid)


def _event_message(response_cls, item):
    """Turn a Process broadcast item into a Start/ConnectResponse."""
    event = pb.ProcessEvent()
    if item[0] == "data":
        _, name, data = item
        setattr(event.data, name, data)
    else:
        code, exited, status, error = item[1]
        event.end.exit_code = code
        event.end.exited = exited
        event.end.status = status
        if error is not None:
            event.end.error = error
    return response_cls(event=event)


async def _follow(proc, queue, response_cls):
    """Yield start, then live output until the end event; always unsubscribes."""
    try:
        yield response_cls(event=pb.ProcessEvent(start=pb.ProcessEvent.StartEvent(pid=proc.pid)))
        while True:
            item = await queue.get()
            proc.consumed()
            yield _event_message(response_cls, item)
            if item[0] == "end":
                return
    finally:
        proc.unsubscribe(queue)


class ProcessService:
    """Holds the shared state the handlers need (settings, manager)."""

    def __init__(self, settings, manager):
        self.settings = settings
        self.manager = manager

    def methods(self):
        p = "/process.Process/"
        return {
            p + "Start": Method(SERVER_STREAM, pb.StartRequest, self.start, self._start_keepalive),
            p + "Connect": Method(SERVER_STREAM, pb.ConnectRequest, self.connect, self._connect_keepalive),
            p + "List": Method(UNARY, pb.ListRequest, self.list),
            p + "SendInput": Method(UNARY, pb.SendInputRequest, self.send_input),
            p + "StreamInput": Method(CLIENT_STREAM, pb.StreamInputRequest, self.stream_input),
            p + "SendSignal": Method(UNARY, pb.SendSignalRequest, self.send_signal),
            p + "CloseStdin": Method(UNARY, pb.CloseStdinRequest, self.close_stdin),
            p + "Update": Method(UNARY, pb.UpdateRequest, self.update),
        }

    @staticmethod
    def _start_keepalive():
        return pb.StartResponse(event=pb.ProcessEvent(keepalive=pb.ProcessEvent.KeepAlive()))

    @staticmethod
    def _connect_keepalive():
        return pb.ConnectResponse(event=pb.ProcessEvent(keepalive=pb.ProcessEvent.KeepAlive()))

    def _workdir(self, req, pw):
        if req.process.HasField("cwd") and req.process.cwd:
            cwd = resolve_path(req.process.cwd, pw.pw_dir)
        elif self.settings.default_workdir and os.path.isdir(self.settings.default_workdir):
            cwd = self.settings.default_workdir
        else:
            cwd = pw.pw_dir
        ensure_home(pw, cwd)
        if not os.path.isdir(cwd):
            raise ConnectError("invalid_argument", f"cwd '{cwd}' does not exist or is not a directory")
        return cwd

    async def start(self, req, ctx):
        pw = ctx.user
        if not req.process.cmd:
            raise ConnectError("invalid_argument", "process.cmd is required")
        cwd = self._workdir(req, pw)
        env = base_env(pw)
        env.update(self.settings.env())
        env.update(req.process.envs)
        pty_size = None
        if req.HasField("pty"):
            pty_size = (req.pty.size.cols, req.pty.size.rows)
        stdin = req.stdin if req.HasField("stdin") else True
        proc = self.manager.start(req.process, pw, env, cwd, pty_size=pty_size, stdin=stdin,
                                  tag=req.tag if req.HasField("tag") else None)
        proc.set_lifetime(ctx.remaining())
        queue = proc.subscribe()
        async for msg in _follow(proc, queue, pb.StartResponse):
            yield msg

    async def connect(self, req, ctx):
        proc = _select(self.manager, req.process)
        queue = proc.subscribe()
        async for msg in _follow(proc, queue, pb.ConnectResponse):
            yield msg

    async def list(self, req, ctx):
        resp = pb.ListResponse()
        for proc in list(self.manager.processes.values()):
            info = resp.processes.add(pid=proc.pid)
            info.config.CopyFrom(proc.config)
            if proc.tag is not None:
                info.tag = proc.tag
        return resp

    async def _write(self, proc, inp):
        which = inp.WhichOneof("input")
        if which is None:
            return
        await proc.write_input(getattr(inp, which), which)

    async def send_input(self, req, ctx):
        proc = _select(self.manager, req.process)
        await self._write(proc, req.input)
        return pb.SendInputResponse()

    async def stream_input(self, messages, ctx):
        proc = None
        async for msg in messages:
            which = msg.WhichOneof("event")
            if proc is None:
                if which != "start":
                    raise ConnectError("invalid_argument", "first StreamInput message must be start")
                proc = _select(self.manager, msg.start.process)
            elif which == "data":
                await self._write(proc, msg.data.input)
        if proc is None:
            raise ConnectError("invalid_argument", "StreamInput without a start message")
        return pb.StreamInputResponse()

    async def send_signal(self, req, ctx):
        proc = _select(self.manager, req.process)
        sig = _SIGNALS.get(req.signal)
        if sig is None:
            raise ConnectError("invalid_argument", f"unsupported signal {req.signal}")
        proc.signal(sig)
        return pb.SendSignalResponse()

    async def close_stdin(self, req, ctx):
        proc = _select(self.manager, req.process)
        await proc.close_stdin()
        return pb.CloseStdinResponse()

    async def update(self, req, ctx):
        proc = _select(self.manager, req.process)
        if req.HasField("pty"):
            proc.resize(req.pty.size.cols, req.pty.size.rows)
        return pb.UpdateResponse()
