"""kdev command line: one thin function per command (parsing, output mode, exit code); the work lives in
the stage modules. Exit codes (docs/architecture.md §5): 0 success, 1 a check failed, 2 bad usage or input,
3 environment missing. --json prints exactly one JSON document on stdout; progress and logs go to stderr."""

from __future__ import annotations

import functools
import inspect
import signal
from pathlib import Path
from typing import Optional

import typer

from kdev import __version__, report
from kdev.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, BadInput, EnvironmentMissing, KdevError

app = typer.Typer(
    name="kdev",
    help="Develop and validate CUDA kernels for tree speculative decoding on MLA models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain help (click's layout): a flag shows no placeholder there, -h among them
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 1000},
)

JsonOpt = typer.Option(False, "--json", help="Print one JSON document on stdout (logs go to stderr).")
# the shapes of kdev bench and kdev plan: a named sweep (their own --sweep default), or these
ShapeOpt = typer.Option(None, "--shape", help="One shape, e.g. B=1,L=32768,N=64,H=8 (repeatable).")
AxisOpt = typer.Option(None, "-a", "--axis", help="Override an axis: AXIS=V1,V2 (repeatable).")
# verify and bench: another GPU's split plan, run on this one
PlanGpuOpt = typer.Option(
    None, "--plan-gpu", help="Plan the flash calls as for a GPU of configs/gpus.yaml (e.g. rtx-pro-6000 with "
    "flash-portable: the target's kernels and split plan) or for a number of SMs: its split counts and workspace, "
    "run here.")


def command(fn):
    """Turn KdevError into one line on stderr and its exit code; never a traceback for bad input. With --json, an error
    is still exactly one JSON document on stdout: {"error": ..., "exit_code": ...}."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        json_out = bool(kwargs.get("json_out"))

        def fail(message: str, code: int):
            report.error(message)
            if json_out:
                report.emit_json({"error": message, "exit_code": code})
            raise typer.Exit(code) from None

        try:
            if kwargs.get("repo") is None:  # every command works on the checkout around the current directory
                from kdev import project

                project.require_root()
            return fn(*args, **kwargs)
        except KdevError as e:
            fail(str(e), e.exit_code)
        except OSError as e:  # a path the user gave that cannot be read or written: bad input, said in one line
            where = f"{e.filename}: " if e.filename else ""
            fail(f"{where}{e.strerror or e}", EXIT_BAD_INPUT)
        except typer.BadParameter as e:  # raised by a command's own checks
            if not json_out:
                raise
            hint = f"{e.param_hint}: " if getattr(e, "param_hint", None) else ""
            fail(f"{hint}{e.format_message()}", EXIT_BAD_INPUT)
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except Terminated as e:
            fail(f"terminated ({e.signal_name})", 128 + e.signum)

    return wrapper


def _version(value: bool):
    if value:
        typer.echo(f"kdev {__version__}")
        raise typer.Exit(0)


@app.callback()
def main_callback(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
):
    """kdev: gen-refs -> build -> verify -> bench -> deploy-check."""


def git_words(info: dict) -> str:
    """'git <sha>' of a build's provenance, or what stands for none (a candidate built from a copy outside git)."""
    sha = info.get("git_sha")
    return f"git {sha[:12]}" if sha else "not from a git checkout"


def _is_microbenchmark(kernel: str) -> bool:
    """ceilings.cu's kernels: the mma.sync peak and the flash loop ladder, not part of any call."""
    return kernel.startswith(("mma_peak_kernel", "inner_loop_kernel", "grouped_loop_kernel"))


