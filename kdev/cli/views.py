"""What the commands show a person: the tables and lines of each command's human output, from the documents the stage
modules return (--json prints those documents as they are). Nothing here computes a result or decides an exit code."""

from __future__ import annotations

from kdev import report


def pass_fail(passed: bool, word: str = "pass"):
    """pass (or PASS) in green, FAIL in red."""
    return report.styled(word, "green") if passed else report.styled("FAIL", "red")


def verdict_mark(verdict: str):
    """FAST, SLOW or SAME against a baseline, coloured."""
    return report.styled(verdict, {"SLOW": "red", "FAST": "green"}.get(verdict, ""))


def git_words(info: dict) -> str:
    """'git <sha>' of a build's provenance, or what stands for none (a candidate built from a copy outside git)."""
    sha = info.get("git_sha")
    return f"git {sha[:12]}" if sha else "not from a git checkout"


def is_microbenchmark(kernel: str) -> bool:
    """ceilings.cu's kernels: the mma.sync peak and the flash loop ladder, not part of any call."""
    return kernel.startswith(("mma_peak_kernel", "inner_loop_kernel", "grouped_loop_kernel"))


# ------------------------------------------------------------------------------------------------ gen-refs
def show_suite_check(suite: str, cases: int, path, problems: list[str]) -> None:
    for p in problems:
        report.error(p)
    verdict = (report.styled("matches", "green") if not problems
               else report.styled(f"{len(problems)} file(s) differ", "red"))
    report.show(report.line(f"gen-refs --check {suite}: {cases} cases, ", verdict, f" ({path})"))


def show_suite_written(suite: str, folder, manifest: dict) -> None:
    rows = [[c["name"], "+".join(map(str, c["tree_sizes"])), c["spec"]["heads"], c["spec"]["page_size"],
             ",".join(map(str, c["spec"]["prefix_lens"])), f"{c['bytes'] / 1e6:.2f}"] for c in manifest["cases"]]
    report.show(report.table(f"suite {suite} -> {folder}", ["case", "T", "H", "page", "prefix", "MB"],
                             rows, {"left": ("case",)}))
    report.show(f"wrote {len(rows)} cases, {sum(c['bytes'] for c in manifest['cases']) / 1e6:.1f} MB")


# --------------------------------------------------------------------------------------------------- build
def is_empty_stub(r: dict) -> bool:
    """A kernel ptxas compiled with no body on r's arch (its code guarded by __CUDA_ARCH__): what ptxas reports for an
    empty kernel, 4 registers and nothing else (a kernel with a single store already takes 8)."""
    return (r["registers"] <= 4 and not r["spill_stores"] and not r["spill_loads"] and not r["stack_frame"]
            and not r["smem"])


def show_build(res, verbose: bool) -> None:
    """ptxas resources one row per kernel (its archs side by side), the flash calls' dynamic shared memory, the
    embedded archs and the library's provenance; then the gate's problems."""
    shown = [r for r in res.resources if verbose or not is_microbenchmark(r["kernel"])]
    archs = list(dict.fromkeys(r["arch"] for r in shown))
    by_kernel: dict = {}
    for r in shown:  # one row per kernel, its archs' figures side by side ("255 / 255"): half the rows
        by_kernel.setdefault(r["kernel"], {})[r["arch"]] = r

    def per_arch(rs: dict, key: str) -> str:
        return " / ".join(str(rs[a][key]) if a in rs else "-" for a in archs)

    def registers(rs: dict) -> str:  # an empty stub's 4 marked, not read as a kernel that fits in 4 registers
        return " / ".join("-" if a not in rs else f"{rs[a]['registers']}*" if is_empty_stub(rs[a])
                          else str(rs[a]["registers"]) for a in archs)

    rows = [[k, registers(rs), per_arch(rs, "spill_stores"), per_arch(rs, "spill_loads"),
             per_arch(rs, "stack_frame"), per_arch(rs, "smem")] for k, rs in by_kernel.items()]
    report.show(report.table(f"ptxas resources ({res.folder.name}), each column {' / '.join(archs)}",
                             ["kernel", "regs", "spill st", "spill ld", "stack", "smem"], rows,
                             {"left": ("kernel",)}))
    stubs: dict = {}
    for r in shown:
        if is_empty_stub(r):
            stubs.setdefault(r["arch"], []).append(r["kernel"])
    if stubs:
        report.show("* an empty stub there, never launched on that arch (" + ", ".join(
            f"{a}: {len(ks)} kernel{'s' * (len(ks) > 1)}" for a, ks in stubs.items()) + "): its body is compiled only "
            "for archs with what it needs (wgmma: sm_90a; the teams kernels' shared memory: more than sm_120's 99 KB)")
    hidden = [r for r in res.resources if r not in shown]
    if hidden:
        spills = sum(bool(r["spill_stores"] or r["spill_loads"]) for r in hidden)
        report.show(f"and {len({r['kernel'] for r in hidden})} microbenchmark kernels (kdev bench --ceilings), "
                    f"{'none spills' if not spills else f'{spills} spill'}: --verbose shows them")
    if res.launches is None:
        report.warn("this library's sources have no kdtree_flash_launch_plan: the flash kernels' dynamic "
                    "shared memory is not reported")
    elif res.launches:
        report.show(report.table(
            "flash calls: kernels launched and dynamic shared memory per block (set at launch: not in ptxas)",
            ["kernel", "arch", "launched by", "dynamic smem", "limit"],
            [[r["kernel"], r["arch"], ", ".join(r["calls"]), r["dynamic_smem"], r["limit"]] for r in res.launches],
            {"left": ("kernel", "arch", "launched by")}))
    emb = res.embedded
    if emb.get("sass") is None:
        report.warn("cuobjdump not found: embedded archs not confirmed (pip install 'kdev[build]')")
    else:
        report.show(f"embedded: SASS {', '.join(emb['sass']) or '-'}; PTX {', '.join(emb['ptx']) or '-'}")
    info = res.build_info
    dirty = " (dirty)" if info.get("git_dirty") else ""
    state = "up to date, nothing compiled" if res.cached else f"built in {res.seconds:.1f} s"
    report.show(f"{res.library}: {state}; sources {info['source_hash'][:12]}, "
                f"{git_words(info)}{dirty}, nvcc {info['nvcc_version']}")
    for p in res.problems:
        report.error(p)


