// Flash tree-verify attention for absorbed MLA (tensor cores, heads x nodes packed, split-KV, paged KV).
//
// Computes exactly what the naive oracle computes (verify_attn.cu): for every tree node i of request b
// and head h, softmax(scale * q . k) over the prefix and node i's ancestors-or-self, times V = K[:, :512],
// plus the natural-log LSE.
//
// How:
// * Rows. One latent KV head serves every query head, so a request's T nodes x H heads form R = T*H rows
//   (row = node*H + head, contiguous in q) and every KV tile is read once per CTA for 64 rows.
// * CTA = 8 warps, 64 rows x 32-token KV tiles, one CTA per SM (91,136 B of dynamic shared memory: fits
//   sm_120's 101,376 B limit, so the same code runs on sm_90 and sm_120). Warp w = (row group g = w%4,
//   half c = w/4).
// * S = Q K^T (64 x 32 x 576): warp (g, c) multiplies its 16 rows over half the dims (the 16-dim k-steps
//   2j + c, j < 18) with Q held in registers (72 per thread, loaded once) and K read by ldmatrix; the two
//   half-sums meet in shared memory. Splitting by dims rather than tokens keeps Q at 72 registers instead
//   of 144.
// * Softmax in fp32 registers on the mma accumulator layout (a row's 32 scores sit in one quad), exp2
//   with log2(e) folded into the scale, against a lazy reference max that moves only when a row's max
//   rises by more than 2^8 (so the O rescale runs on few tiles). Tiles entirely inside the prefix skip
//   the mask; the others read the node's bitmask row. P feeds P.V directly as bf16 A fragments; the row
//   sum adds the unrounded fp32 values, so lse stays fp32-exact (summing the rounded values biased lse by
//   up to ~1e-3 on peaked rows: measured, see NOTES.md).
// * O += P V (64 x 512 x 32): warp (g, c) owns rows 16g.. and the 16-column value blocks 2j + c (j < 16):
//   128 fp32 accumulators per thread; V fragments via ldmatrix.trans from the same K tile (V = first 512
//   dims).
// * KV tiles go into a double buffer (tile i+1 loads while tile i computes) as 9 boxes of 32 rows x 64 dims
//   (128 B per row), 16-byte chunk c of a box row r stored at chunk c ^ (r & 7): the fills write whole
//   128-byte lines (rows padded to 1,168 B for conflict-free ldmatrix cost 2.6 shared-memory wavefronts per
//   128 B filled, measured; see NOTES.md) and the 8 rows of every ldmatrix still fall in 8 different banks.
//   Interleaving the halves by 16 dims / columns (above) leaves a lane two swizzled offsets per tile
//   instead of one per k-step.
// * With pages of >= 32 tokens (sm_90+), a full tile is one page-table lookup and 9 TMA tensor copies (the
//   box layout above is the hardware's 128-byte swizzle) that complete on an mbarrier: no per-thread copy
//   instructions. Smaller pages, and a range's last partial tile, gather each row through the page table
//   with cp.async (16-byte chunks) into the same layout: its zero-fill past the end is needed there (TMA has
//   none, and the slots past a range may hold NaN, which times P = 0 is NaN).
// * Split-KV: when batch x row tiles cannot fill the GPU, each request's KV range is cut into equal
//   chunks; each split writes fp32 partial O (normalised) and its LSE to the caller's workspace and a
//   combine kernel merges them weighted by exp(lse_s - lse), launched programmatically on sm_90+ so that its
//   launch overlaps the last tiles. The split count depends only on the shapes, and every reduction runs in
//   a fixed order: the same inputs give the same bits on every run.
// mma.sync m16n8k16 bf16 -> fp32, ldmatrix, cp.async: all available on sm_80+ (no wgmma).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kdev/kv_tensor_map.cuh"
#include "kdev/mbarrier.cuh"
#include "kdev/mma_sync.cuh"
#include "kdev/verify_attn.cuh"

