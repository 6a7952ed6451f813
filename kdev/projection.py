"""kdev plan --project: how long the flash call will take on a GPU that is not here, from the SASS of that arch's build,
the launch plan the library makes for it and the GPU's rates (configs/gpus.yaml), with four constants per GPU family
fitted on calls this project has timed (configs/projection.yaml). docs/projection.md states the model, what it ignores
and how far it was off; in short:
- a KV tile of one CTA costs, on each pipe of its SM, cycles priced from the kernel's main loop (tensor: HMMAs, smem:
  wavefronts and a tensor copy's bytes, issue: instructions, l2 and dram: the tile's bytes at their rates); it takes
  the largest compute pipe over `efficiency`, or the slower memory pipe;
- a CTA takes its tiles and `cta_cycles`; a narrow CTA after the full-tile kernel reads from memory, at
  `memory_tile_cycles` per tile at least; a tile gathered row by row (page size 1) takes `gather_tile_cycles` more,
  fitted on gathered points once the rest are fitted on tensor-copy ones (the gathers' latency);
- the launch ends when the planner's own schedule says (kdtree_flash_launch_time); the combine reads the partials and
  writes the output; `call_us` is the rest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from kdev import bench, cabi, sass
from kdev import plan as kplan
from kdev.config import CONFIG_DIR, REPO_ROOT, GpuSpec, Rate, load_gpus, load_yaml, YamlReader
from kdev.errors import BadInput, EnvironmentMissing
from kdev.fsutil import atomic_write_bytes, read_json_record

HMMA_FLOP = 16 * 8 * 16 * 2  # one HMMA.16816
TILE_BYTES = kplan.BLOCK_N * kplan.KV_ROW_BYTES  # one KV tile: 32 tokens x 576 bf16
WARPS = kplan.THREADS // 32
WAVEFRONT = 128
PARTIAL_ROW_BYTES = (cabi.LATENT_DIM + 1) * 4  # a split partial's row: 512 fp32 values and the LSE
OUT_ROW_BYTES = cabi.LATENT_DIM * 2
COMPUTE_PIPES, MEMORY_PIPES = ("tensor", "smem", "issue"), ("l2", "dram")
CLUSTERS = (2, 4)
PROJECTION_CONFIG = CONFIG_DIR / "projection.yaml"


# ------------------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Loop:
    """The main HMMA loop of one kernel on one arch, per warp and KV tile."""

    kernel: str
    arch: str
    instructions: int  # the hot path's (stretches a forward branch skips without HMMA left out)
    hmma: int
    smem_wavefronts: int  # the hot path's, guarded instructions left out (kdev sass)
    cp_async: bool  # the tile is written by LDGSTS in the loop (counted above); else a tensor copy writes it


LOOPS_CACHE = "sass-loops.json"  # beside the library: reading its SASS takes cuobjdump seconds


def read_loops(library: Path) -> dict[tuple[str, str], Loop]:
    """(arch, kernel) -> its main HMMA loop, for every kernel of the library with one; kept beside the library, keyed
    by the library's bytes."""
    digest = hashlib.sha256(library.read_bytes()).hexdigest()
    cache = library.parent / LOOPS_CACHE
    doc = read_json_record(cache, ("library_sha256", "loops"))
    if doc is not None and doc["library_sha256"] == digest:
        try:
            return {(x["arch"], x["kernel"]): Loop(**x) for x in doc["loops"]}
        except (TypeError, KeyError):
            pass  # a cache from another version of this module: read the SASS again
    loops = _read_loops(library)
    try:
        atomic_write_bytes(cache, json.dumps({"library_sha256": digest,
                                              "loops": [asdict(x) for x in loops.values()]}).encode())
    except OSError:
        pass  # a read-only build folder: the next run reads the SASS again
    return loops


