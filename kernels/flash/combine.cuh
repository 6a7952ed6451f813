// The combine kernel: merges the split-KV partials by their LSE (both products).
// Part of verify_attn_flash.cu's translation unit (included there, in this order); its header comment says how
// the kernels work.
#pragma once

#include "common.cuh"

namespace kdtree {
namespace {

// Merge split partials: lse = ln sum_s exp(lse_s); out = sum_s exp(lse_s - lse) * O_s. One CTA per row: CTA
// (r, b) is row r of request b, of the full tiles' part of the workspace or, in the request's narrow last tile where
// there is a narrow kernel, of the narrow tiles' part, with the split counts of the host plan or the schedule
// (schedule.cuh); a row whose part has one split was written by its tile's kernel. Warp 0 turns the splits' LSEs (at
// most kMaxSplits) into weights in shared memory; then kGroups groups of 128 threads each sum every kGroups-th split's
// partial over 4 columns per thread (their addresses depend on nothing loaded, so several loads are in flight), and
// group 0 adds the groups' sums in order. Every reduction has a fixed order (the butterflies give every lane the same
// bits): the same output on every run. Every CTA waits for the kernel before it (griddepcontrol.wait), the ones with
// nothing to merge too: the call ends only when the kernels before it have.
// (The first form, one 128-thread CTA per row walking the splits with each load behind the previous one's
// weight, took 10-20 µs per call at the target shapes: NOTES.md.)
constexpr int kCombineColumnThreads = KDTREE_V_DIM / 4;  // 128: 4 value columns each

template <int kGroups>
__global__ void __launch_bounds__(kGroups * kCombineColumnThreads)
    verify_attn_combine_kernel(VerifyAttnParams p, FlashLaunch l) {
  // the call's inputs, read before the wait; the schedule after it
  const int b = blockIdx.y, r = blockIdx.x;
  const auto [H, q0, T, R] = request_rows(p, b);
  wait_primary_grids();  // launched programmatically behind the flash kernels: their writes complete and visible
  if (r >= R) return;    // this request has fewer rows than the largest one
  if (l.scheduled && __ldcg(schedule_table(p, 0)).w != schedule_stamp(p, l)) return;  // no schedule: nothing written
  const RequestPlan plan = request_plan(p, l, !l.scheduled, b);
  const int row0 = (R - 1) / kBlockM * kBlockM;
  const bool narrow = plan.narrow_splits > 0 && R - row0 <= kNarrowRows;  // the request's tail is the narrow kernel's
  const SplitPartials part = narrow && r >= row0
                                 ? narrow_partials(p, l, 0, plan.narrow_splits, plan.first_narrow_row, q0, row0)
                                 : full_partials(p, l, 0, plan.splits, plan.first_row, q0, R);
  if (part.splits == 1) return;
  __shared__ float weight[kMaxSplits];
  __shared__ float row_lse;
  __shared__ float4 group_sum[kGroups > 1 ? kGroups - 1 : 1][kCombineColumnThreads];
  const size_t grow = (size_t)q0 * H + r;
  const size_t rows_total = part.rows, row = (size_t)((long long)grow + part.shift);
  const int num_splits = part.splits;
  const float* ws_o = part.o;
  const float* ws_lse = part.lse;
  if (threadIdx.x < 32) {
    // lane holds splits lane + 32 k; the splits past num_splits are -inf, and add exactly 0 below, so a row of at most
    // 64 splits gets the bits it got when a lane held two
    constexpr int kPerLane = kMaxSplits / 32;
    const int lane = threadIdx.x;
    float l[kPerLane];
    float m = -INFINITY;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      l[k] = lane + 32 * k < num_splits ? ws_lse[(lane + 32 * k) * rows_total + row] : -INFINITY;
      m = fmaxf(m, l[k]);
    }
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    // a split with no key for this row (empty range or all masked) has lse = -inf and weight 0
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) total += l[k] == -INFINITY ? 0.f : expf(l[k] - m);
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) total += __shfl_xor_sync(0xffffffffu, total, off);
    const float lse = m == -INFINITY ? -INFINITY : m + logf(total);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) weight[lane + 32 * k] = l[k] == -INFINITY ? 0.f : expf(l[k] - lse);
    if (lane == 0) row_lse = lse;
  }
  __syncthreads();
  const int group = threadIdx.x / kCombineColumnThreads, t = threadIdx.x % kCombineColumnThreads;
  const float* col = ws_o + row * KDTREE_V_DIM + t * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  // batches of kBatch splits, loads unpredicated (ptxas still interleaves them with the FMAs, 3 in flight)
  constexpr int kBatch = 8;
  for (int s0 = group; s0 < num_splits; s0 += kBatch * kGroups) {
    float4 v[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {  // past the last split: a valid address again, at weight 0 (below)
      const int s = min(s0 + i * kGroups, num_splits - 1);
      v[i] = *reinterpret_cast<const float4*>(col + s * rows_total * KDTREE_V_DIM);
    }
    // no branch on the weight: a weight-0 split's partial is finite (every split writes one for every row,
    // zeros where it saw no key), so it adds exactly 0
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int s = s0 + i * kGroups;
      const float w = s < num_splits ? weight[s] : 0.f;
      acc.x = fmaf(w, v[i].x, acc.x);
      acc.y = fmaf(w, v[i].y, acc.y);
      acc.z = fmaf(w, v[i].z, acc.z);
      acc.w = fmaf(w, v[i].w, acc.w);
    }
  }
  if (group > 0) group_sum[group - 1][t] = acc;
  __syncthreads();
  if (group > 0) return;
#pragma unroll
  for (int g = 1; g < kGroups; ++g) {
    const float4 v = group_sum[g - 1][t];
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
  }
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + grow * KDTREE_V_DIM + t * 4;
  *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(acc.x, acc.y);
  *reinterpret_cast<__nv_bfloat162*>(out + 2) = __floats2bfloat162_rn(acc.z, acc.w);
  if (t == 0) p.lse[grow] = row_lse;
}

}  // namespace
}  // namespace kdtree
