"""`kdev bench` as one call: the options checked before anything is measured (bad input is exit 2 on any machine),
then a stored result read or a sweep measured (or the ceilings), then the verdicts and files. The CLI parses the
options into BenchOptions, calls run(), and renders what it returns (kdev/bench/render.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from kdev.bench import ceilings as kceilings
from kdev.bench.results import load_results, plot, write_csv
from kdev.bench.run import run_bench, run_tree_bench
from kdev.bench.runners import load_peer
from kdev.bench.sweeps import ATTENTION_BACKENDS, TREE_BACKENDS, expand, load_bench
from kdev.bench.verdicts import baseline_verdicts, judge_capture, judge_skew, judge_targets
from kdev.errors import BadInput


@dataclass
class BenchOptions:
    sweep: str | None = None
    shape: list[str] | None = None
    axis: list[str] | None = None
    backend: str | None = None
    peer: list[str] | None = None
    ceilings: bool = False
    loop: list[str] | None = None
    baseline: Path | None = None
    normalize_by: str | None = None
    from_file: Path | None = None
    csv_out: Path | None = None
    plot_out: Path | None = None
    plot_metric: str = "time"
    out_json: Path | None = None
    seed: int = 0
    config: Path | None = None
    library: Path | None = None
    plan_gpu: str | None = None
    graph: bool = False


@dataclass
class BenchOutcome:
    doc: dict | None = None               # the result document (None: --ceilings alone)
    verdicts: list | None = None          # against --baseline
    ceilings: dict | None = None          # measured with --ceilings
    gpu: dict | None = None               # the GPU the ceilings were measured on
    ceilings_path: Path | None = None     # where they were cached (None with --loop)
    notes: list[str] = field(default_factory=list)  # what to say besides the table


def require_same_gpu(base_doc: dict, gpu_name: str, base_where: str, where: str) -> None:
    """A verdict against a baseline needs both timed on the same kind of GPU: an H100's times against an H200's would
    read its slower memory as a regression (and --normalize-by does not cancel that: the reference's balance moves
    too)."""
    base_gpu = base_doc["provenance"]["gpu"]["name"]
    if base_gpu != gpu_name:
        raise BadInput(f"--baseline {base_where} was timed on {base_gpu}, {where} on {gpu_name}: a verdict needs the "
                       "same GPU (time the baseline here, or compare builds in one run with kdev ab)")


def require_reference(normalize_by: str | None, results: list[dict], where: str) -> None:
    """--normalize-by needs that backend timed in both runs."""
    if normalize_by and not any(r["backend"] == normalize_by and r.get("timing") for r in results):
        raise BadInput(f"--normalize-by {normalize_by}: no timing of that backend in {where}")


def _backends(o: BenchOptions, cfg, peers: dict, kernel_ref) -> tuple[list[str], bool]:
    """The backends to time, each once in the order given, and whether triton was left out (named in bench.yaml but
    not installed; named on the command line it is refused)."""
    default = cfg.sweep_backends.get(o.sweep or "smoke", cfg.backends) if not o.shape else cfg.backends
    names = list(dict.fromkeys([b.strip() for b in (o.backend.split(",") if o.backend else default) if b.strip()]
                               + list(peers)))
    if not names:
        raise BadInput("--backend: names no backend")
    bad = [b for b in names if b not in ATTENTION_BACKENDS + TREE_BACKENDS and b not in peers and kernel_ref(b) is None]
    if bad:
        raise BadInput(f"--backend: unknown backend {bad[0]!r}")
    dropped = False
    if "triton" in names:
        from kdev import triton_peer

        if not triton_peer.available():
            if o.backend:
                raise BadInput("--backend: triton needs the triton package (pip install -e '.[peers]')")
            dropped = True
            names.remove("triton")
    if o.normalize_by and o.normalize_by not in names:
        raise BadInput(f"--normalize-by: {o.normalize_by!r} is not among the backends timed ({', '.join(names)})")
    return names, dropped


def _measure(o: BenchOptions, cfg, base_doc, log, progress) -> BenchOutcome:
    from kdev import abi, gpu
    from kdev.plan import plan_target

    shapes = expand(cfg, o.sweep, o.shape, o.axis)  # bad shapes are exit 2 even without a GPU
    plan = plan_target(o.plan_gpu) if o.plan_gpu else None  # and a bad --plan-gpu
    peers = {spec: load_peer(spec) for spec in o.peer or []}  # and the backends
    backends, dropped = _backends(o, cfg, peers, abi.kernel_ref)
    gpu.require_cuda("kdev bench")  # before any remark on the backends: no GPU is the one thing to say then
    outcome = BenchOutcome()
    if dropped:
        outcome.notes.append("triton is not installed: the triton peer is left out (pip install -e '.[peers]')")
    if base_doc:
        require_same_gpu(base_doc, gpu.current_gpu().name, str(o.baseline), "this run")
    lib = abi.load_library(o.library, log)
    if plan:
        lib.plan_as(plan.sms)
    others = abi.load_kernel_refs(backends, plan.sms if plan else 0, log=log)
    if o.ceilings:
        import torch

        ident = gpu.current_gpu().to_dict()
        device = torch.device("cuda", torch.cuda.current_device())
        if o.loop:  # the named rungs only, against the cached peak; the cache is left as it is
            c = dict(kceilings.load_ceilings(ident) or {})
            c["inner_loops"] = kceilings.measure_inner_loops(lib, device, c.get("flops") or 0.0, only=o.loop)
        else:
            c = kceilings.measure_ceilings(lib, device)
            outcome.ceilings_path = kceilings.save_ceilings(ident, c)
        outcome.ceilings, outcome.gpu = c, ident
        if not o.sweep and not o.shape:
            return outcome
    tree = [b for b in backends if b in TREE_BACKENDS]
    attention = [b for b in backends if b not in TREE_BACKENDS]
    label = o.sweep or ("shape" if o.shape else "smoke")
    results, prov = [], None
    with progress(f"bench {label}", len(shapes) * len(backends)) as advance:
        if attention:
            res, prov = run_bench(shapes, attention, cfg, lib, peers, o.seed, advance, others)
            prov["plan"] = plan.to_dict() if plan else None
            results += res
        if tree:
            res, prov = run_tree_bench(shapes, tree, cfg, lib, o.seed, advance)
            results += res
    outcome.doc = {"provenance": prov, "sweep": label, "results": [dict(r.__dict__) for r in results]}
    return outcome


def run(o: BenchOptions, log, progress) -> BenchOutcome:
    """Check the options, measure (or read --from), judge, write the CSV and plot asked for (the JSON file is the
caller's: it writes the document it shows)."""
    if o.plot_metric not in ("time", "roofline"):
        raise BadInput("--plot-metric: must be time or roofline")
    if o.loop and not o.ceilings:
        raise BadInput("--loop: needs --ceilings")
    if o.normalize_by and not o.baseline:  # the baseline and its reference backend before anything is measured
        raise BadInput("--normalize-by: needs --baseline")
    base_doc = load_results(o.baseline) if o.baseline else None
    if base_doc is not None:
        require_reference(o.normalize_by, base_doc["results"], str(o.baseline))
    cfg = load_bench(o.config)
    if o.graph:
        cfg = dataclasses.replace(cfg, method=dataclasses.replace(cfg.method, graph=True))
    if o.from_file:
        outcome = BenchOutcome(doc=load_results(o.from_file))
        if base_doc:
            require_same_gpu(base_doc, outcome.doc["provenance"]["gpu"]["name"], str(o.baseline), str(o.from_file))
    else:
        outcome = _measure(o, cfg, base_doc, log, progress)
        if outcome.doc is None:
            return outcome
    doc = outcome.doc
    if base_doc:
        if o.from_file:
            require_reference(o.normalize_by, doc["results"], str(o.from_file))
        outcome.verdicts = baseline_verdicts(doc["results"], base_doc["results"], normalize_by=o.normalize_by)
        doc["baseline"] = {"file": str(o.baseline), "normalized_by": o.normalize_by, "verdicts": outcome.verdicts}
    # the configs' targets, also for a stored result (--from); on a GPU other than theirs, indicative only
    judged = judge_targets(doc["results"], cfg, doc["provenance"]["gpu"]["name"])
    if judged:
        doc["targets"] = judged
    skewed = judge_skew(doc["results"])
    if skewed:
        doc["skewed"] = skewed
    captured = judge_capture(doc["results"])
    if captured:
        doc["captured"] = captured
    if o.csv_out:
        write_csv(o.csv_out, doc["results"])
    if o.plot_out:
        plot(o.plot_out, doc["results"], o.plot_metric)
    return outcome
