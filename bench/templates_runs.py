"""The measuring half of bench/templates.py: the fresh test image, the template definition
and its build context, one build through the official SDK with the builder's own record
(read from the stack's database), the first sandbox, and the timed creates through the API.

Why the database and not ``GET /templates/{id}``: the API gives a build's status and log
lines but not ``TemplateBuild.result`` (the builder's ``timings`` and ``layers``) nor the
build's ``accepted_at`` / ``finished_at``; the benchmark has a stack of its own, so it
reads them with the Django ORM (``Stack.db``), log entries with the timestamps the builder
gave them."""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import httpx

from bench.create_kill import parse_server_timing
from envd import ENVD_PORT
from harness import oci_images

START_PORT = 8000  # the template's start command serves here (python3 -m http.server)


# -- the image and the template ---------------------------------------------------------------


def fresh_image(registry_host: str, token: str):
    """The e2e test's image (the small debootstrap Debian + an app layer), with ``token`` in
    both layers, so every blob of it is new to the node and the build's base phase is a full
    pull and disk conversion, not a reuse of blobs an earlier run left. Pushed as
    ``<registry>/aenv-bench/app:<token>``; returns (BuiltImage, seconds it took)."""
    copy_rootfs = oci_images.debootstrap_layer(oci_images.debian_rootfs())

    def base_layer(rootfs: Path) -> None:
        copy_rootfs(rootfs)
        (rootfs / "etc" / "aenv-bench-image").write_text(f"{token}\n")

    t0 = time.monotonic()
    image = oci_images.make_test_image(registry_host, "aenv-bench/app", token, token, base_layer=base_layer)
    return image, time.monotonic() - t0