# -------------------------------------------------------------------------------------------------- verify
def show_verify(run, plan_gpu) -> None:
    """A suite shows every case; a fuzz run (thousands of checks) its failures and one row per kernel; then the
    failures, the kept regression vectors and one PASS/FAIL line."""
    shown = run.results if run.kind == "suite" else [r for r in run.results if not r.passed]
    rows = []
    for r in shown:
        vs = "" if r.against == "golden" else f" vs {r.against}"
        if r.out is None:  # an error, or an exact-equality kernel
            rows.append([r.case, r.kernel + vs, "-", "-", "-", r.error or r.note, pass_fail(r.passed)])
            continue
        rows.append([r.case, r.kernel + vs, report.fmt_float(r.out.max_abs), f"{r.out.cos_diff:.1e}",
                     report.fmt_float(r.lse.max_abs), r.token.label() + (", same bits" if r.note else ""),
                     pass_fail(r.passed)])
    title = f"verify {run.record['suite']['name']} on {run.record['gpu']['name']} ({run.record['gpu']['arch']})"
    if plan_gpu:
        title += f", flash calls planned as for {plan_gpu.label}"
    columns = ["case", "kernel", "max |err| out", "cos diff", "max |err| lse", "token-exact", "verdict"]
    if rows:
        report.show(report.table(title, columns, rows, {"left": ("case", "kernel")}))
    if run.kind == "fuzz":
        report.show(report.table(f"{title}: worst over all cases", ["kernel", *columns[2:]],
                                 worst_rows(run.results), {"left": ("kernel",)}))
        secs = run.record["suite"].get("seconds", {})
        report.info("time: " + ", ".join(f"{k} {v:.0f} s" for k, v in secs.items()))
    for f in run.record["failures"]:
        report.error(f"{f['case']} / {f['kernel']} vs {f['against']}: {f['reason']}")
    for path in run.saved_failures:
        report.info(f"failing case kept as a regression vector: {path}")
    per = run.record["kernels"]
    summary = ", ".join(f"{k}: {v['checks'] - v['failed']}/{v['checks']} passed"
                        + (f" ({v['bit_identical_to_first']} bit-identical to {next(iter(per))})"
                           if v.get("bit_identical_to_first") else "") for k, v in per.items())
    seed_note = f" (seed {run.fuzz_seed})" if run.fuzz_seed is not None else ""
    report.show(report.line(pass_fail(run.passed, "PASS"), f" {summary}{seed_note}; ledger {run.ledger_path}"))


