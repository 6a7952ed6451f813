"""The commands of the loop: gen-refs, build, verify, bench, ab (see kdev/cli/__init__.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kdev import registry, report
from kdev.cli import AxisOpt, GpusOpt, JsonOpt, PlanGpuOpt, ShapeOpt, WorkerTimeoutOpt, app, check_device, command
from kdev.cli import kernel_list, run_on_gpus, split_archs, write_json_file
from kdev.cli import views
from kdev.errors import EXIT_CHECK_FAILED, BadInput

# ------------------------------------------------------------------------------------------------ gen-refs
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

    check_device(device)
    spec = cfg.load_suite(suite, config)
    root = out or vectors.default_vectors_root()
    if check:
        disk = vectors.open_suite(str(out / suite) if out else suite, allow_stale=True)  # generated, else shipped
        with report.progress(f"check {suite}", len(spec.cases)) as advance:
            problems = vectors.check_suite(spec, disk, device, progress=advance)
        if json_out:
            report.emit_json({"suite": suite, "path": str(disk.path), "cases": len(spec.cases), "ok": not problems,
                              "stale": disk.stale, "problems": problems})
        else:
            views.show_suite_check(suite, len(spec.cases), disk.path, problems)
        if problems:
            raise typer.Exit(EXIT_CHECK_FAILED)
        return
    with report.progress(f"gen-refs {suite}", len(spec.cases)) as advance:
        manifest = vectors.write_suite(spec, root, force=force, device=device, progress=advance)
    if json_out:
        report.emit_json({"suite": suite, "path": str(root / suite), "cases": [c["name"] for c in manifest["cases"]],
                          "bytes": sum(c["bytes"] for c in manifest["cases"]),
                          "generator_hash": manifest["generator_hash"]})
    else:
        views.show_suite_written(suite, root / suite, manifest)


# --------------------------------------------------------------------------------------------------- build
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
    from kdev import refs

    if kernels is not None and refs.describe_library_ref(str(kernels)) == "patch":
        kernels = refs.patch_kernels(kernels)  # build/ab-patch-<hash>/kernels, written once
    elif kernels is not None and not (kernels / "include").is_dir():
        raise BadInput(f"{kernels}: not a copy of kernels/ (no include/ folder) nor a patch of it")
    bc = cfg.load_build(config, split_archs(arch))
    res = kbuild.build(bc, force=force, log=report.info, variant=kernels is not None,
                       kernel_dir=kernels.resolve() if kernels is not None else kbuild.KERNEL_DIR)
    if json_out:
        report.emit_json({**res.to_dict(), "ok": not res.problems})
    else:
        views.show_build(res, verbose)
    if res.problems:
        raise typer.Exit(EXIT_CHECK_FAILED)


# -------------------------------------------------------------------------------------------------- verify
@app.command("verify")
@command
def verify_cmd(
    ctx: typer.Context,
    suite: str = typer.Option("smoke", "--suite", help="Suite name (under vectors/) or path of a suite folder."),
    kernel: str = typer.Option(",".join(registry.VERIFIED_BY_DEFAULT), "--kernel",
                               help="Comma-separated kernels. Attention: " + registry.describe() + ". The DDTree "
                                    "kernels: ddtree, accept, compact. KERNEL@REF: that kernel of another build (a "
                                    "library, a copy of kernels/, a git revision, a .patch of kernels/), compared with "
                                    "the first kernel, bits too."),
    case: Optional[list[str]] = typer.Option(None, "--case", help="Only these cases (repeatable)."),
    repeat: int = typer.Option(1, "--repeat", min=1, help="Run each kernel N times; outputs must be bit-identical."),
    fuzz: int = typer.Option(0, "--fuzz", min=0, help="Instead of a suite: N fresh random cases."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Fuzz seed (printed on every run; replays a failure)."),
    max_prefix: int = typer.Option(32768, "--max-prefix", min=0, help="Fuzz: largest prefix length."),
    max_nodes: Optional[int] = typer.Option(None, "--max-nodes", min=1, help="Fuzz: largest tree (default: kernel max)."),
    kv_cache: str = typer.Option("bf16", "--kv-cache", help="Fuzz: the KV cache's dtype, bf16 or e4m3 (kdtree.h: "
                                 "value x kv_scale), or mixed (each case draws one)."),
    allow_stale: bool = typer.Option(False, "--allow-stale", help="Run vectors made by older reference sources."),
    library: Optional[Path] = typer.Option(None, "--library", help="Library (or its build folder) to load (default: "
                                           "build for this GPU)."),
    plan_gpu_name: Optional[str] = PlanGpuOpt,
    gpus: Optional[str] = GpusOpt,
    worker_timeout: float = WorkerTimeoutOpt,
    out_json: Optional[Path] = typer.Option(None, "--out-json", help="Also write the JSON document to this file."),
    json_out: bool = JsonOpt,
):
    """Compare the verify kernels with golden vectors (or fuzz cases): elementwise, token-exact, repeatable."""
    import secrets

    from kdev import abi, fleet, vectors, verify
    from kdev.plan import plan_target

    kernels = kernel_list(kernel, (*abi.VERIFY_KERNELS, *verify.TREE_KERNELS), refs=True)
    plan_gpu = plan_target(plan_gpu_name) if plan_gpu_name else None
    if gpus is not None and not fuzz:
        verify.open_checked_suite(suite, allow_stale)  # a bad suite: exit 2 before the GPUs are asked for
    several = fleet.plan(gpus)
    if several is not None:
        return run_on_gpus(ctx, "verify", several, library, worker_timeout, out_json, json_out)
    # run_suite refuses a tampered, truncated, stale or drifted suite (exit 2) before it asks for a GPU (exit 3)
    if kv_cache not in verify.FUZZ_KV_CACHES:
        raise typer.BadParameter(f"must be one of {', '.join(verify.FUZZ_KV_CACHES)}", param_hint="--kv-cache")
    if kv_cache != "bf16" and not fuzz:
        raise typer.BadParameter("takes --fuzz (a suite's cases state their own cache)", param_hint="--kv-cache")
    if fuzz:
        from kdev import gpu

        gpu.require_cuda("kdev verify --fuzz")
        seed = seed if seed is not None else secrets.randbits(31)
        report.info(f"fuzz: {fuzz} cases, seed {seed} (replay with --fuzz {fuzz} --seed {seed})")
        with report.progress("fuzz", fuzz) as advance:
            run = verify.run_fuzz(fuzz, seed, kernels, max_prefix, max_nodes, repeat, library, report.info, advance,
                                  failures_root=fleet.failures_root(), write_ledger=not fleet.in_worker(),
                                  plan_gpu=plan_gpu, kv_cache=kv_cache)
    else:
        n = len(case) if case else len(vectors.open_suite(suite, allow_stale=True).cases)
        with report.progress(f"verify {suite}", n) as advance:
            run = verify.run_suite(suite, kernels, repeat, case, allow_stale, library, report.info, report.warn, advance,
                                   write_ledger=not fleet.in_worker(), plan_gpu=plan_gpu)
    doc = {**run.record, "results": [r.to_dict() for r in run.results], "ledger": str(run.ledger_path),
           "saved_failures": run.saved_failures}
    write_json_file(out_json, doc)
    if json_out:
        report.emit_json(doc)
    else:
        views.show_verify(run, plan_gpu)
    if not run.passed:
        raise typer.Exit(EXIT_CHECK_FAILED)


# --------------------------------------------------------------------------------------------------- bench
@app.command("bench")
@command
def bench_cmd(
    ctx: typer.Context,
    sweep: Optional[str] = typer.Option(None, "--sweep", help="Named sweep in configs/bench.yaml: smoke (the "
                                        "default), targets, engine, replay, small-trees, ddtree, tree-kernels, grid."),
    shape: Optional[list[str]] = ShapeOpt,
    axis: Optional[list[str]] = AxisOpt,
    backend: Optional[str] = typer.Option(None, "--backend", help="Comma-separated backends (default: bench.yaml). "
                                          "The verify calls (" + registry.describe() + "): a scheduled call makes "
                                          "its schedule in each timed call, and " + ", ".join(registry.LAYER_BACKENDS)
                                          + " time it made once, as every layer of a step reads it; the peers triton, "
                                          "torch-eager, torch-sdpa, torch-flex; for the tree-kernels sweep "
                                          "ddtree-build, accept, compact; "
                                          "KERNEL@REF times that kernel of another build in the same run (REF: a library, "
                                          "a copy of kernels/, a git revision or a .patch of kernels/)."),
    peer: Optional[list[str]] = typer.Option(None, "--peer", help="External implementation module:function (repeatable)."),
    ceilings: bool = typer.Option(False, "--ceilings", help="Measure this GPU's mma.sync and copy ceilings (and "
                                  "wgmma's, with a library built for sm_90a); cache them."),
    loop: Optional[list[str]] = typer.Option(
        None, "--loop", help="With --ceilings: time only this rung of the flash loop ladder (repeatable), leave "
        "the cache alone (for a profiler run on one rung)."),
    baseline: Optional[Path] = typer.Option(None, "--baseline", help="Stored result to judge against: FAST/SAME/SLOW "
                                            "(a file, or a GPU of benchmarks/index.yaml: h200)."),
    normalize_by: Optional[str] = typer.Option(
        None, "--normalize-by", metavar="BACKEND", help="Judge each backend's time over this backend's (same shape, same run) "
        "against the baseline's ratio: cancels clock drift between runs (e.g. naive)."),
    from_file: Optional[Path] = typer.Option(None, "--from", help="Report a stored result instead of measuring."),
    csv_out: Optional[Path] = typer.Option(None, "--csv", help="Write the results as CSV."),
    plot_out: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG plot (needs matplotlib)."),
    plot_metric: str = typer.Option("time", "--plot-metric", metavar="METRIC", help="time or roofline."),
    out_json: Optional[Path] = typer.Option(None, "--out-json", help="Also write the JSON document to this file."),
    seed: int = typer.Option(0, "--seed", help="Input seed."),
    config: Optional[Path] = typer.Option(None, "--config", help="Bench config (default: configs/bench.yaml)."),
    library: Optional[Path] = typer.Option(None, "--library", help="Library (or its build folder) to load (default: "
                                           "build for this GPU)."),
    plan_gpu_name: Optional[str] = PlanGpuOpt,
    graph: bool = typer.Option(False, "--graph", help="Time the replay of a CUDA graph holding one call (as a server "
                               "runs decode) instead of the eager launches."),
    gpus: Optional[str] = GpusOpt,
    worker_timeout: float = WorkerTimeoutOpt,
    json_out: bool = JsonOpt,
):
    """Time the verify kernels and peers at DDTree shapes against this GPU's ceilings (and, with the
    tree-kernels sweep, the DDTree build, accept and compaction kernels)."""
    from kdev import fleet
    from kdev.bench import command, render

    several = None if from_file is not None else fleet.plan(gpus)
    if several is not None:
        if baseline or csv_out or plot_out:
            raise typer.BadParameter("--baseline, --csv and --plot take one GPU: name it (--gpus N)", param_hint="--gpus")
        return run_on_gpus(ctx, "bench", several, library, worker_timeout, out_json, json_out)

    opts = command.BenchOptions(sweep, shape, axis, backend, peer, ceilings, loop, baseline, normalize_by, from_file,
                                csv_out, plot_out, plot_metric, out_json, seed, config, library, plan_gpu_name, graph)
    got = command.run(opts, report.info, report.progress)
    if got.doc is not None:
        write_json_file(out_json, got.doc)
    code = render.show_outcome(got, opts, json_out)
    if code:
        raise typer.Exit(code)


# ------------------------------------------------------------------------------------------------------ ab
@app.command("ab")
@command
def ab_cmd(
    against: Optional[str] = typer.Option(None, "--against", help="The base build: a git revision (default: main), a "
                                          "copy of kernels/, or a library or its build folder."),
    candidate: Optional[str] = typer.Option(None, "--candidate", help="Instead: the candidate build, judged against "
                                            "this one as the base; also a patch of kernels/ (variants/NAME.patch)."),
    kernel: str = typer.Option(registry.DEFAULT, "--kernel", help="Comma-separated kernels to compare: "
                               + ", ".join(registry.VERIFY_KERNELS) + "."),
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
    write_json_file(out_json, doc)
    if json_out:
        report.emit_json(doc)
    else:
        views.show_ab(doc, ref, kernels, candidate is not None)
    if not doc["passed"] or any(v["verdict"] == "SLOW" for v in doc["verdicts"]):
        raise typer.Exit(EXIT_CHECK_FAILED)
