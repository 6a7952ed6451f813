// What every flash family uses: the tile constants and shared-memory layouts, the Q load, the S half-tile,
// the online-softmax step, the tile loaders (cp.async and tensor copies), the split partials' stores and the
// teams' ring.
// Part of verify_attn_flash.cu's translation unit (included there, in this order); its header comment says how
// the kernels work.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kdev/flash_plan.cuh"
#include "kdev/kv_pages.cuh"
#include "kdev/kv_tensor_map.cuh"
#include "kdev/mbarrier.cuh"
#include "kdev/mma_sync.cuh"
#include "kdev/verify_attn.cuh"

namespace kdtree {
namespace {


constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
static_assert(kThreads == KDTREE_FLASH_THREADS, "kdtree.h states the flash CTA size");
constexpr int kBoxDims = kKvBoxDims;           // dims per 128-byte box row
constexpr int kBoxes = KDTREE_QK_DIM / kBoxDims;  // 9
constexpr unsigned kBoxBytes = kBlockN * kBoxDims * 2;  // 4,096 B: one box of the tile
constexpr int kKSteps = KDTREE_QK_DIM / 32;    // 18 k-steps of 16 dims per S warp (every other one)
constexpr int kVTiles = KDTREE_V_DIM / 2 / 8;  // 32 n-tiles of 8 value columns per PV warp
constexpr int kChunksPerRow = KDTREE_QK_DIM / 8;  // 72 x 16-byte chunks per KV row
constexpr unsigned kBufBytes = kBoxes * kBoxBytes;  // one KV buffer: 36,864 B, a multiple of 1,024
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kRescaleSlack = 8.f;  // log2 units: the reference max may lag a row's max by up to 2^8

// Where a CTA's rows go: with one split (splits == 1), bf16 out and lse at the row's own index grow; else split
// `split`'s fp32 partial in one part of the workspace (flash_plan.cuh's layout): values at o + (split rows + prow) 512,
// LSE at lse[split rows + prow], for the part's row prow = grow + shift.
struct SplitPartials {
  float* o;
  float* lse;
  size_t rows;
  long long shift;
  int split, splits;
};

// The 128-byte swizzle repeats every 1,024 B: the storage starts on a 1,024-byte boundary.
// The lockstep kernels (a block barrier per tile; every kernel on sm_120, the cp.async kernels everywhere).
struct __align__(1024) SharedStorage {
  __nv_bfloat16 kv[2][kBoxes][kBlockN][kBoxDims];  // 73,728 B: double-buffered KV tile, boxes, chunks swizzled
  float4 s_part[1][kWarps][4][32];                 // 16,384 B: each warp's half-dim partial scores, fragment order
  uint64_t landed[2];                              // TMA: one mbarrier per KV buffer
  int4 work;  // the CTA's split, split count and first partial row, for the epilogue (in registers, the loop spilled)
};
constexpr int kSmemBytes = (int)sizeof(SharedStorage);

// sm_120 (RTX PRO 6000) allows 101,376 B of dynamic shared memory per block: the lockstep kernels must fit it.
static_assert(kSmemBytes <= 101376, "flash verify tile exceeds sm_120's shared memory per block");

// The teams kernels (tensor copies where a block may hold this much: sm_90's 232,448 B; not sm_120's 101,376 B):
// a four-deep KV ring, and the S exchange and P hand-off in two slots, so that no barrier makes all eight warps meet
// per tile.
constexpr int kKvBufs = 4;
struct __align__(1024) TeamsStorage {
  __nv_bfloat16 kv[kKvBufs][kBoxes][kBlockN][kBoxDims];  // 147,456 B: KV tile ring, boxes, chunks swizzled
  float4 s_part[2][kWarps][4][32];  // 32,768 B: each warp's half-dim partial scores, fragment order, by tile parity
  uint4 p_frag[2][4][2][32];        // 8,192 B: each row group's P as bf16 A fragments [tile parity][group][k-step][lane]
  float alpha[2][4][16];            // a row's O rescale on a tile that moved its max [tile parity][group][row]
  uint32_t moved[2][4];             // whether the tile moved a max of the group's rows [tile parity][group]
  float row_l[2][4][16];            // the epilogue's row sums, per half c [c][group][row]
  float row_m[4][16];               // and reference maxes [group][row]
  uint64_t landed[kKvBufs];         // one mbarrier per KV buffer: its tensor copies landed
  uint32_t released[kKvBufs];       // warps done with the buffer, counted up (the eighth copies the next tile in)
};
constexpr int kTeamsSmemBytes = (int)sizeof(TeamsStorage);
static_assert(2 * kKvBufs <= 8, "the teams kernel packs it % (2 kKvBufs) into the ring register's low 3 bits");

// Tensor copies, mbarrier transaction counts, the async-proxy fence and the programmatic launch of the combine
// kernel (griddepcontrol) are sm_90+ (sm_120 has them too); an sm_80 build has only the cp.async path and a
// plain combine launch, and the host never picks the others there.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define KDTREE_FLASH_SM90 1
#else
#define KDTREE_FLASH_SM90 0
#endif
// The teams kernels need kTeamsSmemBytes per block: sm_90 to sm_11x have 227 KB, sm_120 has 99 KB (no body there;
// the host launches them only where the device's opt-in limit holds TeamsStorage).
#if !defined(__CUDA_ARCH__) || (__CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1200)
#define KDTREE_FLASH_TEAMS 1
#else
#define KDTREE_FLASH_TEAMS 0
#endif

// The arch choice is the launcher's (verify_attn_flash.cu): it launches a tensor-copy kernel from sm_90 only
// (encode_kv_map) and a teams kernel only where TeamsStorage fits a block. The arch facts the kernels need are the
// primitives below; a kernel body holds no arch test. One that the launcher never starts on the arch being compiled
// begins with `if (!has_body<...>()) return;`, a constant, so nothing of the body is built there.
template <bool kTensorCopy, bool kTeams = false>
__device__ __forceinline__ constexpr bool has_body() {
  return (!kTensorCopy || KDTREE_FLASH_SM90) && (!kTeams || KDTREE_FLASH_TEAMS);
}

// Programmatic dependent launch (sm_90+): the kernel launched behind this one may start once every CTA of this grid
// has started (or exited). A no-op without a dependent launch, and before sm_90 (the combine is launched plainly).
__device__ __forceinline__ void launch_dependents() {
#if KDTREE_FLASH_SM90
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Wait until the grids this one was launched behind (programmatically) completed and their writes are visible;
// before sm_90 stream order already gave that.
__device__ __forceinline__ void wait_primary_grids() {
#if KDTREE_FLASH_SM90
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cp_async_16(unsigned s, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Byte offset of 16-byte chunk `ch` (of 72) of KV row `r` in a buffer: box ch / 8, row r, chunk (ch ^ r) & 7.
__device__ __forceinline__ unsigned kv_chunk_offset(int r, int ch) {
  return (ch >> 3) * kBoxBytes + r * 128 + (((ch ^ r) & 7) << 4);
}

__device__ __forceinline__ uint32_t load_pair(const __nv_bfloat16* ptr, bool valid) {
  return valid ? *reinterpret_cast<const uint32_t*>(ptr) : 0u;
}

// Q fragments of rows r_lo and r_lo + 8 (zero past R), k-step ks = dims 32ks + 16c + [0, 16): loaded once, kept in
// registers.
__device__ __forceinline__ void load_q_fragments(uint32_t (&qf)[kKSteps][4], const VerifyAttnParams& p, int q0, int H,
                                                 int R, int r_lo, int c, int tig) {
  const __nv_bfloat16* qb = static_cast<const __nv_bfloat16*>(p.q) + (size_t)q0 * H * KDTREE_QK_DIM;
  const int r_hi = r_lo + 8;
  const __nv_bfloat16* q_lo = qb + (size_t)r_lo * KDTREE_QK_DIM + c * 16 + tig * 2;
  const __nv_bfloat16* q_hi = qb + (size_t)r_hi * KDTREE_QK_DIM + c * 16 + tig * 2;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    qf[ks][0] = load_pair(q_lo + ks * 32, r_lo < R);
    qf[ks][1] = load_pair(q_hi + ks * 32, r_hi < R);
    qf[ks][2] = load_pair(q_lo + ks * 32 + 8, r_lo < R);
    qf[ks][3] = load_pair(q_hi + ks * 32 + 8, r_hi < R);
  }
}

// S partial of a warp's 16 rows over its dim half c: sacc[nt] (tokens 8nt + [0, 8) of the 32-token tile in the KV
// buffer at kbuf) += Q[16 rows, the k-steps 2j + c] . K^T, in four independent accumulator chains (measured the same
// speed as two passes of two, NOTES.md). k_lane_off: the lane's ldmatrix row offset in a box for the even k-steps (the
// odd ones' is it with bit 6 flipped: see the kernels).
__device__ __forceinline__ void score_half_tile(float (&sacc)[4][4], const uint32_t (&qf)[kKSteps][4], unsigned kbuf,
                                                unsigned k_lane_off) {
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t bf[4], bg[4];
    const unsigned ka = kbuf + (ks >> 1) * kBoxBytes + (k_lane_off ^ ((ks & 1) << 6));
    ldmatrix_x4(bf, ka);
    ldmatrix_x4(bg, ka + 16 * 128);
    mma_bf16(sacc[0], qf[ks], bf[0], bf[1]);
    mma_bf16(sacc[1], qf[ks], bf[2], bf[3]);
    mma_bf16(sacc[2], qf[ks], bg[0], bg[1]);
    mma_bf16(sacc[3], qf[ks], bg[2], bg[3]);
  }
}

// 2^x by the MUFU unit directly (ex2.approx.ftz): exp2f wraps it in a range check and two scalings for subnormal
// results, which a softmax term below 2^-126 of its row max never needs (it flushes to 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The tree mask and the range end on a 16 x 8NT score tile in accumulator layout whose n-tile nt holds tokens
// tok0 + 8nt + [0, 8): a token past kv_end, or a tree node that is not an ancestor-or-self of the row's node,
// scores -inf. Rows past R (the padding of the last row tile) are not masked: their Q is zero, their scores
// finite, and their output is never written. (Masking them sent that tile's CTA down this path on every tile,
// the slowest CTA of the launch.)
template <int NT>
__device__ __forceinline__ void mask_scores(float (&s)[NT][4], const VerifyAttnParams& p, int tok0, int L, int kv_end,
                                            int q0, int H, int R, int r_lo, int tig) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = r_lo + half * 8;
    const uint64_t* mask_row = p.tree_mask + (size_t)(q0 + (r < R ? r / H : 0)) * p.mask_words;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int pos = tok0 + nt * 8 + tig * 2 + e;
        bool keep = pos < kv_end;
        if (keep && pos >= L) {
          const int node = pos - L;
          keep = (mask_row[node / 64] >> (node % 64)) & 1ull;
        }
        if (!keep) s[nt][half * 2 + e] = -INFINITY;
      }
    }
  }
}

