"""Stored results: finding (benchmarks/index.yaml), reading and checking a result document, CSV and plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from kdev.bench.sweeps import AXES
from kdev.config import REPO_ROOT, load_yaml
from kdev.errors import BadInput


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
        w.writerow([r["shape"], *(r["axes"].get(a, "") for a in AXES), r["backend"], med or "", t.get("p10_us", ""),
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
