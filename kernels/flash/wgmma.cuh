// The wgmma kernel: the full row tiles by warpgroup MMA from shared memory (sm_90a; kdtree_verify_attn_flash_wgmma).
// Part of verify_attn_flash.cu's translation unit (included there, in this order); its header comment says what every
// flash kernel computes. The flash call runs it on Hopper from a library built for sm_90a (docs/kernels.md).
#pragma once

#include "common.cuh"
#include "kdev/wgmma.cuh"

namespace kdtree {
namespace {

// ---- How. A CTA takes the same work as a teams CTA (full_work: a request's 64-row tile and one KV split, of the host
// plan or of the schedule), so the plan, the schedule, the narrow kernel, the partials and the combine are theirs.
// * Two warpgroups (256 threads); Q [64 rows x 576] resident in shared memory in the 128-byte swizzle (9 boxes of 64
//   dims, K-major), loaded once.
// * 64-token tiles as two 32-token halves, each the tensor copy every flash kernel makes (9 boxes of 32 rows), into a
//   two-stage ring: thread 0 copies tile i + 2 into the stage tile i leaves, once both warpgroups are past tile i's
//   P.V (the first barrier of tile i + 1).
// * Warpgroup c computes S for its half: 36 HGMMA 64x32x16 (Q and K both K-major). Its warps hold rows 16 w .. in the
//   mma.sync accumulator layout, so the tree mask and the softmax steps are those of the other kernels. The row maxes
//   of the two halves meet in shared memory (barrier 1); both apply the same lazy reference max (a row's m moves when
//   its tile max passes it by more than 2^8), so their O halves stay on one scale. Each writes its half of P (bf16) into
//   a swizzled [64 x 64] box (barrier 2), and O[:, 256 c ..] += P V by 4 HGMMA 64x256x16: P K-major, V MN-major from the
//   same KV buffers (V = the first 512 dims). Each warpgroup keeps its half's share of the row sums; the epilogue adds
//   the two in a fixed order.
// * A range's partial last tile: its scores past kv_end are masked, and the V rows past kv_end zeroed in shared memory
//   before P.V (a slot past the range may hold NaN, and 0 x NaN is NaN); a half wholly past kv_end is skipped.
constexpr int kWgThreads = 256;
constexpr int kWgStages = 2;
struct __align__(1024) WgmmaStorage {
  __nv_bfloat16 q[kBoxes][kBlockM][kBoxDims];                 // 73,728 B: the row tile's Q, swizzled boxes of 64 rows
  __nv_bfloat16 kv[kWgStages][2][kBoxes][kBlockN][kBoxDims];  // 147,456 B: stages x halves, each a flash KV buffer
  __nv_bfloat16 p[kBlockM][2 * kBlockN];                      // 8,192 B: the tile's P, one swizzled box (K-major)
  float tile_max[2][kBlockM];                                 // each warpgroup's row maxes of its half of the tile
  float row_l[2][kBlockM];                                    // each warpgroup's share of the row sums (epilogue)
  uint64_t landed[kWgStages * 2];                             // one mbarrier per half-tile buffer
};
constexpr int kWgmmaSmemBytes = (int)sizeof(WgmmaStorage);
static_assert(kWgmmaSmemBytes <= 232448, "the wgmma kernel's storage exceeds sm_90's shared memory per block");

__device__ __forceinline__ void wg_barrier() { asm volatile("bar.sync 1, %0;\n" ::"n"(kWgThreads) : "memory"); }

// Copy the halves of the tile at `start` that lie before kv_end into stage s (thread 0).
__device__ __forceinline__ void wg_copy_tile(const KvSource& src_kv, const CUtensorMap* kv_map, unsigned kv_smem,
                                             unsigned landed, int s, int start, int kv_end) {
  for (int h = 0; h < 2 && start + h * kBlockN < kv_end; ++h)
    copy_kv_tile(src_kv, kv_map, kv_smem, landed, 0, 2 * s + h, start + h * kBlockN);
}

__global__ void __launch_bounds__(kWgThreads, 1)
    verify_attn_flash_wgmma_kernel(VerifyAttnParams p, FlashLaunch l, const __grid_constant__ CUtensorMap kv_map) {
#if KDTREE_HAS_WGMMA
  namespace wg = kdtree::wgmma;
  WgmmaStorage& sm = shared_storage<WgmmaStorage>();
  const FullWork work = full_work(p, l);
  if (work.b < 0) return;
  const int m_tile = work.m_tile, b = work.b, split = work.split, num_splits = work.splits;
  const int first_row = work.first_row;
  const auto [H, q0, T, R] = request_rows(p, b);
  const int row0 = m_tile * kBlockM;
  launch_dependents();
  const KvSplit kv = kv_split(p, b, T, split, num_splits);
  const int L = kv.L, kv_begin = kv.begin, kv_end = kv.end;

  const int tid = threadIdx.x, c = tid / 128, w = (tid / 32) % 4, lane = tid % 32;
  const int gid = lane / 4, tig = lane % 4;
  const KvSource src_kv = kv_source(p, b);
  const unsigned q_smem = static_cast<unsigned>(__cvta_generic_to_shared(&sm.q[0][0][0]));
  const unsigned kv_smem = static_cast<unsigned>(__cvta_generic_to_shared(&sm.kv[0][0][0][0][0]));
  const unsigned p_smem = static_cast<unsigned>(__cvta_generic_to_shared(&sm.p[0][0]));
  const unsigned landed = static_cast<unsigned>(__cvta_generic_to_shared(&sm.landed[0]));
  if (tid == 0) {
    for (int i = 0; i < 2 * kWgStages; ++i)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(landed + 8 * i) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (tid == 0)
    for (int s = 0; s < kWgStages; ++s) wg_copy_tile(src_kv, &kv_map, kv_smem, landed, s, kv_begin + s * 2 * kBlockN,
                                                     kv_end);
  // Q: the request's rows row0 .. row0 + 63 (rows past R zero: finite scores, never stored), 16 bytes a thread a step
  const uint4* q_src = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.q) +
                                                      ((size_t)q0 * H + row0) * KDTREE_QK_DIM);
  for (int i = tid; i < kBlockM * kChunksPerRow; i += kWgThreads) {
    const int r = i / kChunksPerRow, ch = i % kChunksPerRow;
    const uint4 v = row0 + r < R ? q_src[i] : make_uint4(0, 0, 0, 0);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(q_smem + wg::swizzled_offset(kBlockM, r, ch * 8)),
                 "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
  }
  wg::fence_shared_for_async();
  __syncthreads();