// Online softmax state of a thread's two rows (lo = gid, hi = gid + 8 of its 16-row group): the reference max m
// (log2 units), replicated across the quad, and this thread's share of the running sum l (its own columns; the quad's
// four shares are added once, by reduce_row_sums, before the epilogue).
struct RowSoftmax {
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;
};

__device__ __forceinline__ void reduce_row_sums(RowSoftmax& st) {
#pragma unroll
  for (int off = 1; off <= 2; off *= 2) {
    st.l_lo += __shfl_xor_sync(0xffffffffu, st.l_lo, off);
    st.l_hi += __shfl_xor_sync(0xffffffffu, st.l_hi, off);
  }
}

// The lazy reference max of a 16 x 8NT score tile (log2 units, masked): when some row's tile max exceeds its m by
// more than kRescaleSlack, m moves for the tile's rows, the sums l are rescaled and so is O, by the caller's
// rescale(alpha_lo, alpha_hi) (the running O times exp2(m_old - m_new) per row), inside the rare branch.
template <int NT, typename Rescale>
__device__ __forceinline__ void raise_reference_max(const float (&s)[NT][4], RowSoftmax& st, Rescale&& rescale) {
  float own_lo = -INFINITY, own_hi = -INFINITY;  // this thread's max of each row
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    own_lo = fmaxf(own_lo, fmaxf(s[nt][0], s[nt][1]));
    own_hi = fmaxf(own_hi, fmaxf(s[nt][2], s[nt][3]));
  }
  const bool rises = own_lo > st.m_lo + kRescaleSlack || own_hi > st.m_hi + kRescaleSlack;
  if (__any_sync(0xffffffffu, rises)) {
    float mx_lo = -INFINITY, mx_hi = -INFINITY;
    quad_row_max(s, mx_lo, mx_hi);
    const float mn_lo = fmaxf(st.m_lo, mx_lo), mn_hi = fmaxf(st.m_hi, mx_hi);
    // a row with nothing attended yet (m = -inf) has l = 0 and O = 0: any finite alpha will do
    const float alpha_lo = mn_lo == -INFINITY ? 1.f : exp2f(st.m_lo - mn_lo);
    const float alpha_hi = mn_hi == -INFINITY ? 1.f : exp2f(st.m_hi - mn_hi);
    st.m_lo = mn_lo;
    st.m_hi = mn_hi;
    st.l_lo *= alpha_lo;
    st.l_hi *= alpha_hi;
    rescale(alpha_lo, alpha_hi);
  }
}

