"""Benchmark (issue 26): the CPU a node task's signature costs, sign on the control plane plus
verify on the node, per message, for a pause's task body (the claims and the sealed fields as
``nodes.signing.outgoing`` makes them). Three ways, alternated in the same process so the
host's load hits each alike:

- ``celery-auth-rsa3072``: Celery's ``auth`` serializer with an RSA-3072 pair (how every node
  task was signed before aenv's own serializer);
- ``aenv-rsa3072``: aenv's ``aenv-signed`` serializer with that RSA pair (a pair made before:
  RSA-PSS, kept working);
- ``aenv-ed25519``: aenv's serializer with the Ed25519 pair ``write_keys`` makes now.

    .venv/bin/python bench/task_signing.py [--n 2000] [--rounds 5]

CPU per message (``time.process_time``): sign, verify, both; the median of the rounds, in µs."""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from celery import Celery  # noqa: E402
from kombu.serialization import dumps, loads  # noqa: E402

from harness.legacy_keys import rsa_pair  # noqa: E402
from nodes import signing  # noqa: E402


def body() -> list:
    task_id = str(uuid.uuid4())
    kwargs = signing.outgoing("agent.tasks.pause_sandbox", "node.n1", task_id,
                              {"sandbox_id": "i" + uuid.uuid4().hex[:19], "snapshot_id": None, "to_disk": True,
                               "access_token": uuid.uuid4().hex}, 60, "bench-secret-" + "x" * 40)
    return [[], kwargs, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    logging.getLogger("nodes.signing").setLevel(logging.ERROR)  # the RSA key's warning, once per configure
    tmp = Path(tempfile.mkdtemp(prefix="bench-signing-"))
    rsa_key, rsa_cert = rsa_pair(tmp / "rsa")
    ed_key, ed_cert, _ = signing.write_keys(tmp / "ed")
    from celery.security.serialization import register_auth  # noqa: PLC0415

    register_auth(key=rsa_key.read_text(), cert=rsa_cert.read_text(), store=str(rsa_cert))
    ways = {"celery-auth-rsa3072": ("auth", None), "aenv-rsa3072": (signing.SERIALIZER, (rsa_key, rsa_cert)),
            "aenv-ed25519": (signing.SERIALIZER, (ed_key, ed_cert))}
    msg = body()
    per: dict[str, list[float]] = {w: [] for w in ways}
    sizes = {}
    for _ in range(args.rounds):
        for way, (serializer, pair) in ways.items():
            if pair:  # the registry holds one aenv-signed at a time: this way's
                signing.configure(Celery("b"), key=str(pair[0]), cert=str(pair[1]))
            t0 = time.process_time()
            for _ in range(args.n):
                ctype, enc, data = dumps(msg, serializer=serializer)
            t1 = time.process_time()
            for _ in range(args.n):
                out = loads(data, ctype, enc, accept={ctype})
            t2 = time.process_time()
            per[way].append(((t1 - t0) / args.n * 1e6, (t2 - t1) / args.n * 1e6))
            assert out == msg
            sizes[way] = len(data)
    print(f"CPU per message (µs), median of {args.rounds} rounds × {args.n}, alternated:")
    print(f"  {'way':22s} {'sign':>8s} {'verify':>8s} {'both':>8s}  bytes")
    for way, values in per.items():
        sign = statistics.median(v[0] for v in values)
        verify = statistics.median(v[1] for v in values)
        print(f"  {way:22s} {sign:8.1f} {verify:8.1f} {sign + verify:8.1f}  {sizes[way]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