def worst_rows(results) -> list[list]:
    """One row per kernel (and pairwise comparison): the worst of each metric over all its checks."""
    groups: dict[str, list] = {}
    for r in results:
        groups.setdefault(r.kernel + ("" if r.against == "golden" else f" vs {r.against}"), []).append(r)
    rows = []
    for name, rs in groups.items():
        failed = sum(not r.passed for r in rs)
        verdict = report.styled("pass", "green") if not failed else report.styled(f"FAIL {failed}", "red")
        with_out = [r for r in rs if r.out is not None]
        if not with_out:
            rows.append([name, "-", "-", "-", f"{len(rs)} checks exact", verdict])
            continue
        ties = sum(r.token.ties for r in with_out if r.token)
        same = sum(r.note == "bit-identical" for r in with_out)
        rows.append([name, report.fmt_float(max(r.out.max_abs for r in with_out)),
                     f"{max(r.out.cos_diff for r in with_out):.1e}", report.fmt_float(max(r.lse.max_abs for r in with_out)),
                     f"{len(with_out)} checks, {ties} ties" + (f", {same} same bits" if same else ""), verdict])
    return rows


# ------------------------------------------------------------------------------------------------------ ab
def show_ab(doc: dict, ref: str, kernels: list[str], ref_is_candidate: bool) -> None:
    title = f"{ref} against this build" if ref_is_candidate else f"this build against {ref}"
    for line in ab_lines(doc):
        report.show(line)
    base_col, cand_col = ("this µs", f"{ref} µs") if ref_is_candidate else (f"{ref} µs", "this µs")
    report.show(report.table(f"{', '.join(kernels)}: {title}, one run on {doc['gpu']['name']}",
                             ["shape", "kernel", base_col, cand_col, "change", "judged beyond", "verdict"],
                             ab_rows(doc), {"left": ("shape", "kernel")}))
    for r in doc["bench"]["results"]:
        if not r["agrees"]:
            report.error(f"{r['shape']} / {r['backend']}: {r['check']}")


def ab_rows(doc: dict) -> list[list]:
    """The timing part of a kdev ab document: one row per shape and kernel."""
    return [[v["shape"], v["backend"], f"{v['baseline_us']:.1f}", f"{v['current_us']:.1f}", f"{100 * v['change']:+.1f}%",
             f"±{100 * v['threshold']:.1f}%", verdict_mark(v["verdict"])]
            for v in doc["verdicts"]]


def ab_lines(doc: dict) -> list:
    """The machine code and verification parts of a kdev ab document, a line each."""
    sass = doc["sass"]
    if "skipped" in sass:
        lines = [f"machine code: not compared ({sass['skipped']})"]
    else:
        changed = ", ".join(f"{d['kernel']} ({d['status']})" for d in sass["differ"][:6])
        more = f" and {len(sass['differ']) - 6} more" if len(sass["differ"]) > 6 else ""
        lines = [f"machine code ({sass['arch']}): {sass['identical']} of {sass['kernels']} kernels identical"
                 + (f"; differ: {changed}{more}" if changed else "")]
    for v in doc["verify"]:
        lines.append(report.line(f"verify {v['suite']}: ", pass_fail(v["passed"], "PASS"),
                                 f" {v['kernel']} and {v['against']}, {v['checks'] - v['failed']}/{v['checks']} checks "
                                 f"passed; same bits in {v['same_bits']} of {v['comparisons']} comparisons"))
        lines += [f"  {f['case']} / {f['kernel']} vs {f['against']}: {f['reason']}" for f in v["failures"]]
    return lines