// P = exp2(s - m) of a 16 x 8NT score tile as bf16 A fragments, pf[nt / 2][2 (nt % 2)] (row lo) and [2 (nt % 2) + 1]
// (row hi) holding tokens 8nt + 2tig + {0, 1}: the A layout of m16n8k16 (pf[kk] for tokens 16kk + [0, 16)) and, for
// NT = 1, of m16n8k8; their unrounded values added to this thread's share of the row sums.
template <int NT>
__device__ __forceinline__ void exp_scores(const float (&s)[NT][4], RowSoftmax& st,
                                           uint32_t (&pf)[(NT + 1) / 2][NT > 1 ? 4 : 2]) {
  // A row with nothing attended so far keeps m = -inf: use 0 as the offset so exp2 gives 0, not NaN.
  const float base_lo = st.m_lo == -INFINITY ? 0.f : st.m_lo, base_hi = st.m_hi == -INFINITY ? 0.f : st.m_hi;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const float p0 = fast_exp2(s[nt][0] - base_lo), p1 = fast_exp2(s[nt][1] - base_lo);
    const float p2 = fast_exp2(s[nt][2] - base_hi), p3 = fast_exp2(s[nt][3] - base_hi);
    st.l_lo += p0 + p1;  // unrounded: keeps lse fp32-accurate (the bf16 rounding of P is unbiased noise)
    st.l_hi += p2 + p3;
    const __nv_bfloat162 lo = __floats2bfloat162_rn(p0, p1), hi = __floats2bfloat162_rn(p2, p3);
    // C layout (row gid / gid+8, tokens 8nt + 2tig..) is the A layout: a0a1 | a2a3 (| a4a5 | a6a7 for k16)
    pf[nt / 2][(nt % 2) * 2 + 0] = *reinterpret_cast<const uint32_t*>(&lo);
    pf[nt / 2][(nt % 2) * 2 + 1] = *reinterpret_cast<const uint32_t*>(&hi);
  }
}

