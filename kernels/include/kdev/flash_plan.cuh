// The flash verify launch's plan: how many KV splits per (request, row tile), and how many splits' ranges one
// CTA of the narrow kernel covers. Plain host arithmetic on the launch's shape bounds (no CUDA in here), shared by
// the launcher (verify_attn_flash.cu) and a host-compiled test of its choices (tests/test_flash_plan.py).
#pragma once

#include <cmath>

namespace kdtree {

constexpr int kBlockM = 64;      // rows (node x head) per CTA of the full-tile kernel
constexpr int kBlockN = 32;      // KV tokens per tile
constexpr int kNarrowRows = 16;  // a last row tile of at most this many rows runs in the narrow kernel
constexpr int kMaxSplits = 128;  // the combine kernel's weights hold this many splits (four per lane of its warp 0)
// A narrow tile's time over a full tile's: measured 0.48 (Nsight Compute, B1 L32K N64 H8: a narrow CTA over two
// splits' range 150.8 us, a full CTA over one 155.6 us; NOTES.md, flash v16).
constexpr double kNarrowTileCost = 0.5;

struct FlashSplitPlan {
  int num_m_tiles;  // ceil(max_qlen * heads / 64)
  int num_splits;   // KV splits per (request, row tile)
  int narrow_span;  // splits whose KV range one narrow CTA covers; 0: no narrow kernel (last tile > 16 rows)
};

// One CTA per SM. A CTA's time is its KV tiles plus a fixed cost worth ~6 tiles of traffic (the 72 KB Q load, the
// 128 KB fp32 partial and its share of the combine); the kernel's time is the number of waves times the longest
// CTA's. A narrow tile is charged kNarrowTileCost of a full one. The plan counts the largest request's row tiles
// (every request alike in the targets). flash_split_cost is that time, in KV tiles, for s splits with a narrow CTA over
// sp of them; infinity for a choice the planner may not take (fewer than 256 tokens (8 tiles) per split, more splits
// than the combine holds, sp outside 1..2, or sp = 2 without a narrow tile). kdtree_flash_split_cost reports it.
inline double flash_split_cost(int batch, int max_qlen, int heads, int max_kv_len, int sm_count, int s, int sp) {
  const int num_m_tiles = (max_qlen * heads + kBlockM - 1) / kBlockM;
  const double tiles = (double)max_kv_len / kBlockN;
  const int last_rows = max_qlen * heads - (num_m_tiles - 1) * kBlockM;
  const long narrow = last_rows <= kNarrowRows ? 1 : 0, full = num_m_tiles - narrow;
  const int by_len = (max_kv_len + 255) / 256;
  const int max_splits = by_len < kMaxSplits ? by_len : kMaxSplits;
  if (s < 1 || s > max_splits || sp < 1 || sp > (narrow ? 2 : 1)) return HUGE_VAL;
  const long ctas = (long)batch * (full * s + narrow * ((s + sp - 1) / sp));
  const long waves = (ctas + sm_count - 1) / sm_count;
  const double full_cta = full ? tiles / s + 6.0 : 0.0;
  const double narrow_cta = narrow ? kNarrowTileCost * tiles * (s < sp ? s : sp) / s + 6.0 : 0.0;
  return (double)waves * (full_cta > narrow_cta ? full_cta : narrow_cta);
}

// Pick the split count s, and how many splits' ranges a narrow CTA covers (1 or 2), of least flash_split_cost; a near
// tie (0.1 %) keeps the fewer splits: fewer partials to write and merge. (v2 used waves / s + 0.01 (s - 1), which
// under-split: see NOTES.md.)
inline FlashSplitPlan plan_flash_splits(int batch, int max_qlen, int heads, int max_kv_len, int sm_count) {
  FlashSplitPlan plan{};
  plan.num_m_tiles = (max_qlen * heads + kBlockM - 1) / kBlockM;
  const int last_rows = max_qlen * heads - (plan.num_m_tiles - 1) * kBlockM;
  const bool narrow = last_rows <= kNarrowRows;
  int splits = 1, span = 1;
  double best = 1e300;
  for (int sp = 1; sp <= (narrow ? 2 : 1); ++sp) {
    for (int s = 1; s <= kMaxSplits; ++s) {
      const double cost = flash_split_cost(batch, max_qlen, heads, max_kv_len, sm_count, s, sp);
      if (cost < best * (1 - 1e-3)) {
        best = cost;
        splits = s;
        span = sp;
      }
    }
  }
  plan.num_splits = splits;
  plan.narrow_span = narrow ? span : 0;
  return plan;
}

}  // namespace kdtree