namespace kdtree {
namespace {

constexpr int kBlockM = 64;                    // rows (node x head) per CTA
constexpr int kBlockN = 32;                    // KV tokens per tile
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
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
struct __align__(1024) SharedStorage {
  __nv_bfloat16 kv[2][kBoxes][kBlockN][kBoxDims];  // 73,728 B: double-buffered KV tile, boxes, chunks swizzled
  float4 s_part[kWarps][4][32];                    // 16,384 B: each warp's half-dim partial scores, fragment order
  uint64_t landed[2];                              // TMA: one mbarrier per KV buffer
};
constexpr int kSmemBytes = (int)sizeof(SharedStorage);

// sm_120 (RTX PRO 6000) allows 101,376 B of dynamic shared memory per block: the one source must fit it.
static_assert(kSmemBytes <= 101376, "flash verify tile exceeds sm_120's shared memory per block");

// Tensor copies, mbarrier transaction counts, the async-proxy fence and the programmatic launch of the combine
// kernel (griddepcontrol) are sm_90+ (sm_120 has them too); an sm_80 build has only the cp.async path and a
// plain combine launch, and the host never picks the others there.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define KDTREE_FLASH_SM90 1
#else
#define KDTREE_FLASH_SM90 0
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

template <bool kTensorCopy>
__global__ void __launch_bounds__(kThreads, 1)
    verify_attn_flash_kernel(VerifyAttnParams p, int num_splits, const __grid_constant__ CUtensorMap kv_map) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
#if !KDTREE_FLASH_SM90
  if (kTensorCopy) return;  // never launched before sm_90 (encode_kv_map): no body to build there
#endif
  // the dynamic shared memory starts at the declared 1,024-byte alignment (nothing static precedes it); a
  // misplaced base would break the swizzle silently, so it traps instead
  if (static_cast<unsigned>(__cvta_generic_to_shared(smem_raw)) & 1023u) __trap();
  SharedStorage& sm = *reinterpret_cast<SharedStorage*>(smem_raw);

  const int m_tile = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int H = p.num_heads;
  const int q0 = p.q_indptr[b];
  const int T = p.q_indptr[b + 1] - q0;
  const int R = T * H;
  const int row0 = m_tile * kBlockM;
  if (row0 >= R) return;  // this request has fewer row tiles than the largest one
#if KDTREE_FLASH_SM90
  // The combine kernel may launch once every CTA of this grid has started (or exited): its CTAs then take each
  // SM this grid leaves and wait there (griddepcontrol.wait) for the whole grid's writes, so the launch gap
  // between the two kernels is spent while the last tiles run. A no-op without a dependent launch.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  const int L = p.prefix_lens[b];
  const int kv_len = L + T;
  int chunk = (kv_len + num_splits - 1) / num_splits;
  chunk = (chunk + kBlockN - 1) / kBlockN * kBlockN;
  const int kv_begin = min(kv_len, split * chunk);
  const int kv_end = min(kv_len, kv_begin + chunk);
  const int num_tiles = (kv_end - kv_begin + kBlockN - 1) / kBlockN;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = warp % 4, c = warp / 4;    // row group, dim/column half
  const int gid = lane / 4, tig = lane % 4;  // mma fragment coordinates

  const __nv_bfloat16* kv = static_cast<const __nv_bfloat16*>(p.kv_cache);
  const int32_t* page_row = p.page_table + (size_t)b * p.max_pages;
  const int page_shift = __ffs(p.page_size) - 1;  // page sizes are powers of two (checked in capi.cu)
  const int page_mask = p.page_size - 1;

