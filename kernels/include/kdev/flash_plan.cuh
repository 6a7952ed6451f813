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
// A narrow tile's time over a full tile's, per KV tile, in thousandths: beside the full-tile kernel (`hot`: the KV it
// reads is in L2, read there by the full tiles too) and after it (`cold`: a wave of narrow CTAs reads it all from memory
// at once). It depends on how a tile reaches shared memory:
// - tensor copies (pages of >= KDTREE_FLASH_TENSOR_COPY_MIN_PAGE tokens): hot 500, measured 0.48 (Nsight Compute, B1 L32K
//   N64 H8: a narrow CTA over two splits' range 150.8 us, a full CTA over one 155.6 us; docs/history, flash v16); cold
//   1,050, measured 1.06-1.07 (the v29 timeline: at B16 a wave of 132 narrow CTAs of 25.7 tiles took 54.8 us after the
//   last full CTA, at B4 128 of 21.8 tiles 48.0 us; docs/history, flash v29).
// - row gathers (cp.async, smaller pages): a tile's time is mostly its 32 row copies and their page-table reads, which a
//   narrow tile makes as a full one does, beside a quarter of the tensor work. Hot 650, from the replay sweep on an H100
//   (docs/history/rounds-2026-12-06.md): at 1, 32K, 65, 8, page 1, 126 full-tile CTAs of 2,345 tokens took 218.7 us
//   where 120 of 2,189 beside 8 narrow ones of 4,104 took 258.4 (a fixed cost of 10-20 us puts the narrow price at
//   0.62-0.68). Cold 1,000: not measured (a gathered tile's time is less its memory read than a copied one's).
struct NarrowPrice {
  int hot, cold;
};
KDTREE_HOST_DEVICE constexpr bool gathered_tiles(int page_size) {
  return page_size < KDTREE_FLASH_TENSOR_COPY_MIN_PAGE;
}
KDTREE_HOST_DEVICE constexpr NarrowPrice narrow_price(bool gathered) {
  return gathered ? NarrowPrice{650, 1000} : NarrowPrice{500, 1050};
}

struct FlashSplitPlan {
  int num_m_tiles;    // ceil(max_qlen * heads / 64)
  int num_splits;     // KV splits per (request, full row tile)
  int narrow_splits;  // KV splits of a request's narrow last row tile, cut on their own; 0: no narrow kernel
  bool gathered;      // the tiles are gathered row by row (narrow_price)
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
// and its share of the combine). A narrow tile is charged narrow_price(gathered) of a full one, beside the full-tile
// kernel and after it. The plan counts the largest request's row tiles (every request alike in the targets).
// flash_split_cost is the launch's time, in KV tiles, for s splits of every full row tile and sn of every narrow one;
// infinity for a choice the planner may not take (fewer than 256 tokens (8 tiles) per split, more splits than the
// combine holds, sn = 0 with a narrow tile or sn > 0 without one, s > 1 without a full tile). kdtree_flash_split_cost
// reports it.
inline double flash_split_cost(int batch, int max_qlen, int heads, int max_kv_len, int sm_count, int s, int sn,
                               bool gathered) {
  const auto [num_m_tiles, full, narrow, tiles, max_splits] = flash_shape(max_qlen, heads, max_kv_len);
  if (s < 1 || s > max_splits || (full == 0 && s > 1)) return HUGE_VAL;
  if (narrow ? sn < 1 || sn > max_splits : sn != 0) return HUGE_VAL;
  const NarrowPrice price = narrow_price(gathered);
  const double full_cta = tiles / s + 6.0;
  const double narrow_cta = narrow ? price.hot * 1e-3 * tiles / sn + 6.0 : 0.0;
  const double narrow_cold_cta = narrow ? price.cold * 1e-3 * tiles / sn + 6.0 : 0.0;
  return flash_launch_time((long)batch * full * s, full_cta, (long)batch * narrow * sn, narrow_cta, narrow_cold_cta,
                           sm_count);
}

// Calls visit(s, sn, cost) for every choice (s full splits, sn narrow ones) whose cost may be at most `bound`, in
// order of s, then sn; the others are ruled out by bounds without their cost: the full tiles' end (t1), a narrow CTA's
// time after the first narrow start, which falls with sn, and the narrow work over the SMs that can take it, which
// grows with sn (both at the cost beside the full tiles, the lesser). So a call weighs tens of choices, not 128 x 129
// (the planner runs on every flash call).
template <typename Visit>
inline void flash_split_choices(int batch, int max_qlen, int heads, int max_kv_len, int sm_count, bool gathered,
                                double bound, Visit&& visit) {
  const auto [num_m_tiles, full, narrow, tiles, max_splits] = flash_shape(max_qlen, heads, max_kv_len);
  const double hot = narrow_price(gathered).hot * 1e-3;
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
    // a narrow CTA ends after the first narrow start: first + hot tiles / sn + 6 <= bound
    const double room = bound - first - 6.0;
    if (room <= 0.0) continue;
    int sn = (int)std::ceil(hot * tiles / room - 1e-9);
    for (sn = sn < 1 ? 1 : sn; sn <= max_splits; ++sn) {
      // the narrow work, batch (hot tiles + 6 sn), on the early SMs until t1, then on every SM
      const double work = (double)batch * (hot * tiles + 6.0 * sn);
      const double early_room = (double)early * (t1 - t0);
      const double end = work <= early_room ? t0 + work / early : t1 + (work - early_room) / sm_count;
      if (end > bound) break;
      visit(s, sn, flash_split_cost(batch, max_qlen, heads, max_kv_len, sm_count, s, sn, gathered));
    }
  }
}

