// The teams kernel: two teams of warps out of phase on a four-deep ring of tensor copies (the flash product
// on sm_90; 186 KB of shared memory).
// Part of verify_attn_flash.cu's translation unit (included there, in this order); its header comment says how
// the kernels work.
#pragma once

#include "common.cuh"

namespace kdtree {
namespace {

// ---- The tensor-copy kernel (sm_90+, pages of >= 32 tokens): two teams of warps out of phase, P.V over a team.
// Team t = warps 4t..4t+3 holds row groups 2t and 2t + 1 (the tile's rows 32t..32t+31). For S, warp w = (row group g =
// 2t + (w % 4) / 2, half c = w % 2), pair partner w ^ 1, as in verify_attn_flash_kernel. For P.V, warp w owns the
// team's 32 rows in value-column quarter q = w % 4 (the 16-column blocks 4j + q): each V fragment feeds both row
// groups' mma, so every tile's V is read from shared memory twice per CTA where 16-row warps read it four times (v23
// in NOTES.md). The two warps that share a scheduler (w and w + 4) are in different teams, so one's exchange and
// softmax can run under the other's ldmatrix and mma. No block barrier per tile: the KV ring is kKvBufs deep; each
// warp waits for its tile's tensor copy itself, and the eighth warp done with a buffer copies the tile kKvBufs ahead
// into it (a counter per buffer, acquire-release). One team barrier per tile: a warp publishes its S half-sums before
// it and reads its partner's after it, and P.V runs a tile behind, on the P both pairs of the team published before it
// (their P fragments and, for a tile that moved a row's max, the O rescale). Every tile is a tensor copy, the range's
// partial last one too: its rows past kv_end hold whatever the pool holds there (NaN included), so their scores are
// masked (as any past kv_end) and their V elements zeroed in the fragments before P.V (0 x NaN is NaN).
constexpr int kTeamVTiles = KDTREE_V_DIM / 4 / 8;  // 16 n-tiles of 8 value columns per row group in a P.V warp

// O[32 team rows, value-column quarter q] += P[32, 32] . V[32 tokens, 128] for the tile at `start` (in buffer vbase =
// its base + the lane's V offset), with the P its team published in P slot `slot`; first the O rows whose max
// that tile moved are rescaled. kTail: the range's partial last tile, its V past kv_end zeroed. n-tile nt of row group
// 2 team + mt is value columns 64 (nt / 2) + 16q + 8 (nt % 2) + [0, 8).
template <bool kTail>
__device__ __forceinline__ void team_pv_tile(float (&o)[2][kTeamVTiles][4], const TeamsStorage& sm, unsigned vbase,
                                             int team, int gid, int tig, int lane, int slot, int start, int kv_end) {
  const uint2 moved = *reinterpret_cast<const uint2*>(&sm.moved[slot][2 * team]);  // the same for every lane
  if (moved.x | moved.y) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      if (!(mt ? moved.y : moved.x)) continue;
      const float alpha_lo = sm.alpha[slot][2 * team + mt][gid], alpha_hi = sm.alpha[slot][2 * team + mt][gid + 8];
#pragma unroll
      for (int nt = 0; nt < kTeamVTiles; ++nt) {
        o[mt][nt][0] *= alpha_lo;
        o[mt][nt][1] *= alpha_lo;
        o[mt][nt][2] *= alpha_hi;
        o[mt][nt][3] *= alpha_hi;
      }
    }
  }
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
    uint32_t pa[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const uint4 v = sm.p_frag[slot][2 * team + mt][kk][lane];
      pa[mt][0] = v.x, pa[mt][1] = v.y, pa[mt][2] = v.z, pa[mt][3] = v.w;
    }
    // A V fragment register holds tokens 16kk + 8h + 2tig + {0, 1} (h = 0 for bf[0], bf[2], 1 for bf[1], bf[3]).
    uint32_t keep0 = ~0u, keep1 = ~0u;
    if (kTail) {
      const int t0 = start + 16 * kk + 2 * tig;
      keep0 = (t0 < kv_end ? 0xffffu : 0u) | (t0 + 1 < kv_end ? 0xffff0000u : 0u);
      keep1 = (t0 + 8 < kv_end ? 0xffffu : 0u) | (t0 + 9 < kv_end ? 0xffff0000u : 0u);
    }
#pragma unroll
    for (int j = 0; j < kBoxes - 1; ++j) {  // the 8 boxes of V's 512 dims
      uint32_t bf[4];
      ldmatrix_x4_trans(bf, vbase + kk * 16 * 128 + j * kBoxBytes);
      if (kTail) bf[0] &= keep0, bf[1] &= keep1, bf[2] &= keep0, bf[3] &= keep1;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        mma_bf16(o[mt][2 * j], pa[mt], bf[0], bf[1]);
        mma_bf16(o[mt][2 * j + 1], pa[mt], bf[2], bf[3]);
      }
    }
  }
}

