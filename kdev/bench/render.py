"""`kdev bench` on the terminal: the results table, the targets' lines and the loop ladder (kdev/report.py's pieces)."""

from __future__ import annotations

from kdev import report
from kdev.bench.verdicts import CAPTURE_BOUND, SKEW_BOUND, speedups


def verdict_mark(verdict: str):
    """FAST, SLOW or SAME against a baseline, coloured."""
    return report.styled(verdict, {"SLOW": "red", "FAST": "green"}.get(verdict, ""))


def loop_table(loops: list[dict]):
    def row(r: dict) -> list:
        if not r["runs"]:
            return [r["loop"], r["warps_per_sm"], r["mma_per_warp_tile"], "not on this GPU", "", ""]
        return [r["loop"], r["warps_per_sm"], r["mma_per_warp_tile"], f"{r['flops'] / 1e12:.0f}",
                f"{100 * r['of_peak']:.0f} %" if r["of_peak"] is not None else "-",
                f"{r['copy_bytes_per_s'] / 1e9:,.0f}" if r["copy_bytes_per_s"] else "-"]

    return report.table("the flash kernel's loop piece by piece, one CTA per SM (kernels/ceilings.cu)",
                        ["loop", "warps/SM", "mma/warp/tile", "TFLOP/s", "of peak", "copied GB/s"],
                        [row(r) for r in loops], {"left": ("loop",)})


def results_table(doc: dict, verdicts: list | None, normalize_by: str | None):
    results = doc["results"]
    sp = speedups(results)
    vmap = {(v["shape"], v["backend"]): v for v in verdicts or []}
    rows = []
    for r in results:
        t = r["timing"]
        v = vmap.get((r["shape"], r["backend"]))
        floor = f"{r['floor_us']:.1f}" if r["floor_us"] else "-"
        row = [r["shape"], r["backend"] + (f" {r['tiles']}" if r.get("tiles") else "")]
        if t:
            pct = f"{100 * r['floor_us'] / t['median_us']:.1f}%" if r["floor_us"] else "-"
            x = sp.get((r["shape"], r["backend"]))
            row += [f"{t['median_us']:.1f}", f"{t['p10_us']:.1f}-{t['p90_us']:.1f}", f"{t['samples']} {t['stop']}",
                    floor, pct, f"{x:.2f}x" if x else "-", "ok"]
        else:
            row += ["-", "-", "-", floor, "-", "-", report.styled("not ranked", "red")]
        if verdicts is not None:
            if v:
                row.append(report.line(verdict_mark(v["verdict"]), f" {100 * v['change']:+.1f}%"))
            else:
                row.append("reference" if r["backend"] == normalize_by else "-")
        rows.append(row)
    cols = ["shape", "backend", "median µs", "p10-p90", "n stop", "floor µs", "% floor", "t/t(flash)", "check"]
    if verdicts is not None:
        cols.append(f"vs baseline (/{normalize_by})" if normalize_by else "vs baseline")
    prov = doc["provenance"]
    ceil = prov.get("ceilings")
    # the tensor ceiling the floors were priced at (a result from before it was recorded: mma.sync's)
    tensor = prov.get("floor_ceiling") or ({"name": "mma.sync", "flops": ceil["flops"]} if ceil else None)
    ceil_s = (f"floor at {tensor['name']} {tensor['flops'] / 1e12:.0f} TFLOP/s, {ceil['bytes_per_s'] / 1e9:.0f} GB/s"
              if ceil else "unknown ceilings")
    from kdev.plan import PlanTarget

    planned = prov.get("plan")
    plan_s = f"; flash calls planned as for {PlanTarget.from_dict(planned).label}" if planned else ""
    if (prov.get("method") or {}).get("graph"):
        plan_s += "; CUDA-graph replays"
    return report.table(f"bench {doc.get('sweep', '')} on {prov['gpu']['name']} ({ceil_s}{plan_s})", cols, rows,
                        {"left": ("shape", "backend")})


def short_shape(name: str) -> str:
    """B1-L32768-N64-H8-p64 -> B1 L32768 N64 H8 (the page size only where it is not 64)."""
    return " ".join(p for p in name.split("-") if p != "p64")