# ---------------------------------------------------------------------------------------------------- plan
def show_plan(doc: dict, gpu, call: str, costs: bool) -> None:
    mib = 2**20
    rows = []
    for p in doc["plans"]:
        tiles = f"{p['row_tiles'] - 1} + {p['narrow_rows']}-row" if p["narrow_kernel"] else str(p["row_tiles"])
        ctas = f"{p['full_ctas']} + {p['narrow_ctas']}" if p["narrow_kernel"] else str(p["full_ctas"])
        rows.append([p["shape"], f"{p['full_kernel'].removeprefix('verify_attn_flash_')} {p['full_smem']:,} B", tiles,
                     f"{p['splits']}" + (f" + {p['narrow_splits']} narrow" if p["narrow_kernel"] else ""), ctas,
                     f"{p['waves']} x {gpu.sms * p['ctas_per_sm']}", f"{100 * p['slot_use']:.1f}%",
                     f"{100 * p['row_use']:.1f}%",
                     f"{p['kv_read_bytes'] / 1e6:,.0f} MB ({p['kv_read_bytes'] // p['kv_bytes']}x)",
                     f"{p['workspace_bytes'] / mib:,.1f} MiB" if p["workspace_bytes"] else "-",
                     f"{p['floor_us']:.1f} {p['bound']}" if p["floor_us"] else "-"])
    ceil = (f"ceilings {gpu.flops / 1e12:.0f} TFLOP/s, {gpu.bytes_per_s / 1e9:,.0f} GB/s: {gpu.ceilings_source}"
            if gpu.flops and gpu.bytes_per_s else "no ceilings known")
    report.show(report.table(
        f"{call} plan on {gpu.name} ({gpu.arch}, {gpu.sms} SMs; {ceil})",
        ["shape", "full-tile kernel", "row tiles", "splits", "CTAs", "waves x slots", "slot use", "row use",
         "KV read by CTAs", "workspace", "floor µs"], rows, {"left": ("shape", "full-tile kernel")}))
    if costs:
        def choice(c: dict) -> str:
            return f"{c['splits']}/{c['narrow_splits']}: {c['cost_tiles']:,.1f} ({100 * (c['relative'] - 1):+.1f}%)"

        rows = []
        for p in doc["plans"]:
            cs = p["split_costs"]
            taken = next(c for c in cs if (c["splits"], c["narrow_splits"]) == (p["splits"], p["narrow_splits"]))
            one = next(c for c in cs if c["splits"] == 1)
            rows.append([p["shape"], choice(taken), "  ".join(choice(c) for c in cs[:4]), choice(one)])
        report.show(report.table(
            "the planner's model (KV tiles: the full tiles' waves, then the narrow CTAs on the SMs they leave, each CTA "
            "its tiles + 6; full/narrow splits: cost, over the cheapest)",
            ["shape", "taken", "cheapest four", "one split"], rows, {"left": ("shape", "taken", "cheapest four", "one split")}))
    for p in doc["plans"]:  # a skewed batch or a replay: what the device schedule cuts, beside the host plan's one count
        s = p.get("schedule")
        if not s:
            continue
        from kdev.bench.sweeps import AXES, Shape

        shape = Shape(**{k: p["axes"][k] for k in AXES if k in p["axes"]})
        counts: dict = {}
        for L, n, a, b in zip(shape.prefix_lens, [x + 1 for x in shape.budget_list], s["splits"], s["narrow_splits"]):
            counts.setdefault((L, n, a, b), 0)
            counts[(L, n, a, b)] += 1
        parts = ", ".join(f"{c} x ({L:,} + {n}: {a} split{'s' * (a > 1)}"
                          + (f", tail {b} narrow" if b else "") + ")" for (L, n, a, b), c in counts.items())
        report.show(f"{p['shape']}: the device schedule (the flash calls') takes k = {s['k']}: {parts}; "
                    f"{s['ctas']} full-tile + {s['narrow_ctas']} narrow CTAs, model {s['model_tokens']:,} tokens a SM; "
                    f"the host plan {p['splits']} split{'s' * (p['splits'] > 1)} for every request")
    big = doc["largest_workspace"]
    if big and big["bytes"]:
        report.show(f"workspace the caller provides for these shapes: up to {big['bytes'] / mib:,.1f} MiB "
                    f"({big['bytes']:,} B, at {big['shape']})")


def show_context(ctx: dict | None) -> None:
    """kdev plan: the tokens of context a GPU holds for the deploy's model, bf16 and e4m3 caches, per attention layout."""
    if not ctx:
        return
    rows = [[r["cache"], r["layout"], f"{r['weight_bytes_per_gpu'] / 1e9:.1f}", f"{r['kv_bytes_per_gpu'] / 1e9:.1f}",
             f"{r['kv_bytes_per_token'] / 1e3:.1f}", f"{r['tokens_per_gpu']:,}", f"{r['distinct_tokens']:,}",
             f"{r['longest_request']:,}"] for r in ctx["rows"]]
    report.show(report.table(
        f"context held: {ctx['model']} on {ctx['gpu_name']} ({ctx['memory_bytes'] / 2**30:.1f} GiB, "
        f"{ctx['mem_fraction_static']:.0%} for weights and KV cache; tp {ctx['tensor_parallel']})",
        ["cache", "attention", "weights GB", "KV GB", "KB/token", "tokens/GPU", "distinct tokens", "longest request"],
        rows))