// Epilogue of a P.V warp: its team's 32 rows in value-column quarter q, each row's (m, l) from shared memory (l as
// the sum of the pair's two halves, in order); bf16 out + lse, or this split's fp32 partial + lse.
__device__ __forceinline__ void store_team_rows(const VerifyAttnParams& p, const float (&o)[2][kTeamVTiles][4],
                                                const TeamsStorage& sm, int q0, int H, int R, int row0, int team,
                                                int gid, int q, int tig, const SplitPartials& part) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int group = 2 * team + mt, gr = gid + half * 8;
      const int r = row0 + 16 * group + gr;
      if (r >= R) continue;
      const float l = sm.row_l[0][group][gr] + sm.row_l[1][group][gr];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const float lse = l > 0.f ? (sm.row_m[group][gr] + log2f(l)) * kLn2 : -INFINITY;
      const size_t grow = (size_t)q0 * H + r;
      store_row<kTeamVTiles, 64>(p, part, grow, q * 16 + tig * 2, inv, lse, q == 0 && tig == 0,
                                 [&](int nt, int e) { return o[mt][nt][half * 2 + e]; });
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    verify_attn_flash_teams_kernel(VerifyAttnParams p, FlashLaunch l, const __grid_constant__ CUtensorMap kv_map) {
  if (!has_body<true, true>()) return;  // no teams body on sm_120 (TeamsStorage does not fit a block there)
  TeamsStorage& sm = shared_storage<TeamsStorage>();

  const FullWork work = full_work(p, l);  // (request, row tile, split) of the host plan or the schedule
  if (work.b < 0) return;                 // a CTA past this call's work
  const int m_tile = work.m_tile, b = work.b, split = work.split, num_splits = work.splits;
  const int first_row = work.first_row;
  const auto [H, q0, T, R] = request_rows(p, b);
  const int row0 = m_tile * kBlockM;
  // The kernel behind this one (the narrow or the combine kernel) may launch once every CTA of this grid has
  // started (or exited): its CTAs then take each SM this grid leaves, so the launch gap between the kernels is
  // spent while the last tiles run.
  launch_dependents();
  const KvSplit kv = kv_split(p, b, T, split, num_splits);
  const int L = kv.L, kv_begin = kv.begin, kv_end = kv.end;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int team = warp / 4, q = warp % 4;       // team, P.V value-column quarter
  const int g = 2 * team + q / 2, c = warp % 2;  // S row group, dim half
  const int gid = lane / 4, tig = lane % 4;      // mma fragment coordinates

  const KvSource src_kv = kv_source(p, b);
  const unsigned kv_smem = static_cast<unsigned>(__cvta_generic_to_shared(&sm.kv[0][0][0][0]));
  const unsigned landed = kv_smem + offsetof(TeamsStorage, landed);  // one base register for all of shared memory
  init_teams_ring(sm, landed);
  if (warp == 0)
    for (int t = 0; t < kKvBufs && kv_begin + t * kBlockN < kv_end; ++t)
      copy_kv_tile(src_kv, &kv_map, kv_smem, landed, lane, t, kv_begin + t * kBlockN);

  // This thread's two S rows: lo = 16g + gid, hi = lo + 8.
  const int r_lo = row0 + g * 16 + gid;
  uint32_t qf[kKSteps][4];
  load_q_fragments(qf, p, q0, H, R, r_lo, c, tig);

  float o[2][kTeamVTiles][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < kTeamVTiles; ++nt) o[mt][nt][0] = o[mt][nt][1] = o[mt][nt][2] = o[mt][nt][3] = 0.f;
  RowSoftmax st;  // row group g's rows; l over this warp's k-step c of every tile
  const float scale_log2 = p.scale * kLog2e;
  // The P.V lane offset inside a KV box: ldmatrix.trans matrix mi reads token row 8 (mi % 2) + lane % 8 and the chunk
  // 2q + mi / 2 (value columns 16q + 8 (mi / 2)), swizzled.
  const int mi = lane / 8;
  const unsigned v_lane_off = ((mi % 2) * 8 + lane % 8) * 128 + (((2 * q + mi / 2) ^ (lane % 8)) << 4);

  // Tile it's place in the ring and the team's barrier, one register: ring = it % (2 kKvBufs) + 8 (1 + team). The
  // tile's buffer is it % kKvBufs, the phase of that buffer's barrier (it / kKvBufs) & 1, its s_part and P slot it & 1.
  int ring = 8 * (1 + team);
  int start = kv_begin;
  for (; start < kv_end; start += kBlockN) {
    const int ring_it = ring & 7;
    const int buf = ring_it >= kKvBufs ? ring_it - kKvBufs : ring_it;
    const int slot = ring_it & 1;
    mbarrier_wait_parity(landed + buf * 8, ring_it >= kKvBufs);

    // ---- S partial = Q[16 rows, dims half c] . K[32 tokens]^T, then the pair exchange, through s_part slot it & 1,
    // behind the team's barrier.
    float sacc[4][4] = {};
    {
      // The K lane offset: ldmatrix matrix mi reads token row 8 (mi / 2) + lane % 8 and chunk 2c + mi % 2 of a box
      // (k-step 2j + c; k-step 2j + 1's chunk is 4 further). From a fresh read of the thread index: in registers of
      // their own across the loop, c and the lane are what ptxas spills.
      unsigned t_now;
      asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t_now));
      const unsigned ln = t_now & 31, cc = (t_now >> 5) & 1;
      const unsigned k_lane_off = (((ln >> 4) & 1) * 8 + (ln & 7)) * 128 + (((2 * cc + ((ln >> 3) & 1)) ^ (ln & 7)) << 4);
      score_half_tile(sacc, qf, kv_smem + buf * kBufBytes, k_lane_off);
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
      sm.s_part[slot][warp][nt][lane] = make_float4(sacc[nt][0], sacc[nt][1], sacc[nt][2], sacc[nt][3]);
    asm volatile("bar.sync %0, 128;\n" ::"r"(ring >> 3) : "memory");
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const float4 v = sm.s_part[slot][warp ^ 1][nt][lane];
      sacc[nt][0] = (sacc[nt][0] + v.x) * scale_log2;
      sacc[nt][1] = (sacc[nt][1] + v.y) * scale_log2;
      sacc[nt][2] = (sacc[nt][2] + v.z) * scale_log2;
      sacc[nt][3] = (sacc[nt][3] + v.w) * scale_log2;
    }

    // ---- mask (only tiles that reach the tree or the range end), then the online softmax. Both warps of a pair hold
    // the same scores, so they move the max alike; each exponentiates its own k-step c (16 tokens) and publishes it.
    if (start + kBlockN > L || start + kBlockN > kv_end) mask_scores(sacc, p, start, L, kv_end, q0, H, R, r_lo, tig);
    bool moved = false;
    raise_reference_max(sacc, st, [&](float alpha_lo, float alpha_hi) {
      moved = true;
      if (c == 0 && tig == 0) {
        sm.alpha[slot][g][gid] = alpha_lo;
        sm.alpha[slot][g][gid + 8] = alpha_hi;
      }
    });
    float own[2][4];  // n-tiles 2c, 2c + 1: k-step c
