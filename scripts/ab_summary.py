"""Summarise an A/B of two kernel libraries timed in one machine start (scripts/gpu-round.sh --ab).

usage: python3 scripts/ab_summary.py [--normalize-by BACKEND] BASE_1.json CAND_1.json [BASE_2.json CAND_2.json ...]

Each pair is `kdev bench --out-json` of the base library, then of the candidate, on the same sweep, run back to
back. Per shape and backend it prints both medians of every pair and candidate / base, and with --normalize-by
(e.g. naive, the same kernel in both libraries) also that ratio divided by the normalising backend's own
candidate / base: how far the machine drifted between the two runs of a pair is then taken out. The last
columns are the mean over pairs and its spread (max - min): a difference smaller than the spread is noise.
"""
import json
import statistics
import sys


def medians(path: str) -> dict[tuple[str, str], float]:
    with open(path) as f:
        doc = json.load(f)
    out = {}
    for r in doc["results"]:
        if r.get("timing"):
            out[(r["shape"], r["backend"])] = r["timing"]["median_us"]
    return out


def main(argv: list[str]) -> int:
    norm = None
    if argv[:1] == ["--normalize-by"]:
        if len(argv) < 2:
            print("--normalize-by takes a backend", file=sys.stderr)
            return 2
        norm, argv = argv[1], argv[2:]
    if not argv or len(argv) % 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        pairs = [(medians(argv[i]), medians(argv[i + 1])) for i in range(0, len(argv), 2)]
    except (OSError, ValueError, KeyError) as e:
        print(f"cannot read a bench result: {e}", file=sys.stderr)
        return 1
    keys = [k for k in pairs[0][0] if all(k in b and k in c for b, c in pairs)]
    if not keys:
        print("no shape and backend timed in every file", file=sys.stderr)
        return 1
    head = f"{'shape':28} {'backend':8}" + "".join(f" {'base' + str(i + 1):>9} {'cand' + str(i + 1):>9} {'c/b':>7}"
                                                    for i in range(len(pairs)))
    print(head + f" {'mean c/b':>9} {'spread':>7}" + (f"  (c/b over {norm}'s c/b)" if norm else ""))
    for shape, backend in keys:
        ratios, cells = [], ""
        for base, cand in pairs:
            b, c = base[(shape, backend)], cand[(shape, backend)]
            r = c / b
            if norm and backend != norm and (shape, norm) in base and (shape, norm) in cand:
                r /= cand[(shape, norm)] / base[(shape, norm)]
            ratios.append(r)
            cells += f" {b:9.1f} {c:9.1f} {r:7.3f}"
        mean = statistics.fmean(ratios)
        print(f"{shape:28} {backend:8}{cells} {mean - 1:+9.1%} {max(ratios) - min(ratios):7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
