"""QEMU driver, host half: the verbs reconcile and the snapshot stores use instead of reading
QEMU's files themselves: inspect (vm.json + process liveness -> VMStatus), failed disk
requests (QMP, for the node's VM watch), the ids with
anything on the host, leftovers (a QEMU process of a VM recorded as saved, a fork capture no
child uses) and their removal, the files VMs use (for the snapshot cache), and adopting a
snapshot downloaded from another host (re-pointing each disk layer's backing file).

Why in the driver: a node worker that died mid-operation leaves exactly these things, and only
the driver knows what its records mean; a Firecracker driver answers the same questions its
own way, so reconcile keeps its protections.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vmm.driver import Leftover, SnapshotManifest, SnapshotUnusable, VMInspection, VMStatus
from vmm.qemu import tops
from vmm.qemu.process import run
from vmm.qemu.qmp import QMP, QMPError
from vmm.qemu.state import VMState, process_alive, read_pidfile, reap, valid_sandbox_id
from vmm.vm_status import VmLifecycle

STRAY_PROCESS, FORK_CAPTURE = "process", "fork capture"
DISK_ERRORS_QMP_TIMEOUT = 2.0  # QMP takes one client: a verb holding it means "ask next time"


class HostMixin:
    """inspect / sandbox_ids / stray / remove_leftover / files_in_use / adopt_snapshot of
    QemuDriver (needs its sandboxes_dir, home, shm_dir, _lock, _release_capture, check_snapshot)."""

    def inspect(self, sandbox_id: str) -> VMInspection:
        if not valid_sandbox_id(sandbox_id):
            return VMInspection(sandbox_id, VMStatus.UNKNOWN)
        state_dir = self.sandboxes_dir / sandbox_id
        state = VMState.load(state_dir)
        if state is None:  # a boot cut off before its record, or files of a half-done kill
            left = state_dir.exists() or (self.shm_dir / f"aenv-{sandbox_id}.ram").exists()
            return VMInspection(sandbox_id, VMStatus.STOPPED if left else VMStatus.UNKNOWN)
        if state.status.offline:
            return VMInspection(sandbox_id, VMStatus.SAVED, memory=state.status is VmLifecycle.PAUSED_DISK)
        if not process_alive(state.pid, state.qmp):
            return VMInspection(sandbox_id, VMStatus.STOPPED)
        return VMInspection(sandbox_id, state.status.reported, pid=state.pid)

    def sandbox_ids(self) -> set[str]:
        if not self.sandboxes_dir.is_dir():
            return set()
        return {d.name for d in self.sandboxes_dir.iterdir() if d.is_dir()}

    def stray(self, sandbox_id: str | None = None) -> list[Leftover]:
        ids = [sandbox_id] if sandbox_id is not None else sorted(self.sandbox_ids())
        found = []
        for sid in ids:
            if valid_sandbox_id(sid) and self._stray_pid(VMState.load(self.sandboxes_dir / sid)):
                found.append(Leftover(STRAY_PROCESS, sid, sandbox_id=sid))
        if sandbox_id is None:
            found += [Leftover(FORK_CAPTURE, c.name) for c in self._unused_captures()]
        return found

    def remove_leftover(self, leftover: Leftover) -> bool:
        if leftover.kind == STRAY_PROCESS:
            with self._lock(leftover.sandbox_id):
                return self._stop_stray(VMState.load(self.sandboxes_dir / leftover.sandbox_id))
        if leftover.kind == FORK_CAPTURE:
            if "/" in leftover.name or leftover.name in ("", ".", ".."):
                return False
            capture = (self.home / "forks" / leftover.name).absolute()
            if not capture.is_dir():
                return False
            self._release_capture(capture)  # only if no VM refers to it (re-checked)
            return not capture.exists()
        return False

    def files_in_use(self, sandbox_id: str | None = None) -> set[str]:
        """Every absolute path a vm.json names (disk chain, RAM file, fork capture, kernel...):
        read as plain JSON, so a partial record still protects its files."""
        paths: set[str] = set()
        if sandbox_id is not None and not valid_sandbox_id(sandbox_id):
            return paths
        pattern = f"{sandbox_id}/vm.json" if sandbox_id is not None else "*/vm.json"
        for record in self.sandboxes_dir.glob(pattern) if self.sandboxes_dir.is_dir() else []:
            try:
                data = json.loads(record.read_text(errors="replace"))
            except (OSError, ValueError):
                continue
            values = data.values() if isinstance(data, dict) else []
            for value in values:
                for item in value if isinstance(value, list) else [value]:
                    if isinstance(item, str) and item.startswith("/"):
                        paths.add(item)
        return paths

    def disk_errors(self, sandbox_id: str) -> int:
        """QMP ``query-blockstats``: the failed reads, writes and flushes of all its drives (a
        failed request is counted when QEMU reports it to the guest: rerror/werror=report)."""
        if not valid_sandbox_id(sandbox_id):
            return 0
        state = VMState.load(self.sandboxes_dir / sandbox_id)
        if state is None or state.status.offline or not process_alive(state.pid, state.qmp):
            return 0
        try:
            with QMP(Path(state.qmp), timeout=DISK_ERRORS_QMP_TIMEOUT) as q:
                devices = q.execute("query-blockstats") or []
        except (QMPError, OSError, ValueError):  # busy with a verb's QMP, or going away: next time
            return 0
        return sum(int(d.get("stats", {}).get(f"failed_{kind}_operations", 0) or 0)
                   for d in devices if isinstance(d, dict) for kind in ("rd", "wr", "flush"))

    def adopt_snapshot(self, dir: Path) -> SnapshotManifest:
        """Each disk layer above the image's base is one of the snapshot's own files; its
        backing file is re-pointed (`qemu-img rebase -u`: header only) at the layer below,
        at the paths the manifest names. The layers at once: each is its own file, and on a
        lazily filled snapshot each header is a fetch from the store (issue 24). Beside them
        the disk top a create over the snapshot copies (``vmm.qemu.tops``) is made."""
        dir = Path(dir)
        manifest = SnapshotManifest.load(dir)
        self.check_snapshot(manifest)
        final = Path(manifest.dir)
        pairs = list(zip(manifest.layers, manifest.layers[1:]))
        for _, upper in pairs:
            if Path(upper).parent != final or not (dir / Path(upper).name).is_file():
                raise SnapshotUnusable(f"layer {upper} is not one of the snapshot's own files")
        top = Path(manifest.layers[-1])
        own_top = top.parent == final and (dir / top.name).is_file()
        with ThreadPoolExecutor(max_workers=min(len(pairs), 4) + 1, thread_name_prefix="adopt") as pool:
            # the first create's disk top, made beside the rebases rather than on that create's path
            drafted = pool.submit(tops.draft, self.tops_dir, top, manifest.disk_size_mb) if own_top else None
            try:
                list(pool.map(lambda pair: run(["qemu-img", "rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b",
                                                pair[0], str(dir / Path(pair[1]).name)]), pairs))
            except BaseException:
                if drafted is not None and drafted.exception() is None:  # (waits for it) not left behind
                    drafted.result().unlink(missing_ok=True)
                raise
        if drafted is not None:  # keyed by the top layer as rebased (its size and mtime)
            tops.adopt(self.tops_dir, drafted.result(), top, manifest.disk_size_mb, os.stat(dir / top.name))
        return manifest

    # -- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _stray_pid(state: VMState | None) -> int:
        """The pid of a QEMU still running for a VM recorded as saved to disk, else 0."""
        if state is None or not state.status.offline:
            return 0
        pid = read_pidfile(Path(state.pidfile)) or state.pid
        return pid if pid and process_alive(pid, state.qmp) else 0

    def _stop_stray(self, state: VMState | None) -> bool:
        """Stops a saved VM's leftover QEMU (SIGTERM, then SIGKILL): the device state and
        RAM file on disk are the VM, the process is not. True if one was stopped."""
        pid = self._stray_pid(state)
        if not pid:
            return False
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            end = time.monotonic() + wait
            while time.monotonic() < end and process_alive(pid, state.qmp):
                time.sleep(0.02)
            if not process_alive(pid, state.qmp):
                break
        reap(pid)
        return True

    def _unused_captures(self) -> list[Path]:
        """Fork captures (home/forks/*) no VM state dir refers to: a fork killed between its
        capture and its children (the driver deletes a capture only when its last child goes)."""
        forks = self.home / "forks"
        if not forks.is_dir():
            return []
        used = {state.capture_ref for d in (self.sandboxes_dir.iterdir() if self.sandboxes_dir.is_dir() else [])
                if (state := VMState.load(d)) is not None and state.capture_ref}
        return [c.absolute() for c in sorted(forks.iterdir()) if c.is_dir() and str(c.absolute()) not in used]
