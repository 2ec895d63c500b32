"""Directory watching: sync polling watcher and async WatchDir stream."""
import asyncio
import os

import pytest
from e2b import FilesystemEventType, NotFoundException


def test_sync_watch_new_file_yields_three_events_immediately(sandbox, workdir):
    w = sandbox.files.watch_dir(workdir)
    try:
        sandbox.files.write(f"{workdir}/w.txt", "w")
        events = w.get_new_events()  # no sleep: events must already be there
        assert len(events) == 3
        assert events[0].type == FilesystemEventType.CREATE and events[0].name == "w.txt"
        assert {e.type for e in events[1:]} <= {FilesystemEventType.WRITE, FilesystemEventType.CHMOD}
        assert w.get_new_events() == []
    finally:
        w.stop()


def test_sync_watch_recursive_with_entries(sandbox, workdir):
    w = sandbox.files.watch_dir(workdir, recursive=True, include_entry=True)
    try:
        sandbox.files.make_dir(f"{workdir}/nested")
        sandbox.files.write(f"{workdir}/nested/file.txt", "x")
        sandbox.files.remove(f"{workdir}/nested/file.txt")
        events = w.get_new_events()
        names = [(e.name, e.type) for e in events]
        assert ("nested", FilesystemEventType.CREATE) in names
        assert ("nested/file.txt", FilesystemEventType.CREATE) in names
        assert ("nested/file.txt", FilesystemEventType.REMOVE) in names
        created = next(e for e in events if e.name == "nested")
        assert created.entry is not None and created.entry.path == f"{workdir}/nested"
    finally:
        w.stop()


def test_sync_watch_rename_and_missing_dir(sandbox, workdir):
    open(f"{workdir}/old", "w").close()
    w = sandbox.files.watch_dir(workdir)
    try:
        sandbox.files.rename(f"{workdir}/old", f"{workdir}/new")
        names = [(e.name, e.type) for e in w.get_new_events()]
        assert ("old", FilesystemEventType.RENAME) in names
        assert ("new", FilesystemEventType.CREATE) in names
    finally:
        w.stop()
    with pytest.raises(NotFoundException):
        sandbox.files.watch_dir(f"{workdir}/missing")


async def test_async_watch_dir_stream(async_sandbox, workdir):
    events = []
    w = await async_sandbox.files.watch_dir(workdir, on_event=events.append, recursive=True)
    try:
        os.mkdir(f"{workdir}/sub")
        await asyncio.sleep(0.2)
        # `sub` was made by this (root) test process, so only root may write in it
        await async_sandbox.files.write(f"{workdir}/sub/aw.txt", "x", user="root")
        for _ in range(50):
            if any(e.name == "sub/aw.txt" for e in events):
                break
            await asyncio.sleep(0.05)
    finally:
        await w.stop()
    assert ("sub", FilesystemEventType.CREATE) in [(e.name, e.type) for e in events]
    assert ("sub/aw.txt", FilesystemEventType.CREATE) in [(e.name, e.type) for e in events]


async def test_async_watch_missing_dir(async_sandbox, workdir):
    with pytest.raises(NotFoundException):
        await async_sandbox.files.watch_dir(f"{workdir}/missing", on_event=lambda e: None)