// Pick the split counts (full tiles, narrow tiles) of least flash_split_cost; of the choices within 0.1 % of it, the
// fewest splits, full first: fewer partials to write and merge. The first bound is the cost of cutting the narrow
// tiles by half the full tiles' count, the choice v16 to v28 made. (v2 used waves / s + 0.01 (s - 1), which
// under-split; NOTES.md.)
inline FlashSplitPlan plan_flash_splits(int batch, int max_qlen, int heads, int max_kv_len, int sm_count,
                                        bool gathered) {
  const FlashShape shape = flash_shape(max_qlen, heads, max_kv_len);
  const bool narrow = shape.narrow != 0;
  FlashSplitPlan plan{};
  plan.num_m_tiles = shape.num_m_tiles;
  plan.gathered = gathered;
  double least = HUGE_VAL;
  for (int s = 1; s <= kMaxSplits; ++s) {
    const double cost =
        flash_split_cost(batch, max_qlen, heads, max_kv_len, sm_count, s, narrow ? (s + 1) / 2 : 0, gathered);
    least = cost < least ? cost : least;
  }
  flash_split_choices(batch, max_qlen, heads, max_kv_len, sm_count, gathered, least, [&](int, int, double cost) {
    least = cost < least ? cost : least;
  });
  plan.num_splits = 0;
  flash_split_choices(batch, max_qlen, heads, max_kv_len, sm_count, gathered, least * (1 + 1e-3),
                      [&](int s, int sn, double cost) {
    if (plan.num_splits == 0 && cost <= least * (1 + 1e-3)) {
      plan.num_splits = s;
      plan.narrow_splits = sn;
    }
  });
  return plan;
}

// ---- The device schedule: split counts from each request's own lengths.
// The plan above sees the launch's bounds only (the longest prefix and the largest tree, as if every request had them),
// so a skewed batch (one 128K request beside fifteen 2K ones) is split as sixteen long ones, and a CUDA graph replays
// the plan of its capture at every later length. So a one-CTA schedule kernel reads prefix_lens and
// q_indptr on the GPU and cuts each request's KV range by its own length; the kernels read their work from the table it
// writes into the workspace. Its arithmetic is here, plain integer host-device code (the same choice on the CPU and the
// GPU; tests/test_flash_plan.py checks it on random batches). Where every request has the bounds' lengths (the host plan
// is then exact) the schedule kernel writes the host plan's table. The schedule is a call of its own
// (kdtree_flash_schedule): it depends on the lengths only, so an engine makes it once per decoding step and every
// layer's scheduled verify call (kdtree_verify_attn_flash_scheduled) reads it; the plain call runs the host plan.
constexpr int kScheduleMaxBatch = 256;  // the schedule kernel keeps a few ints per request in shared memory