def show_projection(doc: dict) -> None:
    """kdev plan --project: a row per shape (the range, its bound and what moves it, the KV traffic and what a cluster
    would save), a row per kernel, the fit behind the constants, and each calibration's verdict."""
    k, fit = doc["constants"], doc["fit"]
    borrowed = "" if fit["constants_from"] == fit["family"] else f", borrowed from {fit['constants_from']}"
    report.show(f"constants (family {fit['family']}{borrowed}, fitted on {k['points']} points): efficiency {k['efficiency']:.3f}, "
                f"{k['cta_cycles']:,.0f} cycles per CTA, {k['call_us']:.1f} µs per call, {k['memory_tile_cycles']:,.0f} "
                f"cycles per tile from memory")
    pct = lambda e: "-" if e is None else f"{100 * e:.1f}%"  # noqa: E731
    report.show(f"off on the fit's points by {pct(fit['fit_max_error'])} at most; on the held-out points by "
                f"{pct(fit['held_out_max_error'])} at most (tolerance {pct(fit['tolerance'])})")
    for why, worst in fit["known_misses"].items():
        report.warn(f"known miss, up to {pct(worst)} off on held-out points: {why} (docs/projection.md)")
    rows = []
    for s in doc["shapes"]:
        clusters = "  ".join(f"{c['ctas']}: {c['no_l2_reuse_us']:,.0f}" for c in s["clusters"])
        rows.append([s["shape"], f"{s['low_us']:,.1f} - {s['high_us']:,.1f}", f"{s['us']:,.1f}", s["bound"],
                     s["moved_most_by"], f"{s['traffic']['l2_read_bytes'] / 1e6:,.0f} MB "
                     f"({s['traffic']['l2_read_bytes'] / s['traffic']['kv_bytes']:.1f}x)",
                     f"{s['no_l2_reuse_us']:,.0f}", clusters,
                     "-" if s["l2_binds_below"] is None else f"{s['l2_binds_below']:.1f}"])
    report.show(report.table(
        f"{doc['call']} projected on {doc['gpu']} ({doc['arch']})",
        ["shape", "µs range", "µs mid", "bound", "moved most by", "KV read from L2", "µs, no L2 reuse",
         "cluster CTAs: µs, no reuse", "L2 binds below B/clk/SM"], rows,
        {"left": ("shape", "bound", "moved most by", "cluster CTAs: µs, no reuse")}))
    rows = [[s["shape"], x["kernel"].removeprefix("verify_attn_flash_"), x["ctas"], x["tiles_per_cta"],
             " ".join(f"{p} {c:,.0f}" for p, c in x["tile_cycles"].items()), x["bound"], f"{x['cta_us']:,.1f}"]
            for s in doc["shapes"] for x in s["kernels"]]
    rows += [[s["shape"], "combine", "-", "-", "-", "memory", f"{s['combine_us']:,.1f}"] for s in doc["shapes"]
             if s["combine_us"]]
    report.show(report.table("per kernel, at the middle of the ranges (cycles per KV tile and CTA on each pipe; a CTA's "
                             "µs: its tiles and its fixed cycles)",
                             ["shape", "kernel", "CTAs", "tiles/CTA", "cycles per tile", "bound", "µs per CTA"], rows,
                             {"left": ("shape", "kernel", "cycles per tile", "bound")}))
    for c in doc["calibrations"]:
        rows = [[b["shape"], b["call"], f"{b['measured_us']:,.1f}", f"{b['projected_us']:,.1f}",
                 f"{100 * b['error']:+.1f}%", f"{a['projected_us']:,.1f}", f"{100 * a['error']:+.1f}%"]
                for b, a in zip(c["before"], c["after"])]
        report.show(report.table(
            f"{c['file']} ({c['gpu']}, family {c['family']}): the projection before and after its points joined the fit",
            ["shape", "call", "measured µs", "projected µs", "off", "refitted µs", "off"], rows,
            {"left": ("shape", "call")}))


def show_field_report(doc: dict, out) -> None:
    n = doc["nvml"]
    clock = n["sm_clock_mhz"] or {}
    power = n["power_w"] or {}
    report.show(f"{doc['gpu']['name']} ({doc['gpu']['arch']}, driver {doc['gpu']['driver']}, power limit "
                f"{doc['gpu']['power_limit_w']} W): SM clock {clock.get('min')}-{clock.get('max')} MHz (median "
                f"{clock.get('median')}), power up to {power.get('max')} W over {n['samples']} samples; clock events: "
                f"{', '.join(n['clock_events']) or 'none'}")
    for s in doc["steps"]:
        if s["rc"] != 0:
            report.warn(f"{s['name']} ({s['command']}): " + ("did not run" if s["rc"] is None else f"exit {s['rc']}")
                        + (f": {s['tail'][-1]}" if s["tail"] else ""))
    report.show(f"report written to {out}: send this one file; `kdev plan --project --calibrate {out}` reads it")


