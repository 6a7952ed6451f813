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
static void exhaustive(int batch, int qlen, int heads, int kv, int sms, int* s_out, int* sn_out) {
  double least = HUGE_VAL;
  for (int s = 1; s <= kdtree::kMaxSplits; ++s)
    for (int sn = 0; sn <= kdtree::kMaxSplits; ++sn) {
      const double c = kdtree::flash_split_cost(batch, qlen, heads, kv, sms, s, sn);
      least = c < least ? c : least;
    }
  for (int s = 1; s <= kdtree::kMaxSplits; ++s)
    for (int sn = 0; sn <= kdtree::kMaxSplits; ++sn)
      if (kdtree::flash_split_cost(batch, qlen, heads, kv, sms, s, sn) <= least * (1 + 1e-3)) {
        *s_out = s;
        *sn_out = sn;
        return;
      }
}
int main(int argc, char**) {
  int batch, qlen, heads, kv, sms;
  while (std::scanf("%d %d %d %d %d", &batch, &qlen, &heads, &kv, &sms) == 5) {
    const kdtree::FlashSplitPlan p = kdtree::plan_flash_splits(batch, qlen, heads, kv, sms);
    int s = 0, sn = 0;
    if (argc > 1) exhaustive(batch, qlen, heads, kv, sms, &s, &sn);
    std::printf("%d %d %d %d %d\n", p.num_m_tiles, p.num_splits, p.narrow_splits, s, sn);
  }
}
"""


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler on PATH")
    d = tmp_path_factory.mktemp("flash_plan")
    (d / "plan.cpp").write_text(PROGRAM)
    subprocess.run([CXX, "-std=c++17", "-O1", f"-I{INCLUDE}", str(d / "plan.cpp"), "-o", str(d / "plan")],
                   check=True, capture_output=True, text=True)

    def run(shapes, exhaustive=False):
        out = subprocess.run([str(d / "plan")] + (["exhaustive"] if exhaustive else []),
                             input="".join(" ".join(map(str, s)) + "\n" for s in shapes),
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
    for shape, (_, splits, narrow_splits, s, sn) in zip(shapes, plan(shapes, exhaustive=True)):
        assert (splits, narrow_splits) == (s, sn), shape


def test_no_split_where_one_wave_of_whole_ranges_fills_the_gpu(plan):
    # 132 requests of one row tile each: splitting would only add waves
    assert plan([(132, 8, 8, 32776, 132)]) == [(1, 1, 0)]