  const unsigned kv_smem = static_cast<unsigned>(__cvta_generic_to_shared(&sm.kv[0][0][0][0]));
  const unsigned landed = static_cast<unsigned>(__cvta_generic_to_shared(&sm.landed[0]));
#if KDTREE_FLASH_SM90
  if (kTensorCopy) {
    if (tid == 0) {  // one arrival (the expect-tx) per fill
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(landed) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(landed + 8) : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();  // every warp waits on these barriers
  }
#endif

  // KV gather. Tensor copies: warp 0 looks the tile's page up once (the tile lies in one page: pages hold
  // >= 32 tokens and tiles start at multiples of 32 inside the request's range) and lanes 0-8 copy one box
  // each. cp.async: warp w copies rows w, w+8, w+16, w+24; one page-table lookup per row (the same address for
  // the whole warp), 72 x 16-byte chunks per row over the 32 lanes.
  auto load_tile = [&](int buf, int start) {
    if (kTensorCopy && start + kBlockN <= kv_end) {  // a full tile (a partial one needs cp.async's zero-fill)
#if KDTREE_FLASH_SM90
      if (warp == 0) {
        const unsigned bar = landed + buf * 8;
        if (lane == 0) mbarrier_arrive_expect_tx(bar, kBufBytes);
        __syncwarp();
        if (lane < kBoxes) {
          const int row = (page_row[start >> page_shift] << page_shift) + (start & page_mask);
          kv_box_copy(kv_smem + buf * kBufBytes + lane * kBoxBytes, &kv_map, lane * kBoxDims, row, bar);
        }
      }
#endif
      return;
    }
#pragma unroll
    for (int rr = 0; rr < kBlockN / kWarps; ++rr) {
      const int r = warp + rr * kWarps;
      const int pos = start + r;
      const bool ok = pos < kv_end;
      const __nv_bfloat16* src = kv;  // any valid address; zero bytes are read when !ok
      if (ok) src = kv + (((size_t)page_row[pos >> page_shift] << page_shift) + (pos & page_mask)) * KDTREE_QK_DIM;
#pragma unroll
      for (int ch = lane; ch < kChunksPerRow; ch += 32)
        cp_async_16(kv_smem + buf * kBufBytes + kv_chunk_offset(r, ch), src + ch * 8, ok ? 16 : 0);
    }
    cp_async_commit();
  };
  if (num_tiles > 0) load_tile(0, kv_begin);

  // Q fragments for rows 16g + gid (+8), k-step ks = dims 32ks + 16c + [0, 16): loaded once, kept in registers.
  uint32_t qf[kKSteps][4];
  {
    const __nv_bfloat16* qb = static_cast<const __nv_bfloat16*>(p.q) + (size_t)q0 * H * KDTREE_QK_DIM;
    const int r_lo = row0 + g * 16 + gid, r_hi = r_lo + 8;
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

  float o[kVTiles][4];
#pragma unroll
  for (int nt = 0; nt < kVTiles; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;

  // Softmax state of this thread's two rows (lo = 16g + gid, hi = lo + 8), replicated across the quad.
  const int r_lo = row0 + g * 16 + gid, r_hi = r_lo + 8;
  const float scale_log2 = p.scale * kLog2e;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f;
  // Per-lane byte offsets of the ldmatrix rows inside a KV box, for the even k-steps / column pairs (see
  // the fragment maps of m16n8k16). K k-step ks of half c is chunks 4ks + 2c + {0, 1} (matrix mi % 2), V
  // column pair np is chunks 4np + 2c + {0, 1} (matrix mi / 2): box ks / 2 (np / 2), chunk 4 (ks & 1) + a
  // with a < 4 in it, so the odd steps' offset is the even one's with bit 6 flipped ((4 + a) ^ x =
  // (a ^ x) ^ 4). Every ldmatrix row of a lane is = lane (mod 8), which is what the swizzle XORs with.
  const int mi = lane / 8;
  const unsigned k_lane_off = ((mi / 2) * 8 + lane % 8) * 128 + (((2 * c + mi % 2) ^ (lane % 8)) << 4);
  const unsigned v_lane_off = ((mi % 2) * 8 + lane % 8) * 128 + (((2 * c + mi / 2) ^ (lane % 8)) << 4);

  for (int it = 0; it < num_tiles; ++it) {
    const int buf = it & 1;
    const int start = kv_begin + it * kBlockN;
    if (kTensorCopy && start + kBlockN <= kv_end) {
#if KDTREE_FLASH_SM90
      // buffer `buf` is filled for the (it / 2)-th time, every earlier fill of it a tensor copy too (only the
      // last tile can be partial): wait for that phase of its barrier
      mbarrier_wait_parity(landed + buf * 8, (it >> 1) & 1);
#endif
    } else {
      cp_async_wait_all();
    }
    __syncthreads();  // tile `it` landed; every warp is done with tile it-1 (its buffer and s_part)
    if (it + 1 < num_tiles) load_tile(buf ^ 1, start + kBlockN);

    // ---- S partial = Q[16 rows, dims half c] . K[32 tokens]^T in one pass (four independent accumulator
    // chains: measured the same speed as two passes of two, see NOTES.md). The partner warp (same rows,
    // other dim half) needs it: store it, meet at a 64-thread named barrier, add the partner's. Two-operand
    // float addition is commutative, so own + partner gives both warps the same bits.
    float sacc[4][4] = {};
    {
      const unsigned kbuf = kv_smem + buf * kBufBytes;
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
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
      sm.s_part[warp][nt][lane] = make_float4(sacc[nt][0], sacc[nt][1], sacc[nt][2], sacc[nt][3]);
    asm volatile("bar.sync %0, 64;\n" ::"r"(1 + g) : "memory");
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const float4 v = sm.s_part[warp ^ 4][nt][lane];
      sacc[nt][0] = (sacc[nt][0] + v.x) * scale_log2;
      sacc[nt][1] = (sacc[nt][1] + v.y) * scale_log2;
      sacc[nt][2] = (sacc[nt][2] + v.z) * scale_log2;
      sacc[nt][3] = (sacc[nt][3] + v.w) * scale_log2;
    }

    // ---- mask: only tiles that reach the tree or the range end. Rows past R (the padding of the last row
    // tile) are not masked: their Q is zero, their scores finite, and their output is never written.
    // Masking them sent that tile's CTA down this path on every tile, the slowest CTA of the launch.
    if (start + kBlockN > L || start + kBlockN > kv_end) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = half ? r_hi : r_lo;
        const uint64_t* mask_row = p.tree_mask + (size_t)(q0 + (r < R ? r / H : 0)) * p.mask_words;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int pos = start + nt * 8 + tig * 2 + e;
            bool keep = pos < kv_end;
            if (keep && pos >= L) {
              const int node = pos - L;
              keep = (mask_row[node / 64] >> (node % 64)) & 1ull;
            }
            if (!keep) sacc[nt][half * 2 + e] = -INFINITY;
          }
        }
      }
    }