// One tile of the online softmax on a 16 x 8NT score tile (log2 units, masked): updates the row state, rescales O
// when the reference max moves, and returns P as bf16 A fragments (exp_scores).
// Lazy reference max: m moves only when a row's tile max exceeds it by more than kRescaleSlack, so P = exp2(s -
// m) <= 2^8 (as precise in bf16, exact in the fp32 sums) and the O rescale, 128 multiplies per thread, runs on the
// few tiles that raise a max (on random scores about once per CTA; rescaling on every rise of the max was ~half
// the tiles and measured slower with the vote). Whether a row's max rose that far is known from each thread's own
// scores (some thread of the row's quad holds the row max), so the warp votes on those and only the rare tile that
// moves a max pays the quad reductions: the common tile has no shuffle between its scores and its exponentials. The
// vote keeps the branch warp-uniform; both warps of a row group hold the same scores, so they decide alike.
// Cost: a peaked row's dominant P is no longer exactly 1.0 before bf16 rounding, which raised the worst output
// error over --fuzz 1000 from 1.1e-2 to 1.8e-2 (inside the verify tolerance; NOTES.md).
template <int NT>
__device__ __forceinline__ void softmax_tile(float (&s)[NT][4], RowSoftmax& st, float (&o)[kVTiles][4],
                                             uint32_t (&pf)[(NT + 1) / 2][NT > 1 ? 4 : 2]) {
  raise_reference_max(s, st, [&](float alpha_lo, float alpha_hi) {
#pragma unroll
    for (int nt = 0; nt < kVTiles; ++nt) {
      o[nt][0] *= alpha_lo;
      o[nt][1] *= alpha_lo;
      o[nt][2] *= alpha_hi;
      o[nt][3] *= alpha_hi;
    }
  });
  exp_scores(s, st, pf);
}

