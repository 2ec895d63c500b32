"""bench/lazy.py's results as one headline table (a row per question of issue 24's benchmark
and store link, each target met or not) and a section per part, written with the raw JSON
to ``lazy-<UTC stamp>.{json,md}``."""
from __future__ import annotations

import json
from pathlib import Path

MIB = 1 << 20


def _mib(n) -> str:
    return "–" if n is None else f"{n / MIB:.0f} MiB"


def _ms(d: dict | None, key: str = "p50") -> str:
    v = (d or {}).get(key)
    return "–" if v is None else f"{v:.0f} ms"


def _settled(row: dict) -> str:
    """How long the node's daemon went on fetching after a cold create or resume answered."""
    s = row.get("settle")
    return f"{s['waited_s']} s (+{_mib(s['fetched_bytes'])})" if s else ""


def met(ok) -> str:
    return {True: "yes", False: "**no**", None: "–"}[ok]


def template_rows(t: dict) -> list[tuple]:
    size = t["template"]["size"]
    rows = []
    for key, label in (("new_node", "a running node that never saw it"),
                       ("cold_node", "a node just started (its first lazy restore: chunkfs daemon start, own files "
                                     "indexed)")):
        r = t.get(f"{key}_ratio_p50")
        rows.append((f"create from a built template ({_mib(size['total_bytes'])} in the store) → envd answering, p50 "
                     f"of {t['runs']}: {label} / the node that built it",
                     f"{_ms(t.get(f'{key}_ms'))} / {_ms(t['builder_ms'])} ({r}×)" if r else "–", "≤ 1.5×",
                     met(r <= t["target_ratio"] if r else None)))
        wire = t.get(f"{key}_wire_pct_p50")
        rows.append(("… bytes that node fetched from the store until the guest answered, p50",
                     f"{_mib(t.get(f'{key}_fetched_bytes_p50'))} ({t.get(f'{key}_fetched_pct_p50')} % of the "
                     "template" + (f"; on the wire {wire} %" if wire is not None else "") + ")"
                     + (f" in {t[f'{key}_store_gets_p50']:.0f} GETs" if t.get(f"{key}_store_gets_p50") else ""),
                     "", ""))
    return rows


def resume_rows(rs: dict) -> list[tuple]:
    disk = "with" if rs["node_b_base_disk"] else "without"
    first = ((rs.get("warm_rows") or [{}])[0].get("image")) or {}
    rows = []
    for key, label in (("warm", "a running node that never saw the pause image"),
                       ("cold", "a node just started (its first lazy restore)")):
        p = (rs.get(f"{key}_answer_ms") or {}).get("p50")
        pct = rs.get(f"{key}_fetched_pct_p50")
        wire = rs.get(f"{key}_wire_pct_p50")  # judged on the wire when the daemon counts it
        judged = wire if wire is not None else pct
        rows.append((f"resume (connect → envd answering) of a sandbox paused on another node, p50 of {rs['runs']}: "
                     f"{label} ({disk} the base disk)", _ms(rs.get(f"{key}_answer_ms")), "≤ 1000 ms",
                     met(p <= rs["target_ms"] if p else None)))
        rows.append((f"… bytes it fetched before the guest answered, % of the pause image "
                     f"({_mib(first.get('total_bytes'))}; of what the node lacked: "
                     f"{rs.get(f'{key}_fetched_pct_of_lacked_p50')} %), p50",
                     f"{pct} %" + (f" (on the wire, compressed: {wire} %)" if wire is not None else ""), "≤ 10 %",
                     met(judged <= rs["target_pct"] if judged is not None else None)))
    return rows


def cache_rows(c: dict) -> list[tuple]:
    w = c["watch"]
    created = sum(1 for r in c["rows"] if r.get("created"))
    intact = sum(1 for r in c["rows"] if r.get("fill_intact"))
    sizes = ", ".join(f"{r['template_mib']}" for r in c["rows"])
    ok = c["all_created"] and c["bound_kept"]
    return [(f"{len(c['rows'])} templates ({sizes} MiB in the store) in turn on a node with a {c['cache_mb']} MiB "
             "chunk cache, each read back whole in the guest: created / intact; cache max size vs bound, evictions",
             f"{created} / {intact} of {len(c['rows'])}; {_mib(w.get('max_size_bytes'))} of "
             f"{_mib(w.get('limit_bytes'))} ({w.get('samples', 0)} samples), {w.get('evictions', '–')} evictions",
             "every create succeeds, never over the bound", met(ok))]


