"""Where a flash call's time goes, CTA by CTA: the records of variants/flash-v24-probe-timeline.patch, summarised.

usage: python3 scripts/cta_timeline.py --library LIB --shape B=16,L=8192,N=32,H=8 [--calls 30] [--save FILE.npy]
       python3 scripts/cta_timeline.py --records FILE.npy

With the probe applied (build it with `kdev build --kernels <patched kernels tree>`), every CTA of the teams kernel, of
the narrow kernel and of the combine kernel (those that merge a row) writes one record of %globaltimer stamps to a
device buffer, which the library's kdtree_cta_probe_read copies out: the teams kernel's entry, ring ready, each team's
first landed tile, loop end and stores issued, and its exit; the narrow kernel's entry and exit (its CTAs apart by
whether they start before the teams kernel's last exit, beside CTAs that read the same KV, or after it); the combine
kernel's entry, the release of its wait for the kernels before it, and its exit (what a call spends after its last
tile). The first form runs `--calls` flash calls back to back at one bench shape on this GPU and reads the records (and
saves them with --save); the second summarises saved records. Every CTA runs once per call and the calls one after
another, so a CTA (kernel and blockIdx) seen again starts a new call; the first and last call are dropped. Printed: the
median, p10 and p90 over CTAs (or calls) of each interval, and the gap between one CTA's exit and the next one's entry
on the same SM (teams and narrow CTAs: one at a time per SM).
Exit codes: 0 summary printed, 1 no records (was the probe applied?), 2 bad arguments or records, 3 no library or GPU.
"""
import argparse
import collections
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the kdev package of this tree

RECORD_WORDS = 11  # kind | smid << 8, blockIdx, 9 stamps
PROBE_RECORDS = 1 << 18  # the probe's device buffer (kProbeRecords)
STAMPS = {0: 9, 1: 2, 2: 3}  # per kind: teams, narrow, combine


def _stats(values: list[int]) -> str:
    v = sorted(values)
    return (f"median {statistics.median(v) / 1000:8.2f} us  p10 {v[len(v) // 10] / 1000:8.2f}  "
            f"p90 {v[9 * len(v) // 10] / 1000:8.2f}  n={len(v)}")


