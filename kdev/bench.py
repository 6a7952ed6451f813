"""kdev bench: timing method, DDTree sweeps, roofline, peers, baseline comparison.

Three separate concerns (as in nvbench): the sweep (configs/bench.yaml -> shapes), the measurement
(cold-L2 samples timed with CUDA events, stopped on a noise target or a time limit, throttled samples
dropped), and the report (roofline against this GPU's ceilings, speedups, baseline verdicts).

Shapes: batch B, prefix L, budget N (T = N + 1 tree rows from a DDTree built by the reference over
synthetic drafter distributions), heads H, page size, tree kind. Inputs are random on the GPU (never zeros)
and the page table is shuffled. FLOPs = 2·H·Σ_b T_b·(L_b+T_b)·(576+512); bytes >= Σ_b (L_b+T_b)·576·2 + q + out.

Peers: triton (kdev/triton_peer.py: the flash kernel's tiling written in Triton, split-KV included; it reads the
paged cache itself, like the flash and naive kernels; needs the `peers` extra), torch-eager (float32 einsum with
the mask) and torch-sdpa (scaled_dot_product_attention with a boolean mask); the torch peers get the request's KV
gathered into contiguous tensors before timing. A `--peer module:function` is called as
    fn(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale) -> out  or  (out, lse)
with the contract's tensors (docs/architecture.md §2) and must return out [N_q, H, 512] (any float dtype).
Every backend's output is checked against the naive oracle before it is timed, and the output of its last
timed run (written over NaN) after; one that disagrees is reported and not ranked.
"""

from __future__ import annotations

import csv
import functools
import importlib
import itertools
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kdev import cabi
from kdev.config import (CONFIG_DIR, LATENT_DIM, QK_DIM, REPO_ROOT, TREE_KINDS, Tolerance, _Reader, load_gpus,
                         load_yaml)
from kdev.errors import BadInput
from kdev.fsutil import read_json_record

AXES = ("batch", "prefix", "budget", "heads", "page_size", "tree")
ATTENTION_BACKENDS = ("flash", "flash-portable", "naive", "triton", "torch-eager", "torch-sdpa")
TREE_BACKENDS = ("ddtree-build", "accept", "compact")  # the decoding round's other kernels
# a backend's lse (fp32, natural log) against the naive oracle's, where the backend returns one
PEER_LSE_TOLERANCE = Tolerance(atol=2e-3, rtol=2e-4, cos_diff=1e-8)
DEFAULT_AXES = {"batch": 1, "prefix": 32768, "budget": 64, "heads": 8, "page_size": 64, "tree": "ddtree"}


# ---------------------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shape:
    batch: int
    prefix: int
    budget: int
    heads: int
    page_size: int = 64
    tree: str = "ddtree"

    @property
    def name(self) -> str:
        t = "" if self.tree == "ddtree" else f"-{self.tree}"
        return f"B{self.batch}-L{self.prefix}-N{self.budget}-H{self.heads}-p{self.page_size}{t}"

    @property
    def T(self) -> int:
        return self.budget + 1


def flops_bytes(tree_sizes: list[int], prefix_lens: list[int], heads: int) -> tuple[float, float]:
    flops = sum(2.0 * heads * t * (L + t) * (QK_DIM + LATENT_DIM) for t, L in zip(tree_sizes, prefix_lens))
    n_q = sum(tree_sizes)
    kv = sum((L + t) * QK_DIM * 2 for t, L in zip(tree_sizes, prefix_lens))
    return flops, kv + n_q * heads * QK_DIM * 2 + n_q * heads * LATENT_DIM * 2


@dataclass(frozen=True)
class Method:
    warmup: int = 3
    min_samples: int = 10
    max_samples: int = 200
    target_rel_spread: float = 0.005
    max_seconds: float = 4.0
    l2_flush_factor: int = 2
    tolerance: Tolerance = Tolerance(atol=2e-2, rtol=4e-2, cos_diff=4e-5)
    graph: bool = False  # time the replay of a CUDA graph that holds one call (how a server runs decode)


@dataclass(frozen=True)
class BenchConfig:
    method: Method
    backends: tuple
    sweeps: dict  # name -> (description, [Shape])
    sweep_backends: dict = field(default_factory=dict)  # name -> backends a sweep names for itself
    # what the kernels are judged against (a shape's `target_us`, a sweep's `min_naive_speedup`): reported, not gated
    targets_us: dict = field(default_factory=dict)  # shape name -> time to meet, µs
    min_naive_speedup: dict = field(default_factory=dict)  # shape name -> how many times faster than naive
    # shape name -> the GPU (its configs/gpus.yaml name) its target_us is set for: a time on another GPU is reported
    # against it as indicative only
    target_gpu: dict = field(default_factory=dict)


def _shape(r: _Reader, base: dict) -> tuple[Shape, float | None]:
    vals = dict(base)
    for k in AXES:
        if k in r.data:
            vals[k] = r.get(k, str if k == "tree" else int)
    target = r.get("target_us", float, None, lambda v: v > 0, "must be > 0")
    r.done()
    return _make_shape(vals, f"{r.file}: {r.where}"), target


def _make_shape(vals: dict, where: str) -> Shape:
    s = Shape(**{k: vals[k] for k in AXES})
    problem = cabi.shape_problem(s.batch, s.prefix, s.budget, s.heads, s.page_size)
    if problem:
        raise BadInput(f"{where}: shape {s.name} out of range: {problem}")
    if s.tree not in TREE_KINDS:
        raise BadInput(f"{where}: shape {s.name}: tree {s.tree!r} is not one of {'/'.join(TREE_KINDS)}")
    return s


def _product(axes: dict) -> list[dict]:
    keys = list(axes)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(axes[k] for k in keys))]