def fork_rows(f: dict) -> list[tuple]:
    one, three, n = f["one_node"], f["three_nodes"], f["per_node_max"]
    if three.get("status") != 201:
        result = f"refused: {three.get('status')} {three.get('message')}"
        return [(f"fork ×{2 * n} on three nodes of ≤ {n} each vs fork ×{n} on one: until the last child answers",
                 f"{result}; ×{n} on one node: {one.get('last_answer_ms')} ms", "all answer, ≤ 1.5×", met(False))]
    r = f.get("ratio")
    return [(f"fork ×{2 * n} on three nodes of ≤ {n} each vs fork ×{n} on one: until the last child answers "
             f"(children per node {three.get('per_node')})",
             f"{three.get('last_answer_ms')} / {one.get('last_answer_ms')} ms ({r}×); {three.get('answered')} of "
             f"{2 * n} answered", "all answer, ≤ 1.5×", met(bool(f["all_answered"] and r is not None and r <= 1.5)))]


ROWS = {"template": template_rows, "resume": resume_rows, "cache": cache_rows, "fork": fork_rows}


def headline(result: dict) -> list[str]:
    lines = ["| measurement | store | result | target | met? |", "|---|---|---|---|---|"]
    for run in result.get("runs", []):
        for part, rows in ROWS.items():
            got = run.get(part)
            if not got:
                continue
            if "error" in got:
                lines.append(f"| {part} | {run['store']} | failed: {got['error'][:200]} | | **no** |")
                continue
            lines += [f"| {a} | {run['store']} | {b} | {c} | {d} |" for a, b, c, d in rows(got)]
    return lines


