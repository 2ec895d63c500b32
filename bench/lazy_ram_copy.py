"""Benchmark: copying a lazily filled guest RAM file into a sandbox's own (what a template
create or a resume on another node waits for before the guest runs), by the chunkfs daemon
(``copy_out``) against reading it through FUSE with 4 threads (the fallback), in one run.

A real guest's RAM (the base template's ``memory.ram``, or ``--ram FILE``) is cut into 1 MiB
chunks and stored zstd-compressed in a moto S3 server, as the S3 store does; each round starts
a daemon on an empty cache (a node that never saw the snapshot), mounts the file and copies it
both ways in turn (alternating which goes first). Wall time, the daemon's and this process's
CPU seconds and the bytes written are recorded; the copy is checked byte for byte.

    .venv/bin/python bench/lazy_ram_copy.py [--rounds 5] [--ram FILE] [--out bench/results]

Prints a table and writes ``lazy-ram-copy-<time>.json`` and ``.md``."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chunkfs.client import ChunkfsClient, ensure_daemon  # noqa: E402
from chunkfs.compression import encode  # noqa: E402
from harness import moto_s3  # noqa: E402
from vmm.qemu.ramfile import copy_parallel_into  # noqa: E402

MIB = 1 << 20
CHUNK = MIB  # the S3 store's RAM chunk size
BUCKET = "bench-ram"


def default_ram() -> Path:
    found = sorted((ROOT / "var" / "images" / "snapshots").glob("base-*/*/memory.ram"), key=os.path.getmtime)
    if not found:
        raise SystemExit("no base template snapshot under var/images/snapshots (run scripts/setup.sh), or give --ram")
    return found[-1]


def upload(url: str, prefix: str, ram: Path) -> dict:
    """The file's non-zero chunks stored as the S3 store stores them; its manifest entry."""
    s3 = moto_s3.client(url)
    chunks, stored, wire = [], set(), 0
    with open(ram, "rb") as f:
        offset = 0
        while data := f.read(CHUNK):
            if data.strip(b"\0"):
                sha = hashlib.sha256(data).hexdigest()
                if sha not in stored:
                    body, metadata = encode(data, "zstd")
                    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/chunks/{sha}", Body=body, Metadata=metadata)
                    stored.add(sha)
                    wire += len(body)
                chunks.append([offset, len(data), sha])
            offset += len(data)
    return {"size": ram.stat().st_size, "chunk_size": CHUNK, "chunks": chunks, "wire_bytes": wire}


def cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one_copy(how: str, work: Path, url: str, prefix: str, spec: dict, ram: Path, index: int, store_pid: int) -> dict:
    """A fresh daemon on an empty cache, the file mounted, copied ``how``; the daemon stopped."""
    home = work / f"{how}-{index}"
    env = {**os.environ, "AENV_S3_BUCKET": BUCKET, "AENV_S3_ENDPOINT": url, "AENV_S3_REGION": moto_s3.REGION,
           "AENV_S3_PREFIX": prefix}
    client = ensure_daemon(home / "control.sock", mountpoint=home / "mnt", cache_dir=home / "cache",
                           limit_mb=2048, log_path=home / "daemon.log", env=env, timeout=30)
    pid = int(client.ping()["pid"])
    try:
        files = {"memory.ram": {k: spec[k] for k in ("size", "chunk_size", "chunks")}}
        mount = client.mount("ram", CHUNK, files)
        dest = home / "copy.ram"
        fd = os.open(dest, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, spec["size"])
            d0, c0, s0, t0 = cpu_of(pid), own_cpu(), cpu_of(store_pid), time.monotonic()
            if how == "daemon":
                written = ChunkfsClient(home / "control.sock", timeout=600).copy_out("ram", "memory.ram", dest)["written"]
            else:
                written = copy_parallel_into(mount / "memory.ram", fd)
            wall = time.monotonic() - t0
            d1, c1, s1 = cpu_of(pid), own_cpu(), cpu_of(store_pid)
        finally:
            os.close(fd)
        same = _same(dest, ram)
        dest.unlink()
        client.unmount("ram")
    finally:
        os.kill(pid, 15)
        _wait_gone(pid)
    shutil.rmtree(home, ignore_errors=True)
    return {"how": how, "round": index, "wall_ms": round(wall * 1e3, 1), "daemon_cpu_s": round(d1 - d0, 3),
            "node_cpu_s": round(c1 - c0, 3), "store_cpu_s": round(s1 - s0, 3), "written_bytes": written, "identical": same}