def make_context(root: Path, files: int, mib: float) -> Path:
    """The build context: ``payload/`` with ``files`` files of random bytes, ``mib`` MiB in
    all (random: the SDK's gzip cannot shrink the upload or the archive the guest unpacks)."""
    payload = root / "payload"
    payload.mkdir(parents=True, exist_ok=True)
    each = max(1, int(mib * (1 << 20)) // files)
    for i in range(files):
        (payload / f"f{i:04d}.bin").write_bytes(os.urandom(each))
    return root


def definition(image_ref: str, context: Path, run_mib: int):
    """FROM the fresh image; a small RUN; a RUN writing ``run_mib`` MiB; COPY of the payload;
    ENV; WORKDIR; a start command with a ready check (the SDK's wait_for_port)."""
    from e2b import Template, wait_for_port  # noqa: PLC0415

    return (Template(file_context_path=str(context)).from_image(image_ref)
            .run_cmd("echo small-run > /home/user/small.txt")
            .run_cmd(f"dd if=/dev/urandom of=/home/user/blob.bin bs=1M count={run_mib} status=none && "
                     "sha256sum /home/user/blob.bin")
            .copy("payload/", "/home/user/payload")
            .set_envs({"BENCH_TEMPLATE": "yes", "BENCH_APP": "/home/user/app"})
            .set_workdir("/home/user/app")
            .set_start_cmd(f"python3 -m http.server {START_PORT}", wait_for_port(START_PORT)))


# -- one build ----------------------------------------------------------------------------------


def build(template, name: str, cpu: int, memory: int) -> dict:
    """``Template.build`` as a user calls it; wall-clock bounds (epoch seconds, comparable
    with the database's timestamps on this host) and the ids."""
    from e2b import Template  # noqa: PLC0415

    lines: list[str] = []
    t0 = time.time()
    info = Template.build(template, name, cpu_count=cpu, memory_mb=memory,
                          on_build_logs=lambda e: lines.append(e.message))
    t1 = time.time()
    return {"name": name, "template_id": info.template_id, "build_id": info.build_id, "sdk_start": t0,
            "sdk_end": t1, "sdk_s": round(t1 - t0, 2), "sdk_log_lines": len(lines),
            "cached_lines": sum(1 for m in lines if m.startswith("CACHED "))}


BUILD_RECORD = """
import json
from template_builds.models import TemplateBuild
b = TemplateBuild.objects.get(pk={build_id!r})
ts = lambda t: t.timestamp() if t else None
print("BENCH_JSON " + json.dumps({{
    "status": b.status, "reason": b.reason_message, "created_at": ts(b.created_at), "started_at": ts(b.started_at),
    "accepted_at": ts(b.accepted_at), "finished_at": ts(b.finished_at), "result": b.result,
    "cpu_count": b.cpu_count, "memory_mb": b.memory_mb, "disk_size_mb": b.disk_size_mb,
    "snapshot_size_bytes": b.snapshot.size_bytes if b.snapshot_id else None,
    "logs": [[e.timestamp.timestamp(), e.step, e.message] for e in b.log_entries.order_by("index")]}}))
"""


def db_json(stack, code: str):
    out = stack.db(code)
    return json.loads(out.split("BENCH_JSON ", 1)[1])


def build_record(stack, build_id: str) -> dict:
    """The build as the database has it: status, timestamps, result, log with timestamps."""
    return db_json(stack, BUILD_RECORD.format(build_id=str(build_id)))


def _first(logs: list, prefix: str) -> float | None:
    return next((t for t, _, m in logs if m.startswith(prefix)), None)


def _span(logs: list, start: str, end: str) -> float | None:
    a, b = _first(logs, start), _first(logs, end)
    return round(b - a, 2) if a is not None and b is not None else None


PULLED = re.compile(r"pulled \S+ as (sha256:[0-9a-f]+) \((\d+) layers, ([\d.]+) MiB\)")


def phases(sdk: dict, rec: dict, images_dir: Path) -> dict:
    """One build's numbers: the builder's timings and layers (``result``), the base phase
    split by its log lines (pull: ``pulling`` → ``pulled``; root disk: → ``as root disk``,
    with the converter's own unpack / ext4 / qcow2 split from disk.json), finalize split
    (start command → ready, snapshot), and the SDK's wall time split by the build's
    timestamps (before the builder accepted it: request, COPY uploads, dispatch; after it
    finished: until the SDK's poll saw it)."""
    res, logs = rec["result"] or {}, rec["logs"]
    timings = dict(res.get("timings") or {})
    out = {"timings": timings, "layers": res.get("layers") or [], "cached_steps": res.get("cached_steps"),
           "steps": res.get("steps"), "snapshot_mib": round((rec.get("snapshot_size_bytes") or 0) / 2**20, 1),
           "sdk_s": sdk["sdk_s"], "status": rec["status"], "build_id": sdk["build_id"]}
    pulled = next((PULLED.search(m) for _, _, m in logs if PULLED.search(m)), None)
    if pulled:
        out["image"] = {"digest": pulled.group(1), "layers": int(pulled.group(2)), "mib": float(pulled.group(3))}
    out["pull_s"] = _span(logs, "[base] pulling ", "[base] pulled ")
    out["root_disk_s"] = _span(logs, "[base] pulled ", "[base] image ")
    disk_id = (res.get("base") or {}).get("disk")
    disk_json = images_dir / "oci" / "disks" / str(disk_id) / "disk.json"
    if disk_id and disk_json.is_file() and out["root_disk_s"] is not None and out["root_disk_s"] > 1:
        meta = json.loads(disk_json.read_text())  # built by this build (a reused disk takes no time)
        out["root_disk_split_s"] = meta.get("timings_s")
        out["root_disk_mib"] = meta.get("size_mb")
    out["defaults_s"] = _span(logs, "[finalize] Finalizing", "[finalize] start command")
    out["start_to_ready_s"] = _span(logs, "[finalize] start command", "Template is ready")
    if out["start_to_ready_s"] is None:
        out["start_to_ready_s"] = _span(logs, "Waiting for template to be ready", "Template is ready")
    ready_to_snapshot_line = _span(logs, "Template is ready", "[finalize] template snapshot")
    if ready_to_snapshot_line is not None and "snapshot_s" in timings:
        # the snapshot's line comes after it: the rest is the start command's detach (and the size)
        out["ready_to_snapshot_s"] = round(ready_to_snapshot_line - timings["snapshot_s"], 2)
    t_first = logs[0][0] if logs else 0
    out["log"] = [[round(t - t_first, 3), step, m[:200]] for t, step, m in logs]
    out["labels"] = {}
    for _, step, m in logs:  # each step's first line is its label: "[builder n/N] TYPE args"
        if m.startswith("[builder ") and step not in out["labels"] and "] [std" not in m:
            out["labels"][step] = m.split("] ", 1)[1]
    steps_s = sum(v for k, v in timings.items() if k.startswith("step_"))
    if "total_s" in timings:
        known = sum(timings.get(k, 0) for k in ("base_s", "boot_s", "finalize_s")) + steps_s
        out["other_s"] = round(timings["total_s"] - known, 2)  # the default user, bookkeeping
    if rec.get("accepted_at"):
        out["before_builder_s"] = round(rec["accepted_at"] - sdk["sdk_start"], 2)
        out["upload_and_start_s"] = round((rec["started_at"] or rec["accepted_at"]) - rec["created_at"], 2)
        out["pickup_s"] = round(rec["accepted_at"] - (rec["started_at"] or rec["accepted_at"]), 2)
    if rec.get("finished_at"):
        out["after_builder_s"] = round(sdk["sdk_end"] - rec["finished_at"], 2)
    return out


# -- sandboxes ------------------------------------------------------------------------------------


def first_sandbox(name: str, run_mib: int, copy_files: int) -> dict:
    """From ``Template.build`` returning (the caller calls this right after) to the first
    command answering in ``Sandbox.create(name)``; then checks the sandbox is the template
    (untimed): workdir, env, the RUN's and the COPY's files, the start command running."""
    from e2b import Sandbox  # noqa: PLC0415

    t0 = time.perf_counter()
    sbx = Sandbox.create(name, timeout=600)
    t1 = time.perf_counter()
    try:
        if sbx.commands.run("echo ok").stdout.strip() != "ok":
            raise RuntimeError("the first command did not answer ok")
        t2 = time.perf_counter()
        check = sbx.commands.run("pwd; echo $BENCH_TEMPLATE; stat -c %s /home/user/blob.bin; "
                                 "ls /home/user/payload | wc -l; pgrep -fc http.server").stdout.split()
        expected = ["/home/user/app", "yes", str(run_mib << 20), str(copy_files)]
        if check[:4] != expected or int(check[4]) < 1:
            raise RuntimeError(f"the sandbox is not the template: {check} (expected {expected} + a server)")
    finally:
        sbx.kill()
    return {"create_ms": round((t1 - t0) * 1e3, 1), "first_command_ms": round((t2 - t0) * 1e3, 1),
            "sandbox_id": sbx.sandbox_id}


class Creates:
    """Creates through the API with plain httpx: ``POST /v2/sandboxes``, then envd's
    ``/health`` through the data plane until it answers 204 (as bench/create_kill.py), then a
    kill (not timed). Every sandbox made is remembered, so a failure still kills them."""

    def __init__(self, api: str, sandbox_url: str, key: str):
        self.api, self.sandbox_url = api.rstrip("/"), sandbox_url.rstrip("/")
        self.headers = {"X-API-Key": key}
        self.client = httpx.Client(trust_env=False)
        self.live: set[str] = set()
        self.made: list[str] = []

    def one(self, template: str) -> dict:
        t0 = time.perf_counter()
        resp = self.client.post(f"{self.api}/v2/sandboxes", headers=self.headers, timeout=300,
                                json={"templateID": template, "timeout": 300, "metadata": {"bench": "templates"}})
        t_api = time.perf_counter()
        if resp.status_code != 201:
            raise RuntimeError(f"create {template}: {resp.status_code} {resp.text[:300]}")
        sid = resp.json()["sandboxID"]
        self.live.add(sid)
        self.made.append(sid)
        route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(ENVD_PORT)}
        deadline = time.monotonic() + 60
        while self.client.get(f"{self.sandbox_url}/health", headers=route, timeout=30).status_code != 204:
            if time.monotonic() > deadline:
                raise RuntimeError(f"envd of {sid} ({template}) did not answer within 60 s")
            time.sleep(0.005)
        t_ready = time.perf_counter()
        self.kill(sid)
        return {"sandbox_id": sid, "api_ms": (t_api - t0) * 1e3, "envd_ms": (t_ready - t0) * 1e3,
                "server_timing": parse_server_timing(resp.headers.get("server-timing", ""))}

    def kill(self, sid: str) -> None:
        resp = self.client.delete(f"{self.api}/sandboxes/{sid}", headers=self.headers, timeout=120)
        if resp.status_code not in (204, 404):
            raise RuntimeError(f"kill {sid}: {resp.status_code} {resp.text[:300]}")
        self.live.discard(sid)

    def kill_all(self) -> None:
        for sid in list(self.live):
            try:
                self.kill(sid)
            except Exception as exc:  # noqa: BLE001 - best effort, the stack's teardown follows
                print(f"cleanup: kill {sid} failed: {exc}")

    def close(self) -> None:
        self.kill_all()
        self.client.close()


CREATE_EVENTS = """
import json
from sandboxes.models import SandboxEvent as E
out = {{}}
for e in E.objects.filter(sandbox_id__in={ids!r}, operation="create", outcome="ok"):
    t = (e.details or {{}}).get("timings") or {{}}
    # base: from_template_snapshot 1 / 0; a built template's snapshot: a restore reports its RAM
    # file (ram_ready_made 1 / 0, ram_copy_ms when it copied), a cold boot its boot attempt
    out[e.sandbox_id] = {{"restored": t.get("from_template_snapshot") == 1 or "ram_ready_made" in t
                                     or "ram_copy_ms" in t,
                         "ram_ready_made": t.get("ram_ready_made"),
                         "ram_copy_ms": t.get("ram_copy_ms"), "node_total_ms": t.get("total_ms")}}
print("BENCH_JSON " + json.dumps(out))
"""


def create_events(stack, ids: list[str]) -> dict:
    """Per sandbox: did the node restore a template snapshot or cold-boot, and its RAM copy."""
    return db_json(stack, CREATE_EVENTS.format(ids=list(ids))) if ids else {}
