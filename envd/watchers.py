"""Directory watchers on inotify, producing E2B FilesystemEvents.

Events sit in the kernel queue from the moment of the change, so a poll right
after a write (what the SDK tests do) always sees them. Every live watcher is
also pumped at the start of each request (see ``pump_all``) so a directory
created by one request is watched before the next request writes into it.
"""

import os

from . import inotify as ino
from .connect import ConnectError
from .fsinfo import entry_info
from .proto import filesystem_pb2 as pb

WATCH_MASK = (ino.IN_CREATE | ino.IN_MODIFY | ino.IN_ATTRIB | ino.IN_DELETE | ino.IN_MOVED_FROM
              | ino.IN_MOVED_TO | ino.IN_DELETE_SELF | ino.IN_MOVE_SELF)


def event_type(mask):
    """Map an inotify mask to an EventType (fsnotify-style; moved-to counts as create)."""
    if mask & (ino.IN_CREATE | ino.IN_MOVED_TO):
        return pb.EVENT_TYPE_CREATE
    if mask & ino.IN_MODIFY:
        return pb.EVENT_TYPE_WRITE
    if mask & ino.IN_DELETE:
        return pb.EVENT_TYPE_REMOVE
    if mask & ino.IN_MOVED_FROM:
        return pb.EVENT_TYPE_RENAME
    if mask & ino.IN_ATTRIB:
        return pb.EVENT_TYPE_CHMOD
    return pb.EVENT_TYPE_UNSPECIFIED


MAX_PENDING = 100_000
_ACTIVE = set()


def pump_all():
    """Move kernel events of every live watcher into its buffer (cheap when idle)."""
    for watcher in list(_ACTIVE):
        watcher.pump()


class Watcher:
    """Watches ``root`` (optionally recursively) and buffers converted events."""

    def __init__(self, root, recursive=False, include_entry=False):
        if not os.path.exists(root):
            raise ConnectError("not_found", f"path '{root}' does not exist")
        if not os.path.isdir(root):
            raise ConnectError("invalid_argument", f"path '{root}' is not a directory")
        self.root = root
        self.recursive = recursive
        self.include_entry = include_entry
        self.inotify = ino.Inotify()
        self.dirs = {}  # wd -> directory path relative to root ("" = root)
        self.pending = []
        self.on_events = None  # optional callback run after events were buffered
        try:
            self._add_tree(root, "", synthesize=False)
        except Exception:
            self.close()
            raise
        _ACTIVE.add(self)

    @property
    def fd(self):
        return self.inotify.fd

    def _add(self, path, rel):
        try:
            wd = self.inotify.add_watch(path, WATCH_MASK | ino.IN_ONLYDIR | ino.IN_DONT_FOLLOW)
        except FileNotFoundError:
            return
        except NotADirectoryError:
            return
        self.dirs[wd] = rel

    def _add_tree(self, path, rel, synthesize=True):
        """Watch ``path`` (and, recursively, its subdirectories).

        For a directory that appeared after the watch started, entries created
        before its watch was added are reported as synthetic CREATE events.
        """
        self._add(path, rel)
        if not self.recursive:
            return
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()
            base = os.path.relpath(dirpath, self.root)
            for name in sorted(dirnames + filenames) if synthesize else ():
                self._emit(pb.EVENT_TYPE_CREATE, name if base == "." else os.path.join(base, name))
            for d in list(dirnames):
                sub = os.path.join(dirpath, d)
                if os.path.islink(sub):
                    dirnames.remove(d)
                else:
                    self._add(sub, d if base == "." else os.path.join(base, d))

    def _emit(self, kind, rel):
        if len(self.pending) >= MAX_PENDING:
            return  # an unpolled watcher must not grow without bound
        event = pb.FilesystemEvent(name=rel, type=kind)
        if self.include_entry:
            try:
                event.entry.CopyFrom(entry_info(os.path.join(self.root, rel)))
            except OSError:
                pass
        self.pending.append(event)

    def pump(self):
        """Drain the kernel queue into ``pending``; returns True if anything was added."""
        if self.inotify.fd < 0:
            return False
        before = len(self.pending)
        for wd, mask, _cookie, name in self.inotify.read():
            if mask & ino.IN_IGNORED:
                self.dirs.pop(wd, None)
                continue
            rel_dir = self.dirs.get(wd)
            if rel_dir is None or not name:
                continue  # overflow or events on a watched dir itself (its parent reports them)
            kind = event_type(mask)
            if kind == pb.EVENT_TYPE_UNSPECIFIED:
                continue
            rel = os.path.join(rel_dir, name) if rel_dir else name
            self._emit(kind, rel)
            if self.recursive and mask & ino.IN_ISDIR and kind == pb.EVENT_TYPE_CREATE:
                self._add_tree(os.path.join(self.root, rel), rel)
        added = len(self.pending) > before
        if added and self.on_events is not None:
            self.on_events()
        return added

    def poll(self):
        """Return and clear all buffered events (after draining the kernel queue)."""
        self.pump()
        out, self.pending = self.pending, []
        return out

    def close(self):
        _ACTIVE.discard(self)
        self.inotify.close()


class WatcherRegistry:
    """Server-side watchers for the CreateWatcher/GetWatcherEvents polling API."""

    def __init__(self):
        self._watchers = {}
        self._next = 0

    def add(self, watcher):
        self._next += 1
        watcher_id = f"w{self._next}-{os.urandom(6).hex()}"
        self._watchers[watcher_id] = watcher
        return watcher_id

    def get(self, watcher_id):
        watcher = self._watchers.get(watcher_id)
        if watcher is None:
            raise ConnectError("not_found", f"watcher '{watcher_id}' not found")
        return watcher

    def remove(self, watcher_id):
        watcher = self._watchers.pop(watcher_id, None)
        if watcher is None:
            raise ConnectError("not_found", f"watcher '{watcher_id}' not found")
        watcher.close()