// The full row tiles' part: request b (first node q0, R rows) has splits x its row tiles x 64 rows from its first
// partial row on (flash_plan.cuh; a tail the narrow kernel takes keeps its rows here unused).
__device__ __forceinline__ SplitPartials full_partials(const VerifyAttnParams& p, const FlashLaunch& l, int split,
                                                       int splits, int first_row, int q0, int R) {
  const FlashWorkspace w = flash_workspace(p.batch, l);
  unsigned char* ws = static_cast<unsigned char*>(p.workspace);
  const int full = (R + kBlockM - 1) / kBlockM;
  return {reinterpret_cast<float*>(ws + w.full_o), reinterpret_cast<float*>(ws + w.full_lse), (size_t)kBlockM * full,
          (long long)first_row - (long long)q0 * p.num_heads, split, splits};
}

// The narrow tiles' part: request b's narrow tile, rows [row0, R) of the request whose first node is q0, at its first
// narrow partial row on, 16 per split.
__device__ __forceinline__ SplitPartials narrow_partials(const VerifyAttnParams& p, const FlashLaunch& l, int split,
                                                         int splits, int first_row, int q0, int row0) {
  const FlashWorkspace w = flash_workspace(p.batch, l);
  unsigned char* ws = static_cast<unsigned char*>(p.workspace);
  return {reinterpret_cast<float*>(ws + w.narrow_o), reinterpret_cast<float*>(ws + w.narrow_lse), (size_t)kNarrowRows,
          (long long)first_row - ((long long)q0 * p.num_heads + row0), split, splits};
}

// One output row of an epilogue: this thread's NT pairs of O values (pair nt at value column col0 + (nt / 2) kStride
// + 8 (nt % 2), pair(nt, e) its two values), times inv, as bf16 out or as this split's fp32 partial; and the row's
// lse, where write_lse.
template <int NT, int kStride, typename Pair>
__device__ __forceinline__ void store_row(const VerifyAttnParams& p, const SplitPartials& part, size_t grow, int col0,
                                          float inv, float lse, bool write_lse, Pair&& pair) {
  if (part.splits == 1) {
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + grow * KDTREE_V_DIM + col0;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      *reinterpret_cast<__nv_bfloat162*>(out + (nt / 2) * kStride + (nt % 2) * 8) =
          __floats2bfloat162_rn(pair(nt, 0) * inv, pair(nt, 1) * inv);
    if (write_lse) p.lse[grow] = lse;
  } else {
    const size_t slot = (size_t)part.split * part.rows + (size_t)((long long)grow + part.shift);
    float* ws_o = part.o + slot * KDTREE_V_DIM + col0;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      *reinterpret_cast<float2*>(ws_o + (nt / 2) * kStride + (nt % 2) * 8) =
          make_float2(pair(nt, 0) * inv, pair(nt, 1) * inv);
    if (write_lse) part.lse[slot] = lse;
  }
}

// Epilogue of a 16-row group's half c: normalise and write bf16 out + lse, or this split's fp32 partial + lse.
// n-tile nt of O is value columns 32 (nt / 2) + 16c + 8 (nt % 2) + [0, 8).
__device__ __forceinline__ void store_rows(const VerifyAttnParams& p, const float (&o)[kVTiles][4], const RowSoftmax& st,
                                           int q0, int H, int R, int r_lo, int c, int tig, const SplitPartials& part) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = r_lo + half * 8;
    if (r >= R) continue;
    const float l = half ? st.l_hi : st.l_lo;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float lse = l > 0.f ? ((half ? st.m_hi : st.m_lo) + log2f(l)) * kLn2 : -INFINITY;
    const size_t grow = (size_t)q0 * H + r;
    store_row<kVTiles, 32>(p, part, grow, c * 16 + tig * 2, inv, lse, c == 0 && tig == 0,
                           [&](int nt, int e) { return o[nt][half * 2 + e]; });
  }
}

