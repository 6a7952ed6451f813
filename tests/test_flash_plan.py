"""The flash launch's split plan (kernels/include/kdev/flash_plan.cuh), compiled for the host: the plans at the seven
target shapes (kernels/NOTES.md, flash v16 and v29: what the speed of each depends on), what every plan must satisfy over
a grid of shapes and GPU sizes, and that the planner's pruned search takes what weighing every choice would."""

import itertools
import shutil
import subprocess
from pathlib import Path

import pytest

INCLUDE = Path(__file__).resolve().parents[1] / "kernels" / "include"
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

PROGRAM = r"""
#include <cstdio>
#include "kdev/flash_plan.cuh"
// every choice weighed: the least cost, then the first choice (s, then sn) within 0.1 % of it
static void exhaustive(int batch, int qlen, int heads, int kv, int sms, bool gathered, int* s_out, int* sn_out) {
  double least = HUGE_VAL;
  for (int s = 1; s <= kdtree::kMaxSplits; ++s)
    for (int sn = 0; sn <= kdtree::kMaxSplits; ++sn) {
      const double c = kdtree::flash_split_cost(batch, qlen, heads, kv, sms, s, sn, gathered);
      least = c < least ? c : least;
    }
  for (int s = 1; s <= kdtree::kMaxSplits; ++s)
    for (int sn = 0; sn <= kdtree::kMaxSplits; ++sn)
      if (kdtree::flash_split_cost(batch, qlen, heads, kv, sms, s, sn, gathered) <= least * (1 + 1e-3)) {
        *s_out = s;
        *sn_out = sn;
        return;
      }
}
int main(int argc, char**) {
  int batch, qlen, heads, kv, sms, page;
  while (std::scanf("%d %d %d %d %d %d", &batch, &qlen, &heads, &kv, &sms, &page) == 6) {
    const bool gathered = kdtree::gathered_tiles(page);
    const kdtree::FlashSplitPlan p = kdtree::plan_flash_splits(batch, qlen, heads, kv, sms, gathered);
    int s = 0, sn = 0;
    if (argc > 1) exhaustive(batch, qlen, heads, kv, sms, gathered, &s, &sn);
    std::printf("%d %d %d %d %d\n", p.num_m_tiles, p.num_splits, p.narrow_splits, s, sn);
  }
}
"""


def _compiled(tmp_path_factory, name: str, source: str) -> Path:
    """`source` compiled for the host against kernels/include (skips where there is no C++ compiler)."""
    if CXX is None:
        pytest.skip("no C++ compiler on PATH")
    d = tmp_path_factory.mktemp(name)
    (d / f"{name}.cpp").write_text(source)
    subprocess.run([CXX, "-std=c++17", "-O1", f"-I{INCLUDE}", str(d / f"{name}.cpp"), "-o", str(d / name)],
                   check=True, capture_output=True, text=True)
    return d / name


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    exe = _compiled(tmp_path_factory, "flash_plan", PROGRAM)

    def run(shapes, exhaustive=False, page_size=64):
        out = subprocess.run([str(exe)] + (["exhaustive"] if exhaustive else []),
                             input="".join(" ".join(map(str, (*s, page_size))) + "\n" for s in shapes),
                             check=True, capture_output=True, text=True).stdout
        rows = [tuple(map(int, line.split())) for line in out.splitlines()]
        return rows if exhaustive else [r[:3] for r in rows]
    return run


# (batch, max_qlen T, heads, max_kv_len L + T, SMs) -> (row tiles, full splits, narrow splits); on the H200
TARGETS = {
    (1, 65, 8, 32833, 132): (9, 15, 8),     # 8 full tiles x 15 + 8 narrow CTAs = 128: one wave
    (1, 65, 8, 131137, 132): (9, 31, 16),
    (4, 65, 8, 32833, 132): (9, 4, 48),     # 128 full CTAs in one wave; 192 short narrow ones on the 4 SMs left, then all
    (16, 33, 8, 8225, 132): (5, 2, 10),     # the same: 128 + 160 (v16 to v28: 7 splits, 448 + 64 CTAs in 4 waves)
    (1, 17, 8, 32785, 132): (3, 52, 26),
    (1, 129, 8, 32897, 132): (17, 8, 4),    # 16 x 8 + 4 = 132: one wave (v13 took two at 15 splits)
    (1, 65, 64, 32833, 132): (65, 2, 0),    # 4,160 rows: no narrow tile
}


