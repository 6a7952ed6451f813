"""Summarise an Nsight Compute CSV of GPU times (gpu__time_duration.sum) per kernel launch.

usage: python3 scripts/kernel_times.py NCU_CSV

Launches are grouped by kernel and grid size (a grid stands for one bench shape: the flash kernel's grid is
(row tiles, splits, batch), the combine kernel's is rows); each group prints its launch count and median time
in µs, in the order the groups first appear. Used by scripts/gpu-round.sh --kernel-times.
"""
import csv
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the kdev package of this tree
from kdev.resources import short_kernel_name  # noqa: E402


def main(path: str) -> int:
    with open(path, newline="") as f:
        # ncu writes its own log lines ("==PROF==") before the CSV header
        lines = [line for line in f if line.startswith('"')]
    groups: dict[tuple[str, str], list[float]] = {}
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(
            row.get("Metric Unit", ""))
        if scale is None:
            print(f"unknown unit {row.get('Metric Unit')!r} in {path}", file=sys.stderr)
            return 1
        name = short_kernel_name(row["Kernel Name"])
        value = float(row["Metric Value"].replace(",", ""))
        groups.setdefault((name, row["Grid Size"]), []).append(value * scale)
    if not groups:
        print(f"no gpu__time_duration.sum rows in {path}", file=sys.stderr)
        return 1
    print(f"{'kernel':45} {'grid':>16} {'launches':>8} {'median us':>10}")
    for (name, grid), times in groups.items():
        print(f"{name:45} {grid:>16} {len(times):8d} {statistics.median(times):10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]) if len(sys.argv) == 2 else (print(__doc__, file=sys.stderr) or 2))
