"""QEMU driver, lifecycle half: pause / resume in memory, pause to disk (device state, or
filesystem-only) and resume from it (an incoming migration of the device state over the same
RAM file, or a cold boot on the kept disk).

Why these recipes: see the package docstring (x-ignore-shared: saving a VM migrates only its
device state; the share=on RAM file is the memory snapshot). What happens to a saved VM's
memory after the verb has answered (to disk, and the disk copy deleted after a resume) is
vmm.qemu.ram_moves's job; the verbs here only hand it over.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

from envd_client import EnvdClient, EnvdError, EnvdUnavailable
from vmm.driver import HostDiskFull, MemoryLost, SnapshotUnusable, VMError, VMInfo
from vmm.qemu import ramfile
from vmm.qemu.cmdline import VMPaths
from vmm.qemu.process import GUEST_SYNC_TIMEOUT, BootAttemptFailed, attempts_error, release_mismatch
from vmm.qemu.qmp import QMP, QMPError, migrate_from_file, migrate_to_file, set_ignore_shared
from vmm.qemu.state import VMState, process_alive, read_pidfile, reap
from vmm.vm_status import VmLifecycle

log = logging.getLogger(__name__)
# Below this much free room on the state dir's filesystem a failed save of the device state
# (QEMU's "migrate ... failed": its writer got ENOSPC) counts as the disk being full.
DISK_FULL_BELOW = 64 << 20


# What a host tool (qemu-img: a new disk top, a capture's layer) prints for ENOSPC / EDQUOT; its
# failure reaches us as a VMError with its stderr (vmm.qemu.process.run).
_NO_ROOM_TEXTS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


def disk_full(exc: BaseException, where: Path) -> str:
    """Why ``exc`` (a failed save into ``where``) is the disk being full, or "" if it is not."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return str(exc)
    # QEMU's writer got ENOSPC (migrate ... failed), or a host tool did: a plain VMError from
    # vmm.qemu.process.run with its stderr, which says so (qemu-img create) or not (qemu-img
    # rebase: "No space left in the file header"), then judged by the room left. Never another
    # kind of VMError: a lost VM stays lost, and a boot's error carries the guest's console,
    # whose text the guest writes.
    if not (isinstance(exc, QMPError) or type(exc) is VMError):
        return ""
    first = str(exc).splitlines()[0][:500] if str(exc) else ""
    if type(exc) is VMError and any(text in str(exc) for text in _NO_ROOM_TEXTS):
        return first
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return ""
    return f"{first}; {free >> 20} MiB free" if free < DISK_FULL_BELOW else ""