  const int r_lo = row0 + 16 * w + gid;  // this thread's rows: r_lo and r_lo + 8 (tile rows 16 w + gid, + 8)
  const int tr = 16 * w + gid;
  const float scale_log2 = p.scale * kLog2e;
  RowSoftmax st;  // m: the reference max both warpgroups share; l: this thread's share of its half's sums
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;

  int it = 0;
  for (int start = kv_begin; start < kv_end; start += 2 * kBlockN, ++it) {
    const int s = it & 1;
    const unsigned phase = (it >> 1) & 1;
    const int half0 = start + c * kBlockN;                // this warpgroup's first token
    const bool own = half0 < kv_end, second = start + kBlockN < kv_end;  // own half; the tile's second half
    const unsigned own_buf = kv_smem + (2 * s + c) * kBufBytes;
    mbarrier_wait_parity(landed + (2 * s) * 8, phase);
    if (second) mbarrier_wait_parity(landed + (2 * s + 1) * 8, phase);

    // ---- S for this warpgroup's 32 tokens, in the accumulator layout of a 16 x 32 mma.sync tile per warp
    float sf[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) sf[i] = 0.f;
    if (own) {
      wg::fence();
#pragma unroll
      for (int k = 0; k < KDTREE_QK_DIM / 16; ++k)
        wg::mma_64x32_ss(sf, wg::k_major(q_smem, kBlockM, k), wg::k_major(own_buf, kBlockN, k), k > 0);
      wg::commit();
      wg::wait<0>();
      wg::pin(sf);
    }
    float sacc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sacc[nt][e] = own ? sf[4 * nt + e] * scale_log2 : -INFINITY;
    if (own && (half0 + kBlockN > L || half0 + kBlockN > kv_end))
      mask_scores(sacc, p, half0, L, kv_end, q0, H, R, r_lo, tig);
    // V rows of this half past kv_end: zeroed before anyone's P.V reads them
    if (own && half0 + kBlockN > kv_end) {
      for (int i = tid % 128; i < kBlockN * (kBoxes - 1) * 8; i += 128) {
        const int r = i / ((kBoxes - 1) * 8), ch = i % ((kBoxes - 1) * 8);
        if (half0 + r >= kv_end)
          asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(own_buf + kv_chunk_offset(r, ch)), "r"(0));
      }
    }
    float mx_lo = -INFINITY, mx_hi = -INFINITY;
    quad_row_max(sacc, mx_lo, mx_hi);
    if (tig == 0) {
      sm.tile_max[c][tr] = mx_lo;
      sm.tile_max[c][tr + 8] = mx_hi;
    }
    wg::fence_shared_for_async();
    wg_barrier();  // 1: both halves' maxes; both warpgroups are past the P.V of the tile before
    if (tid == 0 && it >= 1 && start + 2 * kBlockN < kv_end) {
      // the stage of tile it - 1 is free: copy tile it + 1 into it
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      wg_copy_tile(src_kv, &kv_map, kv_smem, landed, s ^ 1, start + 2 * kBlockN, kv_end);
    }
    mx_lo = fmaxf(mx_lo, sm.tile_max[c ^ 1][tr]);
    mx_hi = fmaxf(mx_hi, sm.tile_max[c ^ 1][tr + 8]);
    if (__any_sync(0xffffffffu, mx_lo > st.m_lo + kRescaleSlack || mx_hi > st.m_hi + kRescaleSlack)) {
      const float mn_lo = fmaxf(st.m_lo, mx_lo), mn_hi = fmaxf(st.m_hi, mx_hi);
      const float alpha_lo = mn_lo == -INFINITY ? 1.f : exp2f(st.m_lo - mn_lo);
      const float alpha_hi = mn_hi == -INFINITY ? 1.f : exp2f(st.m_hi - mn_hi);
      st.m_lo = mn_lo, st.m_hi = mn_hi;
      st.l_lo *= alpha_lo, st.l_hi *= alpha_hi;
#pragma unroll
      for (int nt = 0; nt < 32; ++nt) {
        o[4 * nt] *= alpha_lo, o[4 * nt + 1] *= alpha_lo;
        o[4 * nt + 2] *= alpha_hi, o[4 * nt + 3] *= alpha_hi;
      }
    }
    uint32_t pf[2][4];
    exp_scores(sacc, st, pf);  // a half wholly past kv_end: every score -inf, P = 0, nothing added
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int col = c * kBlockN + 8 * nt + 2 * tig;
      const uint32_t lo = pf[nt / 2][(nt % 2) * 2], hi = pf[nt / 2][(nt % 2) * 2 + 1];
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(p_smem + wg::swizzled_offset(kBlockM, tr, col)), "r"(lo));
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(p_smem + wg::swizzled_offset(kBlockM, tr + 8, col)), "r"(hi));
    }
    wg::fence_shared_for_async();
    wg_barrier();  // 2: P of the whole tile

    // ---- O[:, 256 c .. 256 c + 255] += P[64 x 64] V[64 x 256]: k step t = tokens 16 t .., half t / 2
    wg::fence();
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      if (t >= 2 && !second) break;
      wg::mma_64x256_ss<1>(o, wg::k_major(p_smem, kBlockM, t),
                           wg::mn_major(kv_smem + (2 * s + t / 2) * kBufBytes, kBlockN, 4 * c, t % 2), 1);
    }
    wg::commit();
    wg::wait<0>();
    wg::pin(o);
  }

  // ---- epilogue: the row sums of both halves, added in a fixed order; bf16 out + lse, or this split's partial
  reduce_row_sums(st);
  if (tig == 0) {
    sm.row_l[c][tr] = st.l_lo;
    sm.row_l[c][tr + 8] = st.l_hi;
  }
  wg_barrier();
  const SplitPartials part = full_partials(p, l, split, num_splits, first_row, q0, R);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = r_lo + half * 8;
    if (r >= R) continue;
    const float lsum = sm.row_l[0][tr + half * 8] + sm.row_l[1][tr + half * 8];
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    const float lse = lsum > 0.f ? ((half ? st.m_hi : st.m_lo) + log2f(lsum)) * kLn2 : -INFINITY;
    store_row<32, 16>(p, part, (size_t)q0 * H + r, 256 * c + 2 * tig, inv, lse, c == 0 && tig == 0,
                      [&](int nt, int e) { return o[4 * nt + half * 2 + e]; });
  }
#endif
}

}  // namespace
}  // namespace kdtree
