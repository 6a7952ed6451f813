"""Summarise the per-CTA event times that variants/flash-v24-probe-timeline.patch prints from the flash kernels.

usage: python3 scripts/cta_timeline.py BENCH_STDOUT

With the probe applied, every CTA of the teams kernel prints one line
  TLF smid m_tile split b  entry ring_ready team0_first_landed team1_first_landed
      team0_loop_end team1_loop_end team0_stored team1_stored exit      (%globaltimer, ns)
and every narrow-kernel CTA one line
  TLN smid x b  entry exit
(run e.g. `kdev bench --library <probe library> --shape B=1,L=32768,N=64,H=8 --backend flash > out.txt`). Calls run one
after another, so a CTA that enters after every CTA seen so far has exited starts a new call; the first and last call
are dropped. Printed: the median, p10 and p90 over CTAs (or calls) of each interval. The printf itself runs after the
last timestamp, so it lengthens the gaps between a CTA's exit and the next one's entry on the same SM (not usable),
but none of the intervals inside a CTA.
"""
import collections
import statistics
import sys


def _stats(values: list[int]) -> str:
    v = sorted(values)
    return (f"median {statistics.median(v) / 1000:8.2f} us  p10 {v[len(v) // 10] / 1000:8.2f}  "
            f"p90 {v[9 * len(v) // 10] / 1000:8.2f}  n={len(v)}")


def main(path: str) -> int:
    full, narrow = [], []
    with open(path) as f:
        for line in f:
            w = line.split()
            if w and w[0] == "TLF" and len(w) == 14:
                full.append(tuple(int(x) for x in w[1:]))
            elif w and w[0] == "TLN" and len(w) == 6:
                narrow.append(tuple(int(x) for x in w[1:]))
    if not full:
        print(f"{path}: no TLF lines (was the probe patch applied?)", file=sys.stderr)
        return 1
    full.sort(key=lambda r: r[4])
    calls, cur, last_exit = [], [], 0
    for r in full:
        if cur and r[4] > last_exit:
            calls.append(cur)
            cur, last_exit = [], 0
        cur.append(r)
        last_exit = max(last_exit, r[12])
    calls.append(cur)
    print(f"{len(calls)} calls, {len(full)} full-kernel CTAs, {len(narrow)} narrow CTAs")
    per = collections.defaultdict(list)
    for call in calls[1:-1]:
        t0 = min(r[4] for r in call)
        end = max(r[12] for r in call)
        per["call: first entry -> last full-kernel exit"].append(end - t0)
        ends = sorted(r[12] - t0 for r in call)
        per["call: CTA exits p10 -> p90"].append(ends[9 * len(ends) // 10] - ends[len(ends) // 10])
        nr = [r for r in narrow if t0 <= r[3] <= end]
        if nr:
            per["call: first entry -> last narrow exit"].append(max(r[4] for r in nr) - t0)
        for (_sm, _m, _s, _b, entry, ready, land0, land1, loop0, loop1, st0, st1, exit_) in call:
            per["CTA: entry -> ring ready"].append(ready - entry)
            per["CTA: entry -> team 0 first tile landed"].append(land0 - entry)
            per["CTA: entry -> team 1 first tile landed"].append(land1 - entry)
            per["CTA: team 0 tile loop"].append(loop0 - land0)
            per["CTA: team 1 loop end - team 0 loop end"].append(loop1 - loop0)
            per["CTA: team 0 loop end -> stores issued"].append(st0 - loop0)
            per["CTA: team 1 loop end -> stores issued"].append(st1 - loop1)
            per["CTA: entry -> exit"].append(exit_ - entry)
    for name, values in per.items():
        print(f"{name:45s} {_stats(values)}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
