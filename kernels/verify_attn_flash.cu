// Flash tree-verify attention for absorbed MLA (tensor cores, heads x nodes packed, split-KV, paged KV).
//
// Computes exactly what the naive oracle computes (verify_attn.cu): for every tree node i of request b
// and head h, softmax(scale * q . k) over the prefix and node i's ancestors-or-self, times V = K[:, :512],
// plus the natural-log LSE.
//
// How:
// * Rows. One latent KV head serves every query head, so a request's T nodes x H heads form R = T*H rows
//   (row = node*H + head, contiguous in q) and every KV tile is read once per CTA for 64 rows.
// * CTA = 8 warps, 64 rows x 32-token KV tiles, one CTA per SM. The lockstep kernels (91,136 B of dynamic shared
//   memory: fits sm_120's 101,376 B limit) run on sm_120, wherever pages are under 32 tokens, and in every portable
//   call (kdtree_verify_attn_flash_portable): warp w = (row group g = w%4, half c = w/4), a block barrier per tile.
//   Otherwise, where a block holds 186 KB (sm_90), the tensor-copy path runs
//   as two teams of warps out of phase (verify_attn_flash_teams_kernel, below): no barrier that all warps meet per
//   tile, a four-deep KV ring, the two warps of a scheduler in different teams (v21 in NOTES.md: 2-8 % faster), and
//   P.V over a team's 32 rows, a tile behind S (v23: 1.5-3.6 % faster at six target shapes).
// * S = Q K^T (64 x 32 x 576): warp (g, c) multiplies its 16 rows over half the dims (the 16-dim k-steps
//   2j + c, j < 18) with Q held in registers (72 per thread, loaded once) and K read by ldmatrix; the two
//   half-sums meet in shared memory. Splitting by dims rather than tokens keeps Q at 72 registers instead
//   of 144.
// * Softmax in fp32 registers on the mma accumulator layout (a row's 32 scores sit in one quad), exp2
//   (ex2.approx) with log2(e) folded into the scale, against a lazy reference max that moves only when a row's
//   max rises by more than 2^8 (so the O rescale runs on few tiles). Each thread tests its own scores for that
//   rise and the warp votes, so only a tile that moves a max runs the quad reductions; each thread keeps its
//   share of the row sums, added across the quad once before the epilogue. Tiles entirely inside the prefix skip
//   the mask; the others read the node's bitmask row. P feeds P.V directly as bf16 A fragments; the row
//   sum adds the unrounded fp32 values, so lse stays fp32-exact (summing the rounded values biased lse by
//   up to ~1e-3 on peaked rows: measured, see NOTES.md).
// * O += P V (64 x 512 x 32): warp (g, c) owns rows 16g.. and the 16-column value blocks 2j + c (j < 16):
//   128 fp32 accumulators per thread; V fragments via ldmatrix.trans from the same K tile (V = first 512
//   dims). (The teams kernel: a warp owns its team's 32 rows in the blocks 4j + q, the same 128 accumulators.)
// * KV tiles go into a double buffer (lockstep: tile i+1 loads while tile i computes) or the teams' four-deep ring
//   as 9 boxes of 32 rows x 64 dims (128 B per row), 16-byte chunk c of a box row r stored at chunk c ^ (r & 7): the
//   fills write whole
//   128-byte lines (rows padded to 1,168 B for conflict-free ldmatrix cost 2.6 shared-memory wavefronts per
//   128 B filled, measured; see NOTES.md) and the 8 rows of every ldmatrix still fall in 8 different banks.
//   Interleaving the halves by 16 dims / columns (above) leaves a lane two swizzled offsets per tile
//   instead of one per k-step.
// * With pages of >= 32 tokens (sm_90+), a full tile is one page-table lookup and TMA tensor copies (the box
//   layout above is the hardware's 128-byte swizzle) that complete on an mbarrier: no per-thread copy
//   instructions: one 3-D copy from one lane, the 9 boxes of the tile in one instruction (nine box copies from
//   lanes 0-8 were 10-14 % slower in the teams kernels, v22 in NOTES.md, 7-11 % in the lockstep ones, v25).
//   kdtree_verify_attn_flash_portable runs the lockstep kernels on any GPU: how the sm_120 path is verified and
//   timed on an H200. Smaller pages, and a range's last partial tile,
//   gather each row through the page table with cp.async (16-byte chunks) into the same layout: its zero-fill
//   past the end is needed there (TMA has none, and the slots past a range may hold NaN, which times P = 0 is
//   NaN). (The teams kernels copy their partial tail tile by TMA too and zero its V elements past the end.)
// * Narrow row tiles: a request's last row tile of <= 16 rows (with H = 8 every tree of 2^k + 1 nodes leaves 8)
//   runs in verify_attn_flash_narrow_kernel: its four row groups take the same 16 rows, each on 8 of every
//   tile's 32 tokens (a quarter of the tensor work per tile), keep four online softmaxes and merge them at the
//   end; one such CTA covers the KV range of one or two splits. It is launched programmatically behind the
//   full-tile kernel, so its CTAs take the SMs the full tiles leave.
// * Split-KV: when batch x row tiles cannot fill the GPU, each request's KV range is cut into equal
//   chunks; each split writes fp32 partial O (normalised) and its LSE to the caller's workspace and a
//   combine kernel merges them weighted by exp(lse_s - lse), launched programmatically on sm_90+ behind the
//   last of the kernels above so that its launch overlaps the last tiles. The split count depends only on the
//   shapes, and every reduction runs in a fixed order: the same inputs give the same bits on every run.
// mma.sync m16n8k16 / m16n8k8 bf16 -> fp32, ldmatrix, cp.async: all available on sm_80+ (no wgmma).
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