def _read_loops(library: Path) -> dict[tuple[str, str], Loop]:
    """The main HMMA loop (the loop with the most HMMAs) of every kernel of the library that has one."""
    functions = sass.parse(sass.dump(library))
    names = sass.demangle(sorted({f.name for f in functions}))
    out = {}
    for f in functions:
        best = None
        for first, last in sass.loops(f):
            body = f.instrs[first:last + 1]
            hmma = sum(i.op == "HMMA" for i in body)
            if hmma and (best is None or hmma > best[0]):
                best = (hmma, first, last)
        if best is None:
            continue
        hmma, first, last = best
        body = f.instrs[first:last + 1]
        rare = sass.rare_stretches(body)
        hot = [i for i, r in zip(body, rare) if not r]
        report = sass.loop_report(f, first, last)
        name = names.get(f.name, f.name)
        out[(f.arch, name)] = Loop(name, f.arch, len(hot), hmma, report["smem_wavefronts_hot"],
                                   any(i.op == "LDGSTS" for i in hot))
    return out


def loop_of(loops: dict, arch: str, name: str) -> Loop | None:
    """The kernel's loop in the code a GPU of `arch` runs: its own arch's SASS, else its arch-specific form's (an
    sm_90a build, which holds sm_90's mma.sync kernels as well as the wgmma kernel)."""
    arch = arch.rstrip("a")
    return loops.get((arch, name)) or loops.get((arch + "a", name))


@dataclass(frozen=True)
class Rates:
    """One corner of a GPU's rates: every figure a number (a range's low or high end, or its middle)."""

    clock_mhz: float
    tensor_flop_per_clk: float
    smem_bytes_per_clk: float
    l2_bytes_per_clk: float
    dram_bytes_per_s: float
    issue_per_clk: float
    l2_bytes: float
    sms: int

    @property
    def dram_bytes_per_clk(self) -> float:  # per SM
        return self.dram_bytes_per_s / (self.clock_mhz * 1e6) / self.sms


def rate_table(gpu: GpuSpec) -> dict[str, Rate]:
    """The GPU's rates, the tensor and memory ones derived from its ceilings (one truth: configs/gpus.yaml's)."""
    if not gpu.rates or not gpu.flops or not gpu.bytes_per_s or not gpu.ceilings_clock_mhz:
        raise BadInput(f"{gpu.name}: configs/gpus.yaml gives no rates or no ceilings with clock_mhz for it: the "
                       f"projection needs both (docs/projection.md)")
    tensor = gpu.flops / (gpu.sms * gpu.ceilings_clock_mhz * 1e6)
    out = dict(gpu.rates)
    out["tensor_flop_per_clk"] = Rate(tensor, tensor, f"ceilings: {gpu.ceilings_source}", gpu.ceilings_measured)
    out["dram_bytes_per_s"] = Rate(gpu.bytes_per_s, gpu.bytes_per_s, f"ceilings: {gpu.ceilings_source}",
                                   gpu.ceilings_measured)
    return out


# The unknowns a projection's range spans, each with the end that makes the call slower: the clock and the L2's
# bandwidth (configs/gpus.yaml ranges), and the loop's efficiency, from 1 (the limiting pipe never idles: the SASS's
# own floor) down to the fitted family's.
UNKNOWNS = ("clock_mhz", "l2_bytes_per_clk", "efficiency")


def corner(table: dict[str, Rate], gpu: GpuSpec, slow: dict[str, bool]) -> Rates:
    """The rates at one corner: for each range, its slow end (True), its fast end (False) or its middle (absent)."""
    def at(name: str) -> float:
        r = table[name]
        if name not in slow:
            return r.nominal
        # a lower clock or bandwidth is slower
        return r.low if slow[name] else r.high

    return Rates(clock_mhz=at("clock_mhz"), tensor_flop_per_clk=at("tensor_flop_per_clk"),
                 smem_bytes_per_clk=at("smem_bytes_per_clk"), l2_bytes_per_clk=at("l2_bytes_per_clk"),
                 dram_bytes_per_s=at("dram_bytes_per_s"), issue_per_clk=at("issue_per_clk"),
                 l2_bytes=at("l2_mb") * 1e6, sms=gpu.sms)


