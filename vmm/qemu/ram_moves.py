"""QEMU driver, a paused VM's memory: moving the RAM of a VM saved with its memory out of
tmpfs onto disk in the background, and deleting a resumed VM's disk copy off the resume path.

Why a module of its own: this is the one part of the lifecycle that runs outside the verb
that caused it (a thread pool, after the pause has answered) and so outside the VM's lock
for most of its work; it has its own rules for not mixing up a stale copy with the VM's
memory (see ``_spill``), kept apart from the verbs in vmm.qemu.lifecycle.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path

from vmm.qemu import ramfile
from vmm.qemu.state import VMState
from vmm.vm_status import VmLifecycle

RAM_ON_DISK = "memory.ram"  # a paused VM's RAM, in its state dir
DISCARDED = ".discard"  # RAM files in ram-moves/ that are only waiting to be deleted

log = logging.getLogger(__name__)


class RamMovesMixin:
    """_spill_later / _discard_later / settle of QemuDriver (needs its sandboxes_dir, _lock,
    _spill_mutex, _spill_pool, _spills)."""

    def _spill_later(self, sandbox_id: str) -> None:
        """Moves the RAM of a VM just saved with its memory out of tmpfs in the background
        (~0.2 s for 140 MiB with its fsync, which the pause need not wait for)."""
        self._in_background(self._spill, sandbox_id)

    def _in_background(self, fn, *args) -> None:
        """Runs fn(*args) on the driver's pool for RAM moves; settle() waits for it."""
        with self._spill_mutex:
            if self._spill_pool is None:
                self._spill_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ram-to-disk")
                _remove_stale_copies(self._ram_moves_dir())
            self._spills = [f for f in self._spills if not f.done()]
            self._spills.append(self._spill_pool.submit(fn, *args))

    def _discard_later(self, path: Path) -> None:
        """Deletes a paused VM's RAM file from disk off the verb's path: freeing its extents
        takes ~80 ms here, which a resume need not wait for. It is renamed away first (atomic,
        instant), so its name is free at once for the VM's next pause."""
        moves = self._ram_moves_dir()
        doomed = moves / f"{path.name}.{uuid.uuid4().hex[:12]}{DISCARDED}"
        try:
            moves.mkdir(exist_ok=True)
            os.rename(path, doomed)
        except FileNotFoundError:
            return
        except OSError:  # not the same filesystem: at once, then
            path.unlink(missing_ok=True)
            return
        self._in_background(doomed.unlink, True)

    def _spill(self, sandbox_id: str) -> None:
        """The copy runs outside the VM's lock, so a resume that comes meanwhile is not kept
        waiting for it: it resumes from tmpfs and the copy is dropped. Only the switch to
        the copy takes the lock, and only for the very pause it copied (same status, RAM
        file and device state file), so a resume + pause during the copy is never mixed up
        with the stale copy."""
        state_dir = self.sandboxes_dir / sandbox_id
        try:
            state = VMState.load(state_dir)
            move = self._ram_move(state) if state is not None and state.status is VmLifecycle.PAUSED_DISK else None
            if move is None:
                return
            ram, dest = move
            pause = _pause_mark(state)
            # Not in the state dir: a kill meanwhile removes that dir, and must find it empty.
            moves = self._ram_moves_dir()
            moves.mkdir(exist_ok=True)
            tmp = moves / f"{sandbox_id}.{os.getpid()}-{threading.get_ident()}.tmp"
            t0 = time.monotonic()
            try:
                copied = _copy_synced(ram, tmp)
            except OSError:
                tmp.unlink(missing_ok=True)
                now = VMState.load(state_dir)
                if now is not None and now.status is VmLifecycle.PAUSED_DISK and _pause_mark(now) == pause:
                    raise
                return  # resumed or killed meanwhile: its RAM file went away or changed hands
            with self._lock(sandbox_id):
                now = VMState.load(state_dir)
                if (now is None or now.status is not VmLifecycle.PAUSED_DISK or now.ram != str(ram)
                        or _pause_mark(now) != pause):
                    tmp.unlink(missing_ok=True)
                    return
                os.replace(tmp, dest)
                now.ram = str(dest)  # from here the disk copy is the VM's memory
                now.timings.update({"ram_to_disk_ms": (time.monotonic() - t0) * 1e3, "ram_to_disk_mb": copied / 2**20})
                now.save()
                ram.unlink(missing_ok=True)
        except Exception:  # noqa: BLE001 - the RAM stays in tmpfs, which works as before
            log.exception("sandbox %s: moving its paused memory to disk failed", sandbox_id)

    def settle(self, timeout: float | None = None) -> bool:
        """Until every pending RAM move to disk has ended (a node that stops, tests)."""
        with self._spill_mutex:
            pending = list(self._spills)
        _, late = wait_futures(pending, timeout=timeout)
        return not late

    def _ram_moves_dir(self) -> Path:
        """Where RAM copies are written before they become a VM's (the state dirs' filesystem)."""
        return self.sandboxes_dir.with_name("ram-moves")

    @staticmethod
    def _ram_move(state: VMState) -> tuple[Path, Path] | None:
        """(tmpfs RAM file, its place on disk) for a VM saved with its memory that owns its
        RAM file: copied (sparse, synced) next to its device state and the tmpfs one removed,
        a paused sandbox holds no host memory and survives a reboot. None when there is
        nothing to move: a copy-on-write VM has its RAM in the device state already (its RAM
        file is a snapshot's), or the RAM is on disk already."""
        ram = Path(state.ram)
        if not (state.ram_owned and state.ram_share and not state.device_state_full_ram) or not ram.is_file():
            return None
        dest = Path(state.state_dir) / RAM_ON_DISK
        return None if ram == dest else (ram, dest)


def _pause_mark(state: VMState) -> tuple | None:
    """Which pause a VM's saved state is: its device state file is written anew by each."""
    try:
        st = os.stat(state.device_state)
    except (OSError, TypeError):
        return None
    return state.device_state, st.st_ino, st.st_mtime_ns, st.st_size


def _copy_synced(src: Path, dst: Path) -> int:
    """A sparse copy of ``src`` as the new file ``dst``, on disk before it returns."""
    fd = os.open(dst, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.ftruncate(fd, src.stat().st_size)
        copied = ramfile.copy_sparse_into(src, fd)
        os.fsync(fd)
        return copied
    finally:
        os.close(fd)


def _remove_stale_copies(moves: Path, older_than_s: float = 600.0) -> None:
    """RAM copies a crashed node left half-written (never anyone's memory), and files it
    had not finished deleting (whatever their age)."""
    try:
        entries = list(moves.iterdir())
    except FileNotFoundError:
        return
    limit = time.time() - older_than_s
    for path in entries:
        try:
            if path.name.endswith(DISCARDED) or path.stat().st_mtime < limit:
                path.unlink()
        except FileNotFoundError:
            pass