def target_lines(judged: list[dict], gpu_name: str) -> list:
    """One line per judged backend: the first targets it meets, and its speedup over naive where it falls short. Targets
    set for another GPU than the run's are compared in yellow and said to be indicative."""
    lines = []
    for j in judged:
        n = len(j["met"]) + len(j["missed"])
        if n:
            missed = ", ".join(f"{short_shape(m['shape'])} {m['median_us']:.1f} > {m['target_us']:g} µs"
                               if m["median_us"] is not None else f"{short_shape(m['shape'])} not timed"
                               for m in j["missed"])
            colour = "yellow" if j.get("indicative") else "green" if not j["missed"] else "red"
            other = (f" (targets set for {' / '.join(j['targets_set_for'])}, timed on {gpu_name}: indicative only)"
                     if j.get("indicative") else "")
            lines.append(report.line(f"{j['backend']}: first targets met at ",
                                     report.styled(f"{len(j['met'])} of {n}", colour),
                                     " shapes" + (f"; missed: {missed}" if missed else "") + other))
        n = len(j["fast_enough"]) + len(j["too_slow"])
        if n:
            short = ", ".join(f"{short_shape(t['shape'])} {t['speedup']:.1f}x" if t["speedup"] else
                              f"{short_shape(t['shape'])} not timed" for t in j["too_slow"])
            wanted = "/".join(f"{w:g}" for w in j["wanted_speedups"])
            colour = "red" if j["too_slow"] else "green"
            lines.append(report.line(f"{j['backend']}: at least {wanted}x faster than naive at ",
                                     report.styled(f"{len(j['fast_enough'])} of {n}", colour),
                                     " shapes" + (f"; short: {short}" if short else "")))
    return lines


def show_outcome(got, o, json_out: bool) -> int:
    """What `kdev bench` prints for an outcome of command.run (one JSON document with --json), and its exit code: 1 where
    a shape is SLOW against the baseline."""
    for note in got.notes:
        report.info(note)
    if got.ceilings is not None:
        c = got.ceilings
        if got.ceilings_path:
            wgmma = c.get("wgmma_flops")
            report.info(f"ceilings on {got.gpu['name']}: mma.sync bf16 {c['flops'] / 1e12:.0f} TFLOP/s, "
                        + (f"wgmma bf16 {wgmma / 1e12:.0f} TFLOP/s, " if wgmma else "wgmma not in this library "
                           "(an sm_90a build has it: kdev build --arch sm_90a), ")
                        + f"copy {c['bytes_per_s'] / 1e9:.0f} GB/s (cached in {got.ceilings_path})")
        if not json_out and c["inner_loops"]:
            report.show(loop_table(c["inner_loops"]))
        if got.doc is None:
            if json_out:
                report.emit_json({"ceilings": c, "gpu": got.gpu})
            return 0
    doc, verdicts = got.doc, got.verdicts
    if json_out:
        report.emit_json(doc)
    else:
        report.show(results_table(doc, verdicts, o.normalize_by))
        for line in target_lines(doc.get("targets") or [], doc["provenance"]["gpu"]["name"]):
            report.show(line)
        for k in doc.get("skewed") or []:
            alone = " + ".join(f"{a['count']} x {a['median_us']:,.1f}" for a in k["alone"])
            line = (f"{k['shape']} / {k['backend']}: {k['batch_us']:,.1f} µs, its requests alone {alone} = "
                    f"{k['alone_sum_us']:,.1f} µs ({k['ratio']:.2f}x)")
            report.show(line) if k["within"] else report.warn(line + f": more than {100 * SKEW_BOUND:.0f}% over")
        for k in doc.get("captured") or []:
            line = (f"{k['shape']} / {k['backend']}: {k['replay_us']:,.1f} µs at capture {k['capture']}'s bounds, "
                    f"{k['own_us']:,.1f} µs at its own ({k['ratio']:.2f}x)")
            report.show(line) if k["within"] else report.warn(line + f": more than {100 * CAPTURE_BOUND:.0f}% over")
        for name, other in (doc["provenance"].get("libraries") or {}).items():  # KERNEL@REF: which build ran
            report.info(f"{name}: {other['library']} (sources {str(other['build_info'].get('source_hash', '?'))[:12]})")
        for r in doc["results"]:
            if not r["agrees"]:
                report.error(f"{r['shape']} / {r['backend']}: {r['check']}")
    if o.normalize_by and any(r["backend"] == o.normalize_by and not r.get("timing") for r in doc["results"]):
        # a measured run is written in full first; its shapes without a reference timing get no verdict
        report.warn(f"--normalize-by {o.normalize_by}: not timed at some shapes here; those shapes are not judged")
    slow = [v for v in verdicts or [] if v["verdict"] == "SLOW"]
    if slow:
        report.error(f"{len(slow)} regression(s) against {o.baseline}: " + ", ".join(
            f"{v['shape']}/{v['backend']} {100 * v['change']:+.1f}%" for v in slow[:5]))
        return 1
    return 0