@dataclass(frozen=True)
class Constants:
    family: str
    efficiency: float  # of the limiting pipe, in the tile loop
    cta_cycles: float  # per CTA beside its tiles
    call_us: float  # per call beside its kernels' CTAs and the combine's bytes
    memory_tile_cycles: float  # a tile read from device memory with the loads one CTA keeps in flight (latency)
    fitted_on: tuple = ()  # the files
    points: int = 0
    # a tile gathered row by row (pages of fewer than TENSOR_COPY_MIN_PAGE tokens: each row's address waits on its
    # page-table read) costs this beside its pipes: fitted afterwards on gathered points alone (fit_gather)
    gather_tile_cycles: float = 0.0
    gather_fitted_on: tuple = ()
    gather_points: int = 0

    def vector(self) -> np.ndarray:
        return np.array([self.efficiency, self.cta_cycles, self.call_us, self.memory_tile_cycles])


# ---------------------------------------------------------------------------------------------------- model
def tile_cycles(loop: Loop, rates: Rates, dram_share: float) -> dict[str, float]:
    """Cycles one KV tile of one CTA takes on each pipe of its SM (one CTA per SM)."""
    wavefronts = loop.smem_wavefronts * WARPS + (0 if loop.cp_async else TILE_BYTES / WAVEFRONT)
    return {
        "tensor": loop.hmma * WARPS * HMMA_FLOP / rates.tensor_flop_per_clk,
        "smem": wavefronts / (rates.smem_bytes_per_clk / WAVEFRONT),
        "issue": loop.instructions * WARPS / rates.issue_per_clk,
        "l2": TILE_BYTES / rates.l2_bytes_per_clk,
        "dram": TILE_BYTES * dram_share / rates.dram_bytes_per_clk,
    }


def _bound(cycles: dict[str, float], efficiency: float) -> str:
    """The pipe a tile waits on: the compute pipes at the loop's efficiency, the memory pipes at their rates."""
    pipe = max(cycles, key=lambda p: cycles[p] / (efficiency if p in COMPUTE_PIPES else 1.0))
    return {"l2": "memory (L2)", "dram": "memory (DRAM)"}.get(pipe, pipe)


@dataclass
class KernelProjection:
    kernel: str
    ctas: int
    tiles_per_cta: int
    tile_cycles: dict
    bound: str
    cta_us: float  # one CTA: its tiles and its fixed cycles


@dataclass
class ShapeProjection:
    shape: str
    axes: dict
    call: str
    gpu: str
    us: float
    bound: str
    kernels: list
    combine_us: float
    plan: dict  # row tiles, splits, waves (kdev plan's figures)
    traffic: dict


def dram_share(plan: kplan.ShapePlan, rates: Rates, reuse: bool = True) -> float:
    """The fraction of the CTAs' tile reads that device memory serves. With L2 reuse (what the Hopper points show:
    an H100 times the 128K prefix as an H200 does, with 70 % of its memory bandwidth and a KV three times its L2) the
    row tiles of a split read each tile once from memory while the KV fits the L2, and in proportion past it; without,
    every read."""
    if not reuse:
        return 1.0
    once = 1.0 / max(1, plan.row_tiles)
    return min(1.0, once * max(1.0, plan.kv_bytes / rates.l2_bytes))


