// The lockstep kernel: 8 warps on a double buffer, a block barrier per tile, within sm_120's 99 KB (the
// flash-portable product, and pages of < 32 tokens on sm_90).
// Part of verify_attn_flash.cu's translation unit (included there, in this order); its header comment says how
// the kernels work.
#pragma once

#include "common.cuh"

namespace kdtree {
namespace {

template <bool kTensorCopy>
__global__ void __launch_bounds__(kThreads, 1)
    verify_attn_flash_kernel(VerifyAttnParams p, FlashLaunch l, const __grid_constant__ CUtensorMap kv_map) {
  if (!has_body<kTensorCopy>()) return;
  SharedStorage& sm = shared_storage();

  const FullWork work = full_work(p, l);  // (request, row tile, split) of the host plan or the schedule
  if (work.b < 0) return;                 // a CTA past this call's work
  const int m_tile = work.m_tile, b = work.b;
  if (threadIdx.x == 0) sm.work = make_int4(work.split, work.splits, work.first_row, 0);
  const auto [H, q0, T, R] = request_rows(p, b);
  const int row0 = m_tile * kBlockM;
  // The kernel behind this one (the narrow or the combine kernel) may launch once every CTA of this grid has
  // started (or exited): its CTAs then take each SM this grid leaves, so the launch gap between the kernels is
  // spent while the last tiles run.
  launch_dependents();
  const KvSplit kv = kv_split(p, b, T, work.split, work.splits);
  const int L = kv.L, kv_begin = kv.begin, kv_end = kv.end;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = warp % 4, c = warp / 4;    // row group, dim/column half
  const int gid = lane / 4, tig = lane % 4;  // mma fragment coordinates

  const KvSource src_kv = kv_source(p, b);
  const unsigned kv_smem = static_cast<unsigned>(__cvta_generic_to_shared(&sm.kv[0][0][0][0]));
  const unsigned landed = static_cast<unsigned>(__cvta_generic_to_shared(&sm.landed[0]));
  init_landed_barriers<kTensorCopy>(landed);
  __syncthreads();  // sm.work written
  auto load_tile = [&](int buf, int start) {
    load_kv_tile<kTensorCopy>(src_kv, &kv_map, kv_smem, landed, kv_end, warp, lane, buf, start);
  };
  if (kv_begin < kv_end) load_tile(0, kv_begin);

  // This thread's two rows: lo = 16g + gid, hi = lo + 8.
  const int r_lo = row0 + g * 16 + gid;
  uint32_t qf[kKSteps][4];
  load_q_fragments(qf, p, q0, H, R, r_lo, c, tig);

  float o[kVTiles][4];
#pragma unroll
  for (int nt = 0; nt < kVTiles; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
  RowSoftmax st;
  const float scale_log2 = p.scale * kLog2e;
  // Per-lane byte offsets of the ldmatrix rows inside a KV box, for the even k-steps / column pairs (see
  // the fragment maps of m16n8k16). K k-step ks of half c is chunks 4ks + 2c + {0, 1} (matrix mi % 2), V
  // column pair np is chunks 4np + 2c + {0, 1} (matrix mi / 2): box ks / 2 (np / 2), chunk 4 (ks & 1) + a
  // with a < 4 in it, so the odd steps' offset is the even one's with bit 6 flipped ((4 + a) ^ x =
  // (a ^ x) ^ 4). Every ldmatrix row of a lane is = lane (mod 8), which is what the swizzle XORs with.
  const int mi = lane / 8;
  const unsigned k_lane_off = ((mi / 2) * 8 + lane % 8) * 128 + (((2 * c + mi % 2) ^ (lane % 8)) << 4);
  const unsigned v_lane_off = ((mi % 2) * 8 + lane % 8) * 128 + (((2 * c + mi / 2) ^ (lane % 8)) << 4);

  // The loop runs on `start` alone (the tile index derived from it): with a separate index and count live across
  // the loop, the one-copy-per-tile form spilled a register on sm_90.
  for (int start = kv_begin; start < kv_end; start += kBlockN) {
    const int it = (start - kv_begin) / kBlockN;
    const int buf = it & 1;
    wait_kv_tile<kTensorCopy>(landed, kv_end, it, start);
    __syncthreads();  // tile `it` landed; every warp is done with tile it-1 (its buffer and s_part)
    if (start + kBlockN < kv_end) load_tile(buf ^ 1, start + kBlockN);

    // ---- S partial = Q[16 rows, dims half c] . K[32 tokens]^T in one pass. The partner warp (same rows, other dim
    // half) needs it: store it, meet at a 64-thread named barrier, add the partner's. Two-operand float addition is
    // commutative, so own + partner gives both warps the same bits.
    float sacc[4][4] = {};
    score_half_tile(sacc, qf, kv_smem + buf * kBufBytes, k_lane_off);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
      sm.s_part[0][warp][nt][lane] = make_float4(sacc[nt][0], sacc[nt][1], sacc[nt][2], sacc[nt][3]);
    if constexpr (kTensorCopy) {  // the pair's barrier id 1 + g from a fresh read of the thread index: kept across
      unsigned t_now;             // the loop, it was spilled on sm_90 (the cp.async form spills with this read instead)
      asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t_now));
      asm volatile("bar.sync %0, 64;\n" ::"r"(1 + ((t_now >> 5) & 3)) : "memory");
    } else {
      asm volatile("bar.sync %0, 64;\n" ::"r"(1 + g) : "memory");
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const float4 v = sm.s_part[0][warp ^ 4][nt][lane];
      sacc[nt][0] = (sacc[nt][0] + v.x) * scale_log2;
      sacc[nt][1] = (sacc[nt][1] + v.y) * scale_log2;
      sacc[nt][2] = (sacc[nt][2] + v.z) * scale_log2;
      sacc[nt][3] = (sacc[nt][3] + v.w) * scale_log2;
    }

    // ---- mask (only tiles that reach the tree or the range end), then the online softmax
    if (start + kBlockN > L || start + kBlockN > kv_end) mask_scores(sacc, p, start, L, kv_end, q0, H, R, r_lo, tig);
    uint32_t pf[2][4];  // P as the A operand of P.V: two k-steps of 16 tokens
    softmax_tile(sacc, st, o, pf);

    // ---- O[16 rows, 256 columns of half c] += P[16, 32] . V[32, 256]
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const unsigned vbuf = kv_smem + buf * kBufBytes + kk * 16 * 128;
#pragma unroll
      for (int np = 0; np < kVTiles / 2; ++np) {
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, vbuf + (np >> 1) * kBoxBytes + (v_lane_off ^ ((np & 1) << 6)));
        mma_bf16(o[2 * np], pf[kk], bf[0], bf[1]);
        mma_bf16(o[2 * np + 1], pf[kk], bf[2], bf[3]);
      }
    }
  }

  reduce_row_sums(st);
  const int4 w = sm.work;
  store_rows(p, o, st, q0, H, R, r_lo, c, tig, full_partials(p, l, w.x, w.y, w.z, q0, R));
}

}  // namespace
}  // namespace kdtree