    // ---- online softmax in registers (a row's 32 scores live in the 4 threads of a quad)
    float mx_lo = -INFINITY, mx_hi = -INFINITY;
    quad_row_max(sacc, mx_lo, mx_hi);
    // Lazy reference max: m moves only when a row's tile max exceeds it by more than kRescaleSlack, so
    // P = exp2(s - m) <= 2^8 (as precise in bf16, exact in the fp32 sums) and the O rescale, 128 multiplies
    // per thread, runs on the few tiles that raise a max (on random scores about once per CTA; rescaling on
    // every rise of the max was ~half the tiles and measured slower with the vote). The vote keeps the
    // branch warp-uniform; both warps of a row group hold the same scores, so they decide alike.
    // Cost: a peaked row's dominant P is no longer exactly 1.0 before bf16 rounding, which raised the
    // worst output error over --fuzz 1000 from 1.1e-2 to 1.8e-2 (inside the verify tolerance; NOTES.md).
    const bool rises = mx_lo > m_lo + kRescaleSlack || mx_hi > m_hi + kRescaleSlack;
    if (__any_sync(0xffffffffu, rises)) {
      const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
      // a row with nothing attended yet (m = -inf) has l = 0 and O = 0: any finite alpha will do
      const float alpha_lo = mn_lo == -INFINITY ? 1.f : exp2f(m_lo - mn_lo);
      const float alpha_hi = mn_hi == -INFINITY ? 1.f : exp2f(m_hi - mn_hi);
      m_lo = mn_lo;
      m_hi = mn_hi;
      l_lo *= alpha_lo;
      l_hi *= alpha_hi;
#pragma unroll
      for (int nt = 0; nt < kVTiles; ++nt) {
        o[nt][0] *= alpha_lo;
        o[nt][1] *= alpha_lo;
        o[nt][2] *= alpha_hi;
        o[nt][3] *= alpha_hi;
      }
    }
    // A row with nothing attended so far keeps m = -inf: use 0 as the offset so exp2 gives 0, not NaN.
    const float base_lo = m_lo == -INFINITY ? 0.f : m_lo, base_hi = m_hi == -INFINITY ? 0.f : m_hi;
    float sum_lo = 0.f, sum_hi = 0.f;
    uint32_t pf[2][4];  // P as the A operand of P.V: two k-steps of 16 tokens
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const float p0 = exp2f(sacc[nt][0] - base_lo), p1 = exp2f(sacc[nt][1] - base_lo);
      const float p2 = exp2f(sacc[nt][2] - base_hi), p3 = exp2f(sacc[nt][3] - base_hi);
      sum_lo += p0 + p1;  // unrounded: keeps lse fp32-accurate (the bf16 rounding of P is unbiased noise)
      sum_hi += p2 + p3;
      const __nv_bfloat162 lo = __floats2bfloat162_rn(p0, p1), hi = __floats2bfloat162_rn(p2, p3);
      // C layout (row gid / gid+8, tokens 8nt + 2tig..) is the A layout of m16n8k16: a0a1 | a2a3 | a4a5 | a6a7
      pf[nt / 2][(nt % 2) * 2 + 0] = *reinterpret_cast<const uint32_t*>(&lo);
      pf[nt / 2][(nt % 2) * 2 + 1] = *reinterpret_cast<const uint32_t*>(&hi);
    }
#pragma unroll
    for (int off = 1; off <= 2; off *= 2) {
      sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, off);
      sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, off);
    }
    l_lo += sum_lo;
    l_hi += sum_hi;

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

  // ---- epilogue: normalise; write bf16 out + lse, or this split's fp32 partial + lse
  const size_t rows_total = (size_t)p.total_q * H;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = half ? r_hi : r_lo;
    if (r >= R) continue;
    const float l = half ? l_hi : l_lo;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float lse = l > 0.f ? ((half ? m_hi : m_lo) + log2f(l)) * kLn2 : -INFINITY;
    const size_t grow = (size_t)q0 * H + r;
    if (num_splits == 1) {
      // n-tile nt is value columns 32 (nt / 2) + 16c + 8 (nt % 2) + [0, 8)
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + grow * KDTREE_V_DIM + c * 16 + tig * 2;
#pragma unroll
      for (int nt = 0; nt < kVTiles; ++nt)
        *reinterpret_cast<__nv_bfloat162*>(out + (nt / 2) * 32 + (nt % 2) * 8) =
            __floats2bfloat162_rn(o[nt][half * 2] * inv, o[nt][half * 2 + 1] * inv);
      if (c == 0 && tig == 0) p.lse[grow] = lse;
    } else {
      float* ws_o = static_cast<float*>(p.workspace) + ((size_t)split * rows_total + grow) * KDTREE_V_DIM +
                    c * 16 + tig * 2;
#pragma unroll
      for (int nt = 0; nt < kVTiles; ++nt)
        *reinterpret_cast<float2*>(ws_o + (nt / 2) * 32 + (nt % 2) * 8) = make_float2(o[nt][half * 2] * inv, o[nt][half * 2 + 1] * inv);
      float* ws_lse = static_cast<float*>(p.workspace) + (size_t)num_splits * rows_total * KDTREE_V_DIM;
      if (c == 0 && tig == 0) ws_lse[(size_t)split * rows_total + grow] = lse;
    }
  }
}