def details(run: dict) -> list[str]:
    lines = [f"## Store: {run['store']}", ""]
    probe = run.get("store_probe") or {}
    if probe:
        lines += [f"- the store link measured: PUT {probe.get('put_mib_s')} MiB/s, GET {probe.get('get_mib_s')} MiB/s "
                  f"({probe.get('mib')} MiB in 4 MiB objects, {probe.get('threads')} threads)", ""]
    if run.get("peer_fetch"):
        lines += ["- peer fetch on every node (`--peer-fetch`), and with it a fork's early hand-off", ""]
    t = run.get("template")
    if t and "error" not in t:
        tpl = t["template"]
        lines += ["### Template create: the building node vs a node that never saw it", "",
                  f"- template {tpl['name']} built in {tpl['build_s']} s on {tpl['built_on']} (the cold node's "
                  f"{t['other_template']['name']}: the same shape and size); files in the store: "
                  + ", ".join(f"{k} {_mib(v)}" for k, v in tpl["size"]["own"].items())
                  + "; image files: " + ", ".join(f"{k} {_mib(v)}" for k, v in tpl["size"]["images"].items()),
                  f"- warm-up create on the builder {t['warm_up_ms']} ms; misplaced creates {t['misplaced']}", "",
                  "| create on | answer ms | API ms | dispatch ms | node's RAM copy ms | fetched from the store | "
                  "node start s | then quiet after |", "|---|---:|---:|---:|---:|---:|---:|---|"]
        for label, key in (("builder", "on_builder"), ("cold new node", "on_cold_node"),
                           ("warm new node", "on_new_node")):
            for r in t.get(key) or []:
                nt, ph = r.get("node_timings") or {}, r.get("phases") or {}
                fetched = _mib(r["fetched"]["store_bytes"]) if "fetched" in r else ""
                lines.append(f"| {label} | {r['answer_ms']} | {r['api_ms']} | {ph.get('dispatch', '–')} | "
                             f"{nt.get('ram_copy_ms', '–')} | {fetched} | {r.get('node_start_s', '')} | "
                             f"{_settled(r)} |")
        lines.append("")
    rs = run.get("resume")
    if rs and "error" not in rs:
        lines += ["### Resume on another node", "",
                  f"- a new node B per run (base disk: {rs['node_b_base_disk']}): a cold resume (its first lazy "
                  f"restore), then a warm one; misplaced {rs['misplaced']}; files intact {rs['all_files_intact']}", "",
                  "| run | node | connect ms | answer ms | dispatch ms | node's RAM copy ms | pause image | fetched | "
                  "% of image | % of what B lacked | export s | then quiet after |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for i, (c, w) in enumerate(zip(rs["cold_rows"], rs["warm_rows"])):
            for label, r in (("cold", c), ("warm", w)):
                nt, ph = r.get("node_timings") or {}, r.get("phases") or {}
                lines.append(f"| {i} | {label} | {r['connect_ms']} | {r['answer_ms']} | {ph.get('dispatch', '–')} | "
                             f"{nt.get('ram_copy_ms', '–')} | {_mib(r['image']['total_bytes'])} | "
                             f"{_mib(r['fetched']['store_bytes'])} | {r['fetched_pct_of_image']} | "
                             f"{r['fetched_pct_of_lacked']} | {r['export_s']} | {_settled(r)} |")
        lines.append("")
    c = run.get("cache")
    if c and "error" not in c:
        w = c["watch"]
        lines += ["### Three templates through a bounded chunk cache", "",
                  f"- bound {c['cache_mb']} MiB; largest size seen {_mib(w.get('max_size_bytes'))} "
                  f"({w.get('samples')} polls, {w.get('samples_over_bound')} over the bound); evictions "
                  f"{w.get('evictions')}; pinned at most {_mib(w.get('max_pinned_bytes'))}", "",
                  "| template | MiB | created | answer ms | read back s | intact | fetched | cache after | error |",
                  "|---|---:|---|---:|---:|---|---:|---:|---|"]
        for r in c["rows"]:
            lines.append(f"| {r['template']} | {r['template_mib']} | {r.get('created')} | {r.get('answer_ms', '–')} | "
                         f"{r.get('read_s', '–')} | {r.get('fill_intact', '–')} | "
                         f"{_mib((r.get('fetched') or {}).get('store_bytes'))} | "
                         f"{_mib((r.get('cache') or {}).get('size_bytes'))} | {r.get('error', '')} |")
        lines.append("")
    f = run.get("fork")
    if f and "error" not in f:
        lines += ["### Fork over three nodes", ""]
        if f.get("warm_store"):
            lines += ["- a snapshot of the parent kept through the part (`--fork-warm-store`): the base image "
                      "files were in the store before the forks", ""]
        for label, d in (("one node", f["one_node"]), ("three nodes", f["three_nodes"])):
            if d.get("status") != 201:
                lines.append(f"- ×{d['count']} on {label}: refused {d.get('status')}: {d.get('message')}")
                continue
            lines.append(f"- ×{d['count']} on {label}: call {d['call_ms']} ms, last child answered after "
                         f"{d['last_answer_ms']} ms (p50 {_ms(d['answer_ms'])}), {d['answered']} of {d['children']} "
                         f"answered, per node {d['per_node']} (the last answer per node, ms: "
                         f"{d.get('last_answer_ms_per_node')}); errors {d['errors']}")
            if d.get("phases") or d.get("parent_fork_timings"):
                lines.append(f"  - the call's Server-Timing {d.get('phases')}; the parent's fork event timings "
                             f"{d.get('parent_fork_timings')}")
            if d.get("parent_fork_events"):
                lines.append("  - after the capture (hand-off, upload): " + "; ".join(
                    f"{e['outcome']} {e['ms']} ms{' ' + e['message'] if e.get('message') else ''}"
                    for e in d["parent_fork_events"]))
        lines.append("")
    for part in ("template", "resume", "cache", "fork"):
        got = run.get(part)
        if got and "error" in got:
            lines += [f"### {part}: failed", "", "```", got.get("trace", got["error"])[-3000:], "```", ""]
    return lines


def write_results(result: dict, stamp: str, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"lazy-{stamp}.json"
    out.write_text(json.dumps(result, indent=2, default=str))
    h = result.get("host", {})
    lines = [f"# lazy (issue 24) benchmark {stamp}", "",
             f"parts {result['parts']}; stores {[r['store'] for r in result.get('runs', [])]}; host {h.get('machine')} "
             f"× {h.get('cpus')} cores, {h.get('memory_mib')} MiB, kernel {h.get('kernel')}; load average at start "
             f"{h.get('loadavg_at_start')}, at end {h.get('loadavg_at_end')}; run took {result.get('duration_s')} s; "
             f"git {result.get('git', {}).get('commit', '?')}", ""]
    lines += [f"- {n}" for n in result.get("notes", [])] + ["", "## Headline", "", *headline(result), ""]
    for run in result.get("runs", []):
        lines += details(run)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return out
