"""The commands around the loop: plan, sass, e2e, clean, deploy-check, all, help (see kdev/cli/__init__.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kdev import registry, report
from kdev.cli import AxisOpt, GpusOpt, JsonOpt, ParameterSource, ShapeOpt, app, command, split_archs, views
from kdev.errors import EXIT_CHECK_FAILED, BadInput, EnvironmentMissing

# ---------------------------------------------------------------------------------------------------- plan
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
    call: str = typer.Option(registry.HOPPER, "--call", help=f"{registry.HOPPER} or {registry.PORTABLE} (the kernels "
                             "within sm_120's 99 KB)."),
    library: Optional[Path] = typer.Option(None, "--library", help="Library (or its build folder) to ask (default: "
                                           "the last build)."),
    config: Optional[Path] = typer.Option(None, "--config", help="Bench config for --sweep (default: configs/bench.yaml)."),
    costs: bool = typer.Option(False, "--costs", help="Also the planner's model cost of the choices it weighed "
                               "(full-tile and narrow split counts), the cheapest first, against the one it took."),
    project: bool = typer.Option(False, "--project", help="Project the call's time on the GPU from its arch's SASS "
                                 "and rates, with constants fitted on measured GPUs (docs/projection.md)."),
    calibrate: Optional[list[Path]] = typer.Option(
        None, "--calibrate", help="With --project: a field report (kdev field-report) or bench result: how far the "
        "projection was off on its calls, and after its points join the fit (repeatable)."),
    json_out: bool = JsonOpt,
):
    """What the flash call launches at DDTree shapes on a GPU (no GPU needed): kernels, row tiles, KV splits, CTAs
    and waves, the caller's workspace, and the plan's slot use, row use and KV reads against the roofline floor."""
    from kdev import bench, build
    from kdev import plan as kplan

    if call not in kplan.CALLS:
        raise typer.BadParameter(f"must be one of {', '.join(kplan.CALLS)}", param_hint="--call")
    if project and not shape and not any(a.split("=")[0].strip().lower() in ("page_size", "page", "p")
                                         for a in axis or []):
        axis = [*(axis or []), "page_size=1,64"]  # a projection is asked of both paths an engine takes
    shapes = bench.expand(bench.load_bench(config), sweep or (None if shape else "targets"), shape, axis)
    gpu = kplan.resolve_gpu(gpu_name, sms)
    path = library or build.latest_library()
    if path is None:
        raise EnvironmentMissing(build.missing_default_library())
    planner = kplan.PlanLibrary(build.library_file(Path(path)))
    stale = planner.stale_note()
    if stale:
        report.warn(stale)
    if calibrate and not project:
        raise typer.BadParameter("takes --project", param_hint="--calibrate")
    if project:
        from kdev import projection

        doc = projection.run(planner, shapes, gpu, call, calibrate or [])
        report.emit_json(doc) if json_out else views.show_projection(doc)
        return
    doc = kplan.plan(planner, shapes, gpu, call, costs)
    # the KV context this GPU holds for the deploy's model (configs/steps), bf16 and e4m3 caches, per attention layout
    doc["context"] = kplan.context_capacity(gpu) if gpu.memory_bytes else None
    if json_out:
        report.emit_json(doc)
    else:
        views.show_plan(doc, gpu, call, costs)
        views.show_context(doc["context"])


# ---------------------------------------------------------------------------------------------------- sass
@app.command("sass")
@command
def sass_cmd(
    kernel: Optional[str] = typer.Option(None, "--kernel",
                                         help="Kernel name (or part of it); default: verify_attn_flash, every "
                                              "kernel of the flash family (one table each), or with --against every "
                                              "kernel."),
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
    from kdev import refs, sass

    if expect_same and against is None:
        raise typer.BadParameter("needs --against (the build to compare with)", param_hint="--expect-same")
    archs = split_archs(arch)
    for ref in (library, against):  # a reference that names nothing is bad input, before any build is looked for
        if ref is not None and refs.describe_library_ref(ref) is None:
            raise BadInput(f"{ref}: {refs.NO_LIBRARY_REF}")
    # the last build of exactly these archs (kdev build --arch sm_90 names its own), else build.yaml's
    latest = (archs and kbuild.latest_library(archs=archs)) or kbuild.latest_library()
    if library is None and latest is None:
        raise EnvironmentMissing("no library: run 'kdev build' first, or pass --library")
    lib = _sass_library(library or str(latest), archs)
    if against is not None:
        base, kernel = _sass_library(against, archs), kernel or ""
        rows = sass.compare(sass.parse(sass.dump(base)), sass.parse(sass.dump(lib)), kernel, archs)
        same = all(r["status"] == "same" for r in rows)
        if json_out:
            report.emit_json({"library": str(lib), "against": str(base), "kernel": kernel, "same": same,
                              "kernels": rows})
        else:
            views.show_sass_compare(rows, base, lib, kernel)
        if expect_same and not same:
            raise typer.Exit(EXIT_CHECK_FAILED)
        return
    kernel = "verify_attn_flash" if kernel is None else kernel
    functions = sass.parse(sass.dump(lib))
    rows = sass.report(functions, kernel, archs)
    wgmma_rows = sass.wgmma_report(functions, kernel, archs)
    if json_out:
        report.emit_json({"library": str(lib), "kernel": kernel, "loops": rows, "wgmma_loops": wgmma_rows})
    else:
        views.show_loops(rows, lib, kernel, wgmma_rows)


def _sass_library(ref: str, archs: Optional[list[str]]) -> Path:
    """The library file kdev sass reads for --library / --against: a library or its build folder as it is; a copy of
    kernels/, a git revision or a patch of kernels/ built first (refs.library_for: an A/B variant, cached by content)
    for the archs asked, else build.yaml's. A build that fails the resource gate is read all the same, with a warning:
    its spills are what one wants to see."""
    from kdev import build as kbuild
    from kdev import config, refs

    if refs.describe_library_ref(ref) == "library":
        return kbuild.library_file(Path(ref))
    res = refs.library_for(ref, archs or list(config.load_build(None, None).archs), log=report.info)
    if res.problems:
        report.warn(f"{ref}: its build fails the resource gate ({res.problems[0]}); its SASS is read all the same")
    return res.library


# --------------------------------------------------------------------------------------------------------- e2e
@app.command("field-report")
@command
def field_report_cmd(
    out: Path = typer.Option(..., "--out", help="The report to write (one JSON file: the only thing to send)."),
    fuzz: int = typer.Option(200, "--fuzz", help="Fresh random cases for the fuzz step."),
    sweep: str = typer.Option("targets", "--sweep", help="The bench sweep, timed at page sizes 1 and 64."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists."),
):
    """On a machine with the GPU: build for its arch, verify (smoke and fuzz), the sanitizers, the ceilings and the
    bench targets at page sizes 1 and 64 with NVML's clocks and power sampled throughout, into one JSON file that
    `kdev plan --project --calibrate FILE` takes as a calibration point."""
    from kdev import field_report

    def progress(step, result):
        rc = result["rc"]
        report.info(report.line(f"{step.name}: ", views.pass_fail(rc == 0, "ok"),
                                f" ({'timed out' if rc is None else f'exit {rc}'}, {result['seconds']:.0f} s)"))

    doc = field_report.collect(out, fuzz, sweep, force, progress=progress)
    views.show_field_report(doc, out)
    if field_report.failed_steps(doc):
        raise typer.Exit(EXIT_CHECK_FAILED)


@app.command("e2e")
@command
def e2e_cmd(
    ctx: typer.Context,
    prompts: Optional[int] = typer.Option(None, "--prompts", min=1, help="Prompts decoded side by side (ragged "
                                          "lengths), in every case of the matrix (default: each case's own, 1 to 3)."),
    rounds: Optional[int] = typer.Option(None, "--rounds", min=1, help="Speculative rounds per prompt, in every case "
                                         "(default: each case's own, 3 to 5)."),
    budget: Optional[str] = typer.Option(None, "--budget", help="Node budgets, comma-separated (e.g. 1,16,64,256), "
                                         "in every case (default: each case's own: 16,64,256 at pages of 64)."),
    page_size: Optional[int] = typer.Option(None, "--page-size", help="Tokens per page of the latent cache, in every "
                                            "case (default: 64, and 1 in one case)."),
    position_offset: Optional[int] = typer.Option(None, "--position-offset", min=0, help="Added to every RoPE "
                                                  "position, the oracle's too, in every case (default: 0, and 5000 in "
                                                  "one case: positions past 4,096 with Kimi K2's YaRN)."),
    backend: Optional[str] = typer.Option(None, "--backend", help="Verify attentions, comma-separated, each run on "
                                          "every case: reference (float64: the bound is near machine precision), "
                                          "bf16-emulated (the kernels' bf16 arithmetic on any device), or a verify call "
                                          "(bf16 kernels, CUDA; a scheduled one makes its schedule once per forward): "
                                          + registry.describe() + ". Default: reference,bf16-emulated on cpu, "
                                          "reference and the engine calls on cuda."),
    full: bool = typer.Option(False, "--full", help="The fuller matrix: budgets 1..512, pages of 16, a real prefix of "
                              "4K+ tokens, 64 heads (minutes of CPU; docs/e2e.md)."),
    depth: int = typer.Option(8, "--depth", help="Drafter depths after the root."),
    topk: int = typer.Option(4, "--topk", help="Drafter tokens per depth."),
    agree: float = typer.Option(0.7, "--agree", help="How often the drafter's first token is the target's (0..1)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda (the kernels need cuda)."),
    seed: int = typer.Option(0, "--seed", help="Added to each case's seed: prompts, drafter and cache layout."),
    threads: int = typer.Option(1, "--threads", min=1, help="CPU threads for torch (the work is many small ops: more "
                                "threads cost several times the CPU for little wall time)."),
    graph: bool = typer.Option(False, "--graph", help="Capture each budget's verify forward in a CUDA graph and replay "
                               "it every round, as a server does (kernel backends on cuda; the verify attention is "
                               "then not timed apart from the forward, and RoPE is transformers' function on the "
                               "model's float64 table)."),
    acceptance: Optional[Path] = typer.Option(
        None, "--acceptance", help="Instead of decoding: the budget curve of a real deploy from this acceptance curve "
        "(YAML: tokens_per_round by budget, e.g. measured in production), --attention and --step-costs."),
    attention: Optional[Path] = typer.Option(None, "--attention", help="With --acceptance: a kdev bench result with "
                                             "the verify attention's times over the budgets at --batch/--prefix "
                                             "(default: kdev plan --project's range on the cost model's GPU)."),
    step_costs: Optional[Path] = typer.Option(None, "--step-costs", help="With --acceptance: the rest of a step's "
                                              "cost model (default: configs/steps/kimi-k2.6-rtx-pro-6000-tp8.yaml)."),
    batch: int = typer.Option(1, "--batch", min=1, help="With --acceptance: requests per step."),
    prefix: int = typer.Option(32768, "--prefix", min=0, help="With --acceptance: tokens of each request's prefix."),
    topology: str = typer.Option("tp", "--topology", help="With --acceptance: tp (tensor parallel over every GPU) or "
                                 "dp-ep (attention data parallel, experts spread over the GPUs)."),
    plot_out: Optional[Path] = typer.Option(None, "--plot", help="With --acceptance: a PNG of tokens/s by budget."),
    out_json: Optional[Path] = typer.Option(None, "--out-json", help="Also write the JSON document to this file."),
    json_out: bool = JsonOpt,
):
    """Tree speculative decoding on a small MLA model (transformers' DeepSeek-V3, its attention swapped for kdev's)
    against plain greedy decoding of the same model: at every accepted and bonus position the logits, within the
    bound of the precision (docs/e2e.md), and the tokens; a matrix of cases (pages, trees, positions), each under
    float64 and the kernels' bf16. With --acceptance, the budget curve of a real deploy instead."""
    import dataclasses

    from kdev.cli import check_device, write_json_file
    from kdev.e2e import oracle, run, verdict
    from kdev.e2e.adapter import BACKENDS, EMULATED

    check_device(device)
    budgets = None
    if budget is not None:
        try:
            budgets = tuple(int(b) for b in budget.split(",") if b.strip())
        except ValueError:
            raise BadInput(f"--budget {budget!r}: whole numbers, comma-separated") from None
        if not budgets:
            raise BadInput(f"--budget {budget!r}: no budget given (whole numbers, comma-separated, e.g. 1,16,64)")
    backends = tuple(b.strip() for b in backend.split(",") if b.strip()) if backend is not None else None
    for b in backends or ():
        if b not in BACKENDS:
            raise BadInput(f"--backend {b!r}: one of {', '.join(BACKENDS)}")
    if backends is not None and not backends:
        raise BadInput(f"--backend {backend!r}: no backend given")
    # the deploy curve's own options do nothing to a decoding run: refused rather than ignored
    given = ctx.get_parameter_source
    deploy_only = [opt for name, opt in (("attention", "--attention"), ("step_costs", "--step-costs"),
                                        ("batch", "--batch"), ("prefix", "--prefix"), ("plot_out", "--plot"),
                                        ("topology", "--topology"))
                   if given(name) not in (None, ParameterSource.DEFAULT)]
    if acceptance is None and deploy_only:
        raise BadInput(f"{', '.join(deploy_only)}: only with --acceptance (the budget curve of a deploy); "
                       "without it kdev e2e decodes on a small model")
    if acceptance is not None:
        b = backends[0] if backends else "reference"
        _deploy_curve(acceptance, attention, step_costs, budgets, batch, prefix, b, topology, plot_out, out_json,
                      json_out)
        return
    if graph and device != "cuda":
        raise BadInput("--graph: CUDA graphs of a kernel backend, on --device cuda")
    if backends is None:
        backends = ("reference", EMULATED) if device == "cpu" else ("reference", *registry.ENGINE)
        backends = backends if not graph else tuple(registry.ENGINE)
    for b in backends:
        if b not in ("reference", EMULATED) and device != "cuda":
            raise BadInput(f"--backend {b}: a kernel, which runs on --device cuda")
    if device == "cpu":
        import torch

        torch.set_num_threads(threads)
    overrides = {k: v for k, v in (("prompts", prompts), ("rounds", rounds), ("budgets", budgets),
                                   ("page_size", page_size), ("position_offset", position_offset)) if v is not None}
    cases = [dataclasses.replace(c, depth=depth, topk=topk, agree=agree, graph=graph, seed=c.seed + seed)
             for c in run.matrix(backends, full, **overrides)]
    for c in cases:
        c.check(oracle.tiny_config(oracle.TinyModel(heads=c.heads)))
    report.info(f"e2e: {len(cases)} case(s) x their budgets, {', '.join(backends)}; the oracle's greedy decoding "
                "first")
    models: dict = {}
    with report.progress("e2e", run.work(cases)) as advance:
        results = run.run_matrix(cases, device, advance, models)
    rope = oracle.rope_agreement(next(iter(models.values())))
    doc = {"cases": [{**c.__dict__, "label": c.label()} for c in cases],
           "bounds": {"f64_rel": verdict.F64_REL, "bf16_rel": verdict.BF16_REL, "shared_rel": verdict.SHARED_REL,
                      "sigmas": verdict.SIGMAS, "propagation": verdict.PROPAGATION},
           "rope_vs_transformers": rope, "budgets": [r.to_dict() for r in results],
           "passed": all(r.passed for r in results)}
    write_json_file(out_json, doc)
    if json_out:
        report.emit_json(doc)
    else:
        views.show_e2e(results, doc)
    if not doc["passed"]:
        raise typer.Exit(EXIT_CHECK_FAILED)