// What the flash kernels are launched with: the host plan (its split counts and full row tiles per request, for the
// batches that run it) and the grids, which bound the schedule too.
struct FlashLaunch {
  int scheduled;              // 1: the kernels read their work from the schedule in the workspace; 0: the host plan
  int splits, narrow_splits;  // the host plan's; narrow_splits 0: no narrow kernel
  int full_tiles, row_tiles;  // full row tiles per request at the bounds (max_qlen), and all its row tiles
  int sm_count;               // the SMs the schedule is cut for (the plan's: plan_sm_count where set)
  int units, narrow_units;    // the full-tile and narrow kernels' grids (CTAs)
  int rows, narrow_rows;      // partial rows in the workspace: 64 per full CTA, 16 per narrow CTA
  int narrow_price;           // a narrow tile's time over a full one's beside the full tiles, in thousandths
};
// The launch from the host plan. Plain: its grids and partial rows. Scheduled: the narrow grid is the host plan's; the
// full-tile grid the host plan's or one CTA per SM, whichever is more (the CTAs past the schedule's find no work and
// take the SMs it leaves idle, at once, beside one wave: more would queue behind it and hold the narrow kernel's
// start); partial rows the host plan's, else (one split) two waves of full-tile CTAs' worth; 16 per narrow CTA.
inline FlashLaunch flash_launch(const FlashSplitPlan& plan, int batch, int max_qlen, int heads, int sm_count,
                                bool scheduled) {
  const FlashShape f = flash_shape(max_qlen, heads, max_qlen);
  const long host_units = (long)batch * f.full * plan.num_splits, host_narrow = (long)batch * plan.narrow_splits;
  const long host_rows = plan.num_splits > 1 ? (long)batch * f.num_m_tiles * plan.num_splits : 0;
  FlashLaunch l{scheduled ? 1 : 0, plan.num_splits, plan.narrow_splits, (int)f.full, f.num_m_tiles, sm_count, 0, 0, 0, 0,
                narrow_price(plan.gathered).hot};
  if (!scheduled) {
    l.units = (int)(host_units > 0 ? host_units : 1);
    l.narrow_units = (int)host_narrow;
    l.rows = (int)(kBlockM * host_rows);
    l.narrow_rows = plan.narrow_splits > 1 ? (int)(kNarrowRows * host_narrow) : 0;
    return l;
  }
  const long units = host_units > sm_count ? host_units : sm_count;
  l.units = (int)units;
  l.narrow_units = (int)host_narrow;
  l.rows = (int)(kBlockM * (host_rows > 0 ? host_rows : (units < 2L * sm_count ? units : 2L * sm_count)));
  l.narrow_rows = (int)(kNarrowRows * host_narrow);
  return l;
}

