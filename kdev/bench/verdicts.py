"""The verdicts: speedups, the targets of a sweep, and FAST / SAME / SLOW against a baseline."""

from __future__ import annotations

import math

from kdev import registry
from kdev.bench.sweeps import AXES, BenchConfig, Shape


# ------------------------------------------------------------------------------------------- reporting
def speedups(results: list[dict], reference: str = registry.DEFAULT) -> dict:
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
        if backend == registry.ORACLE:
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
            wanted, naive = cfg.min_naive_speedup.get(shape), timed.get((shape, registry.ORACLE))
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


# How much slower a skewed batch may be than its requests timed alone, summed: past this it is reported as a finding (a
# plan keyed on the longest prefix splits the short requests as if they were long).
SKEW_BOUND = 0.10


def _timed_with(results: list[dict], axis: str):
    """The timed medians by (shape, backend), and each timed result whose shape sets `axis`, with its Shape."""
    timed = {(r["shape"], r["backend"]): r["timing"]["median_us"] for r in results if r.get("timing")}
    found = []
    for r in results:
        axes = r.get("axes") or {}
        if axes.get(axis) and (r["shape"], r["backend"]) in timed:
            found.append((r, Shape(**{k: axes[k] for k in AXES if k in axes})))
    return timed, found


def judge_skew(results: list[dict]) -> list[dict]:
    """Per skewed batch and backend: its median against the sum of its requests' medians timed alone in the same run
    (each distinct request once, times how many the batch holds). None where a request alone was not timed."""
    timed, found = _timed_with(results, "requests")
    rows = []
    for r, shape in found:
        parts = [(a, shape.count(a.prefix, a.budget), timed.get((a.name, r["backend"]))) for a in shape.alone()]
        if any(t is None for _, _, t in parts):
            continue
        alone = sum(n * t for _, n, t in parts)
        batch = timed[(r["shape"], r["backend"])]
        rows.append({"shape": r["shape"], "backend": r["backend"], "batch_us": batch, "alone_sum_us": alone,
                     "ratio": batch / alone, "within": batch <= alone * (1 + SKEW_BOUND),
                     "alone": [{"shape": a.name, "count": n, "median_us": t} for a, n, t in parts]})
    return rows


# How much slower a call may be at a capture's bounds than planned for its own lengths: past this it is reported (a
# graph captured for the largest batch replays the plan of its capture at every smaller one).
CAPTURE_BOUND = 0.05


def judge_capture(results: list[dict]) -> list[dict]:
    """Per shape made at a capture's bounds and backend: its median against its twin's, planned for its own lengths,
    in the same run. None where the twin was not timed."""
    timed, found = _timed_with(results, "capture")
    rows = []
    for r, shape in found:
        own = shape.own()
        if (own.name, r["backend"]) not in timed:
            continue
        replay, planned = timed[(r["shape"], r["backend"])], timed[(own.name, r["backend"])]
        rows.append({"shape": r["shape"], "backend": r["backend"], "capture": shape.capture, "replay_us": replay,
                     "own_us": planned, "own_shape": own.name, "ratio": replay / planned,
                     "within": replay <= planned * (1 + CAPTURE_BOUND)})
    return rows
