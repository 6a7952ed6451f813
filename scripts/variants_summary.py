"""Summarise kernels/ variants timed beside the working tree in one machine start (scripts/gpu-round.sh --variants).

usage: python3 scripts/variants_summary.py TREE_1.json TREE_2.json NAME=VARIANT.json [NAME=VARIANT.json ...]

TREE_1 and TREE_2 are `kdev bench --out-json` of the working tree's library on one sweep, run first and last; each
VARIANT is the same sweep on a variant's library, run in between. Per shape and backend it prints both tree medians and
their drift (TREE_2 / TREE_1 - 1: how far the machine moved over the runs, the noise band), then each variant's median
and its ratio to the mean of the two tree runs. A variant that does a stage twice (or leaves one out) prices that
stage; one that changes a stage is a candidate.
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_summary import medians  # noqa: E402  (one reader of bench documents for both summaries)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or any("=" not in a for a in argv[2:]):
        print(__doc__, file=sys.stderr)
        return 2
    variants = [a.split("=", 1) for a in argv[2:]]
    try:
        tree1, tree2 = medians(argv[0]), medians(argv[1])
        timed = [(name, medians(path)) for name, path in variants]
    except (OSError, ValueError, KeyError) as e:
        print(f"cannot read a bench result: {e}", file=sys.stderr)
        return 1
    keys = [k for k in tree1 if k in tree2 and all(k in v for _, v in timed)]
    if not keys:
        print("no shape and backend timed in every file", file=sys.stderr)
        return 1
    width = max(9, *(len(name) for name, _ in timed))
    print(f"{'shape':28} {'backend':8} {'tree1':>9} {'tree2':>9} {'drift':>7}"
          + "".join(f" {name:>{width}} {'vs-tree':>8}" for name, _ in timed))
    for shape, backend in keys:
        t1, t2 = tree1[(shape, backend)], tree2[(shape, backend)]
        tree = statistics.fmean([t1, t2])
        cells = "".join(f" {v[(shape, backend)]:{width}.1f} {v[(shape, backend)] / tree - 1:+8.1%}" for _, v in timed)
        print(f"{shape:28} {backend:8} {t1:9.1f} {t2:9.1f} {t2 / t1 - 1:+7.1%}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
