// The schedule kernel and how the flash kernels find their work (both products).
// Part of verify_attn_flash.cu's translation unit (included there, in this order); its header comment says how
// the kernels work, and kdev/flash_plan.cuh holds the schedule's arithmetic and the workspace layout.
//
// kdtree_flash_schedule launches one CTA: it reads every request's prefix length and tree size, takes the split factor
// k of least model time (each candidate weighed by kScheduleLanes threads), cuts each request's KV range by its own
// length, and writes the requests' split counts and first partial rows and the full and narrow CTAs' work, longest
// first, into the workspace; where every request has the bounds' lengths (runs_host_plan) it writes the host plan's
// work instead, which is exact there. A scheduled verify call, later in the stream, reads it: stream order makes it
// complete and visible. A plain call decodes its CTAs as the host plan's and reads nothing.
#pragma once

#include "common.cuh"

namespace kdtree {
namespace {

constexpr int kScheduleLanes = 2;                              // threads per candidate split factor
constexpr int kScheduleThreads = kMaxSplits * kScheduleLanes;  // 256

// Whether the host plan is exact for this batch (every request at the bounds) or the batch too large to schedule. Every
// lane of a whole warp calls it (32 requests per load).
__device__ __forceinline__ bool runs_host_plan(const VerifyAttnParams& p) {
  if (p.batch > kScheduleMaxBatch) return true;
  bool at_bounds = true;
  for (int b = threadIdx.x % 32; b < p.batch; b += 32) {
    const int T = p.q_indptr[b + 1] - p.q_indptr[b];
    at_bounds &= T == p.max_qlen && p.prefix_lens[b] + T == p.max_kv_len;
  }
  return __all_sync(0xffffffffu, at_bounds);
}

__device__ __forceinline__ const int4* schedule_table(const VerifyAttnParams& p, size_t offset) {
  return reinterpret_cast<const int4*>(static_cast<const unsigned char*>(p.workspace) + offset);
}

// What the schedule kernel stamps into the schedule's fourth int: its call's batch, bounds and grids, mixed. A
// scheduled call reads no work from a workspace whose stamp differs (never scheduled, or scheduled for another call's
// shapes): its CTAs find none, and its outputs stay as they were, not written from garbage. (A schedule made for other
// lengths under the same shapes is the caller's error: kdtree.h says to make it again when the lengths change.)
__device__ __forceinline__ int schedule_stamp(const VerifyAttnParams& p, const FlashLaunch& l) {
  unsigned h = 2166136261u;
  for (const int v : {p.batch, p.max_kv_len, p.max_qlen, p.num_heads, l.units, l.narrow_units, l.rows, l.sm_count})
    h = (h ^ (unsigned)v) * 16777619u;
  return (int)h;
}

// A request's split counts and first partial rows (flash_plan.cuh's workspace layout).
struct RequestPlan {
  int splits, narrow_splits, first_row, first_narrow_row;
};
__device__ __forceinline__ RequestPlan request_plan(const VerifyAttnParams& p, const FlashLaunch& l, bool host, int b) {
  if (host)
    return {l.splits, l.narrow_splits, l.splits > 1 ? b * kBlockM * l.row_tiles * l.splits : 0,
            l.narrow_splits > 1 ? b * kNarrowRows * l.narrow_splits : 0};
  const int4 r = __ldcg(schedule_table(p, flash_workspace(p.batch, l).requests) + b);
  return {r.x, r.y, r.z, r.w};
}

// The work of full-tile CTA blockIdx.x: request b's row tile m_tile, KV split `split` of `splits`; b < 0: none.
struct FullWork {
  int b, m_tile, split, splits, first_row;
};
__device__ __forceinline__ FullWork full_work(const VerifyAttnParams& p, const FlashLaunch& l) {
  const int u = blockIdx.x;
  if (!l.scheduled) {  // the host plan: request-major, then split, then row tile
    const int per_request = l.full_tiles * l.splits;
    const int b = per_request > 0 ? u / per_request : p.batch, rest = u - b * per_request;
    if (b >= p.batch) return {-1, 0, 0, 0, 0};
    // a request with fewer row tiles than the bounds' has none here, nor its tail where the narrow kernel takes it
    const int m_tile = rest % l.full_tiles, rows = (p.q_indptr[b + 1] - p.q_indptr[b]) * p.num_heads;
    if (m_tile * kBlockM >= rows || (l.narrow_splits > 0 && rows - m_tile * kBlockM <= kNarrowRows))
      return {-1, 0, 0, 0, 0};
    const RequestPlan r = request_plan(p, l, true, b);
    return {b, m_tile, rest / l.full_tiles, r.splits, r.first_row};
  }
  const FlashWorkspace w = flash_workspace(p.batch, l);
  const int4 head = __ldcg(schedule_table(p, 0));
  if (u >= head.x || head.w != schedule_stamp(p, l)) return {-1, 0, 0, 0, 0};
  const int4 e = __ldcg(schedule_table(p, w.units) + u);
  const RequestPlan r = request_plan(p, l, false, e.x);
  return {e.x, e.y, e.z, r.splits, r.first_row};
}

// The same for narrow CTA blockIdx.x: request b's narrow tile, split `split` of `splits`.
struct NarrowWork {
  int b, split, splits, first_row;
};
__device__ __forceinline__ NarrowWork narrow_work(const VerifyAttnParams& p, const FlashLaunch& l) {
  const int u = blockIdx.x;
  if (!l.scheduled) {
    const int b = u / l.narrow_splits;
    if (b >= p.batch) return {-1, 0, 0, 0};
    const RequestPlan r = request_plan(p, l, true, b);
    return {b, u % l.narrow_splits, r.narrow_splits, r.first_narrow_row};
  }
  const FlashWorkspace w = flash_workspace(p.batch, l);
  const int4 head = __ldcg(schedule_table(p, 0));
  if (u >= head.y || head.w != schedule_stamp(p, l)) return {-1, 0, 0, 0};
  const int4 e = __ldcg(schedule_table(p, w.narrow_units) + u);
  const RequestPlan r = request_plan(p, l, false, e.x);
  return {e.x, e.y, r.narrow_splits, r.first_narrow_row};
}

// The request's shape as the schedule counts it.
__device__ __forceinline__ ScheduleRequest schedule_request_of(const VerifyAttnParams& p, int b) {
  const int q0 = p.q_indptr[b], T = p.q_indptr[b + 1] - q0;
  return schedule_request(p.prefix_lens[b], T, p.num_heads);
}

// An exclusive scan of n values by one warp, 32 at a time; returns the total.
template <typename Value, typename Store>
__device__ __forceinline__ int warp_exclusive_scan(int n, Value&& value, Store&& store) {
  const int lane = threadIdx.x % 32;
  int carry = 0;
  for (int i0 = 0; i0 < n; i0 += 32) {
    const int v = i0 + lane < n ? value(i0 + lane) : 0;
    int x = v;
#pragma unroll
    for (int off = 1; off < 32; off *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, x, off);
      if (lane >= off) x += y;
    }
    if (i0 + lane < n) store(i0 + lane, carry + x - v);
    carry += __shfl_sync(0xffffffffu, x, 31);
  }
  return carry;
}

// The host plan's work as a schedule: request-major, then split, then row tile, as a plain call's grid decodes it.
__device__ void write_host_schedule(const VerifyAttnParams& p, const FlashLaunch& l) {
  const FlashWorkspace w = flash_workspace(p.batch, l);
  unsigned char* ws = static_cast<unsigned char*>(p.workspace);
  const int per_request = l.full_tiles * l.splits, units = p.batch * per_request;
  const int narrow_units = p.batch * l.narrow_splits;
  int4* records = reinterpret_cast<int4*>(ws + w.requests);
  for (int b = threadIdx.x; b < p.batch; b += blockDim.x) {
    const RequestPlan r = request_plan(p, l, true, b);
    records[b] = make_int4(r.splits, r.narrow_splits, r.first_row, r.first_narrow_row);
  }
  int4* full = reinterpret_cast<int4*>(ws + w.units);
  for (int u = threadIdx.x; u < units; u += blockDim.x) {
    const int rest = u % per_request;
    full[u] = make_int4(u / per_request, rest % l.full_tiles, rest / l.full_tiles, 0);
  }
  int4* narrow = reinterpret_cast<int4*>(ws + w.narrow_units);
  for (int u = threadIdx.x; u < narrow_units; u += blockDim.x)
    narrow[u] = make_int4(u / l.narrow_splits, u % l.narrow_splits, 0, 0);
  if (threadIdx.x == 0) *reinterpret_cast<int4*>(ws) = make_int4(units, narrow_units, 0, schedule_stamp(p, l));
}

__global__ void __launch_bounds__(kScheduleThreads) flash_schedule_kernel(VerifyAttnParams p, FlashLaunch l) {
  if (runs_host_plan(p)) {
    write_host_schedule(p, l);
    return;
  }
  __shared__ ScheduleRequest req[kScheduleMaxBatch];
  __shared__ int full[kScheduleMaxBatch], splits[kScheduleMaxBatch], narrow_splits[kScheduleMaxBatch];
  __shared__ int order[kScheduleMaxBatch], narrow_order[kScheduleMaxBatch];
  __shared__ int start[kScheduleMaxBatch + 1], narrow_start[kScheduleMaxBatch + 1];
  __shared__ long long times[kMaxSplits];
  __shared__ int narrows[kMaxSplits];
  __shared__ int kv_max, chosen, counts[2];
  const int B = p.batch, tid = threadIdx.x;
  if (tid == 0) kv_max = 1;
  __syncthreads();
  for (int b = tid; b < B; b += kScheduleThreads) {
    req[b] = schedule_request_of(p, b);
    atomicMax(&kv_max, req[b].kv_len);
  }
  __syncthreads();
  auto request = [&](int b) { return req[b]; };
  {  // candidate k = tid / kScheduleLanes + 1, its requests shared by kScheduleLanes neighbouring lanes
    const int k = tid / kScheduleLanes + 1, part = tid % kScheduleLanes;
    long tails = schedule_tail_splits(k, part, kScheduleLanes, B, kv_max, request);
#pragma unroll
    for (int off = 1; off < kScheduleLanes; off *= 2) tails += __shfl_xor_sync(0xffffffffu, tails, off);
    const int narrow = schedule_narrow(tails, l);
    ScheduleSums t = schedule_sums(k, narrow, l.narrow_price, part, kScheduleLanes, B, kv_max, request);
#pragma unroll
    for (int off = 1; off < kScheduleLanes; off *= 2) {
      ScheduleSums o;
      o.work = __shfl_xor_sync(0xffffffffu, t.work, off);
      o.narrow_work = __shfl_xor_sync(0xffffffffu, t.narrow_work, off);
      o.largest = __shfl_xor_sync(0xffffffffu, t.largest, off);
      o.narrow_largest = __shfl_xor_sync(0xffffffffu, t.narrow_largest, off);
      o.units = __shfl_xor_sync(0xffffffffu, t.units, off);
      o.narrow_units = __shfl_xor_sync(0xffffffffu, t.narrow_units, off);
      o.rows = __shfl_xor_sync(0xffffffffu, t.rows, off);
      o.big = 0;
      t = schedule_merge(t, o);
    }
    long big = schedule_big(k, narrow, l.narrow_price, part, kScheduleLanes, B, kv_max, schedule_largest(t), request);
#pragma unroll
    for (int off = 1; off < kScheduleLanes; off *= 2) big += __shfl_xor_sync(0xffffffffu, big, off);
    t.big = big;
    if (part == 0) {
      times[k - 1] = schedule_time(t, l.sm_count, l);
      narrows[k - 1] = narrow;
    }
  }
  __syncthreads();
  if (tid < 32) {  // the least time, then the smallest k near it (schedule_choice's rule)
    long long least = -1;
    for (int i = tid; i < kMaxSplits; i += 32)
      if (times[i] >= 0 && (least < 0 || times[i] < least)) least = times[i];
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) {
      const long long o = __shfl_xor_sync(0xffffffffu, least, off);
      if (o >= 0 && (least < 0 || o < least)) least = o;
    }
    int k = kMaxSplits + 1;
    for (int i = tid; i < kMaxSplits; i += 32)
      if (schedule_near(times[i], least) && i + 1 < k) k = i + 1;
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) k = min(k, __shfl_xor_sync(0xffffffffu, k, off));
    if (tid == 0) chosen = k <= kMaxSplits ? k : 1;
  }
  __syncthreads();
  const int narrow = narrows[chosen - 1];
  for (int b = tid; b < B; b += kScheduleThreads) {
    full[b] = schedule_full_tiles(req[b], narrow);
    splits[b] = schedule_splits(chosen, req[b].kv_len, kv_max);
    narrow_splits[b] = req[b].tail && narrow ? schedule_narrow_splits(splits[b], narrow, req[b].kv_len) : 0;
  }
  __syncthreads();
  auto full_key = [&](int b) { return full[b] > 0 ? schedule_unit_cost(req[b].kv_len, splits[b]) : 0LL; };
  auto narrow_key = [&](int b) {
    return narrow_splits[b] ? schedule_narrow_unit_cost(req[b].kv_len, narrow_splits[b], l.narrow_price) : 0LL;
  };
  for (int b = tid; b < B; b += kScheduleThreads) {
    order[schedule_rank(b, B, full_key)] = b;
    narrow_order[schedule_rank(b, B, narrow_key)] = b;
  }
  __syncthreads();
  const FlashWorkspace w = flash_workspace(B, l);
  unsigned char* ws = static_cast<unsigned char*>(p.workspace);
  int4* records = reinterpret_cast<int4*>(ws + w.requests);
  const int warp = tid / 32;
  if (warp == 0) {  // CTA positions of the requests in dispatch order
    const int n = warp_exclusive_scan(
        B, [&](int i) { return full[order[i]] * splits[order[i]]; }, [&](int i, int v) { start[i] = v; });
    if (tid == 0) start[B] = counts[0] = n;
  } else if (warp == 1) {
    const int n = warp_exclusive_scan(
        B, [&](int i) { return narrow_splits[narrow_order[i]]; }, [&](int i, int v) { narrow_start[i] = v; });
    if (tid == 32) narrow_start[B] = counts[1] = n;
  } else if (warp == 2) {  // first partial rows, in request order (a request of one split writes none)
    warp_exclusive_scan(
        B, [&](int b) { return splits[b] > 1 ? kBlockM * req[b].row_tiles * splits[b] : 0; },
        [&](int b, int v) { records[b].z = v; });
  } else if (warp == 3) {
    warp_exclusive_scan(
        B, [&](int b) { return narrow_splits[b] > 1 ? kNarrowRows * narrow_splits[b] : 0; },
        [&](int b, int v) { records[b].w = v; });
  }
  __syncthreads();
  for (int b = tid; b < B; b += kScheduleThreads) {
    records[b].x = splits[b];
    records[b].y = narrow_splits[b];
  }
  if (tid == 0) *reinterpret_cast<int4*>(ws) = make_int4(counts[0], counts[1], chosen, schedule_stamp(p, l));
  int4* units = reinterpret_cast<int4*>(ws + w.units);
  for (int u = tid; u < counts[0]; u += kScheduleThreads) {
    int lo = 0, hi = B - 1;  // the last rank whose start is <= u
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (start[mid] <= u) lo = mid; else hi = mid - 1;
    }
    const int b = order[lo], local = u - start[lo], f = full[b];
    units[u] = make_int4(b, local % f, local / f, 0);
  }
  int4* narrow_units = reinterpret_cast<int4*>(ws + w.narrow_units);
  for (int u = tid; u < counts[1]; u += kScheduleThreads) {
    int lo = 0, hi = B - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (narrow_start[mid] <= u) lo = mid; else hi = mid - 1;
    }
    narrow_units[u] = make_int4(narrow_order[lo], u - narrow_start[lo], 0, 0);
  }
}

}  // namespace
}  // namespace kdtree