def project_shape(planner: kplan.PlanLibrary, loops: dict, shape: bench.Shape, gpu: GpuSpec, call: str,
                  k: Constants, rates: Rates, l2_reuse: bool = True, cluster: int = 1,
                  wgmma: bool | None = None) -> ShapeProjection:
    """`wgmma`: whether the code holds the wgmma kernel (None: the planner's library; a measured point: its own)."""
    p = kplan.plan_shape(planner, shape, gpu, call, wgmma)
    if p.ctas_per_sm != 1:
        raise BadInput(f"{shape.name}: {p.full_kernel} fits {p.ctas_per_sm} CTAs per SM on {gpu.name}: the model "
                       f"(and the planner's schedule) takes one")
    arch = gpu.arch.rstrip("a")
    kv_len = shape.prefix + shape.T
    share = dram_share(p, rates, l2_reuse)
    clock = rates.clock_mhz  # cycles per microsecond

    def kernel(name: str, ctas: int, splits: int, cold: bool) -> KernelProjection:
        loop = loop_of(loops, arch, name)
        if loop is None and any(a.rstrip("a") == arch for a, _ in loops):
            # the code is there, but its loop is not one the model prices (the wgmma kernel's HGMMA)
            raise BadInput(f"{gpu.name}: the {call} call of this library runs {name}, whose main loop has no HMMA: "
                           f"the projection prices mma.sync loops only (--call flash-portable, or a library built "
                           f"for {arch}: kdev build --arch {arch})")
        if loop is None:
            raise EnvironmentMissing(f"the library has no {arch} SASS of {name} with an HMMA loop: kdev build --arch {arch}")
        tiles = max(kplan.split_tiles(kv_len, splits))
        cyc = tile_cycles(loop, rates, 1.0 if cold else share / cluster)
        cyc["l2"] /= cluster
        if cold:
            cyc["dram"] = max(cyc["dram"], k.memory_tile_cycles)
        per_tile = max(max(cyc[p] for p in COMPUTE_PIPES) / k.efficiency, *(cyc[p] for p in MEMORY_PIPES))
        if gathered(shape):
            per_tile += k.gather_tile_cycles
        return KernelProjection(name, ctas, tiles, {n: round(c, 1) for n, c in cyc.items()},
                                _bound(cyc, k.efficiency) if tiles * per_tile >= k.cta_cycles else "latency",
                                (tiles * per_tile + k.cta_cycles) / clock)

    kernels = [kernel(p.full_kernel, p.full_ctas, p.splits, False)] if p.full_ctas else []
    narrow = narrow_cold = 0.0
    if p.narrow_ctas:
        warm = kernel(p.narrow_kernel, p.narrow_ctas, p.narrow_splits, False)
        cold = kernel(p.narrow_kernel, p.narrow_ctas, p.narrow_splits, True)
        kernels.append(warm)
        narrow, narrow_cold = warm.cta_us, cold.cta_us
    full = kernels[0].cta_us if p.full_ctas else 0.0
    end = planner.launch_time(p.full_ctas, full, p.narrow_ctas, narrow, narrow_cold, gpu.sms)
    rows = shape.batch * p.rows
    partials = (p.splits > 1) * rows * p.splits + (p.narrow_splits > 1) * shape.batch * kplan.NARROW_ROWS * p.narrow_splits
    # the partials were written just before: the combine reads them from L2 where they fit, else from memory
    partial_bytes = partials * PARTIAL_ROW_BYTES
    l2_rate = rates.l2_bytes_per_clk * rates.sms * rates.clock_mhz * 1e6
    read_rate = l2_rate if partial_bytes <= rates.l2_bytes else rates.dram_bytes_per_s
    combine = (partial_bytes / read_rate + rows * OUT_ROW_BYTES / rates.dram_bytes_per_s) * 1e6
    l2_read = sum(x.ctas * x.tiles_per_cta for x in kernels) * TILE_BYTES
    traffic = {"kv_bytes": p.kv_bytes, "l2_read_bytes": l2_read / cluster,
               "dram_bytes_low": p.kv_bytes, "dram_bytes_high": l2_read / cluster}
    plan = {"row_tiles": p.row_tiles, "splits": p.splits, "narrow_splits": p.narrow_splits, "waves": p.waves,
            "full_ctas": p.full_ctas, "narrow_ctas": p.narrow_ctas}
    return ShapeProjection(shape.name, asdict(shape), call, gpu.name, end + combine + k.call_us,
                           kernels[0].bound if kernels else "-", [asdict(x) for x in kernels], combine, plan, traffic)


def gathered(shape: bench.Shape) -> bool:
    """Whether the call's KV tiles are gathered row by row through the page table (no tensor copy): pages of fewer
    than TENSOR_COPY_MIN_PAGE tokens, page size 1 as SGLang calls kdev."""
    return shape.page_size < cabi.TENSOR_COPY_MIN_PAGE


# -------------------------------------------------------------------------------------------------- points
@dataclass(frozen=True)
class Point:
    """One measured call: a shape, a product, a median, and the GPU it ran on (its clock and ceilings that day)."""

    gpu: GpuSpec
    shape: bench.Shape
    call: str
    us: float
    source: str
    archs: tuple = ()  # the archs of the library that timed it: whether its flash call ran the wgmma kernel


