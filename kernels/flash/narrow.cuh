// The narrow kernel: a request's last row tile of <= 16 rows (both products).
// Part of verify_attn_flash.cu's translation unit (included there, in this order); its header comment says how
// the kernels work.
#pragma once

#include "common.cuh"

namespace kdtree {
namespace {

// ---- The narrow row tile: a CTA whose row tile has at most kNarrowRows rows.
// With H = 8 every target has T H = 8 (2^k + 1) rows, 64 m + 8: the last row tile holds 8 rows and, as a full
// tile, costs as much as any other (a third of the work at N16, a ninth at N64). In a narrow CTA the four row
// groups all take the same 16 rows, group tg on tokens 8tg + [0, 8) of every tile: per warp S is 18 mma and P.V
// 32 m16n8k8, a quarter of a full tile's tensor work and ldmatrix traffic, with the same tile copies, barrier
// and pair exchange. Each group keeps its own online softmax; the four (m, l, O) merge once at the end through
// shared memory, in a fixed order. The narrow tiles have a split count of their own (the planner's narrow_splits, cut
// as split_chunk cuts the full tiles' ranges) and their own part of the workspace (narrow_partials): shorter CTAs than
// the full tiles', which fill the SMs the full tiles' last wave leaves (flash_plan.cuh).

// kTeams (tensor copies, TeamsStorage): the teams kernel's warp map, ring and refill (verify_attn_flash_teams_kernel),
// with the token group in place of the row group; else lockstep, a block barrier per tile.
template <bool kTensorCopy, bool kTeams, typename Storage>
__device__ __forceinline__ void narrow_rows(const VerifyAttnParams& p, Storage& sm, const CUtensorMap* kv_map,
                                            int b, int q0, int H, int R, int row0, int L, int kv_begin, int kv_end,
                                            const SplitPartials& part) {
  static_assert(!kTeams || kTensorCopy, "the teams' ring is filled by tensor copies only");
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int tg = kTeams ? 2 * (warp / 4) + (warp % 4) / 2 : warp % 4;  // token group
  const int c = kTeams ? warp % 2 : warp / 4;                          // dim/column half
  const int gid = lane / 4, tig = lane % 4;  // mma fragment coordinates
  const int num_tiles = (kv_end - kv_begin + kBlockN - 1) / kBlockN;
  const KvSource src_kv = kv_source(p, b);
  const unsigned kv_smem = static_cast<unsigned>(__cvta_generic_to_shared(&sm.kv[0][0][0][0]));
  const unsigned landed = static_cast<unsigned>(__cvta_generic_to_shared(&sm.landed[0]));
  auto load_tile = [&](int buf, int start) {
    load_kv_tile<kTensorCopy>(src_kv, kv_map, kv_smem, landed, kv_end, warp, lane, buf, start);
  };
  if constexpr (kTeams) {
    init_teams_ring(sm, landed);
    if (warp == 0)
      for (int t = 0; t < kKvBufs && t < num_tiles; ++t) copy_kv_tile(src_kv, kv_map, kv_smem, landed, lane, t, kv_begin + t * kBlockN);
  } else {
    init_landed_barriers<kTensorCopy>(landed);
    if (num_tiles > 0) load_tile(0, kv_begin);
  }
  const float scale_log2 = p.scale * kLog2e;

  const int r_lo = row0 + gid;
  uint32_t qf[kKSteps][4];
  load_q_fragments(qf, p, q0, H, R, r_lo, c, tig);
  float o[kVTiles][4];
#pragma unroll
  for (int nt = 0; nt < kVTiles; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
  RowSoftmax st;

  // One lane offset serves K and V: ldmatrix matrix mi reads token row 8tg + lane % 8 and, in each box, chunk
  // 2c + (mi & 1) + 4 (mi >> 1). For S that is k-steps 2j (mi = 0, 1) and 2j + 1 (mi = 2, 3) of half c in box j;
  // for P.V (transposed) the n-tiles 4j + mi of half c, whose value columns 32 (nt / 2) + 16c + 8 (nt % 2) are
  // those chunks of box j.
  const int mi = lane / 8;
  const unsigned lane_off = (8 * tg + lane % 8) * 128 + (((2 * c + (mi & 1) + 4 * (mi >> 1)) ^ (lane % 8)) << 4);

  int ring = 0;  // with the teams' ring: it % 6 (buffer it % 3, barrier phase (it / 3) & 1, s_part slot it & 1)
  for (int it = 0; it < num_tiles; ++it) {
    const int buf = kTeams ? (ring >= kKvBufs ? ring - kKvBufs : ring) : (it & 1);
    const int start = kv_begin + it * kBlockN;
    if constexpr (kTeams) {
      mbarrier_wait_parity(landed + buf * 8, ring >= kKvBufs);
    } else {
      wait_kv_tile<kTensorCopy>(landed, kv_end, it, start);
      __syncthreads();  // tile `it` landed; every warp is done with tile it-1 (its buffer and s_part)
      if (it + 1 < num_tiles) load_tile(buf ^ 1, start + kBlockN);
    }
    const unsigned tile = kv_smem + buf * kBufBytes + lane_off;

    // S partial = Q[16 rows, dims half c] . K[8 tokens]^T: even and odd k-steps in two chains
    float sacc[2][4] = {};
#pragma unroll
    for (int j = 0; j < kKSteps / 2; ++j) {
      uint32_t bf[4];
      ldmatrix_x4(bf, tile + j * kBoxBytes);
      mma_bf16(sacc[0], qf[2 * j], bf[0], bf[1]);
      mma_bf16(sacc[1], qf[2 * j + 1], bf[2], bf[3]);
    }
    float s[1][4];
#pragma unroll
    for (int e = 0; e < 4; ++e) s[0][e] = sacc[0][e] + sacc[1][e];
    const int slot = kTeams ? (ring & 1) : 0;
    sm.s_part[slot][warp][0][lane] = make_float4(s[0][0], s[0][1], s[0][2], s[0][3]);
    asm volatile("bar.sync %0, 64;\n" ::"r"(1 + tg) : "memory");
    {
      const float4 v = sm.s_part[slot][warp ^ (kTeams ? 1 : 4)][0][lane];  // own + partner: the same bits in both warps
      s[0][0] = (s[0][0] + v.x) * scale_log2;
      s[0][1] = (s[0][1] + v.y) * scale_log2;
      s[0][2] = (s[0][2] + v.z) * scale_log2;
      s[0][3] = (s[0][3] + v.w) * scale_log2;
    }
    if (start + kBlockN > L || start + kBlockN > kv_end) mask_scores(s, p, start + 8 * tg, L, kv_end, q0, H, R, r_lo, tig);
    uint32_t pf[1][2];
    softmax_tile(s, st, o, pf);

    // O[16 rows, 256 columns of half c] += P[16, 8] . V[8 tokens, 256]. With the teams' ring the tail tile is a
    // tensor copy, so its V elements past kv_end (tokens 8tg + 2tig + {0, 1} of a fragment register) are zeroed.
    uint32_t keep = ~0u;
    if (kTeams && start + kBlockN > kv_end) {
      const int t0 = start + 8 * tg + 2 * tig;
      keep = (t0 < kv_end ? 0xffffu : 0u) | (t0 + 1 < kv_end ? 0xffff0000u : 0u);
    }
#pragma unroll
    for (int j = 0; j < kVTiles / 4; ++j) {
      uint32_t bf[4];
      ldmatrix_x4_trans(bf, tile + j * kBoxBytes);
#pragma unroll
      for (int m = 0; m < 4; ++m) mma_bf16_k8(o[4 * j + m], pf[0][0], pf[0][1], kTeams ? bf[m] & keep : bf[m]);
    }
    if constexpr (kTeams) {
      if (start + kKvBufs * kBlockN < kv_end) release_teams_buffer(src_kv, kv_map, kv_smem, landed, lane, buf, start);
      ring = ring == 2 * kKvBufs - 1 ? 0 : ring + 1;
    }
  }

  // ---- merge the four token groups. First the rows' combined max and sum, over the groups in order; then O,
  // each group's scaled to the combined max, summed through shared memory as (g0 + g2) + (g1 + g3).
  reduce_row_sums(st);
  __syncthreads();  // every warp is done with the KV buffers and s_part (the last tile starts no copy)
  float2* row_ml = reinterpret_cast<float2*>(&sm.s_part[0][0][0][0]);  // [token group][16 rows]: (m, l)
  if (c == 0 && tig == 0) {
    row_ml[tg * 16 + gid] = make_float2(st.m_lo, st.l_lo);
    row_ml[tg * 16 + gid + 8] = make_float2(st.m_hi, st.l_hi);
  }
  __syncthreads();
  RowSoftmax merged;
  float factor[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float m = -INFINITY;
#pragma unroll
    for (int g = 0; g < 4; ++g) m = fmaxf(m, row_ml[g * 16 + gid + half * 8].x);
    float l = 0.f;
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const float2 ml = row_ml[g * 16 + gid + half * 8];
      if (ml.x != -INFINITY) l += ml.y * exp2f(ml.x - m);
    }
    const float own = half ? st.m_hi : st.m_lo;
    factor[half] = own == -INFINITY ? 0.f : exp2f(own - m);
    (half ? merged.m_hi : merged.m_lo) = m;
    (half ? merged.l_hi : merged.l_lo) = l;
  }
#pragma unroll
  for (int nt = 0; nt < kVTiles; ++nt) {
    o[nt][0] *= factor[0];
    o[nt][1] *= factor[0];
    o[nt][2] *= factor[1];
    o[nt][3] *= factor[1];
  }
  float4* slots = reinterpret_cast<float4*>(&sm.kv[0][0][0][0]);  // 4 slots of 16 KB: [nt][lane]
  auto put = [&](int slot) {
#pragma unroll
    for (int nt = 0; nt < kVTiles; ++nt)
      slots[(slot * kVTiles + nt) * 32 + lane] = make_float4(o[nt][0], o[nt][1], o[nt][2], o[nt][3]);
  };
  auto add = [&](int slot) {
#pragma unroll
    for (int nt = 0; nt < kVTiles; ++nt) {
      const float4 v = slots[(slot * kVTiles + nt) * 32 + lane];
      o[nt][0] += v.x;
      o[nt][1] += v.y;
      o[nt][2] += v.z;
      o[nt][3] += v.w;
    }
  };
  if (tg >= 2) put((tg - 2) * 2 + c);
  __syncthreads();
  if (tg < 2) add(tg * 2 + c);
  __syncthreads();
  if (tg == 1) put(c);
  __syncthreads();
  if (tg != 0) return;
  add(c);
  store_rows(p, o, merged, q0, H, R, r_lo, c, tig, part);
}

template <bool kTensorCopy, bool kTeams>
__global__ void __launch_bounds__(kThreads, 1)
    verify_attn_flash_narrow_kernel(VerifyAttnParams p, FlashLaunch l, const __grid_constant__ CUtensorMap kv_map) {
  launch_dependents();  // the combine kernel behind this one may launch once every CTA of this grid has started
  if (!has_body<kTensorCopy, kTeams>()) return;
  using Storage = std::conditional_t<kTeams, TeamsStorage, SharedStorage>;
  Storage& sm = shared_storage<Storage>();
  const NarrowWork work = narrow_work(p, l);  // (request, split) of the host plan or the schedule
  if (work.b >= 0) {
    const int b = work.b;
    const auto [H, q0, T, R] = request_rows(p, b);
    const int row0 = (R - 1) / kBlockM * kBlockM;  // the request's last row tile
    if (R > 0 && R - row0 <= kNarrowRows) {
      const KvSplit kv = kv_split(p, b, T, work.split, work.splits);
      const int L = kv.L, kv_begin = kv.begin, kv_end = kv.end;
      narrow_rows<kTensorCopy, kTeams>(p, sm, &kv_map, b, q0, H, R, row0, L, kv_begin, kv_end,
                                       narrow_partials(p, l, work.split, work.splits, work.first_row, q0, row0));
    }
  }
  // Launched behind the full-tile kernel (programmatically), and the combine kernel behind this one waits only for
  // this grid: so this grid completes only after that one has, and its writes are visible.
  wait_primary_grids();
}

}  // namespace
}  // namespace kdtree
