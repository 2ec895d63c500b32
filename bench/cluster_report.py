"""bench/cluster.py's results as a headline table and one section per part, written with
the raw JSON to ``cluster-<UTC stamp>.{json,md}``."""
from __future__ import annotations

import json
from pathlib import Path


def _v(x, unit: str = "", digits: int = 1) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}f}{unit}" if isinstance(x, float) else f"{x}{unit}"


def _d(d: dict, key: str, unit: str = " ms") -> str:
    return _v((d or {}).get(key), unit)


def headline(r: dict) -> list[str]:
    """The numbers docs/benchmarks.md shows: one row per question of the issue's benchmark."""
    rows = []
    cap = r.get("capacity")
    if cap:
        met = {True: "yes", False: "**no**", None: "– (not filled until refused)"}[cap["met"]]
        rows.append(("idle `base` sandboxes (2 vCPU / 512 MiB) on one default node until admission refuses",
                     f"{cap['created']} (stopped by {cap['stopped_by']})", f"≥ {cap['target']}", met))
        idle = cap.get("idle") or {}
        if idle:
            q = idle.get("qemu_pct_of_core") or {}
            saturated = " (saturated: per-sandbox figures are what they got, not what they want)" \
                if idle["host_busy_pct"] >= 95 else ""
            rows.append((f"host CPU with all {cap['created']} idle ({idle['seconds']:.0f} s, /proc/stat, "
                         f"{r['host']['cpus']} cores){saturated}",
                         f"{idle['host_busy_pct']:.1f} % of the machine (baseline {cap['host_cpu_baseline_pct']:.1f} %); "
                         f"{idle['host_busy_pct_per_sandbox_of_core']:.2f} % of a core per sandbox "
                         f"(each QEMU: median {_d(q, 'median', ' %')}, max {_d(q, 'max', ' %')})", "", ""))
            m = cap.get("qemu_memory") or {}
            rows.append(("host memory per idle sandbox: MemAvailable drop / QEMU RSS / PSS / guest RAM in /dev/shm",
                         f"{_v(cap.get('mem_available_drop_per_sandbox_mib'), ' MiB')} / "
                         f"{_d(m.get('rss_mib'), 'mean', ' MiB')} / {_d(m.get('pss_mib'), 'mean', ' MiB')} / "
                         f"{_v(cap.get('shm_used_per_sandbox_mib'), ' MiB')}", "", ""))
    for label, key in (("1 node", "creates_1"), ("3 nodes", "creates_3")):
        c = r.get(key)
        if not c:
            continue
        lat = c.get("latency_ms_created") or {}
        statuses = ", ".join(f"{n} × {s}" for s, n in sorted(c["statuses"].items()))
        rows.append((f"{c['creates']} creates from {c['clients']} concurrent clients, {label}: created/s, "
                     "latency p50 / p99 (201s)",
                     f"{c['creates_per_s']:.2f}/s, {_d(lat, 'p50', '')} / {_d(lat, 'p99')} ({statuses})", "", ""))
    mv = r.get("moves")
    if mv:
        rows.append((f"resume (connect → 201) of a paused, exported sandbox: own node vs another node "
                     f"(S3 store), p50 of {mv['runs']}",
                     f"{_d(mv['same_node_ms'], 'p50', '')} vs {_d(mv['other_node_ms'], 'p50')} "
                     f"({_v(mv.get('other_over_same_p50'), '×', 2)})", "", ""))
    mem = r.get("memory")
    if mem:
        t, d = mem["tmpfs"], mem["disk"]
        rows.append(("pause (API), p50 / p90: before the RAM moves to disk / then left to move",
                     f"{_d(t['pause_ms'], 'p50', '')} / {_d(t['pause_ms'], 'p90')}; "
                     f"{_d(d['pause_ms'], 'p50', '')} / {_d(d['pause_ms'], 'p90')}", "", ""))
        n_at_once, found = t["resume_ms"].get("n", 0), t["ram_found_on_disk"]
        how = (f"; {found} of {n_at_once} 'at once' resumes found the RAM already moved or moving to disk"
               if found else "")
        rows.append((f"resume (connect → 201), p50 / p90: at once after the pause / with the RAM on disk{how}",
                     f"{_d(t['resume_ms'], 'p50', '')} / {_d(t['resume_ms'], 'p90')}; "
                     f"{_d(d['resume_ms'], 'p50', '')} / {_d(d['resume_ms'], 'p90')}", "≤ 350 ms",
                     "yes" if max(t["resume_ms"].get("p50", 1e9), d["resume_ms"].get("p50", 1e9)) <= 350 else "**no**"))
    lines = ["| measurement | result | target | met? |", "|---|---|---|---|"]
    return lines + [f"| {a} | {b} | {c} | {e} |" for a, b, c, e in rows]