def _with_run(gpu: GpuSpec, clock: float | None, flops: float | None, bytes_per_s: float | None) -> GpuSpec:
    """The GPU as one run saw it: its clock and ceilings that day, where the file records them."""
    rates = dict(gpu.rates or {})
    if clock:
        rates["clock_mhz"] = Rate(clock, clock, "the run's own NVML samples", True)
    # ceilings measured in the run hold at the run's clock
    return replace(gpu, rates=rates, flops=flops or gpu.flops, bytes_per_s=bytes_per_s or gpu.bytes_per_s,
                   ceilings_clock_mhz=clock if flops and clock else gpu.ceilings_clock_mhz)


def _gpu_named(name: str, where: str) -> GpuSpec:
    gpus = load_gpus()
    found = gpus.get(name) or next((g for g in gpus.values() if g.name == name), None)
    if found is None:
        raise BadInput(f"{where}: GPU {name!r} is not in configs/gpus.yaml (have: {', '.join(gpus)})")
    return found


def points_from_bench(doc: dict, where: str) -> list[Point]:
    """The flash products' medians of a kdev bench result (or a field report's bench part)."""
    prov = doc.get("provenance") or {}
    gpu = _gpu_named((prov.get("gpu") or {}).get("name", "?"), where)
    archs = tuple((prov.get("build_info") or {}).get("archs") or ())
    ceil = prov.get("ceilings") or {}
    out = []
    for r in doc.get("results", []):
        t = r.get("timing") or {}
        if r.get("backend") not in kplan.CALLS or not t.get("median_us") or r.get("check") != "ok":
            continue
        clocks = [c for c in t.get("sm_clock_mhz") or [] if c]
        clock = float(np.median(clocks)) if clocks else None
        axes = {k: v for k, v in r["axes"].items() if k in bench.Shape.__dataclass_fields__}
        out.append(Point(_with_run(gpu, clock, ceil.get("flops"), ceil.get("bytes_per_s")), bench.Shape(**axes),
                         r["backend"], float(t["median_us"]), where, archs))
    if out and not archs:
        raise BadInput(f"{where}: its provenance names no build archs: which kernels its calls ran is not known")
    return out


def points_from_table(path: Path) -> list[Point]:
    """A points file (benchmarks/points/*.yaml): medians transcribed from a run's table, with its GPU and ceilings."""
    top = YamlReader(load_yaml(path), path, "")
    gpu = _gpu_named(top.get("gpu", str), str(path))
    top.get("commit", str)
    archs = tuple(top.get("archs", list))  # the build that timed them (whether flash ran the wgmma kernel)
    clock = top.get("clock_mhz", (int, float))
    c = top.sub("ceilings")
    flops, gbps = c.get("tflops", (int, float)) * 1e12, c.get("gbps", (int, float)) * 1e9
    c.done()
    run_gpu = _with_run(gpu, float(clock), flops, gbps)
    out = []
    for i, row in enumerate(top.get("points", list)):
        if not isinstance(row, dict):
            raise BadInput(f"{path}: points[{i}] is not a mapping")
        axes = {k: row[k] for k in ("batch", "prefix", "budget", "heads", "page_size") if k in row}
        for call in kplan.CALLS:
            if call in row:
                out.append(Point(run_gpu, bench.Shape(**axes), call, float(row[call]), str(path), archs))
    top.done()
    return out