class LifecycleMixin:
    """pause / pause_to_disk / resume of QemuDriver (needs its _lock, _load, _paths, _argv,
    _prepare, _spawn_cold, _wait_health, _stop_process, _to_info, and RamMovesMixin's
    _spill_later / _discard_later)."""

    def _spawn_incoming(self, state: VMState, device_state: Path, ignore_shared: bool = True,
                        before_cont=None, before_incoming=None) -> dict[str, float]:
        """Starts a destination QEMU for `state` (-incoming defer), loads the device state, runs
        it and waits for envd. On failure the new process is stopped and the error raised."""
        t0 = time.monotonic()
        if not device_state.is_file():  # `exec:cat` of a missing file leaves QEMU waiting forever
            raise VMError(f"sandbox {state.sandbox_id}: device state {device_state} is missing")
        state.argv = self._argv(state, incoming=True)
        state.top_node = "root"
        state.pid = 0
        state.save()
        paths = self._paths(state)
        try:
            paths.pidfile.unlink()
        except FileNotFoundError:
            pass
        try:
            proc = subprocess.run(self._launch(state) + state.argv, capture_output=True, text=True,
                                  start_new_session=True, stdin=subprocess.DEVNULL)
            if proc.returncode != 0:
                raise VMError(f"sandbox {state.sandbox_id}: qemu exited {proc.returncode}: "
                              f"{proc.stderr.strip()[-500:]}")
            pid = read_pidfile(paths.pidfile)
            if pid is None:
                raise VMError(f"sandbox {state.sandbox_id}: no pidfile")
            state.pid = pid
            t_spawn = time.monotonic()
            with QMP(paths.qmp, timeout=30.0) as q:
                self._prepare(q)
                if before_incoming is not None:  # e.g. the RAM file must be complete before the guest runs
                    before_incoming()
                if not ignore_shared:  # a full-RAM stream written without x-ignore-shared
                    set_ignore_shared(q, False)
                migrate_from_file(q, device_state, before_cont=before_cont)
                if not ignore_shared:
                    set_ignore_shared(q, True)
            t_run = time.monotonic()
            self._wait_health(state, self.boot_timeout)
        except BaseException:
            self._stop_process(paths)
            raise
        t_ready = time.monotonic()
        return {"spawn_ms": (t_spawn - t0) * 1e3, "incoming_ms": (t_run - t_spawn) * 1e3,
                "envd_ms": (t_ready - t_run) * 1e3, "total_ms": (t_ready - t0) * 1e3}


    def pause(self, sandbox_id: str) -> dict[str, float]:
        with self._lock(sandbox_id):
            state = self._load(sandbox_id)
            if state.status.offline:
                raise VMError(f"sandbox {sandbox_id} is paused to disk")
            t0 = time.monotonic()
            with QMP(Path(state.qmp)) as q:
                q.execute("stop")
            timings = {"pause_ms": (time.monotonic() - t0) * 1e3}
            state.move(VmLifecycle.PAUSED)
            state.timings.update(timings)
            state.save()
            return timings

    def pause_to_disk(self, sandbox_id: str, memory: bool = True) -> dict[str, float]:
        with self._lock(sandbox_id):
            state = self._load(sandbox_id)
            if state.status is (VmLifecycle.PAUSED_DISK if memory else VmLifecycle.PAUSED_FS):
                return {}
            if state.status.offline:
                raise VMError(f"sandbox {sandbox_id} is already paused to disk "
                              f"({'without' if state.status is VmLifecycle.PAUSED_FS else 'with'} its memory); "
                              "resume it first")
            if not memory:
                return self._pause_fs(state)
            paths = self._paths(state)
            device_state = paths.state_dir / "device.state"
            t0 = time.monotonic()
            with QMP(paths.qmp, timeout=30.0) as q:
                was_running = q.execute("query-status").get("status") == "running"
                q.execute("stop")
                t_stop = time.monotonic()
                full_ram = not state.ram_share  # copy-on-write RAM travels in the stream anyway
                try:
                    if full_ram:  # plain format, so a share=on destination loads it (see _resume_incoming)
                        set_ignore_shared(q, False)
                    migrate_to_file(q, device_state)
                    t_saved = time.monotonic()
                    # From here the device state + RAM file are the VM: record that before QEMU exits.
                    state.move(VmLifecycle.PAUSED_DISK)
                    state.device_state = str(device_state)
                    state.device_state_full_ram = full_ram
                    state.device_state_qemu = self._qemu_version(state)
                    state.save()
                except BaseException as exc:
                    # vm.json still says it runs: so it does again (the caller relies on it)
                    if full_ram:
                        set_ignore_shared(q, True)
                    if was_running:
                        q.execute("cont")
                    full = disk_full(exc, paths.state_dir)  # before its partial file frees room
                    device_state.unlink(missing_ok=True)
                    if full:
                        raise HostDiskFull(f"sandbox {sandbox_id}: not paused, no room on the node's disk for its "
                                           f"saved state ({full}); it runs on") from exc
                    raise
                try:
                    q.execute("quit")
                except QMPError:
                    pass  # the socket may close before the reply
            self._wait_exit(state, paths)
            t_exit = time.monotonic()
            state.pid = 0
            # The VM is paused to disk now: what is left is bookkeeping, which a full disk must
            # not turn into a failed pause (the caller would call the sandbox running again).
            try:
                self._give_back_slot(state)
            except OSError as exc:  # its record keeps the slot: the resume runs in it, a kill frees it
                log.warning("sandbox %s: paused to disk; its network slot is kept: %s", sandbox_id, exc)
            timings = {"stop_ms": (t_stop - t0) * 1e3, "save_ms": (t_saved - t_stop) * 1e3,
                       "pause_to_disk_ms": (t_saved - t0) * 1e3, "exit_ms": (t_exit - t_saved) * 1e3,
                       "total_ms": (t_exit - t0) * 1e3}
            state.timings.update({f"pause_to_disk.{k}": v for k, v in timings.items()})
            try:
                state.save()
            except OSError as exc:
                log.warning("sandbox %s: paused to disk; its timings were not recorded: %s", sandbox_id, exc)
        self._spill_later(sandbox_id)
        return timings

    def _wait_exit(self, state: VMState, paths: VMPaths) -> None:
        """Waits for a QEMU that was told to quit; stops it harder after 10 s."""
        pid = state.pid
        end = time.monotonic() + 10.0
        while process_alive(pid, state.qmp) and time.monotonic() < end:
            time.sleep(0.002)
        if process_alive(pid, state.qmp):
            self._stop_process(paths)
        reap(pid)

    def _guest_sync(self, state: VMState) -> None:
        """Has envd run sync(2) so the guest page cache is on the virtual disk; raises VMError."""
        try:
            with EnvdClient.at(state.host_address, state.host_port) as envd:
                envd.sync(timeout=GUEST_SYNC_TIMEOUT)
        except EnvdUnavailable as e:
            raise VMError(f"sandbox {state.sandbox_id}: guest sync failed: {e}") from None
        except EnvdError as e:
            raise VMError(f"sandbox {state.sandbox_id}: guest sync answered {e.status}: {e}") from None

    def _sync_running(self, state: VMState, paths: VMPaths) -> bool:
        """Guest sync, continuing a guest paused in memory for it (only a running guest
        flushes its page cache); if the sync fails it is stopped again and VMError raised.
        Returns whether it was continued (the caller stops it again when it is done)."""
        continued = state.status is VmLifecycle.PAUSED
        if continued:
            with QMP(paths.qmp) as q:
                q.execute("cont")
        try:
            self._guest_sync(state)
        except BaseException:
            if continued:
                with QMP(paths.qmp) as q:
                    q.execute("stop")
            raise
        return continued

    def _pause_fs(self, state: VMState) -> dict[str, float]:
        """Filesystem-only pause: guest sync, QEMU quits, RAM file deleted, disk chain kept.
        A failed sync leaves the VM as it was (a dirty page cache must not be thrown away)."""
        paths = self._paths(state)
        t0 = time.monotonic()
        self._sync_running(state, paths)
        t_sync = time.monotonic()
        with QMP(paths.qmp, timeout=30.0) as q:
            q.execute("stop")
            # From here only the disk is the VM: record that before QEMU exits.
            state.move(VmLifecycle.PAUSED_FS)
            state.device_state = ""
            state.save()
            try:
                q.execute("quit")
            except QMPError:
                pass  # the socket may close before the reply
        t_stop = time.monotonic()
        self._wait_exit(state, paths)
        t_exit = time.monotonic()
        self._give_back_slot(state)
        if state.ram_owned:
            try:
                paths.ram.unlink()
            except FileNotFoundError:
                pass
        # The next start is a cold boot on a RAM file of its own (even if restored from a snapshot).
        state.ram = str(VMPaths.for_sandbox(paths.state_dir, state.sandbox_id, self.shm_dir).ram)
        state.ram_share = state.ram_owned = True
        state.pid = 0
        timings = {"sync_ms": (t_sync - t0) * 1e3, "stop_ms": (t_stop - t_sync) * 1e3,
                   "exit_ms": (t_exit - t_stop) * 1e3, "total_ms": (time.monotonic() - t0) * 1e3}
        state.timings.update({f"pause_fs.{k}": v for k, v in timings.items()})
        state.save()
        return timings

    def _discard_memory(self, state: VMState) -> None:
        """Turns a memory-paused VM into a filesystem-paused one without a guest sync (the
        guest is not running): its process, device state and RAM go, the disk stays."""
        paths = self._paths(state)
        self._stop_process(paths)
        self._give_back_slot(state)
        if state.device_state:
            Path(state.device_state).unlink(missing_ok=True)
        if state.ram_owned:
            paths.ram.unlink(missing_ok=True)
            Path(state.ram).unlink(missing_ok=True)  # or its copy on disk (_spill)
        state.move(VmLifecycle.PAUSED_FS)
        state.device_state = ""
        state.device_state_qemu = ""
        state.ram = str(VMPaths.for_sandbox(paths.state_dir, state.sandbox_id, self.shm_dir).ram)
        state.ram_share = state.ram_owned = True
        state.pid = 0
        state.save()

    def _resume_cold(self, state: VMState) -> dict[str, float]:
        """Cold-boots a filesystem-only paused VM on its own disk (same id, port and top).
        On failure it stays paused_fs with no process and no RAM file."""
        paths = self._paths(state)
        self._stop_process(paths)  # a QEMU left by an interrupted pause
        failures = []
        for attempt in (1, 2):
            t0 = time.monotonic()
            state.argv = self._argv(state, incoming=False)
            state.top_node = "root"
            state.pid = 0
            state.save()
            for stale in (paths.pidfile, paths.ram):
                try:
                    stale.unlink()
                except FileNotFoundError:
                    pass
            try:
                t_spawn, t_ready = self._spawn_cold(state, paths, attempt)
                return {"spawn_ms": (t_spawn - t0) * 1e3, "envd_ms": (t_ready - t_spawn) * 1e3,
                        "total_ms": (t_ready - t0) * 1e3, "attempt": attempt, "cold_boot": 1}
            except BootAttemptFailed as e:
                failures.append(e)
            except BaseException:
                self._undo_spawn(state, paths)
                raise
            self._undo_spawn(state, paths)
        raise attempts_error(state.sandbox_id, failures)

    def _undo_spawn(self, state: VMState, paths: VMPaths) -> None:
        self._stop_process(paths)
        try:
            paths.ram.unlink()
        except FileNotFoundError:
            pass
        state.pid = 0
        state.save()

    def _resume_incoming(self, state: VMState) -> dict[str, float]:
        """Resume after pause_to_disk with memory. A copy-on-write VM (restored or forked:
        share=off over a snapshot's RAM) saved its whole RAM into the device state; it comes
        back on a share=on RAM file of its own that the stream fills, so its next pause or
        snapshot saves only the device state again."""
        device_state = Path(state.device_state)
        why = release_mismatch(state.device_state_qemu, self._qemu_version(state)) if state.device_state_qemu else ""
        if why:  # QEMU would start and then exit with "load of migration failed"
            raise SnapshotUnusable(f"sandbox {state.sandbox_id} cannot resume with its memory: {why}; "
                                   "resume it without its memory (a cold boot on its own disk) instead")
        saved = (state.ram, state.ram_share, state.ram_owned)
        converting = not state.ram_share and state.device_state_full_ram
        on_disk = Path(state.ram) if Path(state.ram).parent == Path(state.state_dir) else None
        copy = None
        if on_disk is not None:  # its memory waited on disk (_spill): back into tmpfs, in the background
            shm = VMPaths.for_sandbox(Path(state.state_dir), state.sandbox_id, self.shm_dir).ram
            shm.unlink(missing_ok=True)
            copy = ramfile.RamCopy(on_disk, shm, on_disk.stat().st_size)
            state.ram = str(shm)
        if converting:
            own = VMPaths.for_sandbox(Path(state.state_dir), state.sandbox_id, self.shm_dir).ram
            try:
                own.unlink()
            except FileNotFoundError:
                pass
            state.ram, state.ram_share, state.ram_owned = str(own), True, True
        ran = []  # the guest ran: from then on its RAM file is newer than the saved device state
        try:
            punched = {}

            def before_cont():
                if converting:  # loading the stream touched (allocated) every page
                    t = time.monotonic()
                    punched["ram_zero_punched_mb"] = ramfile.punch_zero_pages(state.ram) / (1 << 20)
                    punched["ram_punch_ms"] = (time.monotonic() - t) * 1e3
                ran.append(True)

            timings = self._spawn_incoming(state, device_state, ignore_shared=not state.device_state_full_ram,
                                           before_cont=before_cont,
                                           before_incoming=copy.wait if copy is not None else None)
            timings.update(punched)
        except BaseException as exc:
            if ran and copy is None and not converting:
                # The guest ran on the only copy of its memory and then failed (envd silent, QEMU
                # died): loading the saved device state again would pair it with a newer memory, a
                # corrupt guest. The memory is given up, the disk kept: the next resume cold-boots.
                self._discard_memory(state)
                raise MemoryLost(f"sandbox {state.sandbox_id}: not resumed, and its memory is lost (the guest ran "
                              f"before the resume failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
                              "its disk is kept and the next resume cold-boots on it") from exc
            if copy is not None:  # the disk copy stays the VM's memory
                copy.wait(raise_error=False)
                Path(state.ram).unlink(missing_ok=True)
                state.ram = str(on_disk)
                state.pid = 0
                state.save()
            if converting:
                try:
                    Path(state.ram).unlink()
                except FileNotFoundError:
                    pass
                state.ram, state.ram_share, state.ram_owned = saved
                state.pid = 0
                state.save()
            raise
        if converting:
            timings["ram_converted"] = 1
        if copy is not None:
            timings["ram_from_disk_ms"] = copy.elapsed_ms
            timings["ram_from_disk_wait_ms"] = copy.waited_ms
            self._discard_later(on_disk)
        try:
            device_state.unlink()
        except FileNotFoundError:
            pass
        state.device_state = ""
        state.device_state_full_ram = False
        state.device_state_qemu = ""
        return timings

    def resume(self, sandbox_id: str, memory: bool = True) -> VMInfo:
        with self._lock(sandbox_id):
            state = self._load(sandbox_id)
            if not memory and state.status in (VmLifecycle.PAUSED, VmLifecycle.PAUSED_DISK):
                self._discard_memory(state)
            if state.status.offline:
                ram_in_tmpfs = (state.status is VmLifecycle.PAUSED_DISK and state.ram_share
                                and Path(state.ram).parent == self.shm_dir)
                if not ram_in_tmpfs:  # a RAM file is made in tmpfs (back from disk, or a new one)
                    self._check_shm(state.memory_mb, sandbox_id)
                try:
                    self._take_slot(state)
                    try:
                        timings = (self._resume_cold(state) if state.status is VmLifecycle.PAUSED_FS
                                   else self._resume_incoming(state))
                    except BaseException:
                        self._give_back_slot(state)
                        raise
                except OSError as exc:
                    full = disk_full(exc, Path(state.state_dir))
                    if full:  # nothing ran: it stays paused, as it was
                        raise HostDiskFull(f"sandbox {sandbox_id}: not resumed, no room on the node's disk "
                                           f"({full}); it stays paused") from exc
                    raise
            else:
                t0 = time.monotonic()
                with QMP(Path(state.qmp)) as q:
                    q.execute("cont")
                t_cont = time.monotonic()
                self._wait_health(state, self.boot_timeout)
                timings = {"cont_ms": (t_cont - t0) * 1e3, "total_ms": (time.monotonic() - t0) * 1e3}
            state.move(VmLifecycle.RUNNING)
            state.timings.update({f"resume.{k}": v for k, v in timings.items()})
            state.save()
            info = self._to_info(state)
            info.timings = timings
            return info