// One request as the schedule sees it: its KV length (prefix + tree), its row tiles, whether the last is a tail of at
// most 16 rows (the narrow kernel's, where the schedule gives it narrow CTAs; else a full-tile CTA computes it).
struct ScheduleRequest {
  int kv_len, row_tiles, tail;
};
KDTREE_HOST_DEVICE inline ScheduleRequest schedule_request(int prefix_len, int qlen, int heads) {
  const int rows = qlen * heads, m_tiles = (rows + kBlockM - 1) / kBlockM;
  return {prefix_len + qlen, m_tiles, rows > 0 && rows - (m_tiles - 1) * kBlockM <= kNarrowRows ? 1 : 0};
}
// The most splits a KV range may take: 256 tokens each at least, and what the combine holds.
KDTREE_HOST_DEVICE inline int schedule_max_splits(int kv_len) {
  const int by_len = (kv_len + 255) / 256;
  return by_len < 1 ? 1 : (by_len < kMaxSplits ? by_len : kMaxSplits);
}
// Candidate k cuts the longest range (kv_max tokens) into k splits and every other range in proportion (rounded up):
// chunks of about kv_max / k tokens everywhere, as far as each range's own bound allows. A request's narrow tile takes
// that count times the narrow multiplier, the most that keeps every tail within the narrow grid (short CTAs: the narrow
// kernel starts behind the full tiles and must end near them; half the count instead was 9 % further from the ideal
// on the model's random batches).
KDTREE_HOST_DEVICE inline int schedule_splits(int k, int kv_len, int kv_max) {
  const int s = (k * kv_len + kv_max - 1) / kv_max;  // < 2^31: k <= 128, kv_len <= KDTREE_MAX_PREFIX + KDTREE_MAX_QLEN
  const int most = schedule_max_splits(kv_len);
  return s < 1 ? 1 : (s > most ? most : s);
}
// The split-KV cut, its one statement: split s of `splits` takes tokens [s * chunk, (s + 1) * chunk) of a request's
// kv_len (the last ones may be short or empty), chunk its equal share rounded up to whole KV tiles. The kernels
// (kv_split) and the device schedule cut by it; kdev/plan.py's split_chunk is its Python statement
// (tests/test_flash_plan.py compares the two on random lengths).
KDTREE_HOST_DEVICE inline int split_chunk(int kv_len, int splits) {
  const int chunk = (kv_len + splits - 1) / splits;
  return (chunk + kBlockN - 1) / kBlockN * kBlockN;
}
// A CTA's time in tokens: its chunk plus a fixed cost worth 6 KV tiles (as flash_split_cost counts), for a narrow tile
// its chunk at the launch's narrow price (thousandths).
KDTREE_HOST_DEVICE inline long long schedule_unit_cost(int kv_len, int splits) {
  return static_cast<long long>(split_chunk(kv_len, splits)) + 6 * kBlockN;
}
KDTREE_HOST_DEVICE inline long long schedule_narrow_unit_cost(int kv_len, int narrow_splits, int price) {
  return static_cast<long long>(split_chunk(kv_len, narrow_splits)) * price / 1000 + 6 * kBlockN;
}
// A request's full-tile CTAs per split and whether its tail goes to the narrow kernel: there where the launch has one
// and every tail's splits fit its grid (the multiplier `narrow` > 0), else the tail is a full-tile CTA's.
KDTREE_HOST_DEVICE inline int schedule_full_tiles(const ScheduleRequest& r, int narrow) {
  return r.row_tiles - (r.tail && narrow > 0 ? 1 : 0);
}
KDTREE_HOST_DEVICE inline int schedule_narrow_splits(int splits, int narrow, int kv_len) {
  const int sn = splits * narrow, most = schedule_max_splits(kv_len);
  return sn < most ? sn : most;
}
// The splits the tails would take at candidate k, over requests b0, b0 + step, ... (summed by the caller), and the
// narrow multiplier it leaves (0: the tails run as full-tile CTAs).
template <typename Request>
KDTREE_HOST_DEVICE inline long schedule_tail_splits(int k, int b0, int step, int batch, int kv_max, Request&& request) {
  long n = 0;
  for (int b = b0; b < batch; b += step) {
    const ScheduleRequest r = request(b);
    if (r.tail) n += schedule_splits(k, r.kv_len, kv_max);
  }
  return n;
}
KDTREE_HOST_DEVICE inline int schedule_narrow(long tail_splits, const FlashLaunch& l) {
  if (l.narrow_units <= 0 || tail_splits > l.narrow_units) return 0;
  return tail_splits > 0 ? (int)(l.narrow_units / tail_splits) : 1;
}