// Merge split partials: lse = ln sum_s exp(lse_s); out = sum_s exp(lse_s - lse) * O_s. One CTA per row.
// Warp 0 turns the splits' LSEs (at most kMaxSplits) into weights in shared memory; then kGroups groups of 128
// threads each sum every kGroups-th split's partial over 4 columns per thread (their addresses depend on
// nothing loaded, so several loads are in flight), and group 0 adds the groups' sums in order. Every
// reduction has a fixed order (the butterflies give every lane the same bits): the same output on every run.
// (The first form, one 128-thread CTA per row walking the splits with each load behind the previous one's
// weight, took 10-20 µs per call at the target shapes: NOTES.md.)
constexpr int kCombineColumnThreads = KDTREE_V_DIM / 4;  // 128: 4 value columns each
constexpr int kMaxSplits = 64;                           // plan_verify_attn_flash caps the split count there

template <int kGroups>
__global__ void __launch_bounds__(kGroups * kCombineColumnThreads)
    verify_attn_combine_kernel(VerifyAttnParams p, int num_splits) {
#if KDTREE_FLASH_SM90
  // launched programmatically behind the flash kernel (sm_90+): wait until its writes are complete and visible
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  __shared__ float weight[kMaxSplits];
  __shared__ float row_lse;
  __shared__ float4 group_sum[kGroups > 1 ? kGroups - 1 : 1][kCombineColumnThreads];
  const size_t rows_total = (size_t)p.total_q * p.num_heads;
  const size_t row = blockIdx.x;
  const float* ws_o = static_cast<const float*>(p.workspace);
  const float* ws_lse = ws_o + (size_t)num_splits * rows_total * KDTREE_V_DIM;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const float l0 = lane < num_splits ? ws_lse[lane * rows_total + row] : -INFINITY;
    const float l1 = lane + 32 < num_splits ? ws_lse[(lane + 32) * rows_total + row] : -INFINITY;
    float m = fmaxf(l0, l1);
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    // a split with no key for this row (empty range or all masked) has lse = -inf and weight 0
    float total = (l0 == -INFINITY ? 0.f : expf(l0 - m)) + (l1 == -INFINITY ? 0.f : expf(l1 - m));
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) total += __shfl_xor_sync(0xffffffffu, total, off);
    const float lse = m == -INFINITY ? -INFINITY : m + logf(total);
    weight[lane] = l0 == -INFINITY ? 0.f : expf(l0 - lse);
    weight[lane + 32] = l1 == -INFINITY ? 0.f : expf(l1 - lse);
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
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + row * KDTREE_V_DIM + t * 4;
  *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(acc.x, acc.y);
  *reinterpret_cast<__nv_bfloat162*>(out + 2) = __floats2bfloat162_rn(acc.z, acc.w);
  if (t == 0) p.lse[row] = row_lse;
}

}  // namespace