def summarise(records: np.ndarray) -> list[str]:
    """The summary lines of an [n, 11] uint64 record array."""
    rows = []
    for r in records.astype(np.int64).tolist():
        kind, sm = r[0] & 0xFF, r[0] >> 8
        if kind not in STAMPS:
            raise ValueError(f"a record of kind {kind}: not a probe record")
        stamps = r[2:2 + STAMPS[kind]]
        rows.append((kind, sm, stamps[0], stamps[-1], stamps, r[1]))
    rows.sort(key=lambda x: x[2])
    # every CTA runs once per call and the calls one after another: a CTA (kernel, blockIdx) seen again starts a call
    calls, cur, seen = [], [], set()
    for row in rows:
        key = (row[0], row[5])
        if key in seen:
            calls.append(cur)
            cur, seen = [], set()
        cur.append(row)
        seen.add(key)
    calls.append(cur)
    n = collections.Counter(r[0] for r in rows)
    out = [f"{len(calls)} calls, {n[0]} teams-kernel CTAs, {n[1]} narrow CTAs" +
           (f", {n[2]} combine CTAs" if n[2] else "")]
    per = collections.defaultdict(list)
    for call in calls[1:-1]:
        t0 = min(r[2] for r in call)
        full = [r for r in call if r[0] == 0]
        narrow = [r for r in call if r[0] == 1]
        combine = [r for r in call if r[0] == 2]
        if full:
            per["call: first entry -> last teams-kernel exit"].append(max(r[3] for r in full) - t0)
            ends = sorted(r[3] - t0 for r in full)
            per["call: teams-kernel exits p10 -> p90"].append(ends[9 * len(ends) // 10] - ends[len(ends) // 10])
        if narrow:
            per["call: first entry -> last narrow exit"].append(max(r[3] for r in narrow) - t0)
            # a narrow CTA beside the teams kernel reads KV its CTAs also read (in L2); one after it, from memory
            full_end = max((r[3] for r in full), default=t0)
            if full:
                per["call: last teams exit -> last narrow exit"].append(max(r[3] for r in narrow) - full_end)
            for r in narrow:
                side = "beside teams" if r[2] < full_end else "after teams"
                per[f"narrow CTA {side}: entry -> exit"].append(r[3] - r[2])
        if combine and (full or narrow):
            # the combine waits for the kernels before it; what follows their last exit (tiles end) is the call's tail
            tiles_end = max(r[3] for r in full + narrow)
            per["call: tiles end -> first combine release"].append(min(r[4][1] for r in combine) - tiles_end)
            per["call: tiles end -> last combine exit"].append(max(r[3] for r in combine) - tiles_end)
            for r in combine:
                per["combine CTA: release -> exit"].append(r[3] - r[4][1])
        for _, _, _, _, (entry, ready, land0, land1, loop0, loop1, st0, st1, exit_), _ in full:
            per["CTA: entry -> ring ready"].append(ready - entry)
            per["CTA: entry -> team 0 first tile landed"].append(land0 - entry)
            per["CTA: entry -> team 1 first tile landed"].append(land1 - entry)
            per["CTA: team 0 tile loop"].append(loop0 - land0)
            per["CTA: team 1 loop end - team 0 loop end"].append(loop1 - loop0)
            per["CTA: team 0 loop end -> stores issued"].append(st0 - loop0)
            per["CTA: team 1 loop end -> stores issued"].append(st1 - loop1)
            per["CTA: entry -> exit"].append(exit_ - entry)
        by_sm = collections.defaultdict(list)
        for r in full + narrow:  # combine CTAs share SMs several at a time
            by_sm[r[1]].append(r)
        for seq in by_sm.values():
            seq.sort(key=lambda r: r[2])
            for a, b in zip(seq, seq[1:]):
                per["SM: one CTA's exit -> the next one's entry"].append(b[2] - a[3])
    out += [f"{name:45s} {_stats(values)}" for name, values in per.items()]
    return out


def _read_on_gpu(library: str, shape: str, calls: int) -> np.ndarray:
    import ctypes

    import torch

    from kdev import abi, bench, registry
    from kdev.errors import EnvironmentMissing

    if not torch.cuda.is_available():
        raise EnvironmentMissing("no CUDA GPU visible to torch")
    lib = abi.Library(library)
    read = getattr(lib.lib, "kdtree_cta_probe_read", None)
    if read is None:
        raise EnvironmentMissing(f"{library}: no kdtree_cta_probe_read (build the library from the probe patch)")
    # typed by kdev/cabi.py from kdtree.h's variant exports, as every entry point is
    (s,) = bench.expand(bench.load_bench(), None, [shape], None)
    x, _, _ = bench.make_inputs(s, 0, torch.device("cuda"))
    runner = bench.AbiRunner(lib, registry.HOST_PLAN_OF[registry.DEFAULT], x)  # the plain launch the probe times
    buf = np.zeros((PROBE_RECORDS, RECORD_WORDS), dtype=np.uint64)
    n = ctypes.c_int(0)
    read(buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)), buf.shape[0], ctypes.byref(n))  # drop earlier records
    for _ in range(calls):
        runner.run()
    if read(buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)), buf.shape[0], ctypes.byref(n)) != 0:
        raise EnvironmentMissing("kdtree_cta_probe_read failed (a CUDA error)")
    if n.value > buf.shape[0]:
        print(f"{n.value - buf.shape[0]} records dropped (buffer full): use fewer --calls", file=sys.stderr)
    return buf[:min(n.value, buf.shape[0])]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--library")
    ap.add_argument("--shape")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--save")
    ap.add_argument("--records")
    a = ap.parse_args(argv)
    if bool(a.records) == bool(a.library and a.shape) or a.calls < 3:
        print("give --records FILE, or --library and --shape (and --calls >= 3)", file=sys.stderr)
        return 2
    from kdev.errors import KdevError

    try:
        records = np.load(a.records) if a.records else _read_on_gpu(a.library, a.shape, a.calls)
    except KdevError as e:  # no library, no GPU, a bad shape: kdev's one line and exit code
        print(e, file=sys.stderr)
        return e.exit_code
    except (OSError, ValueError) as e:
        print(f"{a.records or a.library}: {e}", file=sys.stderr)
        return 2
    if a.save:
        np.save(a.save, records)
    if records.ndim != 2 or records.shape[1] != RECORD_WORDS or len(records) == 0:
        print("no probe records (was the probe patch applied?)", file=sys.stderr)
        return 1
    try:
        print("\n".join(summarise(records)))
    except ValueError as e:
        print(f"{a.records or a.library}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