def _deploy_curve(acceptance, attention, step_costs, budgets, batch, prefix, backend, topology, plot_out, out_json,
                  json_out):
    from kdev.cli import write_json_file
    from kdev.e2e import deploy

    if topology not in deploy.TOPOLOGIES:
        raise BadInput(f"--topology {topology!r}: one of {', '.join(deploy.TOPOLOGIES)}")
    path = step_costs or deploy.default_step_costs()
    costs = deploy.load_step_costs(path)
    dep = deploy.load_deploy(path)
    curve, source = deploy.load_acceptance(acceptance)
    kernel = registry.DEFAULT if backend == "reference" else backend
    # tp: each GPU attends with its share of the heads for every request; dp-ep: the busiest GPU with all of them for
    # its requests
    heads = costs.heads // dep.gpus if topology == "tp" else costs.heads
    attn_batch = batch if topology == "tp" else -(-batch // dep.gpus)
    times_high, notes = None, []
    if attention is not None:
        times, timed_on = deploy.load_attention(attention, attn_batch, prefix, heads, kernel)
        attn_source = f"{attention} (kdev bench on {timed_on})"
        if timed_on != costs.gpu_name:
            report.warn(f"the verify attention was timed on {timed_on}, the step costs are for {costs.gpu_name}: "
                        "time it on the deploy GPU for the deploy's curve")
    if budgets is None:  # plain decoding and every power of two the acceptance curve (and the timings) reach
        budgets = (0, *(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
                        if min(curve) <= b <= max(curve) and (attention is None or b <= max(times))))
    if any(b < 0 or b > 512 for b in budgets):
        raise BadInput(f"--budget {','.join(map(str, budgets))}: 0 (plain decoding) to 512")
    if attention is None:  # no bench file of the card: kdev plan --project's range, at page size 1 as SGLang calls it
        times, times_high, timed_on, notes = deploy.projected_attention(costs, list(budgets), attn_batch, prefix, heads,
                                                                        kernel)
        attn_source = f"kdev plan --project on {timed_on}, page size 1 (a range)"
        for n in notes:
            report.warn(n)
    rows = deploy.projection(costs, dep, topology, times, curve, list(budgets), batch, attention_high=times_high)
    moves = deploy.sensitivity(costs, dep, topology, times, curve, list(budgets), batch, times_high)
    measured = deploy.acceptance_measured(acceptance)
    doc = {"projection": True, "illustrative": not measured, "step_costs": costs.__dict__,
           "deploy": {k: (v.__dict__ if isinstance(v, deploy.Span) else v) for k, v in dep.__dict__.items()},
           "topology": topology, "acceptance": {"file": str(acceptance), "source": source, "measured": measured},
           "attention": {"file": str(attention) if attention else None, "source": attn_source, "kernel": kernel,
                         "batch": attn_batch, "prefix": prefix, "heads": heads, "gpu": timed_on, "notes": notes},
           "budgets": rows, "sensitivity": moves}
    write_json_file(out_json, doc)
    if plot_out is not None:
        deploy.plot(plot_out, rows, f"{'ILLUSTRATIVE ' if not measured else ''}projection: {costs.name}, {topology}, "
                    f"B={batch}, prefix {prefix}, {kernel}")
    if json_out:
        report.emit_json(doc)
    else:
        views.show_deploy_curve(rows, moves, costs, dep, topology, batch, prefix, kernel, doc["acceptance"]["source"],
                                measured, attn_source)


# --------------------------------------------------------------------------------------------------- clean
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
    else:
        views.show_clean(items, repo, yes)


# -------------------------------------------------------------------------------------------- deploy-check
@app.command("deploy-check")
@command
def deploy_check_cmd(
    repo: Optional[Path] = typer.Option(None, "--repo", help="Checkout to check (default: the one around the current "
                                        "directory)."),
    target: Optional[str] = typer.Option(None, "--target", help="Deploy target arch (default: configs/deploy.yaml)."),
    strict: bool = typer.Option(False, "--strict", help="Warnings fail too."),
    require_gpu: bool = typer.Option(False, "--require-gpu", help="No GPU (or no NVML) fails instead of warning."),
    gpus: Optional[str] = GpusOpt,
    allow_mixed: bool = typer.Option(False, "--allow-mixed", help="With several GPUs: models or drivers that differ "
                                     "warn instead of failing."),
    json_out: bool = JsonOpt,
):
    """Git, build provenance, vectors, verification record and GPU state before a deploy; with several GPUs, each by
    its UUID: a passing verify of this build, and no fault."""
    from kdev import deploy, fleet, project

    if target is not None and not (target.startswith("sm_") and target[3:].rstrip("a").isdigit()):
        raise typer.BadParameter(f"{target!r} is not an arch like sm_120", param_hint="--target")
    if repo is None:
        repo = project.require_root()
    elif not project.is_checkout(repo):
        raise BadInput(f"--repo {repo}: not a kdev checkout (no {project.MARKERS[0]} and {project.MARKERS[1]})")
    probes, cfg = deploy.run_checks(repo, target, require_gpu, gpus=fleet.plan(gpus), allow_mixed=allow_mixed)
    failed = [p for p in probes if p.status == deploy.FAIL or (strict and p.status == deploy.WARN)]
    if json_out:
        report.emit_json({"repo": str(repo.resolve()), "target_arch": cfg.target_arch, "strict": strict,
                          "ok": not failed, "probes": [p.to_dict() for p in probes]})
    else:
        views.show_deploy(probes, repo, cfg.target_arch, failed, strict)
    if failed:
        raise typer.Exit(EXIT_CHECK_FAILED)


# ----------------------------------------------------------------------------------------------------- all
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

    from kdev import bench

    bench.expand(bench.load_bench(), sweep, None, None)  # a sweep that does not exist: refused before the loop runs
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
        views.show_stages(results)
    if code:
        raise typer.Exit(code)


# ---------------------------------------------------------------------------------------------------- help
@app.command("help")
def help_cmd(
    ctx: typer.Context,
    name: Optional[str] = typer.Argument(None, metavar="[COMMAND]", help="The command (default: the list of them)."),
):
    """What a command takes, as `kdev COMMAND -h` prints it; without COMMAND the list of commands, as `kdev -h`."""
    group, top = ctx.parent.command, ctx.parent
    if name is None:
        typer.echo(group.get_help(top))
        return
    cmd = group.get_command(top, name)
    if cmd is None:
        raise typer.BadParameter(f"no command {name!r} (have: {', '.join(group.list_commands(top))})",
                                 param_hint="COMMAND")
    typer.echo(cmd.get_help(typer.Context(cmd, info_name=name, parent=top)))