// The dynamic shared memory of both flash kernels, which starts at the declared 1,024-byte alignment (nothing
// static precedes it); a misplaced base would break the swizzle silently, so it traps instead.
extern __shared__ __align__(1024) unsigned char flash_smem[];
template <typename Storage = SharedStorage>
__device__ __forceinline__ Storage& shared_storage() {
  if (static_cast<unsigned>(__cvta_generic_to_shared(flash_smem)) & 1023u) __trap();
  return *reinterpret_cast<Storage*>(flash_smem);
}

// Request b's rows: heads H, its first node q0 in q, its T nodes and R = T H rows (row = node H + head).
struct RequestRows {
  int H, q0, T, R;
};
__device__ __forceinline__ RequestRows request_rows(const VerifyAttnParams& p, int b) {
  const int q0 = p.q_indptr[b], T = p.q_indptr[b + 1] - q0;
  return {p.num_heads, q0, T, T * p.num_heads};
}

// The part of request b's KV (its prefix, then its T tree rows) that split `split` of `num_splits` takes: tokens
// [begin, end), cut by split_chunk (flash_plan.cuh: the one statement of the cut); L is the prefix length. Every flash kernel's CTA starts from it (copied into plain
// variables there: a structured binding of it changed the teams kernel's schedule).
struct KvSplit {
  int L, begin, end;
};
__device__ __forceinline__ KvSplit kv_split(const VerifyAttnParams& p, int b, int T, int split, int num_splits) {
  const int L = p.prefix_lens[b];
  const int kv_len = L + T;
  const int chunk = split_chunk(kv_len, num_splits);
  const int begin = min(kv_len, split * chunk);
  return {L, begin, min(kv_len, begin + chunk)};
}

// Where a CTA's KV tiles come from: request b's pages and the pool.
struct KvSource {
  const __nv_bfloat16* kv;
  KvPages pages;
};
__device__ __forceinline__ KvSource kv_source(const VerifyAttnParams& p, int b) {
  return {static_cast<const __nv_bfloat16*>(p.kv_cache), kv_pages(p.page_table, p.max_pages, b, p.page_size)};
}

