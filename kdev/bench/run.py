"""A bench run: every shape and backend checked against the oracle, measured, and recorded with its provenance."""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass

import numpy as np

from kdev import registry

from kdev.bench.ceilings import floor_ceiling, load_ceilings
from kdev.bench.measure import measure
from kdev.bench.runners import make_inputs, make_runner
from kdev.bench.sweeps import PEER_LSE_TOLERANCE, BenchConfig, Shape, flops_bytes
from kdev.config import QK_DIM
from kdev.errors import BadInput


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

    return {"gpu": ident, "ceilings": ceil, "floor_ceiling": floor_ceiling(ceil) if ceil else None,
            "method": {k: v for k, v in asdict(cfg.method).items()},
            "build_info": lib.build_info, "library": str(lib.path), "seed": seed, "torch": torch.__version__,
            "l2_bytes": l2, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def run_bench(shapes: list[Shape], backends: list[str], cfg: BenchConfig, lib, peers: dict, seed: int,
              progress=None, others: dict | None = None) -> tuple[list[Result], dict]:
    import torch

    from kdev.abi import VERIFY_KERNELS
    from kdev.bench.runners import LAYER_BACKENDS
    from kdev.compare import compare

    device, flush, nvml, handle, ident, ceil, l2 = _environment(cfg)
    results = []
    for shape in shapes:
        x, sizes, prefixes = make_inputs(shape, seed, device)
        flops, nbytes = flops_bytes(sizes, prefixes, shape.heads)
        floor = bound = None
        if ceil:
            tc, tm = flops / floor_ceiling(ceil)["flops"], nbytes / ceil["bytes_per_s"]
            floor, bound = max(tc, tm) * 1e6, "compute" if tc >= tm else "memory"
        oracle = make_runner(registry.ORACLE, x, lib, peers)
        oracle.run()
        torch.cuda.synchronize()
        ref_out, ref_lse = oracle.out.float().clone(), oracle.lse.clone()  # the oracle is timed (poisoned) too
        for name in backends:
            try:
                runner = make_runner(name, x, lib, peers, others) if name != registry.ORACLE else oracle
                runner.run()
                torch.cuda.synchronize()
            except Exception as e:
                # A peer that fails (a Triton version that will not compile it, a --peer that raises) is reported
                # and not ranked, and the run goes on. Our kernels' failures end it: a CUDA error is sticky.
                if name in VERIFY_KERNELS or name in LAYER_BACKENDS or (others and name in others):
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

    if shape.requests:
        from kdev.errors import BadInput

        raise BadInput(f"{shape.name}: the tree kernels take uniform batches (no requests/budgets)")
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