// Candidate k's model time (tokens). The time is the largest of: the work over the SMs; the waves of the largest CTAs
// (those over half the largest CTA's time cannot share an SM's span with another): exact waves for a uniform batch, and
// for a skewed one the long request's waves with the short requests' CTAs filling the SMs beside them; and the narrow
// kernel's end. Infeasible (time = -1) where the CTAs or partial rows exceed the launch's. The sums run over requests b0,
// b0 + step, ... (the schedule kernel gives each candidate several threads) and merge by schedule_merge.
struct ScheduleSums {
  long long work, narrow_work, largest, narrow_largest;  // tokens: CTAs' time summed, the largest CTA's
  long units, narrow_units, rows, big;  // rows: full-tile partial rows (requests of > 1 split: all their row tiles')
};
template <typename Request>
KDTREE_HOST_DEVICE inline ScheduleSums schedule_sums(int k, int narrow, int price, int b0, int step, int batch,
                                                     int kv_max, Request&& request) {
  ScheduleSums t{};
  for (int b = b0; b < batch; b += step) {
    const ScheduleRequest r = request(b);
    const int s = schedule_splits(k, r.kv_len, kv_max), f = schedule_full_tiles(r, narrow);
    const int sn = schedule_narrow_splits(s, narrow, r.kv_len);
    const long long c = schedule_unit_cost(r.kv_len, s), cn = schedule_narrow_unit_cost(r.kv_len, sn, price);
    t.units += (long)f * s;
    t.work += (long long)f * s * c;
    if (s > 1) t.rows += (long)kBlockM * r.row_tiles * s;
    if (f > 0 && c > t.largest) t.largest = c;
    if (r.tail && narrow) {
      t.narrow_units += sn;
      t.narrow_work += (long long)sn * cn;
      if (cn > t.narrow_largest) t.narrow_largest = cn;
    }
  }
  return t;
}
// The CTAs over half of `largest` (the whole batch's largest CTA time), over the same requests.
template <typename Request>
KDTREE_HOST_DEVICE inline long schedule_big(int k, int narrow, int price, int b0, int step, int batch, int kv_max,
                                            long long largest, Request&& request) {
  long big = 0;
  for (int b = b0; b < batch; b += step) {
    const ScheduleRequest r = request(b);
    const int s = schedule_splits(k, r.kv_len, kv_max), f = schedule_full_tiles(r, narrow);
    const int sn = schedule_narrow_splits(s, narrow, r.kv_len);
    if (f > 0 && 2 * schedule_unit_cost(r.kv_len, s) > largest) big += (long)f * s;
    if (r.tail && narrow && 2 * schedule_narrow_unit_cost(r.kv_len, sn, price) > largest) big += sn;
  }
  return big;
}
KDTREE_HOST_DEVICE inline ScheduleSums schedule_merge(ScheduleSums a, const ScheduleSums& b) {
  a.work += b.work, a.narrow_work += b.narrow_work;
  a.largest = a.largest > b.largest ? a.largest : b.largest;
  a.narrow_largest = a.narrow_largest > b.narrow_largest ? a.narrow_largest : b.narrow_largest;
  a.units += b.units, a.narrow_units += b.narrow_units, a.rows += b.rows, a.big += b.big;
  return a;
}
KDTREE_HOST_DEVICE inline long long schedule_largest(const ScheduleSums& t) {
  return t.largest > t.narrow_largest ? t.largest : t.narrow_largest;
}
KDTREE_HOST_DEVICE inline long long schedule_time(const ScheduleSums& t, int sm_count, const FlashLaunch& l) {
  if (t.units > l.units || t.narrow_units > l.narrow_units || t.rows > l.rows) return -1;
  const long long spread = (t.work + t.narrow_work + sm_count - 1) / sm_count;
  const long long waves = schedule_largest(t) * ((t.big + sm_count - 1) / sm_count);
  // The narrow kernel starts once every full-tile CTA has: on the SMs the full tiles leave free from the start, else
  // (or if that is later) as the full tiles' work is spread, its largest CTA last.
  long long tail = 0;
  if (t.narrow_units) {
    tail = (t.work + sm_count - 1) / sm_count + t.narrow_largest;
    if (t.units < sm_count) {
      const long free = sm_count - t.units;
      const long long beside = t.narrow_largest * ((t.narrow_units + free - 1) / free);
      tail = beside < tail ? beside : tail;
    }
  }
  const long long most = spread > waves ? spread : waves;
  return most > tail ? most : tail;
}
template <typename Request>
inline long long schedule_cost(int k, int batch, int kv_max, int sm_count, const FlashLaunch& l, Request&& request) {
  const int narrow = schedule_narrow(schedule_tail_splits(k, 0, 1, batch, kv_max, request), l);
  ScheduleSums t = schedule_sums(k, narrow, l.narrow_price, 0, 1, batch, kv_max, request);
  t.big = schedule_big(k, narrow, l.narrow_price, 0, 1, batch, kv_max, schedule_largest(t), request);
  return schedule_time(t, sm_count, l);
}
// The choice among candidates 1..kMaxSplits (1 always fits the grids): the least time, and of the candidates within
// 0.1 % of it the smallest k (the fewest splits: fewer partials to merge). Two reductions, so the schedule kernel can
// weigh every candidate in a thread of its own and take the same k as this loop.
KDTREE_HOST_DEVICE inline bool schedule_near(long long time, long long least) {
  return time >= 0 && time * 1000 <= least * 1001;
}
template <typename Request>
inline int schedule_choice(int batch, int kv_max, int sm_count, const FlashLaunch& l, Request&& request) {
  long long times[kMaxSplits], least = -1;
  for (int k = 1; k <= kMaxSplits; ++k) {
    times[k - 1] = schedule_cost(k, batch, kv_max, sm_count, l, request);
    if (times[k - 1] >= 0 && (least < 0 || times[k - 1] < least)) least = times[k - 1];
  }
  for (int k = 1; k <= kMaxSplits; ++k)
    if (schedule_near(times[k - 1], least)) return k;
  return 1;
}