def show_fleet(doc: dict, stage: str) -> None:
    """verify or bench on several GPUs: a row per GPU; for bench, each card's medians and the spread between cards."""
    rows = []
    for r in doc["gpus"]:
        g, res = r["gpu"], r["result"] or {}
        ecc = {"on": "ECC on", "off": "ECC off", None: "no ECC mode"}[g["ecc_mode"]]
        what = ""
        if stage == "verify" and res:
            kernels = res.get("kernels", {})
            what = f"{sum(k['checks'] for k in kernels.values())} checks, {sum(k['failed'] for k in kernels.values())} failed"
        elif stage == "bench" and res:
            what = f"{sum(1 for x in res.get('results', []) if x.get('timing'))} timed"
        rows.append([g["position"], g["name"], g["uuid"], f"{g['driver']}, {ecc}", pass_fail(r["passed"]), what,
                     f"{r['seconds']:.0f} s", r["reason"] or "-"])
    report.show(report.table(f"kdev {stage} on {len(rows)} GPUs", ["GPU", "model", "UUID", "driver", "result", "",
                                                                   "time", "why"], rows,
                             {"left": ("model", "UUID", "driver", "why")}))
    if stage == "bench" and doc.get("spread"):
        order = [r["gpu"]["uuid"] for r in doc["gpus"]]
        rows = [[x["shape"], x["backend"], *(f"{x['median_us'][u]:,.1f}" if u in x["median_us"] else "-" for u in order),
                 f"{100 * x['spread']:.1f}%", ", ".join(x["slow"]) or "-"] for x in doc["spread"]]
        report.show(report.table(
            f"median µs per card; slow: more than {100 * doc['slow_above']:.0f}% above the cards' median",
            ["shape", "backend", *(f"GPU {r['gpu']['position']}" for r in doc["gpus"]), "spread", "slow"], rows,
            {"left": ("shape", "backend", "slow")}))


# ---------------------------------------------------------------------------------------------------- sass
def show_loops(rows: list[dict], lib, kernel: str, wgmma_rows: list[dict] = ()) -> None:
    """kdev sass: one table per kernel, a row per arch and loop that issues HMMA, and what the columns mean; then the
    loops that issue warpgroup MMA (HGMMA) the same way."""
    def pair(lo, med):
        return "-" if lo is None else f"{lo} / {med:g}"

    def histogram(chains: dict) -> str:  # distances past 8 are values carried around the loop
        near = [f"{d}:{n}" for d, n in chains.items() if int(d) <= 8]
        far = sum(n for d, n in chains.items() if int(d) > 8)
        return " ".join(near + ([f">8:{far}"] if far else [])) or "-"

    for name in sorted({r["kernel"] for r in rows}):
        table_rows = [[r["arch"], r["address"], r["instructions"], r["hmma"], r["loads"], r["nop"],
                       pair(r["chain_min"], r["chain_median"]),
                       histogram(r["chains"]),
                       pair(r["lead_min"], r["lead_median"]),
                       f"{r['smem_wavefronts_hot']} / {r['smem_wavefronts']}",
                       f"{r['smem_wavefronts_hot'] / r['hmma']:.2f}"]
                      for r in rows if r["kernel"] == name]
        report.show(report.table(f"{name}: loops with HMMA ({lib.name} in {lib.parent.name})",
                                 ["arch", "loop", "instr", "HMMA", "loads", "NOP", "chain", "chains", "lead",
                                  "smem wf", "wf/HMMA"], table_rows, {"left": ("arch", "chains")}))
    if wgmma_rows:
        report.show(report.table(
            f"loops with HGMMA ({lib.name} in {lib.parent.name})",
            ["kernel", "arch", "loop", "instr", "HGMMA", "by shape", "FLOP / WG", "waits", "BAR", "mbarrier waits"],
            [[r["kernel"], r["arch"], r["address"], r["instructions"], r["hgmma"],
              " ".join(f"{s}:{n}" for s, n in r["hgmma_by_shape"].items()), f"{r['flop_per_warpgroup']:,}",
              f"{r['wgmma_waits']}" + (" SERIALIZED" if r["serialized"] else ""), r["block_barriers"],
              r["mbarrier_waits"]] for r in wgmma_rows],
            {"left": ("kernel", "arch", "by shape")}))
        report.show("HGMMA: warpgroup MMAs per iteration (by shape); FLOP / WG: what one warpgroup issues per "
                    "iteration; waits: WARPGROUP.DEPBAR per iteration (SERIALIZED: one per HGMMA, each waited for "
                    "before the next issues); BAR: block barriers; mbarrier waits: SYNCS.PHASECHK")
    if not rows:
        if not wgmma_rows:
            report.warn(f"{kernel}: no loop with HMMA or HGMMA")
        return
    report.show("chain: min / median HMMAs back to the one that wrote an HMMA's accumulator (about the chains "
                "in flight), chains: how many HMMAs at each distance; lead: min / median instructions from the "
                "LDSM / LDS of an HMMA's fragments to the HMMA; smem wf: 128-byte shared-memory wavefronts the "
                "loop's instructions move per warp and iteration, conflict-free, tensor copies not counted: hot path "
                "(stretches a branch skips without HMMA, and guarded instructions, left out: an estimate) / every "
                "instruction once (--json splits it by opcode); wf/HMMA: the hot path's per HMMA, where above ~1.7 a "
                "loop is bound by shared memory at the H200's mma.sync peak")