def load_points(path: Path) -> list[Point]:
    """The measured calls of a bench result (.json), a field report (.json) or a points table (.yaml)."""
    if not path.is_file():
        raise BadInput(f"{path}: no such file")
    if path.suffix in (".yaml", ".yml"):
        return points_from_table(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BadInput(f"{path}: not readable JSON: {e}") from None
    if isinstance(doc, dict) and doc.get("kind") == "kdev-field-report":
        doc = doc.get("bench") or {}
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise BadInput(f"{path}: neither a kdev bench result nor a field report (no results)")
    points = points_from_bench(doc, str(path))
    if not points:
        raise BadInput(f"{path}: no timed flash or flash-portable result in it")
    return points


# ------------------------------------------------------------------------------------------------------ fit
@dataclass(frozen=True)
class Family:
    name: str
    archs: tuple
    fit: tuple  # files the constants are fitted on
    held_out: tuple  # files they are checked on
    borrow: str | None  # a family without points takes another's constants (the assumption the range names)
    misses: tuple = ()  # ({axis: value}, reason): held-out points the model is known to miss, kept as failing cases
    gather_fit: tuple = ()  # files whose gathered points (page size 1) fit gather_tile_cycles


def missed(fam: Family, point: "Point") -> str | None:
    """Why the model misses this held-out point (a known failing case), or None."""
    axes = point.shape.__dict__
    return next((why for match, why in fam.misses if all(axes.get(k) == v for k, v in match.items())), None)


@dataclass(frozen=True)
class ProjectionConfig:
    tolerance: float
    families: dict
    start: Constants


def load_config(path: Path = PROJECTION_CONFIG) -> ProjectionConfig:
    top = YamlReader(load_yaml(path), path, "")
    tol = top.get("tolerance", float, check=lambda v: 0 < v < 1, check_msg="a fraction in (0, 1)")
    s = top.sub("start")
    start = Constants("start", s.get("efficiency", float), s.get("cta_cycles", (int, float)),
                      s.get("call_us", (int, float)), s.get("memory_tile_cycles", (int, float)))
    s.done()
    fams = top.sub("families")
    families = {}
    for name in list(fams.data):
        f = fams.sub(name)
        misses = []
        for i, m in enumerate(f.get("misses", list, [])):
            if not isinstance(m, dict) or not isinstance(m.get("reason"), str):
                raise f.fail("misses", f"[{i}]: a mapping of axes and a reason")
            misses.append(({k: v for k, v in m.items() if k != "reason"}, m["reason"]))
        families[name] = Family(name, tuple(f.get("archs", list)), tuple(f.get("fit", list, [])),
                                tuple(f.get("held_out", list, [])), f.get("borrow", str, None), tuple(misses),
                                tuple(f.get("gather_fit", list, [])))
        f.done()
    fams.done()
    top.done()
    for f in families.values():
        if not f.fit and (f.borrow not in families or not families[f.borrow].fit):
            raise BadInput(f"{path}: family {f.name} has no fit files and borrows from no family that has")
    return ProjectionConfig(tol, families, start)


def family_of(cfg: ProjectionConfig, arch: str) -> Family:
    arch = arch.rstrip("a")
    for f in cfg.families.values():
        if arch in f.archs:
            return f
    raise BadInput(f"{arch}: no family in configs/projection.yaml takes it")


class Model:
    """The built library's plan and SASS, and what the projection computes with them."""

    def __init__(self, planner: kplan.PlanLibrary):
        self.planner = planner
        self.loops = read_loops(planner.path)

    def predict(self, point: Point, k: Constants) -> float:
        rates = corner(rate_table(point.gpu), point.gpu, {})
        # the kernels the point's own build ran: a call timed before the wgmma kernel existed ran mma.sync
        wgmma = self.planner.wgmma_built(point.gpu, list(point.archs))
        return project_shape(self.planner, self.loops, point.shape, point.gpu, point.call, k, rates,
                             wgmma=wgmma).us

    def fit(self, points: list[Point], start: Constants, family: str, files: tuple) -> Constants:
        """Least relative squares over (efficiency, cta_cycles, call_us): Levenberg-Marquardt with a numeric Jacobian
        (the model is piecewise linear in the constants), each kept in its range (0 < efficiency <= 1, the rest >= 0)."""
        if len(points) < len(start.vector()):
            raise BadInput(f"family {family}: {len(points)} points cannot fit {len(start.vector())} constants")
        meas = np.array([p.us for p in points])
        lo, hi = np.array([0.05, 0.0, 0.0, 0.0]), np.array([1.0, 1e6, 1e3, 1e6])

        def resid(x: np.ndarray) -> np.ndarray:
            k = Constants(family, *x)
            return np.array([self.predict(p, k) for p in points]) / meas - 1.0

        x, lam = np.clip(start.vector(), lo, hi), 1e-2
        r = resid(x)
        for _ in range(60):
            steps = np.maximum(np.abs(x) * 1e-4, 1e-6)
            J = np.stack([(resid(x + np.eye(len(x))[j] * steps[j]) - r) / steps[j] for j in range(len(x))], axis=1)
            A, g = J.T @ J, J.T @ r
            improved = False
            for _ in range(12):
                cand = np.clip(x - np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-12), g), lo, hi)
                rc = resid(cand)
                if rc @ rc < r @ r:
                    done = (r @ r - rc @ rc) < 1e-12
                    x, r, lam, improved = cand, rc, max(lam / 3, 1e-9), True
                    break
                lam *= 4
            if not improved or done:
                break
        return Constants(family, *map(float, x), fitted_on=files, points=len(points))

    def fit_gather(self, points: list[Point], k: Constants, files: tuple) -> Constants:
        """k with gather_tile_cycles fitted on gathered points (least relative squares, the other constants held: they
        come from the tensor-copy points, where no tile is gathered). The error is unimodal in the one term: a golden
        section search over 0..40,000 cycles a tile."""
        meas = np.array([p.us for p in points])

        def err(g: float) -> float:
            kk = replace(k, gather_tile_cycles=g)
            r = np.array([self.predict(p, kk) for p in points]) / meas - 1.0
            return float(r @ r)

        lo, hi, phi = 0.0, 40000.0, (5 ** 0.5 - 1) / 2
        a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
        fa, fb = err(a), err(b)
        while hi - lo > 1.0:
            if fa < fb:
                hi, b, fb = b, a, fa
                a = hi - phi * (hi - lo)
                fa = err(a)
            else:
                lo, a, fa = a, b, fb
                b = lo + phi * (hi - lo)
                fb = err(b)
        return replace(k, gather_tile_cycles=round((lo + hi) / 2, 1), gather_fitted_on=files,
                       gather_points=len(points))