// The order the CTAs take their work: the requests by their CTAs' time, longest first (so the hardware's in-order CTA
// dispatch is a longest-first list schedule; ties by request index), and inside a request split by split, the row
// tiles of a split next to each other (they read the same KV range at once, from L2). key: a CTA's time (0 for a
// request with no such CTA); the rank of request b among `batch`.
template <typename Key>
KDTREE_HOST_DEVICE inline int schedule_rank(int b, int batch, Key&& key) {
  const long long kb = key(b);
  int rank = 0;
  for (int i = 0; i < batch; ++i) {
    const long long ki = key(i);
    rank += ki > kb || (ki == kb && i < b);
  }
  return rank;
}

// The schedule for a batch, on the host (the schedule kernel computes the same in parallel): the split factor, each
// request's split counts (narrow 0: its tail, if any, is a full-tile CTA's) and first partial rows, and the CTAs' work
// in dispatch order. For the test and for reports.
struct HostSchedule {
  int k;
  int splits[kScheduleMaxBatch], narrow_splits[kScheduleMaxBatch];
  long first_row[kScheduleMaxBatch], first_narrow_row[kScheduleMaxBatch];
  long units, narrow_units;
};
template <typename Request, typename Unit, typename NarrowUnit>
inline void schedule_host(int batch, int sm_count, const FlashLaunch& l, Request&& request, HostSchedule& out,
                          Unit&& unit, NarrowUnit&& narrow_unit) {
  int kv_max = 1;
  for (int b = 0; b < batch; ++b) kv_max = request(b).kv_len > kv_max ? request(b).kv_len : kv_max;
  out.k = schedule_choice(batch, kv_max, sm_count, l, request);
  const int narrow = schedule_narrow(schedule_tail_splits(out.k, 0, 1, batch, kv_max, request), l);
  long row = 0, narrow_row = 0;
  int full[kScheduleMaxBatch];
  for (int b = 0; b < batch; ++b) {
    const ScheduleRequest r = request(b);
    full[b] = schedule_full_tiles(r, narrow);
    out.splits[b] = schedule_splits(out.k, r.kv_len, kv_max);
    out.narrow_splits[b] = r.tail && narrow ? schedule_narrow_splits(out.splits[b], narrow, r.kv_len) : 0;
    out.first_row[b] = row, out.first_narrow_row[b] = narrow_row;
    if (out.splits[b] > 1) row += (long)kBlockM * r.row_tiles * out.splits[b];
    if (out.narrow_splits[b] > 1) narrow_row += (long)kNarrowRows * out.narrow_splits[b];
  }
  auto full_key = [&](int b) { return full[b] > 0 ? schedule_unit_cost(request(b).kv_len, out.splits[b]) : 0LL; };
  auto narrow_key = [&](int b) {
    return out.narrow_splits[b] ? schedule_narrow_unit_cost(request(b).kv_len, out.narrow_splits[b], l.narrow_price)
                                : 0LL;
  };
  int order[kScheduleMaxBatch], narrow_order[kScheduleMaxBatch];
  for (int b = 0; b < batch; ++b) {
    order[schedule_rank(b, batch, full_key)] = b;
    narrow_order[schedule_rank(b, batch, narrow_key)] = b;
  }
  out.units = out.narrow_units = 0;
  for (int i = 0; i < batch; ++i) {
    const int b = order[i], f = full[b];
    for (int u = 0; u < f * out.splits[b]; ++u) unit(out.units++, b, u % f, u / f);
  }
  for (int i = 0; i < batch; ++i) {
    const int b = narrow_order[i];
    for (int u = 0; u < out.narrow_splits[b]; ++u) narrow_unit(out.narrow_units++, b, u);
  }
}

