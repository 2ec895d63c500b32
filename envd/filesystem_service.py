"""``filesystem.Filesystem`` RPC handlers (stat, list, mkdir, move, remove, watch)."""

import asyncio
import os
import shutil
import stat
import subprocess

from . import permissions
from .connect import ConnectError
from .fsinfo import entry_info, make_dirs
from .proto import filesystem_pb2 as pb
from .rpc import SERVER_STREAM, UNARY, Method
from .users import ensure_home, resolve_path
from .watchers import Watcher, WatcherRegistry


def _resolve(path, ctx):
    try:
        return resolve_path(path, ctx.user.pw_dir)
    except ValueError as exc:
        raise ConnectError("invalid_argument", str(exc)) from None


def _stat_entry(path):
    try:
        return entry_info(path)
    except FileNotFoundError:
        raise ConnectError("not_found", f"path '{path}' does not exist") from None
    except NotADirectoryError:
        raise ConnectError("not_found", f"path '{path}' does not exist") from None


def list_dir(root, depth):
    """Entries under ``root`` up to ``depth`` levels, parents before children, names sorted."""
    try:
        st = os.stat(root)
    except (FileNotFoundError, NotADirectoryError):
        raise ConnectError("not_found", f"directory '{root}' does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConnectError("invalid_argument", f"path '{root}' is not a directory")
    entries = []

    def walk(directory, level):
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            return
        for name in names:
            path = os.path.join(directory, name)
            try:
                info = entry_info(path)
            except OSError:
                continue  # vanished while listing
            entries.append(info)
            if level < depth and info.type == pb.FILE_TYPE_DIRECTORY and not info.is_symlink:
                walk(path, level + 1)

    walk(root, 1)
    return entries


def remove_path(path):
    """rm -rf that does not follow symlinks and ignores a missing path."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        try:
            shutil.rmtree(path)
        except RecursionError:
            # a tree deeper than Python's recursion (a user may make one: mkdir -p a/a/a/…):
            # coreutils' rm walks it with openat, never following links, at any depth
            done = subprocess.run(["rm", "-rf", "--one-file-system", "--", path], capture_output=True)
            if done.returncode != 0:
                raise OSError(f"could not remove {path!r}: {done.stderr.decode(errors='replace')[-300:]}") from None
    else:
        os.unlink(path)


class FilesystemService:
    """Handlers plus the registry of polling watchers."""

    def __init__(self, settings):
        self.settings = settings
        self.watchers = WatcherRegistry()

    def methods(self):
        p = "/filesystem.Filesystem/"
        return {
            p + "Stat": Method(UNARY, pb.StatRequest, self.stat),
            p + "MakeDir": Method(UNARY, pb.MakeDirRequest, self.make_dir),
            p + "Move": Method(UNARY, pb.MoveRequest, self.move),
            p + "ListDir": Method(UNARY, pb.ListDirRequest, self.list_dir),
            p + "Remove": Method(UNARY, pb.RemoveRequest, self.remove),
            p + "WatchDir": Method(SERVER_STREAM, pb.WatchDirRequest, self.watch_dir, self._keepalive),
            p + "CreateWatcher": Method(UNARY, pb.CreateWatcherRequest, self.create_watcher),
            p + "GetWatcherEvents": Method(UNARY, pb.GetWatcherEventsRequest, self.get_watcher_events),
            p + "RemoveWatcher": Method(UNARY, pb.RemoveWatcherRequest, self.remove_watcher),
        }

    @staticmethod
    def _keepalive():
        return pb.WatchDirResponse(keepalive=pb.WatchDirResponse.KeepAlive())

    async def stat(self, req, ctx):
        path = _resolve(req.path, ctx)
        permissions.check_stat(ctx.user, path)
        return pb.StatResponse(entry=_stat_entry(path))

    async def make_dir(self, req, ctx):
        path = _resolve(req.path, ctx)
        permissions.check_stat(ctx.user, path)
        if os.path.lexists(path):
            if os.path.isdir(path):
                raise ConnectError("already_exists", f"directory '{path}' already exists")
            raise ConnectError("invalid_argument", f"path '{path}' exists and is not a directory")
        ensure_home(ctx.user, os.path.dirname(path))
        permissions.check_change_in(ctx.user, path)
        try:
            make_dirs(path, ctx.user.pw_uid, ctx.user.pw_gid)
        except NotADirectoryError:
            raise ConnectError("invalid_argument", f"a parent of '{path}' is not a directory") from None
        return pb.MakeDirResponse(entry=entry_info(path))

    async def move(self, req, ctx):
        src = _resolve(req.source, ctx)
        dst = _resolve(req.destination, ctx)
        permissions.check_stat(ctx.user, src)
        if not os.path.lexists(src):
            raise ConnectError("not_found", f"source '{src}' does not exist")
        permissions.check_change_in(ctx.user, src)
        ensure_home(ctx.user, os.path.dirname(dst))
        permissions.check_write(ctx.user, dst)

        def do_move():
            make_dirs(os.path.dirname(dst), ctx.user.pw_uid, ctx.user.pw_gid)
            try:
                os.rename(src, dst)
            except OSError as exc:
                if exc.errno != 18:  # EXDEV: fall back to copy + delete
                    raise
                shutil.move(src, dst)
            return entry_info(dst)

        return pb.MoveResponse(entry=await asyncio.to_thread(do_move))

    async def list_dir(self, req, ctx):
        path = _resolve(req.path, ctx)
        permissions.check_read(ctx.user, path)
        depth = req.depth or 1
        entries = await asyncio.to_thread(list_dir, path, depth)
        return pb.ListDirResponse(entries=entries)

    async def remove(self, req, ctx):
        path = _resolve(req.path, ctx)
        if path == "/":
            raise ConnectError("invalid_argument", "refusing to remove '/'")
        permissions.check_stat(ctx.user, path)
        if os.path.lexists(path):
            permissions.check_change_in(ctx.user, path)
        await asyncio.to_thread(remove_path, path)
        return pb.RemoveResponse()

    async def watch_dir(self, req, ctx):
        watcher = Watcher(_resolve(req.path, ctx), req.recursive, req.include_entry)
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        fd = watcher.fd
        watcher.on_events = ready.set
        loop.add_reader(fd, watcher.pump)
        try:
            yield pb.WatchDirResponse(start=pb.WatchDirResponse.StartEvent())
            while True:
                await ready.wait()
                ready.clear()
                for event in watcher.poll():
                    yield pb.WatchDirResponse(filesystem=event)
        finally:
            loop.remove_reader(fd)
            watcher.close()

    async def create_watcher(self, req, ctx):
        watcher = Watcher(_resolve(req.path, ctx), req.recursive, req.include_entry)
        # Pump as soon as events arrive so new subdirectories get watched promptly.
        asyncio.get_running_loop().add_reader(watcher.fd, watcher.pump)
        return pb.CreateWatcherResponse(watcher_id=self.watchers.add(watcher))

    async def get_watcher_events(self, req, ctx):
        events = self.watchers.get(req.watcher_id).poll()
        return pb.GetWatcherEventsResponse(events=events)

    async def remove_watcher(self, req, ctx):
        watcher = self.watchers.get(req.watcher_id)
        asyncio.get_running_loop().remove_reader(watcher.fd)
        self.watchers.remove(req.watcher_id)
        return pb.RemoveWatcherResponse()