def _same(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(8 * MIB), fb.read(8 * MIB)
            if x != y:
                return False
            if not x:
                return True


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def p50(values):
    return round(statistics.median(values), 1) if values else None


def report(doc: dict) -> str:
    lines = [f"# lazy RAM copy benchmark {doc['stamp']}", "",
             f"RAM file {doc['ram']} ({doc['size_bytes'] >> 20} MiB, {doc['data_bytes'] >> 20} MiB in "
             f"{doc['chunks']} non-zero 1 MiB chunks, {doc['wire_bytes'] >> 20} MiB stored compressed); moto S3 on "
             f"loopback; host {doc['host']}; load average at start {doc['load_start']}, at end {doc['load_end']}; "
             f"git {doc['git']}", "",
             "| how | copies | wall p50 ms | wall min–max ms | daemon CPU p50 s | node CPU p50 s | S3 server CPU p50 s | all identical |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for how in ("daemon", "fuse"):
        rows = [r for r in doc["rows"] if r["how"] == how]
        walls = [r["wall_ms"] for r in rows]
        lines.append(f"| {'chunkfs daemon (copy_out)' if how == 'daemon' else 'FUSE, 4 readers'} | {len(rows)} | "
                     f"{p50(walls)} | {min(walls)}–{max(walls)} | "
                     f"{statistics.median(r['daemon_cpu_s'] for r in rows):.2f} | "
                     f"{statistics.median(r['node_cpu_s'] for r in rows):.2f} | "
                     f"{statistics.median(r['store_cpu_s'] for r in rows):.2f} | {all(r['identical'] for r in rows)} |")
    ratio = doc["summary"]["daemon_over_fuse_p50"]
    lines += ["", f"daemon / FUSE wall time, p50: **{ratio}**. The node's CPU is the daemon's plus this "
              "process's (the FUSE readers); the S3 server (moto, Python) shares the same cores here, which a "
              "real store would not.", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ram", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    ram = args.ram or default_ram()
    moto_s3.default_credentials()
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    doc = {"stamp": stamp, "ram": str(ram), "size_bytes": ram.stat().st_size, "load_start": os.getloadavg(),
           "host": f"{platform.machine()} × {os.cpu_count()} cores, kernel {platform.release()}",
           "git": os.popen(f"git -C {ROOT} rev-parse --short HEAD").read().strip(), "rows": []}
    with moto_s3.moto_server(BUCKET) as url, tempfile.TemporaryDirectory(prefix="aenv-ramcopy-") as tmp:
        spec = upload(url, "bench", ram)
        doc.update(chunks=len(spec["chunks"]), data_bytes=sum(c[1] for c in spec["chunks"]),
                   wire_bytes=spec["wire_bytes"])
        for i in range(args.rounds):
            order = ("daemon", "fuse") if i % 2 == 0 else ("fuse", "daemon")
            for how in order:
                row = one_copy(how, Path(tmp), url, "bench", spec, ram, i, moto_s3.server_pid(url))
                doc["rows"].append(row)
                print(json.dumps(row), flush=True)
    doc["load_end"] = os.getloadavg()
    walls = {how: [r["wall_ms"] for r in doc["rows"] if r["how"] == how] for how in ("daemon", "fuse")}
    doc["summary"] = {"daemon_p50_ms": p50(walls["daemon"]), "fuse_p50_ms": p50(walls["fuse"]),
                      "daemon_over_fuse_p50": round(p50(walls["daemon"]) / p50(walls["fuse"]), 2)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"lazy-ram-copy-{stamp}.json").write_text(json.dumps(doc, indent=1))
    text = report(doc)
    (args.out / f"lazy-ram-copy-{stamp}.md").write_text(text)
    print(text)
    return 0 if all(r["identical"] for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