def test_target_plans(plan):
    shapes = list(TARGETS)
    assert dict(zip(shapes, plan(shapes))) == TARGETS


# The same at page size 1, where the tiles are gathered row by row and a narrow tile is priced at 0.65 of a full one
# (0.5 where tensor copies bring them; flash_plan.cuh, narrow_price): more narrow splits beside one wave of full tiles
TARGETS_PAGE_1 = {
    (1, 65, 8, 32833, 132): (9, 15, 10),    # 120 + 10 = 130: one wave, the narrow CTAs no longer the longest
    (1, 65, 8, 131137, 132): (9, 15, 10),   # one wave of 2,189-token CTAs where page 64 takes two waves of 31 splits
    (4, 65, 8, 32833, 132): (9, 4, 45),
    (16, 33, 8, 8225, 132): (5, 2, 9),
    (1, 17, 8, 32785, 132): (3, 50, 32),
    (1, 129, 8, 32897, 132): (17, 8, 126),  # 128 full CTAs; the tail's 126 short CTAs on the 4 SMs left, then all
    (1, 65, 64, 32833, 132): (65, 2, 0),    # no narrow tile: as at page 64
}


def test_target_plans_at_page_size_1(plan):
    shapes = list(TARGETS_PAGE_1)
    assert dict(zip(shapes, plan(shapes, page_size=1))) == TARGETS_PAGE_1


def test_the_page_size_changes_only_the_plans_with_a_narrow_tile(plan):
    for shape, at_64, at_1 in zip(GRID, plan(GRID), plan(GRID, page_size=1)):
        if at_64[2] == 0:
            assert at_1 == at_64, shape
    assert plan(GRID, page_size=32) == plan(GRID)  # a tile is one tensor copy from 32 tokens a page


GRID = list(itertools.product([1, 3, 16, 64], [1, 2, 17, 33, 65, 129, 1025], [1, 8, 16, 64, 128],
                              [1, 100, 300, 8225, 32833, 262145], [1, 132, 188]))