def _dist_row(label: str, d: dict, unit: str = "ms") -> str:
    return (f"| {label} | {_d(d, 'p50', '')} | {_d(d, 'p90', '')} | {_d(d, 'p99', '')} | {_d(d, 'max', '')} "
            f"| {(d or {}).get('n', 0)} | {unit} |")


def capacity_section(cap: dict) -> list[str]:
    lines = ["## 1. Capacity: idle sandboxes on one default node", "",
             f"- created {cap['created']} in {cap['fill_s']} s ({cap['parallel']} at a time, then one at a time "
             f"after the first refusal); stopped by {cap['stopped_by']}"]
    for ref in cap.get("refusals") or []:
        lines.append(f"- refused at {ref['live']} live: {ref['status']} {ref['message']}")
    for n in cap.get("nodes") or []:
        lines.append(f"- node {n['id']} (GET /nodes, all idle): {n['sandboxes']} sandboxes, reserved "
                     f"{n['allocated_vcpus']} of {n['capacity_vcpus']} vCPUs and {n['allocated_memory_mib']} of "
                     f"{n['capacity_memory_mib']} MiB")
    before, after = cap.get("host_before") or {}, cap.get("host_after") or {}
    if after:
        lines.append(f"- MemAvailable {before['mem_available_mib']} → {after['mem_available_mib']} MiB, /dev/shm used "
                     f"{before['shm_used_mib']} → {after['shm_used_mib']} MiB")
        m = cap.get("qemu_memory") or {}
        lines += ["", "| per idle sandbox | mean | median | min | max | n |", "|---|---:|---:|---:|---:|---:|"]
        for label, d in (("QEMU RSS (MiB)", m.get("rss_mib")), ("QEMU PSS (MiB)", m.get("pss_mib")),
                         ("… of which anonymous (MiB)", m.get("pss_anon_mib")),
                         ("… of which shmem: the guest RAM file (MiB)", m.get("pss_shmem_mib")),
                         ("guest RAM file in /dev/shm, allocated (MiB)", cap.get("ram_file_mib")),
                         ("QEMU CPU while idle (% of one core)", (cap.get("idle") or {}).get("qemu_pct_of_core"))):
            d = d or {}
            lines.append(f"| {label} | {_d(d, 'mean', '')} | {_d(d, 'median', '')} | {_d(d, 'min', '')} "
                         f"| {_d(d, 'max', '')} | {d.get('n', 0)} |")
    lines += ["", "| create while filling | p50 | p90 | p99 | max | n | unit |", "|---|---:|---:|---:|---:|---:|---|",
              _dist_row("POST /v2/sandboxes → 201", cap.get("create_ms"))]
    by_live = cap.get("create_ms_by_live") or []
    if by_live:
        tenth = max(1, len(by_live) // 10)
        marks = [f"{live}: {ms:.0f}" for live, ms in sorted(by_live)[::tenth]]
        lines += ["", f"create time (ms) by sandboxes already live: {', '.join(marks)}"]
    return lines + [""]


def creates_section(r: dict) -> list[str]:
    lines = ["## 2. Creates from concurrent clients: 1 node vs 3 nodes", ""]
    for label, key in (("1 node", "creates_1"), ("3 nodes", "creates_3")):
        c = r.get(key)
        if not c:
            continue
        lines += [f"### {label}", "",
                  f"- {c['creates']} creates from {c['clients']} clients: {c['statuses']}; {c['created']} created, "
                  f"the last one {c['last_created_s']} s after the release ({c['creates_per_s']} created/s); all "
                  f"answered after {c['wall_s']} s; per node {c['per_node']}; kill of all {c['kill_all_s']} s"]
        for status, msgs in (c.get("messages") or {}).items():
            for msg, n in msgs.items():
                lines.append(f"- {n} × {status}: {msg}")
        peak = c.get("host_at_peak") or {}
        lines.append(f"- MemAvailable {c['host_before']['mem_available_mib']} → {peak.get('mem_available_mib')} MiB "
                     f"with every created sandbox running")
        lines += ["", "| latency | p50 | p90 | p99 | max | n | unit |", "|---|---:|---:|---:|---:|---:|---|",
                  _dist_row("created (201)", c.get("latency_ms_created")),
                  _dist_row("refused (not 201)", c.get("latency_ms_refused")), ""]
        if c.get("phases_ms_created"):
            lines += ["Server-Timing medians of the 201s (ms): "
                      + ", ".join(f"{k} {v}" for k, v in c["phases_ms_created"].items()), ""]
    return lines


def moves_section(mv: dict) -> list[str]:
    lines = ["## 3. Resume on the own node vs on another node (S3 store, moto)", "",
             f"- {mv['runs']} run(s); node A {mv['node_a']}, node B {mv['node_b']}; every pause exported to the store "
             f"after {_d(mv['export_s'], 'p50', ' s')} (p50, from the pause's answer); misplaced runs "
             f"{mv['misplaced_runs']}; files intact after both resumes: {mv['all_files_intact']}",
             f"- pause image in the store: {_d(mv.get('image_mib'), 'median', ' MiB')} (median; the first one's "
             f"files: {', '.join(f'{k} {v} MiB' for k, v in (mv['rows'][0].get('image_files_mib') or [{}])[0].items())}"
             "); the other node's "
             f"connect: {_d(mv.get('other_node_node_ms'), 'p50')} p50 reported by the node's restore (driver + envd "
             f"takeover), {_d(mv.get('other_node_dispatch_ms'), 'p50')} outside it (Server-Timing dispatch: the "
             "Celery round trip and the node fetching the image from the store, which the restore's timings do "
             "not include)", "",
             "| connect → 201 | p50 | p90 | p99 | max | n | unit |", "|---|---:|---:|---:|---:|---:|---|",
             _dist_row("own node (A), RAM on its disk", mv["same_node_ms"]),
             _dist_row("another node (B): pause image restored from the store", mv["other_node_ms"]), ""]
    return lines


def memory_section(mem: dict) -> list[str]:
    t, d = mem["tmpfs"], mem["disk"]
    lines = ["## 4. Pause / resume: RAM still in tmpfs vs moved to disk", "",
             f"- {mem['runs']} run(s) of each, alternated on one sandbox; warm-up pause {mem['warm_up']['pause_ms']} ms "
             f"(its RAM went to disk: {mem['warm_up']['ram_went_to_disk']})",
             f"- resumes that found the RAM on disk (from the node's resume timings): 'at once' "
             f"{t['ram_found_on_disk']} of {t['pause_ms'].get('n', 0)}, 'after the move' {d['ram_found_on_disk']} of "
             f"{d['pause_ms'].get('n', 0)}",
             f"- the move to disk (driver timings): {_d(d.get('ram_to_disk_ms'), 'p50')} p50 for "
             f"{_d(d.get('ram_to_disk_mib'), 'median', ' MiB')}; back into tmpfs on resume "
             f"{_d(d.get('ram_from_disk_ms'), 'p50')} p50 (in the background of QEMU's start)", "",
             "| | p50 | p90 | p99 | max | n | unit |", "|---|---:|---:|---:|---:|---:|---|",
             _dist_row("pause, then resumed at once", t["pause_ms"]),
             _dist_row("resume at once after the pause", t["resume_ms"]),
             _dist_row("… node's resume time", t.get("resume_node_ms")),
             _dist_row("pause, then left until its RAM is on disk", d["pause_ms"]),
             _dist_row("resume with the RAM on disk", d["resume_ms"]),
             _dist_row("… node's resume time", d.get("resume_node_ms")), ""]
    return lines


def write_results(result: dict, stamp: str, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"cluster-{stamp}.json"
    out.write_text(json.dumps(result, indent=2))
    h = result.get("host", {})
    lines = [f"# cluster benchmark {stamp}", "",
             f"parts {result['parts']}; host {h.get('machine')} × {h.get('cpus')} cores, "
             f"{h.get('memory_mib')} MiB, kernel {h.get('kernel')}; load average at start {h.get('loadavg_at_start')}, "
             f"at end {h.get('loadavg_at_end')}; run took {result.get('duration_s')} s; git "
             f"{result.get('git', {}).get('commit', '?')}", ""]
    lines += [f"- {n}" for n in result.get("notes", [])] + ["", "## Headline", "", *headline(result), ""]
    if result.get("capacity"):
        lines += capacity_section(result["capacity"])
    if result.get("creates_1") or result.get("creates_3"):
        lines += creates_section(result)
    if result.get("moves"):
        lines += moves_section(result["moves"])
    if result.get("memory"):
        lines += memory_section(result["memory"])
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return out