def points_of(files: tuple, root: Path = REPO_ROOT) -> list[Point]:
    out = []
    for f in files:
        out += load_points(root / f if not Path(f).is_absolute() else Path(f))
    return out


def constants_for(model: Model, cfg: ProjectionConfig, arch: str, extra: list[Point] = ()) -> tuple[Constants, Family]:
    """The constants of the arch's family, fitted on its points (its fit files and `extra`'s points of its archs); a
    family with fewer points than constants borrows the fit of the family it names."""
    fam = family_of(cfg, arch)
    mine = [p for p in extra if family_of(cfg, p.gpu.arch) is fam]
    src, points = fam, points_of(fam.fit) + mine
    files = fam.fit + tuple(sorted({p.source for p in mine}))
    if len([p for p in points if not gathered(p.shape)]) < len(cfg.start.vector()):
        src = cfg.families[fam.borrow]
        points, files, mine = points_of(src.fit), src.fit, []
    # the pipes' constants from the tensor-copy points; then the gather term from the gathered ones
    k = model.fit([p for p in points if not gathered(p.shape)], cfg.start, src.name, files)
    gathered_points = [p for p in points_of(src.gather_fit) + points if gathered(p.shape)]
    if gathered_points:
        k = model.fit_gather(gathered_points, k, src.gather_fit + tuple(sorted({p.source for p in mine})))
    return k, fam


def check(model: Model, points: list[Point], k: Constants, fam: Family | None = None) -> list[dict]:
    """Each point's projection against its measurement (and, held out, why the model is known to miss it)."""
    out = []
    for p in points:
        us = model.predict(p, k)
        out.append({"gpu": p.gpu.name, "shape": p.shape.name, "call": p.call, "measured_us": p.us,
                    "projected_us": us, "error": us / p.us - 1.0, "source": p.source,
                    "known_miss": missed(fam, p) if fam else None})
    return out


