// The flash verify launch's plan: how many KV splits per (request, full row tile), how many per narrow last row tile,
// and where their partials lie in the workspace. Plain host arithmetic on the launch's shape bounds (no CUDA in here
// beyond the host-device marks), shared by the launcher and kernels (verify_attn_flash.cu) and a host-compiled test of
// its choices (tests/test_flash_plan.py).
#pragma once

#include <cmath>
#include <cstddef>

#include "kdev/kdtree.h"

#ifdef __CUDACC__
#define KDTREE_HOST_DEVICE __host__ __device__
#else
#define KDTREE_HOST_DEVICE
#endif

namespace kdtree {

// The tiling, as kdtree.h states it for callers (the combine kernel's weights hold kMaxSplits: four per lane of its
// warp 0).
constexpr int kBlockM = KDTREE_FLASH_BLOCK_M;
constexpr int kBlockN = KDTREE_FLASH_BLOCK_N;
constexpr int kNarrowRows = KDTREE_FLASH_NARROW_ROWS;
constexpr int kMaxSplits = KDTREE_FLASH_MAX_SPLITS;
// A narrow tile's time over a full tile's: measured 0.48 (Nsight Compute, B1 L32K N64 H8: a narrow CTA over two
// splits' range 150.8 us, a full CTA over one 155.6 us; NOTES.md, flash v16).
constexpr double kNarrowTileCost = 0.5;
// The same for a narrow CTA that starts after the full-tile kernel: measured 1.06-1.07 (the v29 timeline: at B16 a wave
// of 132 narrow CTAs of 25.7 tiles took 54.8 us after the last full CTA, at B4 128 of 21.8 tiles 48.0 us; NOTES.md, flash
// v29). Beside the full CTAs a narrow CTA reads KV that they read too, from L2; after them a wave of narrow CTAs reads it
// all from memory at once.
constexpr double kNarrowColdTileCost = 1.05;

struct FlashSplitPlan {
  int num_m_tiles;    // ceil(max_qlen * heads / 64)
  int num_splits;     // KV splits per (request, full row tile)
  int narrow_splits;  // KV splits of a request's narrow last row tile, cut on their own; 0: no narrow kernel
};

// The model's time, in KV tiles, of a launch whose full-tile CTAs all take `full_cta` and narrow CTAs `narrow_cta`
// (`narrow_cold_cta` once the full-tile kernel has ended). One CTA per SM. The full-tile CTAs run in waves; the narrow
// kernel is launched behind them programmatically, so its CTAs start once every full-tile CTA has started: on the SMs the
// last full wave leaves, from that wave's start, then on every SM as that wave ends (list scheduling of equal jobs on two
// groups of SMs, in closed form).
inline double flash_launch_time(long full_ctas, double full_cta, long narrow_ctas, double narrow_cta,
                                double narrow_cold_cta, int sm_count) {
  const long waves = (full_ctas + sm_count - 1) / sm_count;
  const long last_wave = full_ctas - (waves - 1) * sm_count;  // CTAs of the last full wave (sm_count if none)
  const double t1 = (double)waves * full_cta;                // when the full-tile kernel ends
  if (narrow_ctas == 0) return t1;
  const long early = waves > 0 ? sm_count - last_wave : 0;  // SMs free from t0, the last full wave's start
  const long late = sm_count - early;                        // SMs free from t1
  const double t0 = waves > 0 ? t1 - full_cta : 0.0;
  long rest = narrow_ctas;
  double delta = 0.0;  // an early SM's first start at or after t1, less t1
  if (early > 0) {
    const long before = (long)std::ceil((t1 - t0) / narrow_cta);  // starts per early SM before t1
    if (rest <= early * before) return std::fmax(t1, t0 + (double)((rest + early - 1) / early) * narrow_cta);
    rest -= early * before;
    delta = t0 + (double)before * narrow_cta - t1;
  }
  // from t1 every SM: each period the late SMs start at t1 + j narrow_cold_cta, the early ones delta after them
  const long periods = (rest - 1) / sm_count, last = rest - periods * sm_count;
  return t1 + (double)periods * narrow_cold_cta + (last > late ? delta : 0.0) + narrow_cold_cta;
}

// A launch's bounds in the planner's terms: the largest request's row tiles, how many are full and whether the last is
// narrow (<= kNarrowRows rows), its KV tiles, and the most splits a KV range may take (256 tokens each at least, and
// what the combine holds).
struct FlashShape {
  int num_m_tiles;
  long full, narrow;
  double tiles;
  int max_splits;
};
inline FlashShape flash_shape(int max_qlen, int heads, int max_kv_len) {
  FlashShape f{};
  f.num_m_tiles = (max_qlen * heads + kBlockM - 1) / kBlockM;
  f.narrow = max_qlen * heads - (f.num_m_tiles - 1) * kBlockM <= kNarrowRows ? 1 : 0;
  f.full = f.num_m_tiles - f.narrow;
  f.tiles = (double)max_kv_len / kBlockN;
  const int by_len = (max_kv_len + 255) / 256;
  f.max_splits = by_len < kMaxSplits ? by_len : kMaxSplits;
  return f;
}

// A CTA's time is its KV tiles plus a fixed cost worth ~6 tiles of traffic (the 72 KB Q load, the 128 KB fp32 partial
// and its share of the combine). A narrow tile is charged kNarrowTileCost of a full one beside the full-tile kernel and
// kNarrowColdTileCost after it. The plan counts the largest request's row tiles (every request alike in the targets).
// flash_split_cost is the launch's time, in KV tiles, for s splits of every full row tile and sn of every narrow one;
// infinity for a choice the planner may not take (fewer than 256 tokens (8 tiles) per split, more splits than the
// combine holds, sn = 0 with a narrow tile or sn > 0 without one, s > 1 without a full tile). kdtree_flash_split_cost
// reports it.
inline double flash_split_cost(int batch, int max_qlen, int heads, int max_kv_len, int sm_count, int s, int sn) {
  const auto [num_m_tiles, full, narrow, tiles, max_splits] = flash_shape(max_qlen, heads, max_kv_len);
  if (s < 1 || s > max_splits || (full == 0 && s > 1)) return HUGE_VAL;
  if (narrow ? sn < 1 || sn > max_splits : sn != 0) return HUGE_VAL;
  const double full_cta = tiles / s + 6.0;
  const double narrow_cta = narrow ? kNarrowTileCost * tiles / sn + 6.0 : 0.0;
  const double narrow_cold_cta = narrow ? kNarrowColdTileCost * tiles / sn + 6.0 : 0.0;
  return flash_launch_time((long)batch * full * s, full_cta, (long)batch * narrow * sn, narrow_cta, narrow_cold_cta,
                           sm_count);
}

// Calls visit(s, sn, cost) for every choice (s full splits, sn narrow ones) whose cost may be at most `bound`, in
// order of s, then sn; the others are ruled out by bounds without their cost: the full tiles' end (t1), a narrow CTA's
// time after the first narrow start, which falls with sn, and the narrow work over the SMs that can take it, which
// grows with sn (both at the cost beside the full tiles, the lesser). So a call weighs tens of choices, not 128 x 129
// (the planner runs on every flash call).
template <typename Visit>
inline void flash_split_choices(int batch, int max_qlen, int heads, int max_kv_len, int sm_count, double bound,
                                Visit&& visit) {
  const auto [num_m_tiles, full, narrow, tiles, max_splits] = flash_shape(max_qlen, heads, max_kv_len);
  for (int s = 1; s <= (full ? max_splits : 1); ++s) {
    const long full_ctas = (long)batch * full * s;
    const double full_cta = tiles / s + 6.0;
    const double t1 = flash_launch_time(full_ctas, full_cta, 0, 0.0, 0.0, sm_count);
    if (t1 > bound) continue;
    if (!narrow) {
      visit(s, 0, t1);
      continue;
    }
    const long waves = (full_ctas + sm_count - 1) / sm_count;
    const long early = waves > 0 ? sm_count - (full_ctas - (waves - 1) * sm_count) : 0;
    const double t0 = waves > 0 ? t1 - full_cta : 0.0, first = early > 0 ? t0 : t1;
    // a narrow CTA ends after the first narrow start: first + kNarrowTileCost tiles / sn + 6 <= bound
    const double room = bound - first - 6.0;
    if (room <= 0.0) continue;
    int sn = (int)std::ceil(kNarrowTileCost * tiles / room - 1e-9);
    for (sn = sn < 1 ? 1 : sn; sn <= max_splits; ++sn) {
      // the narrow work, batch (kNarrowTileCost tiles + 6 sn), on the early SMs until t1, then on every SM
      const double work = (double)batch * (kNarrowTileCost * tiles + 6.0 * sn);
      const double early_room = (double)early * (t1 - t0);
      const double end = work <= early_room ? t0 + work / early : t1 + (work - early_room) / sm_count;
      if (end > bound) break;
      visit(s, sn, flash_split_cost(batch, max_qlen, heads, max_kv_len, sm_count, s, sn));
    }
  }
}

// Pick the split counts (full tiles, narrow tiles) of least flash_split_cost; of the choices within 0.1 % of it, the
// fewest splits, full first: fewer partials to write and merge. The first bound is the cost of cutting the narrow
// tiles by half the full tiles' count, the choice v16 to v28 made. (v2 used waves / s + 0.01 (s - 1), which
// under-split; NOTES.md.)
inline FlashSplitPlan plan_flash_splits(int batch, int max_qlen, int heads, int max_kv_len, int sm_count) {
  const FlashShape shape = flash_shape(max_qlen, heads, max_kv_len);
  const bool narrow = shape.narrow != 0;
  FlashSplitPlan plan{};
  plan.num_m_tiles = shape.num_m_tiles;
  double least = HUGE_VAL;
  for (int s = 1; s <= kMaxSplits; ++s) {
    const double cost = flash_split_cost(batch, max_qlen, heads, max_kv_len, sm_count, s, narrow ? (s + 1) / 2 : 0);
    least = cost < least ? cost : least;
  }
  flash_split_choices(batch, max_qlen, heads, max_kv_len, sm_count, least, [&](int, int, double cost) {
    least = cost < least ? cost : least;
  });
  plan.num_splits = 0;
  flash_split_choices(batch, max_qlen, heads, max_kv_len, sm_count, least * (1 + 1e-3), [&](int s, int sn, double cost) {
    if (plan.num_splits == 0 && cost <= least * (1 + 1e-3)) {
      plan.num_splits = s;
      plan.narrow_splits = sn;
    }
  });
  return plan;
}

// The split partials in the caller's workspace (fp32): the full row tiles' [num_splits][rows][512] values, then their
// [num_splits][rows] LSEs, padded to 256 B; then the narrow tiles' [narrow_splits][batch x 16][512] and
// [narrow_splits][batch x 16] (row b x 16 + i: row i of request b's narrow tile). A part whose split count is 1 is
// empty (those rows are written to out directly). Counts of floats.
KDTREE_HOST_DEVICE inline size_t flash_full_partials_floats(int num_splits, size_t rows) {
  return num_splits > 1 ? ((size_t)num_splits * rows * (KDTREE_V_DIM + 1) + 63) / 64 * 64 : 0;
}
KDTREE_HOST_DEVICE inline size_t flash_narrow_partials_floats(int narrow_splits, int batch) {
  return narrow_splits > 1 ? (size_t)narrow_splits * batch * kNarrowRows * (KDTREE_V_DIM + 1) : 0;
}

}  // namespace kdtree