// The 128-byte swizzle repeats every 1,024 B: the storage starts on a 1,024-byte boundary.
// The lockstep kernels (a block barrier per tile; every kernel on sm_120, the cp.async kernels everywhere).
struct __align__(1024) SharedStorage {
  __nv_bfloat16 kv[2][kBoxes][kBlockN][kBoxDims];  // 73,728 B: double-buffered KV tile, boxes, chunks swizzled
  float4 s_part[1][kWarps][4][32];                 // 16,384 B: each warp's half-dim partial scores, fragment order
  uint64_t landed[2];                              // TMA: one mbarrier per KV buffer
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

// Where a CTA's rows go: with one split (splits == 1), bf16 out and lse at the row's own index grow; else split
// `split`'s fp32 partial in one part of the workspace (flash_plan.cuh): values at o + (split rows + prow) 512, LSE at
// lse[split rows + prow], for the part's row prow = grow + shift.
struct SplitPartials {
  float* o;
  float* lse;
  size_t rows;
  long long shift;
  int split, splits;
};

// The full row tiles' part: every row of the call, at its own index.
__device__ __forceinline__ SplitPartials full_partials(const VerifyAttnParams& p, int split, int num_splits) {
  const size_t rows = (size_t)p.total_q * p.num_heads;
  float* o = static_cast<float*>(p.workspace);
  return {o, o + (size_t)num_splits * rows * KDTREE_V_DIM, rows, 0, split, num_splits};
}

// The narrow tiles' part, after the full tiles' (whose split count is num_splits): request b's narrow tile, rows
// [row0, R) of the request whose first node is q0, at rows b x 16 + [0, R - row0).
__device__ __forceinline__ SplitPartials narrow_partials(const VerifyAttnParams& p, int num_splits, int split,
                                                         int narrow_splits, int b, int q0, int row0) {
  const size_t rows = (size_t)p.batch * kNarrowRows;
  float* o = static_cast<float*>(p.workspace) + flash_full_partials_floats(num_splits, (size_t)p.total_q * p.num_heads);
  const long long shift = (long long)b * kNarrowRows - ((long long)q0 * p.num_heads + row0);
  return {o, o + (size_t)narrow_splits * rows * KDTREE_V_DIM, rows, shift, split, narrow_splits};
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

// The split-KV cut: split s of request range [0, kv_len) is [s chunk, (s + 1) chunk), chunk a multiple of the tile.
__device__ __forceinline__ int split_chunk(int kv_len, int num_splits) {
  const int chunk = (kv_len + num_splits - 1) / num_splits;
  return (chunk + kBlockN - 1) / kBlockN * kBlockN;
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
    verify_attn_flash_narrow_kernel(VerifyAttnParams p, int num_splits, int narrow_splits,
                                    const __grid_constant__ CUtensorMap kv_map) {
#if KDTREE_FLASH_SM90
  // The combine kernel behind this one may launch once every CTA of this grid has started.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#else
  if (kTensorCopy) return;  // never launched before sm_90 (encode_kv_map): no body to build there
#endif
#if !KDTREE_FLASH_TEAMS
  if (kTeams) return;  // TeamsStorage does not fit a block here: never launched
#endif
  using Storage = std::conditional_t<kTeams, TeamsStorage, SharedStorage>;
  Storage& sm = shared_storage<Storage>();
  const int split = blockIdx.x, b = blockIdx.y;
  const auto [H, q0, T, R] = request_rows(p, b);
  const int row0 = (R - 1) / kBlockM * kBlockM;  // the request's last row tile
  if (R > 0 && R - row0 <= kNarrowRows) {
    const int L = p.prefix_lens[b];
    const int kv_len = L + T;
    const int chunk = split_chunk(kv_len, narrow_splits);
    const int kv_begin = min(kv_len, split * chunk);
    const int kv_end = min(kv_len, kv_begin + chunk);
    narrow_rows<kTensorCopy, kTeams>(p, sm, &kv_map, b, q0, H, R, row0, L, kv_begin, kv_end,
                                     narrow_partials(p, num_splits, split, narrow_splits, b, q0, row0));
  }
#if KDTREE_FLASH_SM90
  // Launched behind the full-tile kernel (programmatically), and the combine kernel behind this one waits only for
  // this grid: so this grid completes only after that one has, and its writes are visible.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

template <bool kTensorCopy>
__global__ void __launch_bounds__(kThreads, 1)
    verify_attn_flash_kernel(VerifyAttnParams p, int num_splits, int narrow_elsewhere,
                             const __grid_constant__ CUtensorMap kv_map) {
#if !KDTREE_FLASH_SM90
  if (kTensorCopy) return;  // never launched before sm_90 (encode_kv_map): no body to build there
#endif
  SharedStorage& sm = shared_storage();

  const int m_tile = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const auto [H, q0, T, R] = request_rows(p, b);
  const int row0 = m_tile * kBlockM;
  if (row0 >= R) return;  // this request has fewer row tiles than the largest one
  if (narrow_elsewhere && R - row0 <= kNarrowRows) return;  // verify_attn_flash_narrow_kernel's
#if KDTREE_FLASH_SM90
  // The kernel behind this one (the narrow or the combine kernel) may launch once every CTA of this grid has
  // started (or exited): its CTAs then take each SM this grid leaves, so the launch gap between the kernels is
  // spent while the last tiles run. A no-op without a dependent launch.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  const int L = p.prefix_lens[b];
  const int kv_len = L + T;
  const int chunk = split_chunk(kv_len, num_splits);
  const int kv_begin = min(kv_len, split * chunk);
  const int kv_end = min(kv_len, kv_begin + chunk);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = warp % 4, c = warp / 4;    // row group, dim/column half
  const int gid = lane / 4, tig = lane % 4;  // mma fragment coordinates

  const KvSource src_kv = kv_source(p, b);
  const unsigned kv_smem = static_cast<unsigned>(__cvta_generic_to_shared(&sm.kv[0][0][0][0]));
  const unsigned landed = static_cast<unsigned>(__cvta_generic_to_shared(&sm.landed[0]));
  init_landed_barriers<kTensorCopy>(landed);
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
  store_rows(p, o, st, q0, H, R, r_lo, c, tig, full_partials(p, split, num_splits));
}

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

#if KDTREE_FLASH_TEAMS  // (no teams kernel body on sm_120: unused there)
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
#endif

__global__ void __launch_bounds__(kThreads, 1)
    verify_attn_flash_teams_kernel(VerifyAttnParams p, int num_splits, int narrow_elsewhere,
                                   const __grid_constant__ CUtensorMap kv_map) {
#if KDTREE_FLASH_TEAMS
  TeamsStorage& sm = shared_storage<TeamsStorage>();

  const int m_tile = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const auto [H, q0, T, R] = request_rows(p, b);
  const int row0 = m_tile * kBlockM;
  if (row0 >= R) return;  // this request has fewer row tiles than the largest one
  if (narrow_elsewhere && R - row0 <= kNarrowRows) return;  // verify_attn_flash_narrow_kernel's
  // The kernel behind this one (the narrow or the combine kernel) may launch once every CTA of this grid has
  // started (or exited): its CTAs then take each SM this grid leaves, so the launch gap between the kernels is
  // spent while the last tiles run. A no-op without a dependent launch.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const int L = p.prefix_lens[b];
  const int kv_len = L + T;
  const int chunk = split_chunk(kv_len, num_splits);
  const int kv_begin = min(kv_len, split * chunk);
  const int kv_end = min(kv_len, kv_begin + chunk);

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
  store_team_rows(p, o, sm, q0, H, R, row0, team, gid, q, tig, full_partials(p, split, num_splits));
#endif
}

// Merge split partials: lse = ln sum_s exp(lse_s); out = sum_s exp(lse_s - lse) * O_s. One CTA per row: CTA
// (r, b) is row r of request b, of the full tiles' part of the workspace (num_splits partials) or, in the request's
// narrow last tile where there is a narrow kernel (narrow_splits > 0), of the narrow tiles' part; a row whose part has
// one split was written by its tile's kernel. Warp 0 turns the splits' LSEs (at most kMaxSplits) into weights in
// shared memory; then kGroups groups of 128 threads each sum every kGroups-th split's partial over 4 columns per
// thread (their addresses depend on nothing loaded, so several loads are in flight), and group 0 adds the groups'
// sums in order. Every reduction has a fixed order (the butterflies give every lane the same bits): the same output
// on every run.
// (The first form, one 128-thread CTA per row walking the splits with each load behind the previous one's
// weight, took 10-20 µs per call at the target shapes: NOTES.md.)
constexpr int kCombineColumnThreads = KDTREE_V_DIM / 4;  // 128: 4 value columns each

template <int kGroups>
__global__ void __launch_bounds__(kGroups * kCombineColumnThreads)
    verify_attn_combine_kernel(VerifyAttnParams p, int num_splits, int narrow_splits) {
  // which part holds the row: the call's inputs only, read before the wait
  const int b = blockIdx.y, r = blockIdx.x;
  const auto [H, q0, T, R] = request_rows(p, b);
  if (r >= R) return;  // this request has fewer rows than the largest one
  const int row0 = (R - 1) / kBlockM * kBlockM;
  const SplitPartials part = narrow_splits > 0 && R - row0 <= kNarrowRows && r >= row0
                                 ? narrow_partials(p, num_splits, 0, narrow_splits, b, q0, row0)
                                 : full_partials(p, 0, num_splits);
  if (part.splits == 1) return;
#if KDTREE_FLASH_SM90
  // launched programmatically behind the flash kernel (sm_90+): wait until its writes are complete and visible
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  __shared__ float weight[kMaxSplits];
  __shared__ float row_lse;
  __shared__ float4 group_sum[kGroups > 1 ? kGroups - 1 : 1][kCombineColumnThreads];
  const size_t grow = (size_t)q0 * H + r;
  const size_t rows_total = part.rows, row = (size_t)((long long)grow + part.shift);
  num_splits = part.splits;
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

FlashPlan plan_verify_attn_flash(int batch, int total_q, int num_heads, int max_qlen, int max_kv_len, int sm_count) {
  const FlashSplitPlan split = plan_flash_splits(batch, max_qlen, num_heads, max_kv_len, sm_count);
  FlashPlan plan{};
  plan.num_m_tiles = split.num_m_tiles;
  plan.num_splits = split.num_splits;
  plan.narrow_splits = split.narrow_splits;
  plan.workspace_bytes = (flash_full_partials_floats(split.num_splits, (size_t)total_q * num_heads) +
                          flash_narrow_partials_floats(split.narrow_splits, batch)) *
                         sizeof(float);
  return plan;
}

// Groups of splits per row: as few as fill the GPU's threads (1, 2 or 4, at most the split count). Few rows (T x H
// small) need the groups to have loads enough in flight; with many rows, groups only add the shared-memory sum and its
// barrier (measured: NOTES.md, flash v13). Counted for the full tiles' rows where they have partials, else for the
// narrow tiles' (at most 16 per request); 0 where no row has partials (no combine kernel).
int flash_combine_groups(const FlashPlan& plan, long batch, long rows, int sms, int threads_per_sm) {
  const bool full = plan.num_splits > 1;
  const int splits = full ? plan.num_splits : plan.narrow_splits;
  if (splits <= 1) return 0;
  const long merged = full ? rows : batch * kNarrowRows;
  const long want = (long)sms * threads_per_sm;
  int groups = 1;
  while (groups < 4 && 2 * groups <= splits && merged * kCombineColumnThreads * groups < want) groups *= 2;
  return groups;
}

// The KV pool for the tensor-copy path: num_pages * page_size rows of 576 bf16, 1,152 B apart, read with the 128-byte
// swizzle, as a 3-D tensor copied a whole 32-row tile at a time. False when it cannot be used: pages of fewer than 32
// tokens (a tile would span pages), no encoder in the driver, or a pool the encoder refuses (e.g. not 16-byte
// aligned); the cp.async path then runs.
static bool encode_kv_map(const VerifyAttnParams& p, CUtensorMap* map) {
  const uint64_t rows = (uint64_t)p.num_pages * p.page_size;
  return p.page_size >= KDTREE_FLASH_TENSOR_COPY_MIN_PAGE && encode_kv_tile_tensor_map(p.kv_cache, rows, kBlockN, map);
}

// Launches `kernel` on `grid` behind the previous launch in the stream: programmatically (it may start once every
// CTA of that one has started; it waits in griddepcontrol.wait for that grid's writes) on sm_90+.
template <class... Params, class... Args>
static cudaError_t launch_behind(void (*kernel)(Params...), dim3 grid, unsigned threads, size_t smem, bool programmatic,
                                cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

template <int kGroups>
static cudaError_t launch_combine(const VerifyAttnParams& p, const FlashPlan& plan, bool programmatic,
                                  cudaStream_t stream) {
  return launch_behind(verify_attn_combine_kernel<kGroups>, dim3((unsigned)(p.max_qlen * p.num_heads), p.batch),
                       kGroups * kCombineColumnThreads, 0, programmatic, stream, p, plan.num_splits,
                       plan.narrow_splits);
}

FlashKernels flash_kernels(int major, int smem_optin, bool tensor_copy, bool portable) {
  // The teams kernels where a block holds their ring (sm_90: measured faster, NOTES.md) unless the call is portable,
  // else the lockstep ones; the arch window is the one KDTREE_FLASH_TEAMS gives a body. The names are those of the
  // kernels launch_verify_attn_flash picks by the same two flags (teams, tensor_copy).
  const bool teams = tensor_copy && !portable && major < 12 && smem_optin >= kTeamsSmemBytes;
  if (teams)
    return {true, "verify_attn_flash_teams_kernel", kTeamsSmemBytes, "verify_attn_flash_narrow_kernel<true, true>",
            kTeamsSmemBytes};
  if (tensor_copy)
    return {false, "verify_attn_flash_kernel<true>", kSmemBytes, "verify_attn_flash_narrow_kernel<true, false>",
            kSmemBytes};
  return {false, "verify_attn_flash_kernel<false>", kSmemBytes, "verify_attn_flash_narrow_kernel<false, false>",
          kSmemBytes};
}

cudaError_t launch_verify_attn_flash(const VerifyAttnParams& p, const FlashPlan& plan, bool portable,
                                     cudaStream_t stream) {
  int dev = 0, major = 0, sms = 0, threads_per_sm = 0, smem_optin = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, dev);
  if (err != cudaSuccess) return err;
  const bool sm90 = major >= 9;  // tensor copies and the programmatic launches
  CUtensorMap kv_map{};
  const bool tensor_copy = sm90 && encode_kv_map(p, &kv_map);
  const FlashKernels choice = flash_kernels(major, smem_optin, tensor_copy, portable);
  const bool teams = choice.teams;
  const auto kernel = teams ? verify_attn_flash_teams_kernel
                            : (tensor_copy ? verify_attn_flash_kernel<true> : verify_attn_flash_kernel<false>);
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, choice.full_smem);
  if (err != cudaSuccess) return err;
  const int narrow_elsewhere = plan.narrow_splits > 0;
  dim3 grid(plan.num_m_tiles, plan.num_splits, p.batch);
  kernel<<<grid, kThreads, choice.full_smem, stream>>>(p, plan.num_splits, narrow_elsewhere, kv_map);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (narrow_elsewhere) {  // the rows of the requests' narrow last tiles, on the SMs the full tiles leave
    const auto narrow = teams ? verify_attn_flash_narrow_kernel<true, true>
                              : (tensor_copy ? verify_attn_flash_narrow_kernel<true, false>
                                             : verify_attn_flash_narrow_kernel<false, false>);
    err = cudaFuncSetAttribute(narrow, cudaFuncAttributeMaxDynamicSharedMemorySize, choice.narrow_smem);
    if (err != cudaSuccess) return err;
    err = launch_behind(narrow, dim3(plan.narrow_splits, p.batch), kThreads, choice.narrow_smem, sm90, stream, p,
                        plan.num_splits, plan.narrow_splits, kv_map);
    if (err != cudaSuccess) return err;
  }
  const int groups = flash_combine_groups(plan, p.batch, (long)p.total_q * p.num_heads, sms, threads_per_sm);
  if (groups == 0) return cudaSuccess;
  err = groups == 4   ? launch_combine<4>(p, plan, sm90, stream)
        : groups == 2 ? launch_combine<2>(p, plan, sm90, stream)
                      : launch_combine<1>(p, plan, sm90, stream);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace kdtree
