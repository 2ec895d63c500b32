"""``aenv snapshot create | ls | rm``: E2B's snapshot API (``POST /sandboxes/{id}/snapshots``,
``GET /snapshots`` with its ``X-Next-Token`` pages) and ``DELETE /templates/{id}``,
which deletes a snapshot by id or name as ``Sandbox.delete_snapshot`` does."""
from __future__ import annotations

from . import output
from .api import check, client, pages, segment
from .config import Config
from .templates import delete_each


def cmd_create(args, config: Config) -> int:
    body = {**({"name": args.name} if args.name else {}), **({"memory": False} if args.no_memory else {})}
    with client(config, timeout=600) as api:
        snapshot = check(api.post(f"/sandboxes/{segment(args.sandbox_id)}/snapshots", json=body)).json()
    if args.output == "json" or args.json:
        output.print_json(snapshot)
    else:
        print(snapshot["snapshotID"], flush=True)
    return 0


def cmd_ls(args, config: Config) -> int:
    params = {**({"sandboxID": args.sandbox} if args.sandbox else {}), **({"name": args.name} if args.name else {})}
    with client(config) as api:
        rows = list(pages(api, "/snapshots", params, page_size=args.limit))
    if output.wants_json(args):
        output.print_json(rows)
    else:
        output.print_table(["SNAPSHOT ID", "NAMES"], [[r.get("snapshotID"), r.get("names")] for r in rows])
    return 0


def cmd_rm(args, config: Config) -> int:
    return delete_each(config, args.snapshots, output.Outcomes(args, key="snapshot"),
                       lambda ref: f"Deleted snapshot {ref}")
