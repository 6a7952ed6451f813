"""kdev verify: run the verify kernels on golden vectors (or fresh fuzz cases), compare, keep a ledger.

Per case and kernel: outputs, workspace and every SM's shared memory poisoned with NaN, one launch on the current
stream, status checked, synchronised; then out and lse are compared with the golden float64 reference (compare.py),
and the token-exact check projects the latent outputs through a fixed, seeded per-head W_UV, an output projection
and an LM head, takes the argmax at every tree node and runs the greedy accept walk (ddtree.py). A node
whose reference top-2 logit margin is within the noise of bf16 outputs (TIE_SIGMAS standard deviations of
one bf16 ulp per element, propagated through the projection) is a tie: reported, not failed. With --repeat N
every kernel runs N times and must give the same bits. When several kernels run, each is also compared with the
first (flash against naive).

Each run appends one record to the ledger (kdev/ledger.py); deploy-check reads it. The token-exact check lives in
kdev/tokens.py.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from kdev import abi, cabi, cases, ledger, tokens, vectors
from kdev.compare import Comparison, compare
from kdev.config import (DEFAULT_TOLERANCES, CaseSpec, Tolerance, Tolerances, TreeSpec)

FUZZ_SUITE = "fuzz-failures"
TREE_KERNELS = ("ddtree", "accept", "compact")  # exact-equality kernels of the decoding round


def pairwise_tolerances(t: Tolerances) -> Tolerances:
    """Kernel against kernel: each may sit at the edge of the golden tolerance, on either side."""

    def widen(x: Tolerance) -> Tolerance:
        return Tolerance(atol=2 * x.atol, rtol=2 * x.rtol, cos_diff=4 * x.cos_diff)

    return Tolerances(out=widen(t.out), lse=widen(t.lse))


# ------------------------------------------------------------------------------------------ results
@dataclass
class CaseResult:
    case: str
    kernel: str
    against: str  # "golden" or the name of the kernel it was compared with
    passed: bool
    out: Comparison | None = None
    lse: Comparison | None = None
    token: tokens.TokenResult | None = None
    repeat_identical: bool | None = None
    error: str = ""
    note: str = ""  # what an exact-equality check compared

    def to_dict(self) -> dict:
        d = {"case": self.case, "kernel": self.kernel, "against": self.against, "passed": self.passed,
             "repeat_identical": self.repeat_identical, "error": self.error, "note": self.note}
        for k in ("out", "lse", "token"):
            v = getattr(self, k)
            d[k] = v.to_dict() if v is not None else None
        return d


def _cuda_sync_ok(device) -> str:
    if torch.device(device).type != "cuda":
        return ""
    try:
        torch.cuda.synchronize()
        return ""
    except RuntimeError as e:  # a kernel fault surfaces here
        return f"CUDA error after launch: {e}"


def _padded(flat: torch.Tensor, indptr: list[int], t_max: int, fill: int) -> torch.Tensor:
    """[N_q] in q_indptr layout -> [B, t_max] padded with `fill`."""
    out = torch.full((len(indptr) - 1, t_max), fill, dtype=torch.int32, device=flat.device)
    for b in range(len(indptr) - 1):
        out[b, :indptr[b + 1] - indptr[b]] = flat[indptr[b]:indptr[b + 1]].to(torch.int32)
    return out


def check_tree_kernel(tk: abi.TreeKernels, kernel: str, name: str, tensors: dict, t: dict,
                      device) -> CaseResult | None:
    """ddtree / accept / compact against the reference's golden outputs: exact equality. None when the
    case has nothing for this kernel (ddtree needs drafter distributions). t: the case's tensors already
    on `device` (shared by the three kernels so that a large cache crosses PCIe once)."""
    ind = tensors["q_indptr"].tolist()
    sizes = [b - a for a, b in zip(ind[:-1], ind[1:])]
    B, t_max = len(sizes), max(sizes)
    bad = []
    if kernel == "ddtree":
        if "drafter_log_probs" not in tensors or len(set(sizes)) != 1:
            return None
        roots = t["tree_tokens"][ind[:-1]].to(torch.int32)
        got = tk.build_ddtree(t["drafter_log_probs"].float().contiguous(), t["drafter_token_ids"].to(torch.int32).contiguous(),
                              roots, t["prefix_lens"], t_max - 1)
        torch.cuda.synchronize()
        if got["node_count"].tolist() != sizes:
            bad.append(f"node_count {got['node_count'].tolist()} != {sizes}")
        for key, ref in (("node_tokens", "tree_tokens"), ("parents", "tree_parents"), ("depths", "tree_depths"),
                         ("positions", "tree_positions")):
            if not torch.equal(got[key].flatten().long(), t[ref].long()):
                bad.append(f"{key} differ at {int((got[key].flatten().long() != t[ref].long()).sum())} node(s)")
        if not torch.equal(got["tree_mask"].reshape(B * t_max, -1), t["tree_mask"]):
            bad.append("tree_mask differs")
        note = f"{B} tree(s) of {t_max} nodes equal"
    elif kernel == "accept":
        tokens = _padded(t["tree_tokens"], ind, t_max, -1)
        parents = _padded(t["tree_parents"], ind, t_max, -1)
        target = _padded(t["accept_target"], ind, t_max, -1)
        acc, length, bonus = tk.accept_greedy(tokens, parents, torch.tensor(sizes, dtype=torch.int32, device=device), target)
        torch.cuda.synchronize()
        if not torch.equal(acc, t["accept_nodes"]):
            bad.append("accepted nodes differ")
        if not torch.equal(length, t["accept_len"]):
            bad.append(f"accept_len {length.tolist()} != {t['accept_len'].tolist()}")
        if not torch.equal(bonus, t["bonus_token"]):
            bad.append(f"bonus {bonus.tolist()} != {t['bonus_token'].tolist()}")
        note = f"accepted lengths {t['accept_len'].tolist()} equal"
    else:  # compact
        kv = t["kv_cache"].clone()
        tk.compact_kv(kv, t["page_table"], t["prefix_lens"], t["accept_nodes"], t["accept_len"])
        torch.cuda.synchronize()
        want = t["kv_cache"].clone()
        ps = kv.shape[1]
        pages, slots = [], []
        for b in range(B):
            L = int(tensors["prefix_lens"][b])
            for pos in range(L, L + int(tensors["accept_len"][b])):
                page, offset = cabi.kv_page_offset(tensors["page_table"][b], pos, ps)
                pages.append(int(page))
                slots.append(offset)
        r = len(pages)
        if r:  # slots are distinct, so one indexed write is the same as the row-by-row one
            want[torch.tensor(pages, device=device), torch.tensor(slots, device=device)] = t["compact_rows"]
        diff = cases.cache_bits(kv) != cases.cache_bits(want)  # bitwise, NaN slots included
        if bool(diff.any()):
            bad.append(f"{int(diff.any(-1).sum())} KV row(s) differ from the reference compaction")
        note = f"{r} row(s) moved, rest of the cache bit-identical"
    return CaseResult(name, kernel, "golden", not bad, error="; ".join(bad), note=note)


def check_case(lib: abi.Library, name: str, tensors: dict, scale: float, tol: Tolerances, kernels: list[str],
               repeat: int, proj_cache: dict, device, others: dict | None = None) -> list[CaseResult]:
    """Run every kernel on one case; results against the golden, then each attention kernel against the
    first one (noting where the two gave the same bits). others: {KERNEL@REF name: (Library, kernel)}, kernels of
    another build (abi.load_kernel_refs)."""
    others = others or {}
    results = []
    tree_kernels = [k for k in kernels if k in TREE_KERNELS]
    if tree_kernels:
        tk = abi.TreeKernels(lib)
        on_device = {k: v.to(device) for k, v in tensors.items()}
        for k in tree_kernels:
            try:
                r = check_tree_kernel(tk, k, name, tensors, on_device, device)
            except abi.KernelError as e:
                r = CaseResult(name, k, "golden", False, error=str(e))
            if r is not None:
                results.append(r)
    kernels = [k for k in kernels if k not in TREE_KERNELS]
    if not kernels:
        return results
    x = abi.VerifyInputs.from_case(tensors, scale, device)
    trees = cases.trees_of(tensors)
    heads = x.q.shape[1]
    vocab = max(32000, int(tensors["tree_tokens"].max()) + 1)
    proj = proj_cache.get((heads, vocab))
    if proj is None:
        proj = proj_cache[(heads, vocab)] = tokens.TokenProjector(heads, vocab, device)
    golden_out = tensors["out"].to(device)
    outputs = {}
    for kernel in kernels:
        klib, kname = others.get(kernel, (lib, kernel))
        try:
            out, lse = klib.run(kname, x, sync=False)
            err = _cuda_sync_ok(device)
            if err:
                raise RuntimeError(err)
            identical = None
            if repeat > 1:
                identical = True
                for _ in range(repeat - 1):
                    o2, l2 = klib.run(kname, x)
                    identical &= torch.equal(o2.view(torch.int16), out.view(torch.int16)) and torch.equal(
                        l2.view(torch.int32), lse.view(torch.int32))
        except (abi.KernelError, abi.AbiArgumentError, RuntimeError) as e:  # a refusal too: one line per case
            results.append(CaseResult(name, kernel, "golden", False, error=str(e)))
            continue
        c_out = compare("out", out, tensors["out"], tol.out)
        c_lse = compare("lse", lse, tensors["lse"], tol.lse)
        tok = tokens.token_exact(proj, trees, out, golden_out)
        ok = c_out.passed and c_lse.passed and tok.passed and identical is not False
        results.append(CaseResult(name, kernel, "golden", ok, c_out, c_lse, tok, identical))
        outputs[kernel] = (out, lse, tok)
    if len(outputs) > 1:
        base = kernels[0]
        pt = pairwise_tolerances(tol)
        for kernel in kernels[1:]:
            if kernel not in outputs or base not in outputs:
                continue
            (o, l, tok_t), (ob, lb, tok_b) = outputs[kernel], outputs[base]
            c_out = compare("out", o, ob, pt.out)
            c_lse = compare("lse", l, lb, pt.lse)
            walks_differ = tok_t.accepted != tok_b.accepted
            explained = tok_t.walk_ties + tok_b.walk_ties > 0
            tok = tokens.TokenResult(passed=tok_t.passed and tok_b.passed and (not walks_differ or explained),
                              nodes=tok_t.nodes, node_mismatches=tok_t.node_mismatches + tok_b.node_mismatches,
                              ties=tok_t.ties, walk_mismatches=int(walks_differ and not explained),
                              walk_ties=int(walks_differ and explained), accepted=tok_t.accepted)
            same_bits = torch.equal(o.view(torch.int16), ob.view(torch.int16)) and torch.equal(
                l.view(torch.int32), lb.view(torch.int32))
            results.append(CaseResult(name, kernel, base, c_out.passed and c_lse.passed and tok.passed, c_out, c_lse, tok,
                                      note="bit-identical" if same_bits else ""))
    return results


# ---------------------------------------------------------------------------------------------- fuzz
FUZZ_KV_CACHES = ("bf16", "e4m3", "mixed")  # kdev verify --fuzz --kv-cache: the cache's dtype, or each case draws one


def fuzz_spec(rng: np.random.Generator, name: str, max_prefix: int, max_nodes: int, kv_cache: str = "bf16") -> CaseSpec:
    """A random case: DDTree or random/chain/star tree, ragged batch (prefixes, and in half the cases tree sizes too),
    shuffled pages, page size 1 or 64. Sizes are log-uniform so that small edge cases and large ones both come up.
    kv_cache (FUZZ_KV_CACHES): an e4m3 case stores its cache with a scale of 1.0 (SGLang's uncalibrated one) or a
    calibrated one (1 to 8 times the smallest that fits, rounded to float32), with the e4m3 tolerances (cases.py); its
    draws come from a stream of the case's own seed, so a seed's cases are the same whatever kv_cache says but for their
    cache."""
    batch = int(rng.choice([1, 1, 2, 3, 4, 8]))

    def loguni(hi):
        return int(np.exp(rng.uniform(0, np.log(hi + 1)))) - 1

    prefix = tuple(loguni(max_prefix) for _ in range(batch))
    nodes = max(1, loguni(max_nodes))
    if rng.random() < 0.5:
        budget = max(1, min(nodes - 1, 1024)) if nodes > 1 else 1
        tree = TreeSpec("ddtree", budget=budget, depth=int(rng.integers(1, 16)), topk=min(budget, 4000), vocab=4000,
                        sharpness=float(rng.uniform(0.3, 3.0)), ties=bool(rng.random() < 0.3),
                        ragged=batch > 1 and bool(rng.random() < 0.5))
    else:
        tree = TreeSpec(str(rng.choice(["random", "random", "chain", "star"])), nodes=nodes,
                        ragged=batch > 1 and bool(rng.random() < 0.5))
    heads = int(rng.choice([1, 3, 8, 8, 16, 16, 20, 64]))
    if nodes * heads * batch > 65536:  # keep one case's reference and oracle runs around a second
        heads = max(1, 65536 // (nodes * batch))
    spec = CaseSpec(name=name, prefix_lens=prefix, tree=tree, heads=heads, page_size=int(rng.choice([1, 64])),
                    seed=int(rng.integers(0, 2**31 - 1)), model="kimi-k2.6", tolerances=DEFAULT_TOLERANCES)
    own = np.random.Generator(np.random.PCG64([spec.seed, 8]))  # the cache's draws: not the run's stream
    if kv_cache == "bf16" or (kv_cache == "mixed" and own.random() < 0.5):
        return spec
    calibrated = float(np.float32(cases.E4M3_MIN_SCALE * own.uniform(1.0, 8.0)))
    scale = 1.0 if own.random() < 0.25 else max(calibrated, float(np.nextafter(np.float32(cases.E4M3_MIN_SCALE),
                                                                                np.float32(1))))
    return replace(spec, kv_dtype="e4m3", kv_scale=scale, tolerances=cases.E4M3_TOLERANCES)


def _prefetched_inputs(specs: list[CaseSpec]):
    """Yields (spec, future of its CaseInputs) in order. The CPU-side inputs (random rows, trees, accept
    goldens) are made in worker processes while the GPU checks earlier cases; at most two per worker are
    in flight, so a run of large cases never holds more than a few in memory."""
    import concurrent.futures as cf
    import multiprocessing as mp

    workers = max(1, min(8, (os.cpu_count() or 2) - 1))
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        window = [(s, pool.submit(cases.generate_inputs, s)) for s in specs[:2 * workers]]
        for i in range(len(specs)):
            spec, fut = window.pop(0)
            if i + len(window) + 1 < len(specs):
                nxt = specs[i + len(window) + 1]
                window.append((nxt, pool.submit(cases.generate_inputs, nxt)))
            yield spec, fut


# -------------------------------------------------------------------------------------------- ledger
def summarize(results: list[CaseResult], kernels: list[str]) -> dict:
    per = {}
    for k in kernels:
        rs = [r for r in results if r.kernel == k]
        per[k] = {"cases": len({r.case for r in rs}), "checks": len(rs), "failed": sum(not r.passed for r in rs),
                  "bit_identical_to_first": sum(r.note == "bit-identical" for r in rs if r.against != "golden"),
                  "passed": all(r.passed for r in rs) and bool(rs),
                  "ties": sum(r.token.ties for r in rs if r.token), "worst_abs_out": max(
                      (r.out.max_abs for r in rs if r.out), default=None)}
    return per


def make_record(kind: str, results: list[CaseResult], kernels: list[str], lib: abi.Library, gpu: dict,
                suite: dict, plan_gpu=None, others: dict | None = None) -> dict:
    per = summarize(results, kernels)
    # plan: the GPU (or SM count) whose split plan the flash calls took (kdev verify --plan-gpu); None: this GPU's own
    plan = plan_gpu.to_dict() if plan_gpu else None
    return {
        "schema_version": ledger.LEDGER_SCHEMA, "timestamp": ledger.now_iso(), "kind": kind,
        "source_hash": lib.build_info.get("source_hash"), "build_info": lib.build_info, "library": str(lib.path),
        # whether shared memory was poisoned before each launch (a library from before ABI 7 cannot)
        "shared_memory_poisoned": lib.poisons_shared_memory,
        # the library's bytes: deploy-check --gpus matches each GPU's row to the build it will deploy
        "library_sha256": hashlib.sha256(Path(lib.path).read_bytes()).hexdigest() if Path(lib.path).is_file() else None,
        "gpu": gpu, "plan": plan, "suite": suite, "kernels": per, "passed": all(r.passed for r in results) and bool(results),
        # the builds of the KERNEL@REF kernels (another build's, beside this library's)
        "libraries": {k: {"library": str(o.path), "source_hash": o.build_info.get("source_hash"),
                          "shared_memory_poisoned": o.poisons_shared_memory}
                      for k, (o, _) in (others or {}).items()},
        "failures": [{"case": r.case, "kernel": r.kernel, "against": r.against,
                      "reason": r.error or "; ".join(x for x in (
                          r.out.reason if r.out else "", r.lse.reason if r.lse else "",
                          r.token.label() if r.token and not r.token.passed else "",
                          "bits changed between repeats" if r.repeat_identical is False else "") if x)}
                     for r in results if not r.passed],
    }



# ------------------------------------------------------------------------------------------ running
@dataclass
class VerifyRun:
    kind: str  # "suite" or "fuzz"
    kernels: list
    results: list
    record: dict
    ledger_path: Path | None
    fuzz_seed: int | None = None
    saved_failures: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.record["passed"]


def open_checked_suite(suite_ref: str, allow_stale: bool = False, warn=None) -> vectors.Suite:
    """Open a suite and refuse it (BadInput) when a file fails its sha256, when its generator is stale
    (unless allow_stale), or when its manifest drifted from configs/suites.yaml (named suites only)."""
    from kdev import config
    from kdev.errors import BadInput

    suite = vectors.open_suite(suite_ref, allow_stale=allow_stale, warn=warn)
    suite.check_integrity()
    configured = config.load_suites()
    if suite.name in configured and suite.path.resolve() == (vectors.default_vectors_root() / suite.name).resolve():
        drift = suite.config_drift(configured[suite.name])
        if drift:
            raise BadInput(f"{suite.path}: manifest disagrees with configs/suites.yaml: {drift[0]}")
    return suite


def load_planned_library(lib_path, log, plan_gpu) -> abi.Library:
    """The library to verify, its flash calls planned as for plan_gpu (a plan.PlanTarget) where given."""
    lib = abi.load_library(lib_path, log)
    if plan_gpu is not None:
        lib.plan_as(plan_gpu.sms)
    return lib


def run_suite(suite_ref: str, kernels: list[str], repeat: int = 1, cases: list[str] | None = None,
              allow_stale: bool = False, lib_path=None, log=None, warn=None, progress=None,
              write_ledger: bool = True, plan_gpu=None) -> VerifyRun:
    from kdev import gpu

    suite = open_checked_suite(suite_ref, allow_stale, warn)
    gpu.require_cuda("kdev verify")
    entries = suite.cases
    if cases:
        unknown = sorted(set(cases) - {e["name"] for e in entries})
        if unknown:
            from kdev.errors import BadInput

            raise BadInput(f"{suite.path}: no case named {unknown[0]!r}")
        entries = [e for e in entries if e["name"] in cases]
    lib = load_planned_library(lib_path, log, plan_gpu)
    others = abi.load_kernel_refs(kernels, plan_gpu.sms if plan_gpu else 0, log=log)
    device = torch.device("cuda", torch.cuda.current_device())
    results, proj_cache = [], {}
    for entry in entries:
        tensors = suite.load_case(entry)
        results += check_case(lib, entry["name"], tensors, entry["scale"], suite.tolerances(entry), kernels, repeat,
                              proj_cache, device, others)
        if progress:
            progress(entry["name"])
    info = {"name": suite.name, "path": str(suite.path), "manifest_sha256": suite.manifest_sha256,
            "generator_hash": suite.manifest.get("generator_hash"), "stale": suite.stale,
            "cases": [e["name"] for e in entries], "repeat": repeat}
    record = make_record("suite", results, kernels, lib, gpu.current_gpu().to_dict(), info, plan_gpu, others)
    path = ledger.append_record(record) if write_ledger else None
    return VerifyRun("suite", kernels, results, record, path)


def run_fuzz(n: int, seed: int, kernels: list[str], max_prefix: int, max_nodes: int | None = None, repeat: int = 1,
             lib_path=None, log=None, progress=None, failures_root: Path | None = None,
             write_ledger: bool = True, plan_gpu=None, kv_cache: str = "bf16") -> VerifyRun:
    from kdev import gpu
    from kdev.errors import BadInput

    if kv_cache not in FUZZ_KV_CACHES:
        raise BadInput(f"--kv-cache {kv_cache!r}: one of {', '.join(FUZZ_KV_CACHES)}")

    gpu.require_cuda("kdev verify --fuzz")
    lib = load_planned_library(lib_path, log, plan_gpu)
    others = abi.load_kernel_refs(kernels, plan_gpu.sms if plan_gpu else 0, log=log)
    max_nodes = min(max_nodes or lib.max_qlen, lib.max_qlen)
    device = torch.device("cuda", torch.cuda.current_device())
    rng = np.random.default_rng(seed)
    specs = [fuzz_spec(rng, f"fuzz-{seed}-{i}", max_prefix, max_nodes, kv_cache) for i in range(n)]
    results, saved, proj_cache = [], [], {}
    # where a long fuzz run spends its time (in the record): waiting for the CPU-side inputs, the float64
    # reference on the GPU, and running and checking the kernels
    seconds = {"inputs": 0.0, "reference": 0.0, "check": 0.0}
    for spec, fut in _prefetched_inputs(specs):
        t0 = time.monotonic()
        inputs = fut.result()
        t1 = time.monotonic()
        case = cases.finish_case(inputs, device="cuda")
        t2 = time.monotonic()
        rs = check_case(lib, spec.name, case.tensors, case.scale, spec.tolerances, kernels, repeat, proj_cache, device,
                        others)
        seconds["inputs"] += t1 - t0
        seconds["reference"] += t2 - t1
        seconds["check"] += time.monotonic() - t2
        results += rs
        if not all(r.passed for r in rs):
            saved.append(str(vectors.append_case(failures_root or vectors.default_vectors_root(), FUZZ_SUITE, case,
                                                 "failing fuzz cases, kept as regression vectors")))
        if progress:
            progress(spec.name)
    info = {"name": f"fuzz:{n}", "seed": seed, "max_prefix": max_prefix, "max_nodes": max_nodes, "repeat": repeat,
            "kv_cache": kv_cache, "seconds": {k: round(v, 1) for k, v in seconds.items()}}
    record = make_record("fuzz", results, kernels, lib, gpu.current_gpu().to_dict(), info, plan_gpu, others)
    path = ledger.append_record(record) if write_ledger else None
    return VerifyRun("fuzz", kernels, results, record, path, fuzz_seed=seed, saved_failures=saved)