// The tensor copies' "landed" barriers, one per KV buffer; every thread calls it (a block barrier follows).
template <bool kTensorCopy>
__device__ __forceinline__ void init_landed_barriers(unsigned landed) {
#if KDTREE_FLASH_SM90
  if (kTensorCopy) {
    if (threadIdx.x == 0) {  // one arrival (the expect-tx) per fill
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(landed) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(landed + 8) : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();  // every warp waits on these barriers
  }
#endif
}

// The KV pool row of the tile at `start` (one page holds it: pages hold >= 32 tokens and tiles start at multiples of 32
// inside the request's range).
__device__ __forceinline__ int kv_tile_row(const KvSource& src_kv, int start) {
  return kv_slot<int>(src_kv.pages, start);
}

// The tensor copy of a full tile at `start` into buffer buf: lane 0 of the calling warp arms the buffer's landed
// barrier and copies the tile in one instruction (a 3-D map, box-major, the 2-D boxes' layout). Every kernel takes
// this form: nine per-lane box copies, issued one lane after another, made the teams kernels 10-14 % slower (NOTES.md
// v22) and the lockstep kernels 7-11 % slower (NOTES.md v25): the copying warp is the one the others then wait for.
__device__ __forceinline__ void copy_kv_tile(const KvSource& src_kv, const CUtensorMap* kv_map, unsigned kv_smem,
                                             unsigned landed, int lane, int buf, int start) {
#if KDTREE_FLASH_SM90
  if (lane == 0) {
    const unsigned bar = landed + buf * 8;
    mbarrier_arrive_expect_tx(bar, kBufBytes);
    kv_tile_copy(kv_smem + buf * kBufBytes, kv_map, kv_tile_row(src_kv, start), bar);
  }
#endif
}

// Start filling KV buffer buf (of the double buffer at kv_smem) with the tile at `start` of a range ending at
// kv_end. Tensor copies: warp 0 looks the tile's page up once (the tile lies in one page: pages hold >= 32 tokens
// and tiles start at multiples of 32 inside the request's range) and lanes 0-8 copy one box each. cp.async: warp
// w copies rows w, w+8, w+16, w+24; one page-table lookup per row (the same address for the whole warp), 72 x
// 16-byte chunks per row over the 32 lanes.
template <bool kTensorCopy>
__device__ __forceinline__ void load_kv_tile(const KvSource& src_kv, const CUtensorMap* kv_map, unsigned kv_smem,
                                             unsigned landed, int kv_end, int warp, int lane, int buf, int start) {
  if (kTensorCopy && start + kBlockN <= kv_end) {  // a full tile (a partial one needs cp.async's zero-fill)
    if (warp == 0) copy_kv_tile(src_kv, kv_map, kv_smem, landed, lane, buf, start);
    return;
  }
#pragma unroll
  for (int rr = 0; rr < kBlockN / kWarps; ++rr) {
    const int r = warp + rr * kWarps;
    const int pos = start + r;
    const bool ok = pos < kv_end;
    const __nv_bfloat16* src = src_kv.kv;  // any valid address; zero bytes are read when !ok
    if (ok)
      src = src_kv.kv + kv_slot<size_t>(src_kv.pages, pos) * KDTREE_QK_DIM;
#pragma unroll
    for (int ch = lane; ch < kChunksPerRow; ch += 32)
      cp_async_16(kv_smem + buf * kBufBytes + kv_chunk_offset(r, ch), src + ch * 8, ok ? 16 : 0);
  }
  cp_async_commit();
}

// Wait until this thread sees tile `it` (at `start`) of a range ending at kv_end landed; a block barrier follows.
template <bool kTensorCopy>
__device__ __forceinline__ void wait_kv_tile(unsigned landed, int kv_end, int it, int start) {
  if (kTensorCopy && start + kBlockN <= kv_end) {
#if KDTREE_FLASH_SM90
    // buffer it & 1 is filled for the (it / 2)-th time, every earlier fill of it a tensor copy too (only the last
    // tile can be partial): wait for that phase of its barrier
    mbarrier_wait_parity(landed + (it & 1) * 8, (it >> 1) & 1);
#endif
  } else {
    cp_async_wait_all();
  }
}

// ---- The teams' ring (TeamsStorage): tensor copies only, no block barrier per tile.
// Every buffer has a landed mbarrier (one arrival, the expect-tx, per fill) and a count of the warps done with it;
// the eighth warp done with a buffer copies the tile kKvBufs ahead into it.
__device__ __forceinline__ void init_teams_ring(TeamsStorage& sm, unsigned landed) {
#if KDTREE_FLASH_TEAMS
  if (threadIdx.x == 0) {
    for (int i = 0; i < kKvBufs; ++i) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(landed + 8 * i) : "memory");
      sm.released[i] = 0;
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();  // every warp waits on these barriers
#endif
}

// This warp is done with ring buffer buf, which held the tile at `start`; the range has a tile kKvBufs ahead. The
// count's acquire-release orders every warp's reads of the buffer before the copy's writes (and the async-proxy
// fence the generic reads before the tensor copy). Lane 0 alone counts, fences and copies: broadcasting the count
// to the warp first (a shuffle and a warp-wide branch behind the atomic's return) was 1-3 % slower (NOTES.md v24).
__device__ __forceinline__ void release_teams_buffer(const KvSource& src_kv, const CUtensorMap* kv_map,
                                                     unsigned kv_smem, unsigned landed, int lane, int buf, int start) {
#if KDTREE_FLASH_TEAMS
  constexpr unsigned kReleasedOff = offsetof(TeamsStorage, released) - offsetof(TeamsStorage, landed);
  __syncwarp();
  if (lane == 0) {
    unsigned old;
    asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], 1;\n"
                 : "=r"(old)
                 : "r"(landed + kReleasedOff + buf * 4)
                 : "memory");
    if ((old % kWarps) == kWarps - 1) {
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      copy_kv_tile(src_kv, kv_map, kv_smem, landed, 0, buf, start + kKvBufs * kBlockN);
    }
  }
#endif
}

}  // namespace
}  // namespace kdtree