def test_every_plan_is_well_formed(plan):
    for (batch, qlen, heads, kv, sms), (m_tiles, splits, narrow_splits) in zip(GRID, plan(GRID)):
        rows = qlen * heads
        assert m_tiles == -(-rows // 64)
        most = min(128, -(-kv // 256))
        assert 1 <= splits <= most, (batch, qlen, heads, kv, sms, splits)
        last = rows - (m_tiles - 1) * 64
        assert (narrow_splits == 0) == (last > 16) and narrow_splits <= most
        if m_tiles == 1 and last <= 16:  # no full tile: its split count means nothing, and stays 1
            assert splits == 1


def test_the_pruned_search_takes_what_weighing_every_choice_would(plan):
    # the planner skips choices by bounds; every grid shape on the H200 and the RTX PRO 6000, and the targets
    shapes = [g for g in GRID if g[4] != 1] + list(TARGETS)
    for page_size in (64, 1):
        for shape, (_, splits, narrow_splits, s, sn) in zip(shapes, plan(shapes, exhaustive=True, page_size=page_size)):
            assert (splits, narrow_splits) == (s, sn), (shape, page_size)


def test_no_split_where_one_wave_of_whole_ranges_fills_the_gpu(plan):
    # 132 requests of one row tile each: splitting would only add waves
    assert plan([(132, 8, 8, 32776, 132)]) == [(1, 1, 0)]


# ---- the device schedule (flash_plan.cuh's arithmetic, which the schedule kernel runs on the GPU)
SCHEDULE = r"""
#include <cstdio>
#include <vector>
#include "kdev/flash_plan.cuh"
// stdin: batches, each "B H sms page" then B lines "prefix T"; stdout per batch: the launch's caps, the host plan,
// the schedule's k, the narrow price, each request's (splits, narrow splits, first row, first narrow row), then the
// CTAs' work in order
int main() {
  int B, H, sms, page;
  static kdtree::HostSchedule sch;
  while (std::scanf("%d %d %d %d", &B, &H, &sms, &page) == 4) {
    std::vector<int> prefix(B), qlen(B);
    int max_q = 1, max_kv = 1;
    for (int b = 0; b < B; ++b) {
      if (std::scanf("%d %d", &prefix[b], &qlen[b]) != 2) return 1;
      max_q = qlen[b] > max_q ? qlen[b] : max_q;
      max_kv = prefix[b] + qlen[b] > max_kv ? prefix[b] + qlen[b] : max_kv;
    }
    const kdtree::FlashSplitPlan host = kdtree::plan_flash_splits(B, max_q, H, max_kv, sms, kdtree::gathered_tiles(page));
    const kdtree::FlashLaunch l = kdtree::flash_launch(host, B, max_q, H, sms, true);  // the scheduled call's
    auto request = [&](int b) { return kdtree::schedule_request(prefix[b], qlen[b], H); };
    std::vector<int> units, narrow;
    kdtree::schedule_host(B, sms, l, request, sch,
        [&](long, int b, int m, int s) { units.push_back(b); units.push_back(m); units.push_back(s); },
        [&](long, int b, int s) { narrow.push_back(b); narrow.push_back(s); });
    std::printf("%d %d %d %d %d %d %d %d %d %d\n", l.splits, l.narrow_splits, l.full_tiles, l.units, l.narrow_units,
                l.rows, l.narrow_rows, sch.k, (int)kdtree::flash_workspace(B, l).bytes, l.narrow_price);
    for (int b = 0; b < B; ++b)
      std::printf("%d %d %ld %ld\n", sch.splits[b], sch.narrow_splits[b], sch.first_row[b], sch.first_narrow_row[b]);
    std::printf("%zu", units.size() / 3);
    for (int v : units) std::printf(" %d", v);
    std::printf("\n%zu", narrow.size() / 2);
    for (int v : narrow) std::printf(" %d", v);
    std::printf("\n");
  }
}
"""


@pytest.fixture(scope="module")
def schedule(tmp_path_factory):
    exe = _compiled(tmp_path_factory, "flash_schedule", SCHEDULE)

    def run(batches):  # each (requests, heads, SMs[, page size: 64])
        text = "".join(f"{len(b[0])} {b[1]} {b[2]} {b[3] if len(b) > 3 else 64}\n" +
                       "".join(f"{L} {T}\n" for L, T in b[0]) for b in batches)
        lines = iter(subprocess.run([str(exe)], input=text, check=True, capture_output=True,
                                    text=True).stdout.splitlines())
        out = []
        for reqs, *_ in batches:
            head = list(map(int, next(lines).split()))
            per = [tuple(map(int, next(lines).split())) for _ in reqs]
            u = list(map(int, next(lines).split()))
            n = list(map(int, next(lines).split()))
            out.append({"splits": head[0], "narrow_splits": head[1], "full_tiles": head[2], "units_cap": head[3],
                        "narrow_cap": head[4], "rows_cap": head[5], "narrow_rows_cap": head[6], "k": head[7],
                        "narrow_price": head[9],
                        "requests": per, "units": [tuple(u[1 + 3 * i:4 + 3 * i]) for i in range(u[0])],
                        "narrow": [tuple(n[1 + 2 * i:3 + 2 * i]) for i in range(n[0])]})
        return out
    return run


def _chunk(kv, s):
    return -(-(-(-kv // s)) // 32) * 32


def _ranges(kv, s):
    c = _chunk(kv, s)
    return [(min(kv, i * c), min(kv, i * c + c)) for i in range(s)]


def _makespan(costs, sms):
    """In-order dispatch to the first free SM (what the hardware does with one CTA per SM)."""
    import heapq
    free = [0] * sms
    for c in costs:
        heapq.heapreplace(free, free[0] + c)
    return max(free)


def _host_costs(reqs, heads, sched):
    """The host plan's CTAs on these lengths (the same split counts for every request, each cut by its own length)."""
    costs = []
    for L, T in reqs:
        rows = T * heads
        m = -(-rows // 64)
        narrow = sched["narrow_splits"] > 0 and rows - (m - 1) * 64 <= 16
        costs += [min(_chunk(L + T, sched["splits"]), L + T) + 192] * ((m - narrow) * sched["splits"])
        if narrow:
            costs += [_narrow_cost(min(_chunk(L + T, sched["narrow_splits"]), L + T), sched)] * sched["narrow_splits"]
    return costs


def _narrow_cost(tokens, sched):
    """A narrow CTA's time in tokens: its range at the launch's narrow price (thousandths, as the program reports)."""
    return tokens * sched["narrow_price"] // 1000 + 192


def _sched_costs(reqs, sched):
    costs = [min(_chunk(sum(reqs[b]), sched["requests"][b][0]), sum(reqs[b])) + 192 for b, _, _ in sched["units"]]
    return costs + [_narrow_cost(min(_chunk(sum(reqs[b]), sched["requests"][b][1]), sum(reqs[b])), sched)
                    for b, _ in sched["narrow"]]


def _check(reqs, heads, sms, s):
    """Every KV position of every row tile covered once, the caps held, the partial rows apart."""
    assert len(s["units"]) <= s["units_cap"] and len(s["narrow"]) <= s["narrow_cap"]
    seen = {}
    for b, m, split in s["units"]:
        assert (b, m, split) not in seen
        seen[(b, m, split)] = 1
    rows_used, narrow_used = [], []
    for b, (L, T) in enumerate(reqs):
        splits, nsplits, first, nfirst = s["requests"][b]
        rows = T * heads
        m_tiles = -(-rows // 64)
        narrow = nsplits > 0  # the tail is the narrow kernel's: only a tail, only where the launch has a narrow kernel
        assert not narrow or (s["narrow_splits"] > 0 and rows - (m_tiles - 1) * 64 <= 16)
        full = m_tiles - narrow
        assert 1 <= splits <= min(128, -(-(L + T) // 256))
        assert {(m, sp) for (bb, m, sp) in seen if bb == b} == {(m, sp) for m in range(full) for sp in range(splits)}
        covered = sorted(_ranges(L + T, splits))
        assert covered[0][0] == 0 and covered[-1][1] == L + T
        assert all(a[1] == c[0] for a, c in zip(covered, covered[1:]))
        assert sorted(sp for bb, sp in s["narrow"] if bb == b) == (list(range(nsplits)) if narrow else [])
        if splits > 1 and full:
            rows_used.append((first, first + 64 * m_tiles * splits))
        if narrow and nsplits > 1:
            narrow_used.append((nfirst, nfirst + 16 * nsplits))
    for used, cap in ((rows_used, s["rows_cap"]), (narrow_used, s["narrow_rows_cap"])):
        used.sort()
        assert all(a[1] <= c[0] for a, c in zip(used, used[1:])) and (not used or used[-1][1] <= cap)


def test_the_skewed_batch_is_cut_by_each_request_s_own_length(schedule):
    # kernels/NOTES.md: 1 x 128K + 15 x 2K, budgets 16/64/128 in turn, H = 8, an H100's 132 SMs: the host plan takes one
    # split for every request and the 128K request's row tiles run its whole range each
    budgets = [17, 65, 129]
    reqs = [(131072, 17)] + [(2048, budgets[(i + 1) % 3]) for i in range(15)]
    s, = schedule([(reqs, 8, 132)])
    _check(reqs, 8, 132, s)
    assert s["splits"] == 1 and s["requests"][0][0] >= 16  # the long request cut many ways, the short ones
    assert all(r[0] <= 2 for r in s["requests"][1:])
    ideal = max(sum(_sched_costs(reqs, s)) / 132, max(_sched_costs(reqs, s)))
    mine, host = _makespan(_sched_costs(reqs, s), 132), _makespan(_host_costs(reqs, 8, s), 132)
    assert host > 8 * mine and mine < 1.5 * ideal, (mine, host, ideal)
    assert [b for b, _, _ in s["units"][:2 * s["requests"][0][0]]] == [0] * (2 * s["requests"][0][0])  # longest first


def test_random_batches_are_covered_once_and_balanced(schedule):
    import random
    rng = random.Random(20261206)
    batches = []
    for _ in range(400):
        B = rng.choice([1, 2, 3, 8, 16, 33, 64, 256])
        heads = rng.choice([1, 8, 16, 64, 128])
        sms = rng.choice([8, 132, 188])
        page = rng.choice([1, 64])
        long_tail = rng.random() < 0.5
        reqs = [(rng.choice([rng.randrange(0, 4096), rng.randrange(0, 262144)]) if long_tail
                 else rng.randrange(0, 65536), rng.choice([1, 2, 17, 33, 65, 129, rng.randrange(1, 1026)]))
                for _ in range(B)]
        batches.append((reqs, heads, sms, page))
    worse = []
    for (reqs, heads, sms, _), s in zip(batches, schedule(batches)):
        _check(reqs, heads, sms, s)
        mine, host = _makespan(_sched_costs(reqs, s), sms), _makespan(_host_costs(reqs, heads, s), sms)
        ideal = max(sum(_sched_costs(reqs, s)) / sms, max(_sched_costs(reqs, s)))
        # within the model: no worse than the host plan's CTAs on the same lengths by more than a wave's rounding
        if mine > 1.25 * host:
            worse.append((len(reqs), heads, sms, mine / host))
        assert mine <= 2.5 * ideal + 1, (reqs[:4], heads, sms, mine, ideal)
    assert len(worse) <= len(batches) // 50, worse[:10]


def test_uniform_batches_at_the_bounds_need_no_schedule_but_one_fits(schedule):
    # the kernels run the host plan there (schedule.cuh); the schedule's own choice still fits the launch's caps
    for shape, _ in TARGETS.items():
        batch, T, heads, kv, sms = shape
        reqs = [(kv - T, T)] * batch
        s, = schedule([(reqs, heads, sms)])
        _check(reqs, heads, sms, s)


SPLIT_CHUNK = r"""
#include <cstdio>
#include "kdev/flash_plan.cuh"
int main() {
  int kv_len, splits;
  while (std::scanf("%d %d", &kv_len, &splits) == 2) std::printf("%d\n", kdtree::split_chunk(kv_len, splits));
  return 0;
}
"""


def test_the_split_cut_is_the_same_in_c_and_python(tmp_path_factory, seed):
    """flash_plan.cuh's split_chunk (the kernels' and the schedule's cut) and kdev/plan.py's, on random lengths and split
    counts, the edges too (one token, a whole number of tiles, the longest request)."""
    import random

    from kdev import cabi
    from kdev import plan as kplan

    exe = _compiled(tmp_path_factory, "split_chunk", SPLIT_CHUNK)
    rng = random.Random(seed)
    longest = cabi.MAX_PREFIX + cabi.MAX_QLEN
    pairs = [(rng.randint(1, longest), rng.randint(1, cabi.MAX_SPLITS)) for _ in range(3000)]
    pairs += [(n, s) for n in (1, 31, 32, 33, 64, longest) for s in (1, 2, 3, cabi.MAX_SPLITS)]
    out = subprocess.run([str(exe)], input="".join(f"{n} {s}\n" for n, s in pairs), capture_output=True, text=True,
                         check=True).stdout.split()
    assert [int(x) for x in out] == [kplan.split_chunk(n, s) for n, s in pairs]
    assert kplan.split_chunk(33, 2) == 32 and kplan.split_chunk(65, 2) == 64 and kplan.split_chunk(66, 2) == 64