def show_sass_compare(rows: list[dict], base, lib, kernel: str) -> None:
    """kdev sass --against: the kernels whose machine code differs (identical ones are counted, not listed)."""
    differ = [r for r in rows if r["status"] != "same"]

    def change(a, b, fmt=str):  # "a" when equal, "a -> b" otherwise ("-" for a side that has no such kernel)
        a, b = ("-" if x is None else fmt(x) for x in (a, b))
        return a if a == b else f"{a} -> {b}"

    def loop_sizes(xs):
        return "/".join(map(str, xs)) or "none"

    if differ:
        report.show(report.table(
            f"SASS of {lib.parent.name} against {base.parent.name}" + (f" ('{kernel}')" if kernel else ""),
            ["kernel", "arch", "status", "instructions", "differ", "HMMA loops", "smem wf"],
            [[r["kernel"], r["arch"],
              r["status"] + (f" (code of {r['code_of']}: {r['code_likeness']})" if r["code_of"] else ""),
              change(r["base_instructions"], r["instructions"]),
              r["changed_instructions"],
              change(r["base_hmma_loops"] if r["base_instructions"] is not None else None,
                     r["hmma_loops"] if r["instructions"] is not None else None, loop_sizes),
              change(r["base_hmma_loop_wavefronts"] if r["base_instructions"] is not None else None,
                     r["hmma_loop_wavefronts"] if r["instructions"] is not None else None, loop_sizes)]
             for r in differ],
            {"left": ("kernel", "arch", "status")}))
        report.show("registers: identical but for register numbers (another allocation); differ: "
                    "instructions that differ (branch targets aside); HMMA loops: the instructions of each loop "
                    "that issues HMMA; smem wf: their shared-memory wavefronts per warp and iteration, every instruction once")
    report.show(f"{len(rows) - len(differ)} of {len(rows)} kernels x archs identical to {base}"
                + (f", {len(differ)} differ" if differ else ""))


# ----------------------------------------------------------------------------------------------------- e2e
def show_e2e(results, doc) -> None:
    """One row per case and budget: the positions compared, the largest error against its bound, near-ties excused,
    what the case reached (RoPE position, tree, prefill chunks), acceptance and the stages' time; then every failing
    and excused position."""
    rows = []
    for r in results:
        step = 1e3 * sum(r.seconds.values()) / r.rounds
        attn = 1e3 * r.seconds.get("verify attention", 0.0) / r.rounds
        rows.append([r.case, r.budget, r.compared, f"{r.worst:.3g}", len(r.excused), r.max_position, r.max_nodes,
                     r.prefill_chunks, f"{r.tokens_per_round:.2f}", f"{step:.0f}",
                     f"{100 * attn / step:.0f}%" if step else "-", pass_fail(r.passed)])
    report.show(report.table(
        "e2e: logits at every accepted and bonus position against transformers' greedy decoding",
        ["case", "budget", "positions", "worst err/bound", "excused", "max pos", "nodes", "chunks", "tokens/round",
         "ms/round", "attn share", "verdict"], rows, {"left": ("case",)}))
    for r in results:
        shown = 0
        for d in r.differences:
            report.error(f"{r.case}, budget {r.budget}: prompt {d.prompt}, round {d.round}, generated token "
                         f"{d.position}: {d.what} {d.got} where greedy gives {d.want}")
        for p in r.positions:
            if p.status == "fails" and shown < 5:
                shown += 1
                report.error(f"{r.case}, budget {r.budget}: prompt {p.prompt}, round {p.round}, generated token "
                             f"{p.index}: logits {p.why}")
            elif p.status == "excused":
                report.info(f"{r.case}, budget {r.budget}: prompt {p.prompt}, round {p.round}, generated token "
                            f"{p.index}: {p.why}")
        failed = len(r.failed_positions)
        if failed > shown:
            report.error(f"{r.case}, budget {r.budget}: {failed - shown} more failing position(s) (--json lists all)")
    b = doc["bounds"]
    report.show(f"bounds: float64 {b['f64_rel']:.2g} x (1 + max |logit|); bf16 that plus "
                f"{b['sigmas'] * b['propagation']:g} sigma of the latent outputs' noise ({b['bf16_rel']:.3g} x "
                f"(|o| + row rms) per head, {b['shared_rel']:.3g} x it shared by the heads) carried to the logits "
                "(docs/e2e.md); a near-tie within them is excused and the oracle's token taken")


