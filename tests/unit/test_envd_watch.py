"""inotify binding and event translation: events are readable synchronously after a write."""
import os

import pytest

from envd import inotify as ino
from envd.connect import ConnectError
from envd.proto import filesystem_pb2 as pb
from envd.watchers import Watcher, event_type


def test_event_type_mapping():
    assert event_type(ino.IN_CREATE) == pb.EVENT_TYPE_CREATE
    assert event_type(ino.IN_MOVED_TO) == pb.EVENT_TYPE_CREATE
    assert event_type(ino.IN_MODIFY) == pb.EVENT_TYPE_WRITE
    assert event_type(ino.IN_ATTRIB) == pb.EVENT_TYPE_CHMOD
    assert event_type(ino.IN_DELETE) == pb.EVENT_TYPE_REMOVE
    assert event_type(ino.IN_MOVED_FROM) == pb.EVENT_TYPE_RENAME
    assert event_type(ino.IN_CLOSE_WRITE) == pb.EVENT_TYPE_UNSPECIFIED


def test_parse_events_handles_padded_names():
    import struct
    raw = struct.pack("iIII", 1, ino.IN_CREATE, 0, 16) + b"a.txt".ljust(16, b"\0")
    raw += struct.pack("iIII", 1, ino.IN_DELETE, 0, 0)
    assert ino.parse_events(raw) == [(1, ino.IN_CREATE, 0, "a.txt"), (1, ino.IN_DELETE, 0, "")]


def test_recursive_watcher_reports_nested_names_immediately(tmp_path):
    w = Watcher(str(tmp_path), recursive=True, include_entry=True)
    try:
        (tmp_path / "sub").mkdir()
        first = w.poll()  # the new directory gets its own watch here
        assert [(e.name, e.type) for e in first] == [("sub", pb.EVENT_TYPE_CREATE)]
        assert first[0].entry.type == pb.FILE_TYPE_DIRECTORY
        (tmp_path / "sub" / "f.txt").write_text("x")
        names = [(e.name, e.type) for e in w.poll()]
        assert names[0] == ("sub/f.txt", pb.EVENT_TYPE_CREATE)
        assert ("sub/f.txt", pb.EVENT_TYPE_WRITE) in names
        os.remove(tmp_path / "sub" / "f.txt")
        assert ("sub/f.txt", pb.EVENT_TYPE_REMOVE) in [(e.name, e.type) for e in w.poll()]
        assert w.poll() == []
    finally:
        w.close()


def test_non_recursive_ignores_nested(tmp_path):
    (tmp_path / "sub").mkdir()
    w = Watcher(str(tmp_path), recursive=False)
    try:
        (tmp_path / "sub" / "f.txt").write_text("x")
        (tmp_path / "top.txt").write_text("y")
        names = {e.name for e in w.poll()}
        assert names == {"top.txt"}
    finally:
        w.close()


def test_watcher_errors(tmp_path):
    with pytest.raises(ConnectError) as exc:
        Watcher(str(tmp_path / "missing"))
    assert exc.value.code == "not_found"
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConnectError) as exc:
        Watcher(str(f))
    assert exc.value.code == "invalid_argument"