FlashPlan plan_verify_attn_flash(const VerifyAttnParams& p, int sm_count) {
  FlashPlan plan{};
  plan.num_m_tiles = (p.max_qlen * p.num_heads + kBlockM - 1) / kBlockM;
  const long base = (long)p.batch * plan.num_m_tiles;
  // One CTA per SM. A CTA's time is its KV tiles plus a fixed cost worth ~6 tiles of traffic (the 72 KB Q
  // load, the 128 KB fp32 partial and its share of the combine); the kernel's time is the number of waves
  // times that. Pick the split count s minimising waves(s) * (tiles / s + 6), keeping >= 256 tokens
  // (8 tiles) per split. (v2 used waves / s + 0.01 (s - 1), which under-split: see NOTES.md.)
  const double tiles = (double)p.max_kv_len / kBlockN;
  const int by_len = (p.max_kv_len + 255) / 256;
  const int max_splits = by_len < kMaxSplits ? by_len : kMaxSplits;
  int splits = 1;
  double best = 1e300;
  for (int s = 1; s <= max_splits; ++s) {
    const long waves = (base * s + sm_count - 1) / sm_count;
    const double cost = (double)waves * (tiles / s + 6.0);
    if (cost < best * (1 - 1e-9)) {
      best = cost;
      splits = s;
    }
  }
  plan.num_splits = splits;
  plan.workspace_bytes =
      splits > 1 ? (size_t)splits * p.total_q * p.num_heads * (KDTREE_V_DIM + 1) * sizeof(float) : 0;
  return plan;
}

// The KV pool as a 2-D tensor (num_pages * page_size rows of 576 bf16, 1,152 B apart) read in boxes of 32 rows
// x 64 dims with the 128-byte swizzle, for the tensor-copy path. False when it cannot be used: pages of fewer
// than 32 tokens (a tile would span pages), no encoder in the driver, or a pool the encoder refuses (e.g. not
// 16-byte aligned); the cp.async path then runs.
static bool encode_kv_map(const VerifyAttnParams& p, CUtensorMap* map) {
  return p.page_size >= kBlockN &&
         encode_kv_tensor_map(p.kv_cache, (uint64_t)p.num_pages * p.page_size, kBlockN, map);
}

template <int kGroups>
static cudaError_t launch_combine(const VerifyAttnParams& p, int num_splits, bool programmatic, cudaStream_t stream) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3((unsigned)((size_t)p.total_q * p.num_heads));
  cfg.blockDim = dim3(kGroups * kCombineColumnThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, verify_attn_combine_kernel<kGroups>, p, num_splits);
}

cudaError_t launch_verify_attn_flash(const VerifyAttnParams& p, const FlashPlan& plan, cudaStream_t stream) {
  int dev = 0, major = 0, sms = 0, threads_per_sm = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, dev);
  if (err != cudaSuccess) return err;
  const bool sm90 = major >= 9;  // tensor copies and the programmatic combine launch
  CUtensorMap kv_map{};
  const bool tensor_copy = sm90 && encode_kv_map(p, &kv_map);
  const auto kernel = tensor_copy ? verify_attn_flash_kernel<true> : verify_attn_flash_kernel<false>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  dim3 grid(plan.num_m_tiles, plan.num_splits, p.batch);
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(p, plan.num_splits, kv_map);
  err = cudaGetLastError();
  if (err != cudaSuccess || plan.num_splits == 1) return err;
  // Groups of splits per row: as few as fill the GPU's threads (1, 2 or 4, at most the split count). Few rows
  // (T x H small) need the groups to have loads enough in flight; with many rows, groups only add the
  // shared-memory sum and its barrier (measured: NOTES.md, flash v13).
  const long rows = (long)p.total_q * p.num_heads, want = (long)sms * threads_per_sm;
  int groups = 1;
  while (groups < 4 && 2 * groups <= plan.num_splits && rows * kCombineColumnThreads * groups < want) groups *= 2;
  err = groups == 4   ? launch_combine<4>(p, plan.num_splits, sm90, stream)
        : groups == 2 ? launch_combine<2>(p, plan.num_splits, sm90, stream)
                      : launch_combine<1>(p, plan.num_splits, sm90, stream);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace kdtree