def load_bench(path: str | Path | None = None) -> BenchConfig:
    path = Path(path) if path else CONFIG_DIR / "bench.yaml"
    top = _Reader(load_yaml(path), path, "")
    m = top.sub("method", {})
    tol = m.sub("tolerance", {})
    d = Method()
    method = Method(
        warmup=m.get("warmup", int, d.warmup), min_samples=m.positive_int("min_samples", d.min_samples),
        max_samples=m.positive_int("max_samples", d.max_samples),
        target_rel_spread=m.get("target_rel_spread", float, d.target_rel_spread),
        max_seconds=m.get("max_seconds", float, d.max_seconds),
        l2_flush_factor=m.positive_int("l2_flush_factor", d.l2_flush_factor),
        graph=m.get("graph", bool, d.graph),
        tolerance=Tolerance(atol=tol.get("atol", float, d.tolerance.atol), rtol=tol.get("rtol", float, d.tolerance.rtol),
                            cos_diff=tol.get("cos_diff", float, d.tolerance.cos_diff)))
    tol.done()
    m.done()
    backends = tuple(top.get("backends", list, ["flash", "naive", "torch-eager", "torch-sdpa"]))
    sw = top.sub("sweeps")
    top.done()
    sweeps, sweep_backends, targets_us, min_speedup, target_gpu = {}, {}, {}, {}, {}
    gpus = None
    for name in list(sw.data):
        s = sw.sub(name)
        desc = s.get("description", str, "")
        speedup = s.get("min_naive_speedup", float, None, lambda v: v > 0, "must be > 0")
        set_for = s.get("target_gpu", str, None)
        if set_for is not None:
            from kdev.config import load_gpus

            gpus = gpus or load_gpus()
            if set_for not in gpus:
                raise s.fail("target_gpu", f"{set_for!r} is not in configs/gpus.yaml (have: {', '.join(gpus)})")
            set_for = gpus[set_for].name
        if "backends" in s.data:
            sweep_backends[name] = tuple(s.get("backends", list))
        shapes = []
        if "axes" in s.data:
            a = s.sub("axes")
            axes = {k: a.get(k, list, check=lambda v: len(v) > 0, check_msg="a non-empty list") for k in list(a.data)}
            unknown = set(axes) - set(AXES)
            if unknown:
                raise a.fail(sorted(unknown)[0], "unknown axis")
            a.done()
            shapes += [_make_shape({**DEFAULT_AXES, **combo}, f"{path}: sweeps.{name}") for combo in _product(axes)]
        if "vary" in s.data:  # one axis at a time around a center shape
            center = {**DEFAULT_AXES, **s.get("center", dict, {})}
            v = s.sub("vary")
            for axis in list(v.data):
                if axis not in AXES:
                    raise v.fail(axis, "unknown axis")
                for value in v.get(axis, list):
                    shapes.append(_make_shape({**center, axis: value}, f"{path}: sweeps.{name}.vary.{axis}"))
            v.done()
        for i, raw in enumerate(s.get("shapes", list, [])):
            where = f"sweeps.{name}.shapes[{i}]"
            shape, target = _shape(_Reader(raw, path, where), DEFAULT_AXES)
            shapes.append(shape)
            if target is not None:
                if targets_us.get(shape.name, target) != target:
                    raise BadInput(f"{path}: {where}: {shape.name} has target_us {targets_us[shape.name]:g} elsewhere")
                if target_gpu.get(shape.name, set_for) != set_for:
                    raise BadInput(f"{path}: {where}: {shape.name} has a target set for {target_gpu[shape.name]} "
                                   "elsewhere")
                targets_us[shape.name] = target
                if set_for is not None:
                    target_gpu[shape.name] = set_for
        s.done()
        if not shapes:
            raise BadInput(f"{path}: sweeps.{name}: needs axes or shapes")
        sweeps[name] = (desc, list(dict.fromkeys(shapes)))
        if speedup is not None:
            min_speedup.update({sh.name: speedup for sh in shapes})
    sw.done()
    known = set(ATTENTION_BACKENDS) | set(TREE_BACKENDS)
    for name, bks in [("backends", backends), *((f"sweeps.{k}.backends", v) for k, v in sweep_backends.items())]:
        bad = [b for b in bks if b not in known]
        if bad:
            raise BadInput(f"{path}: {name}: unknown backend {bad[0]!r} (have {', '.join(sorted(known))})")
    return BenchConfig(method, backends, sweeps, sweep_backends, targets_us, min_speedup, target_gpu)


def parse_assignments(items: list[str], what: str) -> dict:
    """['B=1', 'L=4096,8192'] -> {'batch': [1], 'prefix': [4096, 8192]} (short or long axis names)."""
    alias = {"b": "batch", "l": "prefix", "n": "budget", "h": "heads", "page": "page_size", "p": "page_size"}
    out = {}
    for item in items:
        for part in item.split(";") if ";" in item else [item]:
            if "=" not in part:
                raise BadInput(f"{what}: {part!r} is not AXIS=VALUES")
            k, v = part.split("=", 1)
            k = alias.get(k.strip().lower(), k.strip().lower())
            if k not in AXES:
                raise BadInput(f"{what}: unknown axis {k!r} (axes: {', '.join(AXES)})")
            if k in out:  # the first value would be dropped without a word
                raise BadInput(f"{what}: axis {k!r} given twice")
            try:
                out[k] = [x.strip() if k == "tree" else int(x) for x in v.split(",") if x.strip()]
            except ValueError:
                raise BadInput(f"{what}: {part!r}: values must be integers") from None
            if not out[k]:  # an axis without values would leave no shape to run
                raise BadInput(f"{what}: {part!r}: no values")
    return out


def expand(cfg: BenchConfig, sweep: str | None, shape: list[str] | None, overrides: list[str] | None) -> list[Shape]:
    """The shapes to run: a named sweep (with -a AXIS=V1,V2 replacing that axis everywhere) or --shape."""
    if shape:
        if sweep:
            raise BadInput(f"--shape and --sweep {sweep}: give one of them (-a AXIS=V1,V2 varies either)")
        base = []
        for s in shape:
            vals = parse_assignments([s.replace(",", ";") if s.count("=") > 1 else s], "--shape")
            many = [k for k, v in vals.items() if len(v) > 1]
            if many:
                raise BadInput(f"--shape {s}: one value per axis ({many[0]} has {len(vals[many[0]])}); "
                               f"-a {many[0]}=V1,V2 runs several")
            base.append({**DEFAULT_AXES, **{k: v[0] for k, v in vals.items()}})
        rows = base
    else:
        name = sweep or "smoke"
        if name not in cfg.sweeps:
            raise BadInput(f"no sweep named {name!r} (have: {', '.join(cfg.sweeps)})")
        rows = [asdict(s) for s in cfg.sweeps[name][1]]
    ov = parse_assignments(overrides or [], "-a")
    if ov:
        rows = [{**r, **combo} for r in rows for combo in _product(ov)]
    return list(dict.fromkeys(_make_shape(r, "--shape") for r in rows))


