"""kdev ab: this build's kernels against another build's on this GPU, in one process.

A change to a kernel is judged on three things, each by a stage that exists on its own: which kernels' machine code
it changed (kdev sass --against), whether both builds pass the golden vectors and where they give the same bits
(kdev verify with KERNEL@REF), and how their times compare at the same shapes in the same run (kdev bench with
KERNEL@REF), where no drift between processes or machine starts enters the ratio. The other build (REF) is a library,
a copy of kernels/ or a git revision (abi.kernel_ref); the default is main. It is the base, and this build the
candidate; or, with REF named as the candidate (kdev ab --candidate, a patch of kernels/ too), the other way round: this
build is the base, and REF's change is what is judged.
"""

from __future__ import annotations

from kdev import abi, bench, registry
from kdev import build as kbuild
from kdev import refs
from kdev.errors import BadInput, EnvironmentMissing

DEFAULT_MIN_CHANGE = 0.01  # in one run the medians' noise is a few tenths of a percent (kernels/NOTES.md)


def ref_names(kernels: list[str], ref: str, ref_is_candidate: bool = False) -> list[str]:
    """The KERNEL@REF names of the other build's kernels, checked (bad input before any GPU is asked for)."""
    bad = [k for k in kernels if k not in abi.VERIFY_KERNELS]
    if bad or not kernels:
        raise BadInput(f"kernel {bad[0] if bad else ''!r}: kdev ab compares {', '.join(abi.VERIFY_KERNELS)}")
    names = [f"{k}@{ref}" for k in kernels]
    for name in names:
        abi.kernel_ref(name)
    if not ref_is_candidate and refs.describe_library_ref(ref) == "patch":  # as the base, its verdicts reversed
        raise BadInput(f"--against {ref}: a patch is a candidate: kdev ab --candidate {ref}")
    return names


def sass_summary(base_lib, lib, arch: str) -> dict:
    """Which kernels' machine code for `arch` differs between the two libraries (sass.compare), or why not known."""
    from kdev import sass

    try:
        rows = sass.compare(sass.parse(sass.dump(base_lib)), sass.parse(sass.dump(lib)), "", [arch])
    except (EnvironmentMissing, BadInput) as e:
        return {"arch": arch, "skipped": str(e)}
    differ = [r for r in rows if r["status"] != "same"]
    return {"arch": arch, "kernels": len(rows), "identical": len(rows) - len(differ),
            "differ": [{"kernel": r["kernel"], "status": r["status"], "changed_instructions": r["changed_instructions"],
                        "hmma_loop_wavefronts": [r["base_hmma_loop_wavefronts"], r["hmma_loop_wavefronts"]]}
                       for r in differ]}


def verify_summary(run, kernel: str, base: str) -> dict:
    """One verify run of [base, kernel]: both against the goldens, and the kernel's checks against the base."""
    pairs = [r for r in run.results if r.kernel == kernel and r.against == base]
    return {"kernel": kernel, "against": base, "suite": run.record["suite"]["name"], "passed": run.passed,
            "checks": len(run.results), "failed": sum(not r.passed for r in run.results),
            "comparisons": len(pairs), "same_bits": sum(r.note == "bit-identical" for r in pairs),
            "failures": run.record["failures"][:5], "ledger": str(run.ledger_path) if run.ledger_path else None}


def _shared_arch(base_lib, cand_lib, gpu_arch: str) -> str:
    """The arch whose machine code both libraries hold for this GPU (sm_90a where both were built for it), else the one
    a build for this GPU targets (the comparison then says which library lacks it)."""
    base = base_lib.build_info.get("archs", [])
    for arch in cand_lib.build_info.get("archs", []):
        if arch in base and kbuild.runs_on([arch], gpu_arch):
            return arch
    return kbuild.build_arch_for(gpu_arch)


def verdicts(results: list[dict], kernels: list[str], ref: str, min_change: float,
             ref_is_candidate: bool = False) -> list[dict]:
    """Per shape and kernel, the candidate's median against the base's from the same run (this build against the
    other, or the other against this one where it is the candidate): FAST / SAME / SLOW (bench.baseline_verdicts: the
    change must exceed min_change and three times the medians' combined noise)."""
    out = []
    for k in kernels:
        this = [r for r in results if r["backend"] == k]
        other = [dict(r, backend=k) for r in results if r["backend"] == f"{k}@{ref}"]
        cand, base = (other, this) if ref_is_candidate else (this, other)
        out += bench.baseline_verdicts(cand, base, min_rel=min_change)
    return out


def run_ab(ref: str, kernels: list[str], shapes: list, cfg, lib_path=None, fuzz: int = 0, seed: int = 0,
           min_change: float = DEFAULT_MIN_CHANGE, log=None, progress=None, ref_is_candidate: bool = False) -> dict:
    """The whole comparison on this GPU; one JSON-able document. REF's build is the base, this one the candidate;
    ref_is_candidate: the other way round."""
    from kdev import gpu, verify

    names = ref_names(kernels, ref, ref_is_candidate)
    gpu.require_cuda("kdev ab")
    lib = abi.load_library(lib_path, log)
    others = abi.load_kernel_refs(names, log=log)
    ref_lib = others[names[0]][0]
    base_lib, cand_lib = (lib, ref_lib) if ref_is_candidate else (ref_lib, lib)
    doc = {"ref": ref, "ref_is": "candidate" if ref_is_candidate else "base", "kernels": kernels,
           "gpu": gpu.current_gpu().to_dict(),
           "base": {"library": str(base_lib.path), "source_hash": base_lib.build_info.get("source_hash")},
           "candidate": {"library": str(cand_lib.path), "source_hash": cand_lib.build_info.get("source_hash")},
           "sass": sass_summary(base_lib.path, cand_lib.path, _shared_arch(base_lib, cand_lib, gpu.current_arch())),
           "verify": []}
    for k, other in zip(kernels, names):
        base, cand = (k, other) if ref_is_candidate else (other, k)  # verify compares the second with the first
        run = verify.run_suite("smoke", [base, cand], lib_path=lib.path, log=log)
        doc["verify"].append(verify_summary(run, cand, base))
        if fuzz:
            run = verify.run_fuzz(fuzz, seed, [base, cand], max_prefix=32768, lib_path=lib.path, log=log)
            doc["verify"].append(verify_summary(run, cand, base))
    backends = [b for pair in zip(names, kernels) for b in pair] + [registry.ORACLE]
    results, prov = bench.run_bench(shapes, backends, cfg, lib, {}, seed, progress, others)
    doc["bench"] = {"provenance": prov, "results": [dict(r.__dict__) for r in results]}
    doc["verdicts"] = verdicts(doc["bench"]["results"], kernels, ref, min_change, ref_is_candidate)
    doc["passed"] = all(v["passed"] for v in doc["verify"])
    return doc