def show_deploy_curve(rows, moves, costs, dep, topology, batch, prefix, kernel, source, measured,
                      attention_source) -> None:
    def us(v: float) -> str:
        return f"{v:,.0f}"

    table = [[r["budget"] or "0 (plain)", f"{r['tokens_per_round']:.2f}",
              us(r["verify_attention_us"]) + ("*" if r["attention_upper_bound"] else ""),
              f"{r['experts_touched']:.0f}", f"{r['weight_bytes'] / 1e9:.1f}", us(r["weights_us"]), us(r["comm_us"]),
              us(r["drafter_us"]), us(r["other_us"]), us(r["step_us"]),
              report.styled(f"{r['tokens_per_s']:,.0f}", "green") if r["best"] else f"{r['tokens_per_s']:,.0f}",
              f"{r['tokens_per_s_high']:,.0f}..{r['tokens_per_s_low']:,.0f}"] for r in rows]
    label = "PROJECTION" if measured else "ILLUSTRATIVE PROJECTION (acceptance assumed)"
    report.show(report.table(
        f"{label}: {costs.name}, {topology}, B={batch}, prefix {prefix}, {kernel}; per GPU, µs a step",
        ["budget", "tokens/round", "verify attn", "experts/layer", "weights GB", "weights", "comm", "drafter", "other",
         "step", "tokens/s", "range"], table))
    best = next(r for r in rows if r["best"])
    report.show(f"best budget {best['budget']}: {best['tokens_per_s']:,.0f} tokens/s "
                f"({best['tokens_per_s_high']:,.0f} to {best['tokens_per_s_low']:,.0f} over the ranges below)")
    report.show(f"acceptance: {source}")
    report.show(f"verify attention: {attention_source}")
    report.show("what moves the best budget's tokens/s most (one input at each end, the others at their middle):")
    for m in moves[:3]:
        lo, hi = m["at_low"], m["at_high"]
        report.show(f"  {m['input']} {m['low']:g} .. {m['high']:g}: best budget {lo['best_budget']} .. "
                    f"{hi['best_budget']}, {lo['tokens_per_s']:,.0f} .. {hi['tokens_per_s']:,.0f} tokens/s "
                    f"({m['source']})")
    if any(r["attention_upper_bound"] for r in rows):
        report.show("* below the bench's smallest budget: that budget's time (an upper bound)")
    report.show(f"link: {dep.link}; experts touched as if routing were uniform (an upper bound)")


# ---------------------------------------------------------------------------------------- clean, deploy, all
def show_clean(items, repo, removed: bool) -> None:
    rows = [[str(i.path.relative_to(repo)), f"{i.bytes / 1e6:.1f}", i.why] for i in items]
    if rows:
        report.show(report.table("kdev clean" + ("" if removed else " (dry run: --yes removes)"),
                                 ["path", "MB", "why"], rows, {"left": ("path", "why")}))
    total = sum(i.bytes for i in items) / 1e6
    report.show(f"{'removed' if removed else 'would remove'} {len(items)} item(s), {total:.1f} MB"
                if items else "nothing to clean")


def show_deploy(probes, repo, target_arch: str, failed: list, strict: bool) -> None:
    from kdev import deploy

    status = {deploy.PASS: ("pass", "green"), deploy.WARN: ("warn", "yellow"), deploy.FAIL: ("FAIL", "red")}
    rows = [[p.name, report.styled(*status[p.status]), p.reason] for p in probes]
    report.show(report.table(f"deploy-check {repo.resolve()} -> {target_arch}", ["probe", "status", "reason"],
                             rows, {"left": ("probe", "status", "reason")}))
    git = next((p for p in probes if p.name == "git"), None)
    if git and git.details.get("last_commits"):
        report.show("last commits:\n  " + "\n  ".join(git.details["last_commits"]))
    report.show(report.styled("ready to deploy", "green") if not failed else
                report.line(report.styled("not ready", "red"),
                            f": {len(failed)} probe(s) failed" + (" (--strict)" if strict else "")))


def show_stages(results: list[dict]) -> None:
    style = {"passed": ("passed", "green"), "failed": ("FAILED", "red"), "skipped": ("skipped", "yellow"),
             "not run": ("not run", "")}
    report.show(report.table("kdev all", ["stage", "status", "exit"],
                             [[r["stage"], report.styled(*style[r["status"]]),
                               "-" if r["exit_code"] is None else r["exit_code"]]
                              for r in results], {"left": ("stage", "status")}))
