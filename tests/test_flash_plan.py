"""The flash launch's split plan (kernels/include/kdev/flash_plan.cuh), compiled for the host: the plans measured at
the seven target shapes (kernels/NOTES.md, flash v16: what the speed of each depends on), and what every plan must
satisfy over a grid of shapes and GPU sizes."""

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
int main() {
  int batch, qlen, heads, kv, sms;
  while (std::scanf("%d %d %d %d %d", &batch, &qlen, &heads, &kv, &sms) == 5) {
    const kdtree::FlashSplitPlan p = kdtree::plan_flash_splits(batch, qlen, heads, kv, sms);
    std::printf("%d %d %d\n", p.num_m_tiles, p.num_splits, p.narrow_span);
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

    def run(shapes):
        out = subprocess.run([str(d / "plan")], input="".join(" ".join(map(str, s)) + "\n" for s in shapes),
                             check=True, capture_output=True, text=True).stdout
        return [tuple(map(int, line.split())) for line in out.splitlines()]
    return run


# (batch, max_qlen T, heads, max_kv_len L + T, SMs) -> (row tiles, splits, narrow span), as benchmarked on the H200
TARGETS = {
    (1, 65, 8, 32833, 132): (9, 15, 2),     # 8 full tiles x 15 + 8 narrow CTAs = 128: one wave
    (1, 65, 8, 131137, 132): (9, 31, 2),
    (4, 65, 8, 32833, 132): (9, 11, 1),     # 15 splits model 0.03 % cheaper: the near tie keeps 11
    (16, 33, 8, 8225, 132): (5, 7, 2),
    (1, 17, 8, 32785, 132): (3, 52, 2),
    (1, 129, 8, 32897, 132): (17, 8, 2),    # 16 x 8 + 4 = 132: one wave (v13 took two at 15 splits)
    (1, 65, 64, 32833, 132): (65, 2, 0),    # 4,160 rows: no narrow tile
}


def test_target_plans_are_the_measured_ones(plan):
    shapes = list(TARGETS)
    assert dict(zip(shapes, plan(shapes))) == TARGETS


def test_every_plan_is_well_formed(plan):
    shapes = list(itertools.product([1, 3, 16, 64], [1, 2, 17, 33, 65, 129, 1025], [1, 8, 16, 64, 128],
                                    [1, 100, 300, 8225, 32833, 262145], [1, 132, 188]))
    for (batch, qlen, heads, kv, sms), (m_tiles, splits, span) in zip(shapes, plan(shapes)):
        rows = qlen * heads
        assert m_tiles == -(-rows // 64)
        assert 1 <= splits <= min(128, -(-kv // 256)), (batch, qlen, heads, kv, sms, splits)
        last = rows - (m_tiles - 1) * 64
        assert (span == 0) == (last > 16) and span in (0, 1, 2)
        if span == 2:  # a narrow CTA over two ranges must leave SMs to the full tiles: fewer CTAs than span 1
            assert splits > 1


def test_no_split_where_one_wave_of_whole_ranges_fills_the_gpu(plan):
    # 132 requests of one row tile each: splitting would only add waves
    assert plan([(132, 8, 8, 32776, 132)]) == [(1, 1, 0)]