# ---------------------------------------------------------------------------------------------- inputs
def make_inputs(shape: Shape, seed: int, device):
    """Random q and paged KV on the GPU (shuffled pages), DDTree / chain / star / random trees from the
    reference. Returns (VerifyInputs, tree sizes, prefix lens)."""
    import torch

    from kdev import abi, ddtree, vectors
    from kdev.config import CaseSpec, TreeSpec, load_model

    rng = np.random.default_rng(seed)
    if shape.tree == "ddtree":
        ts = TreeSpec("ddtree", budget=shape.budget, depth=15, topk=shape.budget, vocab=32000)
    else:
        ts = TreeSpec(shape.tree, nodes=shape.T)
    spec = CaseSpec("bench", (shape.prefix,) * shape.batch, ts, shape.heads, shape.page_size, seed, "kimi-k2.6",
                    None)
    trees, _ = vectors.make_trees(spec, rng)
    sizes = [t.size for t in trees]
    g = torch.Generator(device=device).manual_seed(seed)
    n_q = sum(sizes)
    q = torch.randn(n_q, shape.heads, QK_DIM, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    pages = [-(-(shape.prefix + t) // shape.page_size) for t in sizes]
    num_pages = sum(pages)
    kv = torch.randn(num_pages, shape.page_size, QK_DIM, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)
    perm = torch.randperm(num_pages, generator=g, device=device).to(torch.int32)
    page_table = torch.zeros(shape.batch, max(pages), dtype=torch.int32, device=device)
    off = 0
    for b, n in enumerate(pages):
        page_table[b, :n] = perm[off:off + n]
        off += n
    mask = torch.from_numpy(ddtree.batch_tree_mask(trees).view(np.int64)).to(device)
    indptr = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int32, device=device)
    x = abi.VerifyInputs(q, kv, page_table, torch.tensor(spec.prefix_lens, dtype=torch.int32, device=device), indptr,
                         mask, load_model("kimi-k2.6").softmax_scale, max_qlen=max(sizes),
                         max_kv_len=max(shape.prefix + t for t in sizes))
    return x, sizes, list(spec.prefix_lens)


# -------------------------------------------------------------------------------------------- backends
class Runner:
    """Constructed = prepared; run() launches once on the current stream; out/lse hold the last outputs;
    poison() fills them with NaN (before every timed sample, outside the timed region)."""

    out = None
    lse = None

    def run(self) -> None:
        raise NotImplementedError

    def poison(self) -> None:
        for t in (self.out, self.lse):
            if t is not None:
                t.fill_(float("nan"))


class AbiRunner(Runner):
    def __init__(self, lib, kernel: str, x):
        self.lib, self.kernel = lib, kernel
        self.out, self.lse = lib.alloc_outputs(x)
        self.p = lib.params(x, self.out, self.lse)
        self.ws = lib.alloc_workspace(kernel, self.p, x.q.device)
        from kdev.abi import FLASH_KERNELS

        self.splits = lib.flash_splits(self.p) if kernel in FLASH_KERNELS else None

    def run(self) -> None:
        self.lib.call(self.kernel, self.p)


def _gathered(x):
    """Per request: contiguous K [S, 576] and the bool mask [T, S] (prefix all True, tree from the bits)."""
    import torch

    from kdev import mla

    out = []
    ind = x.q_indptr.tolist()
    for b, L in enumerate(x.prefix_lens.tolist()):
        T = ind[b + 1] - ind[b]
        k = mla.gather_kv(x.kv_cache, x.page_table[b], L + T).contiguous()
        m = torch.ones(T, L + T, dtype=torch.bool, device=k.device)
        m[:, L:] = mla.unpack_tree_mask(x.tree_mask, slice(ind[b], ind[b + 1]), T)
        out.append((ind[b], ind[b + 1], k, m))
    return out


class TorchEagerRunner(Runner):
    """float32 einsum + masked softmax + einsum, one request at a time."""

    def __init__(self, x):
        import torch

        self.x, self.parts = x, _gathered(x)
        self.out = torch.empty(x.q.shape[0], x.q.shape[1], LATENT_DIM, dtype=torch.float32, device=x.q.device)
        self.lse = torch.empty(x.q.shape[0], x.q.shape[1], dtype=torch.float32, device=x.q.device)

    def run(self) -> None:
        import torch

        for r0, r1, k, m in self.parts:
            kf = k.float()
            s = torch.einsum("thd,sd->ths", self.x.q[r0:r1].float(), kf) * self.x.scale
            s = s.masked_fill(~m[:, None, :], float("-inf"))
            self.lse[r0:r1] = torch.logsumexp(s, -1)
            self.out[r0:r1] = torch.einsum("ths,sc->thc", torch.softmax(s, -1), kf[:, :LATENT_DIM])


class TorchSdpaRunner(Runner):
    """scaled_dot_product_attention with a boolean mask; K/V expanded over heads (no copy)."""

    def __init__(self, x):
        import torch

        self.x, self.parts = x, _gathered(x)
        self.out = torch.empty(x.q.shape[0], x.q.shape[1], LATENT_DIM, dtype=torch.bfloat16, device=x.q.device)

    def run(self) -> None:
        import torch.nn.functional as F

        H = self.x.q.shape[1]
        for r0, r1, k, m in self.parts:
            q = self.x.q[r0:r1].permute(1, 0, 2).unsqueeze(0)  # [1, H, T, 576]
            kk = k[None, None].expand(1, H, -1, -1)
            vv = k[None, None, :, :LATENT_DIM].expand(1, H, -1, -1)
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=m[None, None], scale=self.x.scale)
            self.out[r0:r1] = o[0].permute(1, 0, 2)


class TritonRunner(Runner):
    """kdev/triton_peer.py: the contract as a Triton kernel (heads x nodes packed, split-KV, a Triton combine)
    reading the paged cache itself; construction times its tile sizes at this shape and keeps the fastest
    (recorded as `tiles`)."""

    def __init__(self, x):
        import torch

        from kdev import triton_peer

        sms = torch.cuda.get_device_properties(x.q.device).multi_processor_count
        self.impl = triton_peer.TritonTreeVerify(x, sms)  # compiles, tunes, and leaves the chosen tile's output
        self.out, self.lse, self.splits = self.impl.out, self.impl.lse, self.impl.splits
        self.tiles, self.tiles_tuned = str(self.impl.config), self.impl.tuned or None

    def run(self) -> None:
        self.impl()


class PeerRunner(Runner):
    def __init__(self, fn, x):
        self.fn, self.x = fn, x

    def run(self) -> None:
        x = self.x
        res = self.fn(x.q, x.kv_cache, x.page_table, x.prefix_lens, x.q_indptr, x.tree_mask, x.scale)
        self.out, self.lse = (res if isinstance(res, tuple) else (res, None))


def load_peer(spec: str):
    if ":" not in spec:
        raise BadInput(f"--peer {spec!r}: expected module:function")
    mod, fn = spec.split(":", 1)
    try:
        f = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise BadInput(f"--peer {spec}: cannot load: {e}") from None
    if not callable(f):
        raise BadInput(f"--peer {spec}: not callable")
    return f


def make_runner(name: str, x, lib, peers: dict, others: dict | None = None) -> Runner:
    from kdev.abi import VERIFY_KERNELS

    if name in VERIFY_KERNELS:
        return AbiRunner(lib, name, x)
    if others and name in others:  # KERNEL@REF
        other_lib, kernel = others[name]
        return AbiRunner(other_lib, kernel, x)
    if name == "torch-eager":
        return TorchEagerRunner(x)
    if name == "torch-sdpa":
        return TorchSdpaRunner(x)
    if name == "triton":
        return TritonRunner(x)
    if name in peers:
        return PeerRunner(peers[name], x)
    raise BadInput(f"unknown backend {name!r}")


# ----------------------------------------------------------------------------------------- measurement
@dataclass
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    samples: int
    rel_sem: float  # standard error of the mean over the median
    dropped_throttled: int
    stop: str  # "spread", "time", "max-samples"
    sm_clock_mhz: list = field(default_factory=list)  # [min, max] seen during samples


# A launch through ctypes costs the host tens of microseconds. Were the GPU idle when `start` is recorded, a
# microsecond kernel's sample would time the host's launch path instead of the kernel: a spin kernel of
# ~100 µs queued before `start` keeps the GPU busy until the launch is queued behind it.
HOST_COVER_CYCLES = 200_000


def capture_graph(run):
    """One call of `run` captured into a CUDA graph (after it has run eagerly: lazy set-up stays out of it);
    returns the graph's replay, which launches the same kernels on the same buffers on the current stream."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    torch.cuda.synchronize()
    return graph.replay


def measure(run, method: Method, flush, nvml=None, handle=None, before_sample=None) -> Timing:
    """Cold-L2 samples timed with CUDA events around one call each (method.graph: around the replay of a CUDA
    graph holding one call). before_sample (outputs poisoned, say) runs before the flush, outside the timed region."""
    import torch

    from kdev import gpu

    t_start = time.time()
    for _ in range(method.warmup):
        run()
    torch.cuda.synchronize()
    if method.graph:
        run = capture_graph(run)
    samples, dropped, clocks = [], 0, []
    stop = "max-samples"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu_sleep = getattr(torch.cuda, "_sleep", None)
    while len(samples) < method.max_samples:
        if before_sample is not None:
            before_sample()
        flush.add_(1)  # touches 2x L2 worth of bytes: nothing of the inputs survives in L2
        if gpu_sleep is not None:  # the GPU is still busy when the host records start and launches
            gpu_sleep(HOST_COVER_CYCLES)
        start.record()
        run()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        if nvml is not None and handle is not None:
            if gpu.throttle_reasons(nvml, handle):
                dropped += 1
                if dropped > 4 * method.max_samples:
                    stop = "throttled"
                    break
                continue
            c = gpu.sm_clock_mhz(nvml, handle)
            if c:
                clocks.append(c[0])
        samples.append(ms * 1e3)
        n = len(samples)
        if n >= method.min_samples:
            med = float(np.median(samples))
            sem = float(np.std(samples, ddof=1) / math.sqrt(n))
            if sem <= method.target_rel_spread * med:
                stop = "spread"
                break
        if time.time() - t_start > method.max_seconds and n >= 3:
            stop = "time"
            break
    a = np.array(samples) if samples else np.array([float("nan")])
    med = float(np.median(a))
    sem = float(np.std(a, ddof=1) / math.sqrt(len(a))) if len(a) > 1 else float("nan")
    return Timing(med, float(np.percentile(a, 10)), float(np.percentile(a, 90)), len(samples),
                  sem / med if med else float("nan"), dropped, stop, [min(clocks), max(clocks)] if clocks else [])


# --------------------------------------------------------------------------------------------- ceilings
def ceilings_path(gpu_id: dict) -> Path:
    key = (gpu_id.get("uuid") or gpu_id["name"]).replace(" ", "_").replace("/", "_")
    return REPO_ROOT / ".kdev" / "ceilings" / f"{key}.json"


def load_ceilings(gpu_id: dict) -> dict | None:
    """This GPU's cached ceilings (kdev bench --ceilings), else those configs/gpus.yaml holds as measured on a GPU of
    this name, else None."""
    cached = read_json_record(ceilings_path(gpu_id), ("flops", "bytes_per_s"))  # a damaged cache is no cache
    if cached is not None:
        return cached
    known = [g for g in load_gpus().values() if g.name == gpu_id["name"] and g.ceilings_measured]
    return {"flops": known[0].flops, "bytes_per_s": known[0].bytes_per_s,
            "source": known[0].ceilings_source} if known else None


def save_ceilings(gpu_id: dict, ceilings: dict) -> Path:
    from kdev.fsutil import atomic_write_bytes

    path = ceilings_path(gpu_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, json.dumps({**ceilings, "gpu": gpu_id}, indent=2).encode())
    return path


def measure_ceilings(lib, device) -> dict:
    """bf16 mma.sync m16n8k16 peak (the library's microbenchmark) and device-to-device copy bandwidth."""
    import ctypes

    import torch

    L = lib.lib
    chains = L.kdtree_bench_mma_chains()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    sink = torch.zeros(256, device=device)
    stream = torch.cuda.current_stream()
    blocks, iters = sms * 8, 4096
    best = 0.0
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        st = L.kdtree_bench_mma_peak(blocks, iters, ctypes.c_void_p(sink.data_ptr()), ctypes.c_void_p(stream.cuda_stream))
        e.record()
        e.synchronize()
        if st != 0:
            raise RuntimeError(f"kdtree_bench_mma_peak: status {st} ({cabi.status_text(st)})")
        flops = blocks * 8 * iters * chains * 4096.0
        best = max(best, flops / (s.elapsed_time(e) / 1e3))
    n = 1 << 30  # 2 GiB of bf16 each way
    src = torch.randn(n, device=device, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    bw = 0.0
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        bw = max(bw, 2 * n * 2 / (s.elapsed_time(e) / 1e3))
    return {"flops": best, "bytes_per_s": bw, "source": f"kdev bench --ceilings ({time.strftime('%Y-%m-%d')})",
            "inner_loops": measure_inner_loops(lib, device, best)}


def measure_inner_loops(lib, device, peak_flops: float, only: list[str] | None = None) -> list[dict]:
    """The flash kernel's loop at its occupancy, alone and then piece by piece (kernels/ceilings.cu says
    which loops): per loop the best of five launches, as TFLOP/s and as a fraction of the mma.sync peak just
    measured. The first rungs say what a kernel of that shape could reach if everything but its mma and
    fragment loads were free; each further rung, what one more of the kernel's pieces costs. `only`: these
    rungs by name (BadInput naming the library's rungs for one it lacks)."""
    import ctypes

    import torch

    L = lib.lib
    if not hasattr(L, "kdtree_bench_loop"):  # a library built before the inner loops existed
        if only:
            raise BadInput(f"{lib.path.name} was built before the flash loop ladder: no --loop to run")
        return []
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    sink = torch.zeros(512, device=device)
    # the gathering loops stream tiles from 16 MiB that stay in L2, as the flash kernel's KV tiles mostly do
    # (every row tile's CTA reads the same tile; only the first read comes from HBM)
    src = torch.randn(8 << 20, device=device).to(torch.bfloat16)
    stream = torch.cuda.current_stream()
    tiles = 2048  # ~2 ms per launch at the flash kernel's tile rate: event resolution is not a factor
    names = [L.kdtree_bench_loop_name(i).decode() for i in range(L.kdtree_bench_loop_count())]
    for n in only or []:
        if n not in names:
            raise BadInput(f"no loop {n!r} in {lib.path.name}; it has: {', '.join(repr(x) for x in names)}")
    loops = []
    for i, name in enumerate(names):
        if only and name not in only:
            continue
        warps, mma = L.kdtree_bench_loop_warps(i), L.kdtree_bench_loop_mma_per_tile(i)
        tile_bytes = L.kdtree_bench_loop_tile_bytes(i)
        best_s = float("inf")
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            st = L.kdtree_bench_loop(i, sms, tiles, ctypes.c_void_p(src.data_ptr()), src.numel() * 2,
                                     ctypes.c_void_p(sink.data_ptr()), ctypes.c_void_p(stream.cuda_stream))
            e.record()
            e.synchronize()
            if st == cabi.ERR_UNSUPPORTED:  # its buffers exceed the shared memory, or bulk / tensor copies before sm_90
                break
            if st != 0:
                raise RuntimeError(f"kdtree_bench_loop({name}): status {st} ({cabi.status_text(st)})")
            best_s = min(best_s, s.elapsed_time(e) / 1e3)
        if best_s == float("inf"):
            loops.append({"loop": name, "warps_per_sm": warps, "mma_per_warp_tile": mma, "flops": None,
                          "of_peak": None, "copy_bytes_per_s": None, "runs": False})
            continue
        flops = sms * warps * tiles * mma * 4096.0 / best_s
        loops.append({"loop": name, "warps_per_sm": warps, "mma_per_warp_tile": mma, "flops": flops,
                      "of_peak": flops / peak_flops if peak_flops > 0 else None,
                      "copy_bytes_per_s": sms * tiles * tile_bytes / best_s if tile_bytes else None,
                      "runs": True})
    return loops


# ----------------------------------------------------------------------------------------------- running
@dataclass
class Result:
    shape: str
    axes: dict
    backend: str
    flops: float
    bytes: float
    floor_us: float | None
    bound: str  # "compute" or "memory"
    agrees: bool
    check: str
    timing: dict | None
    splits: int | None = None
    tiles: str | None = None  # the tile size a peer with a choice of them took on this GPU (triton)
    tiles_tuned: dict | None = None  # and what each one it tried took at this shape, µs (warm caches)

    @property
    def median_us(self) -> float | None:
        return self.timing["median_us"] if self.timing else None


def _environment(cfg: BenchConfig):
    """(device, L2 flush buffer, nvml, handle, GPU identity, ceilings, L2 bytes) for one bench run."""
    import torch

    from kdev import gpu

    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 64 << 20) or (64 << 20)
    flush = torch.zeros(cfg.method.l2_flush_factor * l2 // 4, dtype=torch.float32, device=device)
    nvml = gpu.load_nvml()
    handle = None
    if nvml is not None:
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:
            handle = None
    ident = gpu.current_gpu(nvml).to_dict()
    return device, flush, nvml, handle, ident, load_ceilings(ident), l2


def _provenance(cfg: BenchConfig, lib, ident: dict, ceil, seed: int, l2: int) -> dict:
    import torch

    return {"gpu": ident, "ceilings": ceil, "method": {k: v for k, v in asdict(cfg.method).items()},
            "build_info": lib.build_info, "library": str(lib.path), "seed": seed, "torch": torch.__version__,
            "l2_bytes": l2, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def run_bench(shapes: list[Shape], backends: list[str], cfg: BenchConfig, lib, peers: dict, seed: int,
              progress=None, others: dict | None = None) -> tuple[list[Result], dict]:
    import torch

    from kdev.abi import VERIFY_KERNELS
    from kdev.compare import compare

    device, flush, nvml, handle, ident, ceil, l2 = _environment(cfg)
    results = []
    for shape in shapes:
        x, sizes, prefixes = make_inputs(shape, seed, device)
        flops, nbytes = flops_bytes(sizes, prefixes, shape.heads)
        floor = bound = None
        if ceil:
            tc, tm = flops / ceil["flops"], nbytes / ceil["bytes_per_s"]
            floor, bound = max(tc, tm) * 1e6, "compute" if tc >= tm else "memory"
        oracle = make_runner("naive", x, lib, peers)
        oracle.run()
        torch.cuda.synchronize()
        ref_out, ref_lse = oracle.out.float().clone(), oracle.lse.clone()  # the oracle is timed (poisoned) too
        for name in backends:
            try:
                runner = make_runner(name, x, lib, peers, others) if name != "naive" else oracle
                runner.run()
                torch.cuda.synchronize()
            except Exception as e:
                # A peer that fails (a Triton version that will not compile it, a --peer that raises) is reported
                # and not ranked, and the run goes on. Our kernels' failures end it: a CUDA error is sticky.
                if name in VERIFY_KERNELS or (others and name in others):
                    raise
                first = (str(e).strip().splitlines() or [""])[0][:200]
                results.append(Result(shape.name, asdict(shape), name, flops, nbytes, floor, bound or "-", False,
                                      f"failed: {type(e).__name__}: {first}", None))
                if progress:
                    progress(f"{shape.name} {name}")
                continue
            c = compare("out", runner.out.float(), ref_out, cfg.method.tolerance)
            ok = c.passed
            reason = c.reason
            if ok and runner.lse is not None:
                cl = compare("lse", runner.lse, ref_lse, PEER_LSE_TOLERANCE)
                ok, reason = cl.passed, cl.reason
            timing = measure(runner.run, cfg.method, flush, nvml, handle, runner.poison) if ok else None
            if timing is not None:
                # The last timed run wrote over NaN: its output must agree too (no stale or partial outputs).
                torch.cuda.synchronize()
                c = compare("out", runner.out.float(), ref_out, cfg.method.tolerance)
                if not c.passed:
                    ok, reason, timing = False, f"timed run: {c.reason}", None
            results.append(Result(shape.name, asdict(shape), name, flops, nbytes, floor, bound or "-", ok,
                                  "ok" if ok else f"disagrees with naive: {reason}",
                                  asdict(timing) if timing else None, getattr(runner, "splits", None),
                                  getattr(runner, "tiles", None), getattr(runner, "tiles_tuned", None)))
            if progress:
                progress(f"{shape.name} {name}")
            del runner
        del oracle, x, ref_out, ref_lse
        torch.cuda.empty_cache()
    prov = _provenance(cfg, lib, ident, ceil, seed, l2)
    if others:  # which build each KERNEL@REF backend ran
        prov["libraries"] = {name: {"library": str(o.path), "build_info": o.build_info}
                             for name, (o, _) in others.items()}
    return results, prov


def _tree_inputs(shape: Shape, seed: int, device):
    """DDTree drafter distributions (depth 15, K = budget), reference trees, a target argmax that follows a
    child 9 times in 10 (long walks), the reference walks, and a paged KV cache holding prefix + tree."""
    import torch

    from kdev import ddtree

    rng = np.random.default_rng(seed)
    B, N, L, ps = shape.batch, shape.budget, shape.prefix, shape.page_size
    dists = [ddtree.synthetic_drafter(rng, 15, N, 32000) for _ in range(B)]
    roots = rng.integers(0, 32000, B)
    trees = [ddtree.build_ddtree(d, N, int(r)) for d, r in zip(dists, roots)]
    T = max(t.size for t in trees)
    tokens = np.full((B, T), -1, np.int32)
    parents = np.full((B, T), -1, np.int32)
    target = np.full((B, T), -1, np.int32)
    walks = []
    for b, tree in enumerate(trees):
        tokens[b, :tree.size], parents[b, :tree.size] = tree.tokens, tree.parents
        first_child = {}
        for i in range(tree.size - 1, 0, -1):
            first_child[int(tree.parents[i])] = i
        for i in range(tree.size):
            c = first_child.get(i)
            target[b, i] = tree.tokens[c] if c is not None and rng.random() < 0.9 else rng.integers(0, 32000)
        walks.append(ddtree.accept_greedy(tree, target[b]))
    pages = -(-(L + T) // ps)
    kv = torch.randn(B * pages, ps, QK_DIM, device=device).to(torch.bfloat16)
    table = torch.randperm(B * pages, device=device).to(torch.int32).reshape(B, pages)
    acc = np.full((B, T), -1, np.int32)
    for b, w in enumerate(walks):
        acc[b, :len(w.nodes)] = w.nodes

    def dev(x, dtype=torch.int32):
        return torch.tensor(np.asarray(x), dtype=dtype, device=device)

    return {
        "trees": trees, "walks": walks, "log_probs": dev(np.stack([d.log_probs for d in dists]), torch.float32),
        "token_ids": dev(np.stack([d.token_ids for d in dists])), "roots": dev(roots),
        "prefix": dev([L] * B), "tokens": dev(tokens), "parents": dev(parents), "target": dev(target),
        "counts": dev([t.size for t in trees]), "kv": kv, "table": table, "accepted": dev(acc),
        "accept_len": dev([len(w.nodes) for w in walks])}


def run_tree_bench(shapes: list[Shape], backends: list[str], cfg: BenchConfig, lib, seed: int,
                   progress=None) -> tuple[list[Result], dict]:
    """Time the DDTree build, the greedy accept walk and the KV compaction; each is checked against the
    reference (kdev/ddtree.py) on its first launch. Compaction counts its bytes (every accepted row read
    and written) against the copy ceiling; build and accept are latency-bound and get no floor."""
    import torch

    from kdev import abi, ddtree

    device, flush, nvml, handle, ident, ceil, l2 = _environment(cfg)
    tk = abi.TreeKernels(lib)
    results = []
    for shape in shapes:
        d = _tree_inputs(shape, seed, device)
        for name in backends:
            problems, nbytes = [], 0.0
            if name == "ddtree-build":
                p, out = tk.prepare_build(d["log_probs"], d["token_ids"], d["roots"], d["prefix"], shape.budget)
                launch = functools.partial(tk.launch, "build", p)
                launch()
                torch.cuda.synchronize()
                for b, tree in enumerate(d["trees"]):
                    if out["parents"][b, :tree.size].tolist() != tree.parents.tolist() or \
                            out["node_tokens"][b, :tree.size].tolist() != tree.tokens.tolist():
                        problems.append(f"request {b}: tree differs from the reference")
            elif name == "accept":
                p, (acc, length, bonus) = tk.prepare_accept(d["tokens"], d["parents"], d["counts"], d["target"])
                launch = functools.partial(tk.launch, "accept", p)
                launch()
                torch.cuda.synchronize()
                for b, w in enumerate(d["walks"]):
                    if acc[b, :len(w.nodes)].tolist() != w.nodes.tolist() or int(bonus[b]) != w.bonus_token:
                        problems.append(f"request {b}: accepted path or bonus differs from the reference")
            elif name == "compact":
                kv = d["kv"]
                want = kv.view(torch.int16).cpu().numpy()
                table = d["table"].cpu().numpy()
                for b, w in enumerate(d["walks"]):
                    want = ddtree.compact_kv(want, table[b], shape.prefix, w.nodes)
                p = tk.prepare_compact(kv, d["table"], d["prefix"], d["accepted"], d["accept_len"])
                launch = functools.partial(tk.launch, "compact", p)
                launch()
                torch.cuda.synchronize()
                if not np.array_equal(kv.view(torch.int16).cpu().numpy(), want):
                    problems.append("KV cache differs from the reference compaction")
                nbytes = 2.0 * QK_DIM * 2 * sum(len(w.nodes) for w in d["walks"])
            else:
                raise BadInput(f"unknown tree backend {name!r}")
            ok = not problems
            timing = measure(launch, cfg.method, flush, nvml, handle) if ok else None
            floor = nbytes / ceil["bytes_per_s"] * 1e6 if (ceil and nbytes) else None
            results.append(Result(shape.name, asdict(shape), name, 0.0, nbytes, floor,
                                  "memory" if nbytes else "latency", ok,
                                  "ok" if ok else "disagrees with the reference: " + problems[0],
                                  asdict(timing) if timing else None))
            if progress:
                progress(f"{shape.name} {name}")
        del d
        torch.cuda.empty_cache()
    return results, _provenance(cfg, lib, ident, ceil, seed, l2)


# ------------------------------------------------------------------------------------------- reporting
def speedups(results: list[dict], reference: str = "flash") -> dict:
    """(shape, backend) -> time(backend) / time(reference) for backends that agreed."""
    by = {(r["shape"], r["backend"]): r for r in results}
    out = {}
    for (shape, backend), r in by.items():
        ref = by.get((shape, reference))
        if ref and ref["timing"] and r["timing"]:
            out[(shape, backend)] = r["timing"]["median_us"] / ref["timing"]["median_us"]
    return out


def judge_targets(results: list[dict], cfg: BenchConfig, gpu_name: str | None = None) -> list[dict]:
    """Per timed backend but naive, at the shapes of `results` that configs name a target for: which shapes its
    median meets (<= target_us) and where it is at least min_naive_speedup times faster than naive. One row per
    backend: {backend, met, missed: [{shape, median_us, target_us}], fast_enough, too_slow: [{shape, speedup,
    wanted}], wanted_speedups, targets_set_for, indicative}; none where the results hold no judged shape.

    gpu_name: the GPU the results were timed on. A target set for another GPU (a sweep's target_gpu) is still
    compared, but the row says `indicative`: a time from an H100 is not the H200's. The speedup over naive is a
    ratio within one run, judged on any GPU."""
    timed = {(r["shape"], r["backend"]): r["timing"]["median_us"] for r in results if r.get("timing")}
    rows = []
    for backend in dict.fromkeys(r["backend"] for r in results):
        if backend == "naive":
            continue
        row = {"backend": backend, "met": [], "missed": [], "fast_enough": [], "too_slow": [], "wanted_speedups": [],
               "targets_set_for": [], "indicative": False}
        for shape in dict.fromkeys(r["shape"] for r in results if r["backend"] == backend):
            t = timed.get((shape, backend))
            target = cfg.targets_us.get(shape)
            if target is not None:
                if t is not None and t <= target:
                    row["met"].append(shape)
                else:
                    row["missed"].append({"shape": shape, "median_us": t, "target_us": target})
                set_for = cfg.target_gpu.get(shape)
                if set_for is not None and set_for not in row["targets_set_for"]:
                    row["targets_set_for"].append(set_for)
                row["indicative"] |= set_for is not None and set_for != gpu_name
            wanted, naive = cfg.min_naive_speedup.get(shape), timed.get((shape, "naive"))
            if wanted is not None and naive is not None:
                if wanted not in row["wanted_speedups"]:
                    row["wanted_speedups"].append(wanted)
                speedup = naive / t if t else None
                if speedup is not None and speedup >= wanted:
                    row["fast_enough"].append(shape)
                else:
                    row["too_slow"].append({"shape": shape, "speedup": speedup, "wanted": wanted})
        if row["met"] or row["missed"] or row["fast_enough"] or row["too_slow"]:
            rows.append(row)
    return rows


def baseline_verdicts(current: list[dict], baseline: list[dict], min_rel: float = 0.03, sigmas: float = 3.0,
                      normalize_by: str | None = None):
    """Per (shape, backend) present in both: FAST / SAME / SLOW. A change counts only when it exceeds both
    min_rel and `sigmas` times the combined relative noise (standard errors of the medians).

    normalize_by: a backend timed in both runs (e.g. naive). Each backend is then judged by its time over
    that backend's time at the same shape in the same run, against the same ratio in the baseline: a clock
    or thermal shift between the two runs moves both and cancels. The reference gets no verdict."""
    base = {(r["shape"], r["backend"]): r for r in baseline if r.get("timing")}
    cur = {(r["shape"], r["backend"]): r for r in current if r.get("timing")}
    out = []
    for r in current:
        b = base.get((r["shape"], r["backend"]))
        if not b or not r.get("timing") or r["backend"] == normalize_by:
            continue
        new, old = r["timing"]["median_us"], b["timing"]["median_us"]
        sems = [r["timing"].get("rel_sem") or 0, b["timing"].get("rel_sem") or 0]
        entry = {"shape": r["shape"], "backend": r["backend"], "baseline_us": old, "current_us": new}
        if normalize_by:
            rc, rb = cur.get((r["shape"], normalize_by)), base.get((r["shape"], normalize_by))
            if not rc or not rb:
                continue  # no reference timing at this shape in one of the runs: nothing to judge against
            ref_new, ref_old = rc["timing"]["median_us"], rb["timing"]["median_us"]
            sems += [rc["timing"].get("rel_sem") or 0, rb["timing"].get("rel_sem") or 0]
            change = (new / ref_new) / (old / ref_old) - 1
            entry.update(reference=normalize_by, reference_change=ref_new / ref_old - 1)
        else:
            change = new / old - 1
        thr = max(min_rel, sigmas * math.sqrt(sum(x * x for x in sems)))
        verdict = "SLOW" if change > thr else "FAST" if change < -thr else "SAME"
        out.append({**entry, "change": change, "threshold": thr, "verdict": verdict})
    return out


def stored_result(name: str) -> Path | None:
    """benchmarks/index.yaml's current result for a GPU of configs/gpus.yaml named `name` (h200), or None where `name`
    is not one (a path, then)."""
    index = REPO_ROOT / "benchmarks" / "index.yaml"
    if Path(name).exists() or not index.is_file():
        return None
    entry = (load_yaml(index) or {}).get(name)
    if not isinstance(entry, dict) or not isinstance(entry.get("current"), str):
        return None
    return index.parent / entry["current"]


def load_results(path: Path) -> dict:
    path = stored_result(str(path)) or path
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise BadInput(f"{path}: not a readable bench result: {e}") from None
    if not isinstance(doc, dict) or "results" not in doc:
        raise BadInput(f"{path}: not a kdev bench result (no 'results')")
    problem = _result_doc_problem(doc)
    if problem:
        raise BadInput(f"{path}: not a kdev bench result: {problem}")
    return doc


def _result_doc_problem(doc: dict) -> str | None:
    """What a stored result lacks that reporting, baselines and plots read; None when it has it all."""
    prov = doc.get("provenance")
    if not isinstance(prov, dict) or not isinstance(prov.get("gpu"), dict) or "name" not in prov["gpu"]:
        return "no provenance.gpu.name"
    ceil = prov.get("ceilings")
    if ceil is not None and not (isinstance(ceil, dict) and all(_is_number(ceil.get(k)) for k in ("flops",
                                                                                               "bytes_per_s"))):
        return "provenance.ceilings without numeric flops and bytes_per_s"
    results = doc["results"]
    if not isinstance(results, list):
        return "'results' is not a list"
    for i, r in enumerate(results):
        if not isinstance(r, dict):
            return f"results[{i}] is not an object"
        for key, kind in (("shape", str), ("backend", str), ("agrees", bool), ("check", str), ("axes", dict)):
            if not isinstance(r.get(key), kind):
                return f"results[{i}].{key} missing or not a {kind.__name__}"
        for key in ("flops", "bytes"):
            if not _is_number(r.get(key)):
                return f"results[{i}].{key} missing or not a number"
        if r.get("floor_us") is not None and not _is_number(r["floor_us"]):
            return f"results[{i}].floor_us is not a number"
        t = r.get("timing")
        timed = isinstance(t, dict) and all(_is_number(t.get(k)) for k in ("median_us", "p10_us", "p90_us"))
        if t is not None and not (timed and "samples" in t and "stop" in t):
            return f"results[{i}].timing lacks median_us, p10_us, p90_us, samples or stop"
    return None


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def write_csv(path: Path, results: list[dict]) -> None:
    import io

    from kdev.fsutil import atomic_write_bytes

    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["shape", *AXES, "backend", "median_us", "p10_us", "p90_us", "samples", "stop", "floor_us",
                "pct_of_floor", "bound", "flops", "bytes", "agrees"])
    for r in results:
        t = r["timing"] or {}
        med = t.get("median_us")
        pct = 100 * r["floor_us"] / med if med and r["floor_us"] else ""
        w.writerow([r["shape"], *(r["axes"][a] for a in AXES), r["backend"], med or "", t.get("p10_us", ""),
                    t.get("p90_us", ""), t.get("samples", ""), t.get("stop", ""), r["floor_us"] or "", pct,
                    r["bound"], r["flops"], r["bytes"], r["agrees"]])
    atomic_write_bytes(Path(path), buf.getvalue().encode())


def plot(path: Path, results: list[dict], metric: str = "time") -> None:
    """Time (or % of the roofline floor) against prefix length, one line per backend and other axes."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from kdev.errors import EnvironmentMissing

        raise EnvironmentMissing("--plot needs matplotlib (pip install 'kdev[plot]')") from None
    groups = {}
    for r in results:
        if not r["timing"]:
            continue
        a = r["axes"]
        key = (r["backend"], a["batch"], a["budget"], a["heads"], a["page_size"], a["tree"])
        y = r["timing"]["median_us"] if metric == "time" else 100 * (r["floor_us"] or 0) / r["timing"]["median_us"]
        groups.setdefault(key, []).append((a["prefix"], y))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for key, pts in sorted(groups.items()):
        pts.sort()
        label = f"{key[0]} B{key[1]} N{key[2]} H{key[3]}" + (f" p{key[4]}" if key[4] != 64 else "")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    if metric == "time":
        ax.set_yscale("log")
    ax.set_xlabel("prefix length L (tokens)")
    ax.set_ylabel("median time (µs)" if metric == "time" else "% of roofline floor")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    tmp = Path(path).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)
    plt.close(fig)