// The workspace, byte offsets: the schedule's head (4 ints: full CTAs, narrow CTAs, k, its call's stamp), one int4 per
// request (full splits, narrow splits, its first full and first narrow partial row), one int4 per full CTA (request,
// row tile, split, 0) and per narrow CTA (request, split, 0, 0), in the order the CTAs take them; then the split
// partials in fp32: the full row tiles' rows x 512 values and rows LSEs, the narrow tiles' the same, each part on a
// 256-byte boundary.
// A request's split s of row r (of its full-tile CTAs) is partial row first + s x 64 x row tiles + r; of its narrow
// tile, row first_narrow + s x 16 + (r - the tile's first row).
struct FlashWorkspace {
  size_t requests, units, narrow_units, full_o, full_lse, narrow_o, narrow_lse, bytes;
};
KDTREE_HOST_DEVICE inline size_t flash_align256(size_t n) { return (n + 255) / 256 * 256; }
KDTREE_HOST_DEVICE inline FlashWorkspace flash_workspace(int batch, const FlashLaunch& l) {
  FlashWorkspace w{};  // a plain launch's has no schedule: its partials alone (none with one split: no workspace)
  w.requests = l.scheduled ? 16 : 0;
  w.units = w.requests + (l.scheduled ? (size_t)batch * 16 : 0);
  w.narrow_units = w.units + (l.scheduled ? (size_t)l.units * 16 : 0);
  w.full_o = flash_align256(w.narrow_units + (l.scheduled ? (size_t)l.narrow_units * 16 : 0));
  w.full_lse = w.full_o + (size_t)l.rows * KDTREE_V_DIM * sizeof(float);
  w.narrow_o = flash_align256(w.full_lse + (size_t)l.rows * sizeof(float));
  w.narrow_lse = w.narrow_o + (size_t)l.narrow_rows * KDTREE_V_DIM * sizeof(float);
  w.bytes = flash_align256(w.narrow_lse + (size_t)l.narrow_rows * sizeof(float));
  return w;
}
}  // namespace kdtree