# ----------------------------------------------------------------------------------------------- the report
def project(model: Model, shapes: list[bench.Shape], gpu: GpuSpec, call: str, k: Constants) -> dict:
    """Per shape: the projection at the middle of the GPU's ranges with the family's efficiency (its kernels, bound and
    KV traffic); the range from every unknown at its fast end to every one at its slow end, and the unknown that moves
    it most; and the case the L2 does not serve the row tiles' re-reads, alone and with a cluster of CTAs sharing each
    KV tile."""
    table = rate_table(gpu)
    out = []
    for s in shapes:
        def at(slow: dict, l2_reuse: bool = True, cluster: int = 1) -> ShapeProjection:
            kk = k if slow.get("efficiency", True) else replace(k, efficiency=1.0)
            return project_shape(model.planner, model.loops, s, gpu, call, kk, corner(table, gpu, slow), l2_reuse,
                                 cluster)

        nominal = at({})
        fast, slow = dict.fromkeys(UNKNOWNS, False), dict.fromkeys(UNKNOWNS, True)
        moves = {n: at({n: True}).us - at({n: False}).us for n in UNKNOWNS}
        full = nominal.kernels[0] if nominal.kernels else None
        doc = asdict(nominal)
        doc.update(low_us=at(fast).us, high_us=at(slow).us, moved_most_by=max(moves, key=moves.get),
                   moves_us=moves, no_l2_reuse_us=at({}, False).us,
                   clusters=[{"ctas": c, "no_l2_reuse_us": at({}, False, c).us,
                              "l2_read_bytes": at({}, True, c).traffic["l2_read_bytes"]} for c in CLUSTERS],
                   l2_binds_below=_l2_threshold(full, k) if full else None)
        out.append(doc)
    return {"gpu": gpu.name, "arch": gpu.arch, "call": call, "constants": asdict(k),
            "rates": {n: asdict(r) for n, r in table.items()}, "shapes": out}


def _l2_threshold(full: dict, k: Constants) -> float:
    """The L2 -> SM bytes per SM and clock below which the full-tile kernel's tiles would wait on the L2."""
    compute = max(full["tile_cycles"][p] for p in COMPUTE_PIPES) / k.efficiency
    return TILE_BYTES / compute


def fit_report(model: Model, cfg: ProjectionConfig, fam: Family, k: Constants) -> dict:
    """How far the constants are off on the points they were fitted on, and on the held-out ones (none for a family
    that borrows its constants: its points are the other family's)."""
    src = cfg.families[k.family]
    fit_points = points_of(src.fit) + [p for p in points_of(src.gather_fit) if gathered(p.shape)]
    fitted, held = check(model, fit_points, k), check(model, points_of(src.held_out), k, src)
    worst = lambda rows: max((abs(r["error"]) for r in rows), default=None)  # noqa: E731
    return {"family": fam.name, "constants_from": k.family, "tolerance": cfg.tolerance, "fit": fitted,
            "held_out": held, "fit_max_error": worst(fitted),
            "held_out_max_error": worst([r for r in held if not r["known_miss"]]),
            "known_misses": {why: worst([r for r in held if r["known_miss"] == why])
                             for _, why in src.misses}}


def calibrate(model: Model, cfg: ProjectionConfig, path: Path) -> dict:
    """A field report (or any bench result) as a calibration point: how far the projection was off on its calls with the
    constants of before, and the constants and errors once its points join its family's fit."""
    points = load_points(path)
    arch = points[0].gpu.arch
    before, fam = constants_for(model, cfg, arch)
    after, _ = constants_for(model, cfg, arch, points)
    return {"file": str(path), "gpu": points[0].gpu.name, "family": fam.name,
            "constants_before": asdict(before), "before": check(model, points, before),
            "constants_after": asdict(after), "after": check(model, points, after)}


def run(planner: kplan.PlanLibrary, shapes: list[bench.Shape], gpu: GpuSpec, call: str,
        calibrate_files: list[Path] = ()) -> dict:
    """kdev plan --project: the projection at each shape, the fit behind it, and each calibration file's verdict."""
    cfg = load_config()
    model = Model(planner)
    k, fam = constants_for(model, cfg, gpu.arch)
    doc = project(model, shapes, gpu, call, k)
    doc["fit"] = fit_report(model, cfg, fam, k)
    doc["calibrations"] = [calibrate(model, cfg, Path(f)) for f in calibrate_files]
    return doc