#pragma unroll
    for (int x = 0; x < 2; ++x)
#pragma unroll
      for (int e = 0; e < 4; ++e) own[x][e] = c ? sacc[2 + x][e] : sacc[x][e];
    uint32_t pf[1][4];
    exp_scores(own, st, pf);
    sm.p_frag[slot][g][c][lane] = make_uint4(pf[0][0], pf[0][1], pf[0][2], pf[0][3]);
    if (c == 0 && lane == 0) sm.moved[slot][g] = moved;

    // ---- P.V of the tile before, whose P the team published before this tile's barrier; then its buffer is free.
    if (start > kv_begin) {
      const int prev_it = ring_it == 0 ? 2 * kKvBufs - 1 : ring_it - 1;
      const int prev_buf = prev_it >= kKvBufs ? prev_it - kKvBufs : prev_it;
      team_pv_tile<false>(o, sm, kv_smem + prev_buf * kBufBytes + v_lane_off, team, gid, tig, lane, slot ^ 1,
                          start - kBlockN, kv_end);
      if (start + (kKvBufs - 1) * kBlockN < kv_end)
        release_teams_buffer(src_kv, &kv_map, kv_smem, landed, lane, prev_buf, start - kBlockN);
    }
    ring = ring_it == 2 * kKvBufs - 1 ? ring - (2 * kKvBufs - 1) : ring + 1;
  }

  // ---- the last tile's P.V (the range's partial tail, if it has one), behind the team's barrier, which also
  // publishes every row's (m, l) for the epilogue.
  reduce_row_sums(st);
  if (tig == 0) {
    sm.row_l[c][g][gid] = st.l_lo;
    sm.row_l[c][g][gid + 8] = st.l_hi;
    if (c == 0) {
      sm.row_m[g][gid] = st.m_lo;
      sm.row_m[g][gid + 8] = st.m_hi;
    }
  }
  asm volatile("bar.sync %0, 128;\n" ::"r"(ring >> 3) : "memory");
  if (kv_begin < kv_end) {
    const int ring_it = ring & 7;
    const int prev_it = ring_it == 0 ? 2 * kKvBufs - 1 : ring_it - 1;
    const int prev_buf = prev_it >= kKvBufs ? prev_it - kKvBufs : prev_it;
    team_pv_tile<true>(o, sm, kv_smem + prev_buf * kBufBytes + v_lane_off, team, gid, tig, lane, prev_it & 1,
                       start - kBlockN, kv_end);
  }
  store_team_rows(p, o, sm, q0, H, R, row0, team, gid, q, tig,
                  full_partials(p, l, split, num_splits, first_row, q0, R));
}

}  // namespace
}  // namespace kdtree