def _check_device(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise typer.BadParameter("must be cpu or cuda", param_hint="--device")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise EnvironmentMissing("--device cuda: no CUDA GPU visible to torch")


# --------------------------------------------------------------------------------------------- gen-refs
@app.command("gen-refs")
@command
def gen_refs(
    suite: str = typer.Option("smoke", "--suite", help="Suite name in the suites file."),
    config: Optional[Path] = typer.Option(None, "--config", help="Suites file (default: configs/suites.yaml)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder that holds suite folders (default: vectors/)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing suite."),
    check: bool = typer.Option(False, "--check", help="Regenerate in memory and compare with the suite on disk."),
    device: str = typer.Option("cpu", "--device", help="Where the float64 reference runs: cpu or cuda."),
    json_out: bool = JsonOpt,
):
    """Generate golden test vectors from the float64 MLA + DDTree reference (or --check them)."""
    from kdev import config as cfg
    from kdev import vectors

    _check_device(device)
    spec = cfg.load_suite(suite, config)
    root = out or vectors.default_vectors_root()
    if check:
        disk = vectors.open_suite(str(root / suite), allow_stale=True)
        with report.progress(f"check {suite}", len(spec.cases)) as advance:
            problems = vectors.check_suite(spec, disk, device, progress=advance)
        doc = {"suite": suite, "path": str(disk.path), "cases": len(spec.cases), "ok": not problems,
               "stale": disk.stale, "problems": problems}
        if json_out:
            report.emit_json(doc)
        else:
            for p in problems:
                report.error(p)
            verdict = (report.styled("matches", "green") if not problems
                       else report.styled(f"{len(problems)} file(s) differ", "red"))
            report.show(report.line(f"gen-refs --check {suite}: {len(spec.cases)} cases, ", verdict, f" ({disk.path})"))
        if problems:
            raise typer.Exit(EXIT_CHECK_FAILED)
        return
    with report.progress(f"gen-refs {suite}", len(spec.cases)) as advance:
        manifest = vectors.write_suite(spec, root, force=force, device=device, progress=advance)
    total = sum(c["bytes"] for c in manifest["cases"])
    doc = {"suite": suite, "path": str(root / suite), "cases": [c["name"] for c in manifest["cases"]],
           "bytes": total, "generator_hash": manifest["generator_hash"]}
    if json_out:
        report.emit_json(doc)
    else:
        rows = [[c["name"], "+".join(map(str, c["tree_sizes"])), c["spec"]["heads"], c["spec"]["page_size"],
                 ",".join(map(str, c["spec"]["prefix_lens"])), f"{c['bytes'] / 1e6:.2f}"] for c in manifest["cases"]]
        report.show(report.table(f"suite {suite} -> {root / suite}", ["case", "T", "H", "page", "prefix", "MB"],
                                 rows, {"left": ("case",)}))
        report.show(f"wrote {len(rows)} cases, {total / 1e6:.1f} MB")


# ------------------------------------------------------------------------------------------------ build
def _split_archs(values: Optional[list[str]]) -> Optional[list[str]]:
    if not values:
        return None
    return [a.strip() for v in values for a in v.split(",") if a.strip()]


@app.command("build")
@command
def build_cmd(
    arch: Optional[list[str]] = typer.Option(None, "--arch", help="Target arch(s), e.g. sm_90 or sm_90,sm_120 "
                                                                 "(default: build.yaml)."),
    config: Optional[Path] = typer.Option(None, "--config", help="Build config (default: configs/build.yaml)."),
    force: bool = typer.Option(False, "--force", help="Rebuild even when the cache key matches."),
    kernels: Optional[Path] = typer.Option(
        None, "--kernels", help="Build an edited copy of kernels/ (an A/B candidate), or this checkout's kernels/ with "
        "a patch applied (variants/NAME.patch), into a library of its own; the default library is left alone. Load it "
        "with --library in verify and bench."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Every kernel's ptxas row, the microbenchmarks' too."),
    json_out: bool = JsonOpt,
):
    """Build kernels/ into one shared library (C ABI) per configuration, gated on the ptxas report."""
    from kdev import build as kbuild
    from kdev import config as cfg

    if kernels is not None and kbuild.describe_library_ref(str(kernels)) == "patch":
        kernels = kbuild.patch_kernels(kernels)  # build/ab-patch-<hash>/kernels, written once
    elif kernels is not None and not (kernels / "include").is_dir():
        raise BadInput(f"{kernels}: not a copy of kernels/ (no include/ folder) nor a patch of it")
    bc = cfg.load_build(config, _split_archs(arch))
    res = kbuild.build(bc, force=force, log=report.info, variant=kernels is not None,
                       kernel_dir=kernels.resolve() if kernels is not None else kbuild.KERNEL_DIR)
    if json_out:
        report.emit_json({**res.to_dict(), "ok": not res.problems})
    else:
        shown = [r for r in res.resources if verbose or not _is_microbenchmark(r["kernel"])]
        archs = list(dict.fromkeys(r["arch"] for r in shown))
        by_kernel: dict = {}
        for r in shown:  # one row per kernel, its archs' figures side by side ("255 / 255"): half the rows
            by_kernel.setdefault(r["kernel"], {})[r["arch"]] = r

        def per_arch(rs: dict, key: str) -> str:
            return " / ".join(str(rs[a][key]) if a in rs else "-" for a in archs)

        rows = [[k, per_arch(rs, "registers"), per_arch(rs, "spill_stores"), per_arch(rs, "spill_loads"),
                 per_arch(rs, "stack_frame"), per_arch(rs, "smem")] for k, rs in by_kernel.items()]
        report.show(report.table(f"ptxas resources ({res.folder.name}), each column {' / '.join(archs)}",
                                 ["kernel", "regs", "spill st", "spill ld", "stack", "smem"], rows,
                                 {"left": ("kernel",)}))
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
    if res.problems:
        raise typer.Exit(EXIT_CHECK_FAILED)


# ----------------------------------------------------------------------------------------------- verify
def _kernel_list(value: str, allowed, refs: bool = False) -> list[str]:
    """--kernel's comma-separated names, each once; refs: KERNEL@REF names too (abi.kernel_ref checks them)."""
    from kdev import abi

    names = [k.strip() for k in value.split(",") if k.strip()]
    bad = [k for k in names if k not in allowed and not (refs and abi.kernel_ref(k) is not None)]
    if bad or not names:
        raise typer.BadParameter(f"unknown kernel {bad[0] if bad else value!r} (have {', '.join(allowed)})",
                                 param_hint="--kernel")
    return list(dict.fromkeys(names))


def _write_json_file(path: Optional[Path], doc: dict) -> None:
    if path:
        import json

        from kdev.fsutil import atomic_write_bytes

        atomic_write_bytes(path, json.dumps(report._jsonable(doc), indent=2, allow_nan=False).encode())


@app.command("verify")
@command
def verify_cmd(
    suite: str = typer.Option("smoke", "--suite", help="Suite name (under vectors/) or path of a suite folder."),
    kernel: str = typer.Option("naive,flash,flash-portable", "--kernel",
                               help="Comma-separated kernels: naive, flash, flash-portable (attention: flash-portable is the "
                                    "flash call run by the kernels that fit sm_120's shared memory); ddtree, accept, compact; "
                                    "KERNEL@REF: that kernel of another build (a library, a copy of kernels/, a git "
                                    "revision, a .patch of kernels/), compared with the first kernel, bits too."),
    case: Optional[list[str]] = typer.Option(None, "--case", help="Only these cases (repeatable)."),
    repeat: int = typer.Option(1, "--repeat", min=1, help="Run each kernel N times; outputs must be bit-identical."),
    fuzz: int = typer.Option(0, "--fuzz", min=0, help="Instead of a suite: N fresh random cases."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Fuzz seed (printed on every run; replays a failure)."),
    max_prefix: int = typer.Option(32768, "--max-prefix", min=0, help="Fuzz: largest prefix length."),
    max_nodes: Optional[int] = typer.Option(None, "--max-nodes", min=1, help="Fuzz: largest tree (default: kernel max)."),
    allow_stale: bool = typer.Option(False, "--allow-stale", help="Run vectors made by older reference sources."),
    library: Optional[Path] = typer.Option(None, "--library", help="Library (or its build folder) to load (default: "
                                           "build for this GPU)."),
    plan_gpu_name: Optional[str] = PlanGpuOpt,
    out_json: Optional[Path] = typer.Option(None, "--out-json", help="Also write the JSON document to this file."),
    json_out: bool = JsonOpt,
):
    """Compare the verify kernels with golden vectors (or fuzz cases): elementwise, token-exact, repeatable."""
    import secrets

    from kdev import abi, vectors, verify
    from kdev.plan import plan_target

    kernels = _kernel_list(kernel, (*abi.VERIFY_KERNELS, *verify.TREE_KERNELS), refs=True)
    plan_gpu = plan_target(plan_gpu_name) if plan_gpu_name else None
    # run_suite refuses a tampered, truncated, stale or drifted suite (exit 2) before it asks for a GPU (exit 3)
    if fuzz:
        from kdev import gpu

        gpu.require_cuda("kdev verify --fuzz")
        seed = seed if seed is not None else secrets.randbits(31)
        report.info(f"fuzz: {fuzz} cases, seed {seed} (replay with --fuzz {fuzz} --seed {seed})")
        with report.progress("fuzz", fuzz) as advance:
            run = verify.run_fuzz(fuzz, seed, kernels, max_prefix, max_nodes, repeat, library, report.info, advance,
                                  plan_gpu=plan_gpu)
    else:
        n = len(case) if case else len(vectors.open_suite(suite, allow_stale=True).cases)
        with report.progress(f"verify {suite}", n) as advance:
            run = verify.run_suite(suite, kernels, repeat, case, allow_stale, library, report.info, report.warn, advance,
                                   plan_gpu=plan_gpu)
    doc = {**run.record, "results": [r.to_dict() for r in run.results], "ledger": str(run.ledger_path),
           "saved_failures": run.saved_failures}
    _write_json_file(out_json, doc)
    if json_out:
        report.emit_json(doc)
    else:
        # a suite shows every case; a fuzz run (thousands of checks) its failures and one row per kernel
        shown = run.results if run.kind == "suite" else [r for r in run.results if not r.passed]
        rows = []
        for r in shown:
            vs = "" if r.against == "golden" else f" vs {r.against}"
            if r.out is None:  # an error, or an exact-equality kernel
                rows.append([r.case, r.kernel + vs, "-", "-", "-", r.error or r.note,
                             _pass_fail(r.passed)])
                continue
            rows.append([r.case, r.kernel + vs, report.fmt_float(r.out.max_abs), f"{r.out.cos_diff:.1e}",
                         report.fmt_float(r.lse.max_abs), r.token.label() + (", same bits" if r.note else ""),
                         _pass_fail(r.passed)])
        title = f"verify {run.record['suite']['name']} on {run.record['gpu']['name']} ({run.record['gpu']['arch']})"
        if plan_gpu:
            title += f", flash calls planned as for {plan_gpu.label}"
        columns = ["case", "kernel", "max |err| out", "cos diff", "max |err| lse", "token-exact", "verdict"]
        if rows:
            report.show(report.table(title, columns, rows, {"left": ("case", "kernel")}))
        if run.kind == "fuzz":
            report.show(report.table(f"{title}: worst over all cases", ["kernel", *columns[2:]],
                                     _worst_rows(run.results), {"left": ("kernel",)}))
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
        report.show(report.line(_pass_fail(run.passed, "PASS"), f" {summary}{seed_note}; ledger {run.ledger_path}"))
    if not run.passed:
        raise typer.Exit(EXIT_CHECK_FAILED)


def _pass_fail(passed: bool, word: str = "pass"):
    """pass (or PASS) in green, FAIL in red."""
    return report.styled(word, "green") if passed else report.styled("FAIL", "red")


def _verdict_mark(verdict: str):
    """FAST, SLOW or SAME against a baseline, coloured."""
    return report.styled(verdict, {"SLOW": "red", "FAST": "green"}.get(verdict, ""))


def _worst_rows(results) -> list[list]:
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


# ------------------------------------------------------------------------------------------------ bench
@app.command("bench")
@command
def bench_cmd(
    sweep: Optional[str] = typer.Option(None, "--sweep", help="Named sweep in configs/bench.yaml: smoke (the "
                                        "default), targets, small-trees, ddtree, tree-kernels, grid."),
    shape: Optional[list[str]] = ShapeOpt,
    axis: Optional[list[str]] = AxisOpt,
    backend: Optional[str] = typer.Option(None, "--backend", help="Comma-separated backends (default: bench.yaml): "
                                          "flash, flash-portable, naive, triton, torch-eager, torch-sdpa, and for the "
                                          "tree-kernels sweep ddtree-build, accept, compact; "
                                          "KERNEL@REF times that kernel of another build in the same run (REF: a library, "
                                          "a copy of kernels/, a git revision or a .patch of kernels/)."),
    peer: Optional[list[str]] = typer.Option(None, "--peer", help="External implementation module:function (repeatable)."),
    ceilings: bool = typer.Option(False, "--ceilings", help="Measure this GPU's mma.sync and copy ceilings; cache them."),
    loop: Optional[list[str]] = typer.Option(
        None, "--loop", help="With --ceilings: time only this rung of the flash loop ladder (repeatable), leave "
        "the cache alone (for a profiler run on one rung)."),
    baseline: Optional[Path] = typer.Option(None, "--baseline", help="Stored result to judge against: FAST/SAME/SLOW "
                                            "(a file, or a GPU of benchmarks/index.yaml: h200)."),
    normalize_by: Optional[str] = typer.Option(
        None, "--normalize-by", help="Judge each backend's time over this backend's (same shape, same run) "
        "against the baseline's ratio: cancels clock drift between runs (e.g. naive)."),
    from_file: Optional[Path] = typer.Option(None, "--from", help="Report a stored result instead of measuring."),
    csv_out: Optional[Path] = typer.Option(None, "--csv", help="Write the results as CSV."),
    plot_out: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG plot (needs matplotlib)."),
    plot_metric: str = typer.Option("time", "--plot-metric", help="time or roofline."),
    out_json: Optional[Path] = typer.Option(None, "--out-json", help="Also write the JSON document to this file."),
    seed: int = typer.Option(0, "--seed", help="Input seed."),
    config: Optional[Path] = typer.Option(None, "--config", help="Bench config (default: configs/bench.yaml)."),
    library: Optional[Path] = typer.Option(None, "--library", help="Library (or its build folder) to load (default: "
                                           "build for this GPU)."),
    plan_gpu_name: Optional[str] = PlanGpuOpt,
    graph: bool = typer.Option(False, "--graph", help="Time the replay of a CUDA graph holding one call (as a server "
                               "runs decode) instead of the eager launches."),
    json_out: bool = JsonOpt,
):
    """Time the verify kernels and peers at DDTree shapes against this GPU's ceilings (and, with the
    tree-kernels sweep, the DDTree build, accept and compaction kernels)."""
    from kdev.bench import command, render

    opts = command.BenchOptions(sweep, shape, axis, backend, peer, ceilings, loop, baseline, normalize_by, from_file,
                                csv_out, plot_out, plot_metric, out_json, seed, config, library, plan_gpu_name, graph)
    got = command.run(opts, report.info, report.progress)
    if got.doc is not None:
        _write_json_file(out_json, got.doc)
    code = render.show_outcome(got, opts, json_out)
    if code:
        raise typer.Exit(code)


# --------------------------------------------------------------------------------------------------- ab
@app.command("ab")
@command
def ab_cmd(
    against: Optional[str] = typer.Option(None, "--against", help="The base build: a git revision (default: main), a "
                                          "copy of kernels/, or a library or its build folder."),
    candidate: Optional[str] = typer.Option(None, "--candidate", help="Instead: the candidate build, judged against "
                                            "this one as the base; also a patch of kernels/ (variants/NAME.patch)."),
    kernel: str = typer.Option("flash", "--kernel", help="Comma-separated kernels to compare: naive, flash, "
                               "flash-portable."),
    sweep: Optional[str] = typer.Option(None, "--sweep", help="Named sweep in bench.yaml (default: targets)."),
    shape: Optional[list[str]] = ShapeOpt,
    axis: Optional[list[str]] = AxisOpt,
    fuzz: int = typer.Option(0, "--fuzz", min=0, help="Also N fresh random cases through both builds."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Fuzz and input seed."),
    min_change: float = typer.Option(0.01, "--min-change", min=0.0, help="Smallest relative change judged FAST or "
                                     "SLOW (beside three times the medians' noise; in one run that noise is a few "
                                     "tenths of a percent)."),
    library: Optional[Path] = typer.Option(None, "--library", help="This build's library (default: build for this "
                                           "GPU)."),
    config: Optional[Path] = typer.Option(None, "--config", help="Bench config (default: configs/bench.yaml)."),
    out_json: Optional[Path] = typer.Option(None, "--out-json", help="Also write the JSON document to this file."),
    json_out: bool = JsonOpt,
):
    """This build's kernels against another build's on this GPU, in one process: the machine code that changed, both
    on the golden vectors (and where they give the same bits), and their times at the same shapes in one run. The
    other build is the base (--against, default: main) or the candidate (--candidate)."""
    import secrets

    from kdev import ab, bench

    if against is not None and candidate is not None:
        raise typer.BadParameter("takes --against (the base) or --candidate, not both", param_hint="--candidate")
    ref = candidate if candidate is not None else (against or "main")
    kernels = list(dict.fromkeys(k.strip() for k in kernel.split(",") if k.strip()))
    ab.ref_names(kernels, ref, candidate is not None)  # names that name nothing: exit 2 before the GPU is asked for
    cfg = bench.load_bench(config)
    shapes = bench.expand(cfg, sweep or (None if shape else "targets"), shape, axis)
    seed = seed if seed is not None else secrets.randbits(31)
    title = f"{ref} against this build" if candidate is not None else f"this build against {ref}"
    with report.progress(f"ab: {title}", len(shapes) * (2 * len(kernels) + 1)) as advance:
        doc = ab.run_ab(ref, kernels, shapes, cfg, library, fuzz, seed, min_change, report.info, advance,
                        ref_is_candidate=candidate is not None)
    _write_json_file(out_json, doc)
    if json_out:
        report.emit_json(doc)
    else:
        for line in _ab_lines(doc):
            report.show(line)
        base_col, cand_col = ("this µs", f"{ref} µs") if candidate is not None else (f"{ref} µs", "this µs")
        report.show(report.table(f"{', '.join(kernels)}: {title}, one run on {doc['gpu']['name']}",
                                 ["shape", "kernel", base_col, cand_col, "change", "judged beyond", "verdict"],
                                 _ab_rows(doc), {"left": ("shape", "kernel")}))
        for r in doc["bench"]["results"]:
            if not r["agrees"]:
                report.error(f"{r['shape']} / {r['backend']}: {r['check']}")
    if not doc["passed"] or any(v["verdict"] == "SLOW" for v in doc["verdicts"]):
        raise typer.Exit(EXIT_CHECK_FAILED)


def _ab_rows(doc: dict) -> list[list]:
    """The timing part of a kdev ab document: one row per shape and kernel."""
    return [[v["shape"], v["backend"], f"{v['baseline_us']:.1f}", f"{v['current_us']:.1f}", f"{100 * v['change']:+.1f}%",
             f"±{100 * v['threshold']:.1f}%", _verdict_mark(v["verdict"])]
            for v in doc["verdicts"]]


def _ab_lines(doc: dict) -> list:
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
        lines.append(report.line(f"verify {v['suite']}: ", _pass_fail(v["passed"], "PASS"),
                                 f" {v['kernel']} and {v['against']}, {v['checks'] - v['failed']}/{v['checks']} checks "
                                 f"passed; same bits in {v['same_bits']} of {v['comparisons']} comparisons"))
        lines += [f"  {f['case']} / {f['kernel']} vs {f['against']}: {f['reason']}" for f in v["failures"]]
    return lines


# ------------------------------------------------------------------------------------------------- plan
@app.command("plan")
@command
def plan_cmd(
    sweep: Optional[str] = typer.Option(None, "--sweep", help="Named sweep in bench.yaml (default: targets)."),
    shape: Optional[list[str]] = ShapeOpt,
    axis: Optional[list[str]] = AxisOpt,
    gpu_name: Optional[str] = typer.Option(
        None, "--gpu", help="A GPU of configs/gpus.yaml (e.g. rtx-pro-6000, h200); default: the GPU here, else the "
        "deploy target's (configs/deploy.yaml target_arch)."),
    sms: Optional[int] = typer.Option(None, "--sms", help="Plan for this many SMs instead of the GPU's."),
    call: str = typer.Option("flash", "--call", help="flash or flash-portable (the kernels within sm_120's 99 KB)."),
    library: Optional[Path] = typer.Option(None, "--library", help="Library (or its build folder) to ask (default: "
                                           "the last build)."),
    config: Optional[Path] = typer.Option(None, "--config", help="Bench config for --sweep (default: configs/bench.yaml)."),
    costs: bool = typer.Option(False, "--costs", help="Also the planner's model cost of the choices it weighed "
                               "(full-tile and narrow split counts), the cheapest first, against the one it took."),
    json_out: bool = JsonOpt,
):
    """What the flash call launches at DDTree shapes on a GPU (no GPU needed): kernels, row tiles, KV splits, CTAs
    and waves, the caller's workspace, and the plan's slot use, row use and KV reads against the roofline floor."""
    from kdev import bench, build
    from kdev import plan as kplan

    if call not in kplan.CALLS:
        raise typer.BadParameter(f"must be one of {', '.join(kplan.CALLS)}", param_hint="--call")
    shapes = bench.expand(bench.load_bench(config), sweep or (None if shape else "targets"), shape, axis)
    gpu = kplan.resolve_gpu(gpu_name, sms)
    path = library or build.latest_library()
    if path is None:
        raise EnvironmentMissing("no library built (build/latest.json missing or damaged): run 'kdev build'")
    planner = kplan.PlanLibrary(build.library_file(Path(path)))
    stale = planner.stale_note()
    if stale:
        report.warn(stale)
    doc = kplan.plan(planner, shapes, gpu, call, costs)
    if json_out:
        report.emit_json(doc)
        return
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
    big = doc["largest_workspace"]
    if big and big["bytes"]:
        report.show(f"workspace the caller provides for these shapes: up to {big['bytes'] / mib:,.1f} MiB "
                    f"({big['bytes']:,} B, at {big['shape']})")


# ------------------------------------------------------------------------------------------------- sass
@app.command("sass")
@command
def sass_cmd(
    kernel: Optional[str] = typer.Option(None, "--kernel",
                                         help="Kernel name (or part of it); default: both flash kernels, or with "
                                              "--against every kernel."),
    arch: Optional[list[str]] = typer.Option(None, "--arch", help="Only these arch(s) (default: all embedded)."),
    library: Optional[str] = typer.Option(None, "--library", help="Library (or its build folder) to read (default: "
                                          "the last build); or a copy of kernels/, a git revision or a .patch of "
                                          "kernels/, built first for --arch (default: build.yaml's archs)."),
    against: Optional[str] = typer.Option(None, "--against",
                                          help="A base build, named as --library is: compare the machine code of "
                                               "each kernel with it instead (same, registers, changed, added, "
                                               "removed)."),
    expect_same: bool = typer.Option(False, "--expect-same",
                                     help="With --against: exit 1 unless every compared kernel's SASS is identical "
                                          "(other registers count as a difference)."),
    json_out: bool = JsonOpt,
):
    """The SASS schedule of a kernel's tensor-core loops: HMMA accumulator chains in flight and how far each
    HMMA's fragment load runs ahead of it, per arch, read from the built library (no GPU needed). With --against,
    which kernels' machine code differs from another build's."""
    from kdev import build as kbuild
    from kdev import sass

    if expect_same and against is None:
        raise typer.BadParameter("needs --against (the build to compare with)", param_hint="--expect-same")
    archs = _split_archs(arch)
    for ref in (library, against):  # a reference that names nothing is bad input, before any build is looked for
        if ref is not None and kbuild.describe_library_ref(ref) is None:
            raise BadInput(f"{ref}: {kbuild.NO_LIBRARY_REF}")
    if library is None and kbuild.latest_library() is None:
        raise EnvironmentMissing("no library: run 'kdev build' first, or pass --library")
    lib = _sass_library(library or str(kbuild.latest_library()), archs)
    if against is not None:
        _sass_compare(sass, _sass_library(against, archs), lib, "" if kernel is None else kernel, archs, expect_same,
                      json_out)
        return
    kernel = "verify_attn_flash" if kernel is None else kernel
    rows = sass.report(sass.parse(sass.dump(lib)), kernel, archs)
    if json_out:
        report.emit_json({"library": str(lib), "kernel": kernel, "loops": rows})
        return

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
    if not rows:
        report.warn(f"{kernel}: no loop with HMMA")
    report.show("chain: min / median HMMAs back to the one that wrote an HMMA's accumulator (about the chains "
                "in flight), chains: how many HMMAs at each distance; lead: min / median instructions from the "
                "LDSM / LDS of an HMMA's fragments to the HMMA; smem wf: 128-byte shared-memory wavefronts the "
                "loop's instructions move per warp and iteration, conflict-free, tensor copies not counted: hot path "
                "(stretches a branch skips without HMMA, and guarded instructions, left out: an estimate) / every "
                "instruction once (--json splits it by opcode); wf/HMMA: the hot path's per HMMA, where above ~1.7 a "
                "loop is bound by shared memory at the H200's mma.sync peak")


def _sass_library(ref: str, archs: Optional[list[str]]) -> Path:
    """The library file kdev sass reads for --library / --against: a library or its build folder as it is; a copy of
    kernels/, a git revision or a patch of kernels/ built first (kbuild.library_for: an A/B variant, cached by content)
    for the archs asked, else build.yaml's. A build that fails the resource gate is read all the same, with a warning:
    its spills are what one wants to see."""
    from kdev import build as kbuild
    from kdev import config

    if kbuild.describe_library_ref(ref) == "library":
        return kbuild.library_file(Path(ref))
    res = kbuild.library_for(ref, archs or list(config.load_build(None, None).archs), log=report.info)
    if res.problems:
        report.warn(f"{ref}: its build fails the resource gate ({res.problems[0]}); its SASS is read all the same")
    return res.library


def _sass_compare(sass, base: Path, lib: Path, kernel: str, archs, expect_same: bool, json_out: bool) -> None:
    """kdev sass --against: every matching kernel's machine code in lib against base's."""
    rows = sass.compare(sass.parse(sass.dump(base)), sass.parse(sass.dump(lib)), kernel, archs)
    differ = [r for r in rows if r["status"] != "same"]
    if json_out:
        report.emit_json({"library": str(lib), "against": str(base), "kernel": kernel, "same": not differ,
                          "kernels": rows})
    else:
        def change(a, b, fmt=str):  # "a" when equal, "a -> b" otherwise ("-" for a side that has no such kernel)
            a, b = ("-" if x is None else fmt(x) for x in (a, b))
            return a if a == b else f"{a} -> {b}"

        def loop_sizes(xs):
            return "/".join(map(str, xs)) or "none"

        if differ:  # identical kernels are counted in the summary line, not listed
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
    if expect_same and differ:
        raise typer.Exit(EXIT_CHECK_FAILED)


# ----------------------------------------------------------------------------------------- deploy-check
@app.command("clean")
@command
def clean_cmd(
    yes: bool = typer.Option(False, "--yes", help="Remove what is listed (without it: only list, a dry run)."),
    keep_records: int = typer.Option(1000, "--keep-records", min=1, help="Ledger records kept besides the newest "
                                     "passing one of each sources and arch."),
    json_out: bool = JsonOpt,
):
    """What builds, candidate trees, temps of killed runs and old ledger records take, and remove it with --yes."""
    from kdev import clean, project

    repo = project.require_root()
    items = clean.plan(repo, keep_records)
    if yes:
        clean.remove(items)
    if json_out:
        report.emit_json({**clean.summary(items), "removed": yes})
        return
    rows = [[str(i.path.relative_to(repo)), f"{i.bytes / 1e6:.1f}", i.why] for i in items]
    if rows:
        report.show(report.table("kdev clean" + ("" if yes else " (dry run: --yes removes)"),
                                 ["path", "MB", "why"], rows, {"left": ("path", "why")}))
    total = sum(i.bytes for i in items) / 1e6
    report.show(f"{'removed' if yes else 'would remove'} {len(items)} item(s), {total:.1f} MB"
                if items else "nothing to clean")


@app.command("deploy-check")
@command
def deploy_check_cmd(
    repo: Optional[Path] = typer.Option(None, "--repo", help="Checkout to check (default: the one around the current "
                                        "directory)."),
    target: Optional[str] = typer.Option(None, "--target", help="Deploy target arch (default: configs/deploy.yaml)."),
    strict: bool = typer.Option(False, "--strict", help="Warnings fail too."),
    require_gpu: bool = typer.Option(False, "--require-gpu", help="No GPU (or no NVML) fails instead of warning."),
    json_out: bool = JsonOpt,
):
    """Git, build provenance, vectors, verification record and GPU state before a deploy."""
    from kdev import deploy

    from kdev import project

    if target is not None and not (target.startswith("sm_") and target[3:].rstrip("a").isdigit()):
        raise typer.BadParameter(f"{target!r} is not an arch like sm_120", param_hint="--target")
    if repo is None:
        repo = project.require_root()
    elif not project.is_checkout(repo):
        raise BadInput(f"--repo {repo}: not a kdev checkout (no {project.MARKERS[0]} and {project.MARKERS[1]})")
    probes, cfg = deploy.run_checks(repo, target, require_gpu)
    failed = [p for p in probes if p.status == deploy.FAIL or (strict and p.status == deploy.WARN)]
    if json_out:
        report.emit_json({"repo": str(repo.resolve()), "target_arch": cfg.target_arch, "strict": strict,
                          "ok": not failed, "probes": [p.to_dict() for p in probes]})
    else:
        status = {deploy.PASS: ("pass", "green"), deploy.WARN: ("warn", "yellow"), deploy.FAIL: ("FAIL", "red")}
        rows = [[p.name, report.styled(*status[p.status]), p.reason] for p in probes]
        report.show(report.table(f"deploy-check {repo.resolve()} -> {cfg.target_arch}", ["probe", "status", "reason"],
                                 rows, {"left": ("probe", "status", "reason")}))
        git = next((p for p in probes if p.name == "git"), None)
        if git and git.details.get("last_commits"):
            report.show("last commits:\n  " + "\n  ".join(git.details["last_commits"]))
        report.show(report.styled("ready to deploy", "green") if not failed else
                    report.line(report.styled("not ready", "red"),
                                f": {len(failed)} probe(s) failed" + (" (--strict)" if strict else "")))
    if failed:
        raise typer.Exit(EXIT_CHECK_FAILED)


# ---------------------------------------------------------------------------------------------------- all
@app.command("all")
@command
def all_cmd(
    suite: str = typer.Option("smoke", "--suite", help="The suite gen-refs checks and verify runs."),
    sweep: str = typer.Option("smoke", "--sweep", help="The bench sweep."),
    json_out: bool = JsonOpt,
):
    """The whole loop in order: gen-refs --check, build, verify, bench (smoke sweep), deploy-check.
    Stops at the first failing stage; GPU stages are reported as skipped (not passed) without a GPU."""
    import subprocess
    import sys

    import torch

    have_gpu = torch.cuda.is_available()
    stages = [("gen-refs", ["gen-refs", "--suite", suite, "--check"], False),
              ("build", ["build"], False),
              ("verify", ["verify", "--suite", suite], True),
              ("bench", ["bench", "--sweep", sweep], True),
              ("deploy-check", ["deploy-check"], False)]
    results, code = [], 0
    for name, args, needs_gpu in stages:
        if needs_gpu and not have_gpu:
            results.append({"stage": name, "status": "skipped", "reason": "no CUDA GPU", "exit_code": None})
            report.info(report.line(report.styled("skip", "yellow"), f" {name}: no CUDA GPU"))
            continue
        report.info(report.line(report.styled(f"== {name}", "bold"), f": kdev {' '.join(args)}"))
        proc = subprocess.run([sys.executable, "-m", "kdev", *args],
                              stdout=subprocess.DEVNULL if json_out else None)
        ok = proc.returncode == 0
        results.append({"stage": name, "status": "passed" if ok else "failed", "exit_code": proc.returncode})
        if not ok:
            code = proc.returncode
            break
    done = {r["stage"] for r in results}
    results += [{"stage": n, "status": "not run", "exit_code": None} for n, _, _ in stages if n not in done]
    if json_out:
        report.emit_json({"ok": code == 0, "stages": results})
    else:
        style = {"passed": ("passed", "green"), "failed": ("FAILED", "red"), "skipped": ("skipped", "yellow"),
                 "not run": ("not run", "")}
        report.show(report.table("kdev all", ["stage", "status", "exit"],
                                 [[r["stage"], report.styled(*style[r["status"]]),
                                   "-" if r["exit_code"] is None else r["exit_code"]]
                                  for r in results], {"left": ("stage", "status")}))
    if code:
        raise typer.Exit(code)


# The command list shows each command's first paragraph; Typer's rich help would keep the docstring's line breaks
# there (it joins them only in a command's own --help), so the list gets them joined.
for _info in app.registered_commands:
    if _info.short_help is None and _info.callback.__doc__:
        _info.short_help = " ".join(inspect.cleandoc(_info.callback.__doc__).split("\n\n")[0].split())


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where the program is so that every `finally` runs: temp files and folders are removed
    and child compilers killed as for Ctrl-C (the default action would end the process on the spot)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum, self.signal_name = signum, signal.Signals(signum).name


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def _placeholders() -> None:
    """Help shows what an option takes in words, not Python types: a flag takes nothing (`--force`, never
    `--force <bool>`), a number N or X, a path PATH, anything else its option's name (`--arch ARCH`); a repeatable or
    comma-separated option says so."""
    import typing

    for info in app.registered_commands:
        fn = inspect.unwrap(info.callback)
        hints = typing.get_type_hints(fn)
        for name, param in inspect.signature(fn).parameters.items():
            opt = param.default
            if not isinstance(opt, typer.models.OptionInfo) or opt.metavar is not None:
                continue
            kind = hints.get(name)
            args = [a for a in typing.get_args(kind) if a is not type(None)]
            base = args[0] if args else kind
            many = typing.get_origin(base) is list
            base = typing.get_args(base)[0] if many else base
            long = next((d for d in [opt.default, *(opt.param_decls or ())] if isinstance(d, str) and
                         d.startswith("--")), f"--{name}")
            word = {bool: "", int: "N", float: "X", Path: "PATH"}.get(base, long[2:].upper().replace("-", "_"))
            opt.metavar = f"{word}..." if many and word else word


_placeholders()


def main():
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_terminated)
    app()
