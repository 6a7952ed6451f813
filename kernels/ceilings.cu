// Ceiling microbenchmark: the bf16 mma.sync m16n8k16 (fp32 accumulate) issue rate of this GPU.
//
// Every warp runs kChains independent accumulator chains (enough to cover the tensor pipe's latency) for
// `iters` iterations on register operands; no memory traffic inside the loop. FLOPs = 2*16*8*16 per mma.
// The result is folded into `sink` so the compiler cannot drop the work. kdev bench --ceilings times it
// with CUDA events and caches the figure per GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kdev/kdtree.h"
#include "kdev/kv_tensor_map.cuh"
#include "kdev/mbarrier.cuh"
#include "kdev/mma_sync.cuh"

namespace {

constexpr int kChains = 8;

__global__ void __launch_bounds__(256) mma_peak_kernel(int iters, float* sink) {
  uint32_t a[4], b[2];
  const uint32_t seed = threadIdx.x * 2654435761u + blockIdx.x;
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = (seed ^ (0x3c003c00u + i)) & 0x3fff3fffu;  // small finite bf16 pairs
  b[0] = a[1] ^ 0x00010001u;
  b[1] = a[2] ^ 0x00010001u;
  float d[kChains][4] = {};
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(d[c][0]), "+f"(d[c][1]), "+f"(d[c][2]), "+f"(d[c][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
  }
  float acc = 0.f;
#pragma unroll
  for (int c = 0; c < kChains; ++c) acc += d[c][0] + d[c][1] + d[c][2] + d[c][3];
  if (acc == 1234.5f) sink[threadIdx.x] = acc;  // practically never true, but the compiler cannot know
}

}  // namespace

extern "C" {

// Launch `blocks` CTAs of 256 threads, each warp issuing iters * kChains mma.sync. Returns a status (kdtree.h);
// FLOPs done = blocks * 8 * iters * kChains * 4096.
int kdtree_bench_mma_peak(int blocks, int iters, float* sink, cudaStream_t stream) {
  if (blocks < 1 || iters < 1 || sink == nullptr) return KDTREE_ERR_INVALID;
  mma_peak_kernel<<<blocks, 256, 0, stream>>>(iters, sink);
  return cudaGetLastError() == cudaSuccess ? KDTREE_OK : KDTREE_ERR_CUDA;
}

int kdtree_bench_mma_chains(void) { return kChains; }

}  // extern "C"

// ------------------------------------------------------------------------------------------------------
// Inner-loop ceilings: what the flash kernel's loop reaches at its own occupancy, one piece at a time.
//
// The peak above runs 64 warps per SM on register operands. The flash kernel runs 8 warps per SM (one CTA
// of 256 threads), feeds every mma a B fragment from ldmatrix, keeps 200 registers of Q and O live, and does
// more than mma in each 32-token KV tile. These variants time its loop with nothing else, one CTA per SM,
// then add the kernel's other pieces one at a time (a ladder), so the cost of each piece is measured, not
// guessed:
//   S        per tile and warp: 18 k-steps x (2 ldmatrix.x4 of K + 4 mma), Q fragments in registers
//            (16 rows x 288 dims: the flash kernel's S half);
//   PV       2 k-steps x 16 x (1 ldmatrix.x4.trans of V + 2 mma) into 128 fp32 accumulators (16 rows x 256
//            value columns), P as A fragments packed from the S accumulators;
//   +xchg    the two dim halves of S meet in shared memory at a 64-thread named barrier (as in the kernel);
//   +softmax row max over the quad, exp2 against the running max, row sums, P packed from the exponentials;
//   +sync    one block barrier per tile;
//   +gather  the next tile copied from global memory by cp.async into a ring of buffers (contiguous rows,
//            no page table), waited for before the barrier: 2 stages is the kernel's double buffer, 3 and 4
//            (sm_90 only: they do not fit sm_120's 99 KB) put more tiles in flight;
//   +half gather  the same copy of only the first 576 B of each row: whether the gather's cost follows its
//            bytes (contention inside the SM) or the tile (the wait and the barrier around it);
//   +aligned gather  the same copy into rows 1,152 B apart (every row on a 128-byte boundary) instead of the
//            tile's 1,168 (the 16-byte pad that keeps ldmatrix conflict-free): whether the fill's shared-memory
//            writes (2.6 wavefronts per 128 B, measured) cost more for rows off the line boundary; the
//            ldmatrix reads stay on the padded layout (what they read does not matter here);
//   swizzled  rows 1,152 B apart (128-byte aligned fills) and, for conflict-free ldmatrix, chunk ch of row r
//            stored at (ch & ~7) | ((ch ^ r) & 7) (16-byte chunks, XOR within each 128-byte group); each
//            half's dims and value columns interleave by 16 so a lane's addresses take 2 swizzled offsets;
//   +tma     the tile as 9 tensor copies (cp.async.bulk.tensor, boxes of 32 rows x 64 dims, 128-byte swizzle: the
//            same XOR as `swizzled`, box by box) issued by one warp, completing on an mbarrier per buffer: the
//            copy engine writes the swizzled layout itself, with no per-thread copy instructions;
//   +bulk    the same copy as 32 bulk copies (cp.async.bulk, one row each, issued by one warp) that complete
//            on an mbarrier per buffer: the copy engine instead of 2,304 16-byte cp.async per tile;
//   gather only: the copy and the barrier with no tensor work: the rate at which L2 feeds the SMs;
//   regs     the S loop's mma on register operands only (no ldmatrix), accumulating across tiles: the issue
//            rate of 4 chains per warp at this occupancy;
//   Q by ldmatrix: S reads Q's A fragment by ldmatrix every k-step instead of holding Q in registers.
// The 16-warp variant is S+PV for a CTA of 16 warps (16 rows x 144 dims, 16 rows x 128 value columns of O
// per warp): what more warps per SM would get. At 16 warps a thread has 128 registers, and O (64) + Q (36)
// + S (16) + fragments do not fit (ptxas spills): Q comes by ldmatrix there.
// KV rows are 584 bf16 apart, as in the flash kernel, so ldmatrix is bank-conflict free.
namespace {

using kdtree::ldmatrix_x4;
using kdtree::mbarrier_arrive_expect_tx;
using kdtree::mbarrier_wait_parity;
using kdtree::ldmatrix_x4_trans;
using kdtree::mma_bf16;
using kdtree::quad_row_max;

// Bulk copies, mbarrier transaction counts and the async-proxy fence are sm_90+; on older archs the bulk
// loops are built without their copies and kdtree_bench_loop refuses them (status 3).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define KDTREE_LOOP_BULK 1
#else
#define KDTREE_LOOP_BULK 0
#endif

constexpr int kLoopTileTokens = 32;
constexpr int kLoopRowBytes = 576 * 2;
constexpr int kLoopStride = 576 + 8;
constexpr unsigned kLoopTileBytes = kLoopTileTokens * kLoopStride * 2;
constexpr unsigned kLoopXchgBytes = 8 * 4 * 32 * 16;  // 8 warps x 4 n-tiles x 32 lanes x float4
enum LoopParts {
  kPartRegs = 0, kPartS = 1, kPartPV = 2, kPartQShared = 4, kPartXchg = 8, kPartSoftmax = 16, kPartSync = 32,
  kPartGather = 64, kPartBulk = 128, kPartHalfGather = 256, kPartAlignedFill = 512, kPartSwizzle = 1024,
  kPartTensorCopy = 2048, kPartConsumed = 4096
};
// The tiled tensor map of the +tma loops' source (32 rows x 64 dims per box, 128-byte swizzle), written by
// kdtree_bench_loop before their launch; in global memory so that every loop keeps one signature.
constexpr unsigned kTmaBoxBytes = kLoopTileTokens * 128;  // one box: 32 rows x 64 dims
constexpr unsigned kTmaTileBytes = 9 * kTmaBoxBytes;       // 576 dims = 9 boxes: 36,864 B, a multiple of 1,024
__device__ CUtensorMap g_loop_tensor_map;

__device__ __forceinline__ uint32_t loop_pack(float x, float y) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Tile t of this CTA's stream in `src` (which holds src_tiles contiguous 32-token tiles).
__device__ __forceinline__ const char* loop_tile_src(const __nv_bfloat16* src, int tiles, int t, int src_tiles) {
  return reinterpret_cast<const char*>(src) +
         (size_t)((blockIdx.x * (size_t)tiles + t) % src_tiles) * kLoopTileTokens * kLoopRowBytes;
}

// One tile into the buffer at `dst` by cp.async, 16 bytes per copy, as one commit group: warp w copies rows
// w, w + kWarps, ..; kChunks 16-byte chunks of each row (72: the whole row), rows kDstStride bytes apart in
// shared memory (the tile's 1,168, or 1,152: every row on a 128-byte line boundary).
// kSwizzle: chunk ch of row r lands in chunk (ch & ~7) | ((ch ^ r) & 7) (see +swizzled).
template <int kWarps, int kChunks, int kDstStride = kLoopStride * 2, bool kSwizzle = false>
__device__ __forceinline__ void loop_copy_tile(unsigned dst, const char* tile_src, int warp, int lane) {
#pragma unroll
  for (int r = warp; r < kLoopTileTokens; r += kWarps)
#pragma unroll
    for (int ch = lane; ch < kChunks; ch += 32)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                       dst + r * kDstStride + (kSwizzle ? (ch & ~7) | ((ch ^ r) & 7) : ch) * 16),
                   "l"(tile_src + (size_t)r * kLoopRowBytes + ch * 16));
  asm volatile("cp.async.commit_group;\n" ::);
}


// The ring's first kStages - 1 tiles, before the loop; an empty commit group stands for a tile past the end so
// that cp.async.wait_group's count of groups in flight stays right.
template <int kStages, typename Gather>
__device__ __forceinline__ void loop_fill_ring(Gather& gather, int tiles) {
#pragma unroll
  for (int st = 0; st + 1 < kStages; ++st) {
    if (st < tiles) gather(st);
    else asm volatile("cp.async.commit_group;\n" ::);
  }
}

// Fills the tile buffers with small finite values (the loops' operands; what they hold does not matter).
__device__ __forceinline__ void loop_fill(__nv_bfloat16* kv, int elems) {
  for (int i = threadIdx.x; i < elems; i += blockDim.x)
    kv[i] = __float2bfloat16((float)((i * 37 + blockIdx.x) % 17 - 8) * 0.0625f);
}

// kKSteps: S k-steps per warp (its share of the 576 dims / 16); kOTiles: 8-column n-tiles of O per warp.
// `src` holds `src_tiles` contiguous 32-token tiles of 576-dim bf16 rows (read only by the gathering loops).
template <int kWarpsPerCta, int kKSteps, int kOTiles, int kParts, int kStages>
__global__ void __launch_bounds__(kWarpsPerCta * 32, 1)
    inner_loop_kernel(int tiles, const __nv_bfloat16* src, int src_tiles, float* sink) {
  constexpr bool kRegs = kParts == kPartRegs, kDoS = (kParts & kPartS) != 0 || kRegs;
  constexpr bool kDoPV = (kParts & kPartPV) != 0, kQShared = (kParts & kPartQShared) != 0;
  constexpr bool kXchg = (kParts & kPartXchg) != 0, kSoftmax = (kParts & kPartSoftmax) != 0;
  constexpr bool kBulk = (kParts & kPartBulk) != 0, kHalf = (kParts & kPartHalfGather) != 0;
  constexpr bool kAligned = (kParts & kPartAlignedFill) != 0, kTma = (kParts & kPartTensorCopy) != 0;
  constexpr bool kSwz = (kParts & kPartSwizzle) != 0 || kTma, kMbar = kBulk || kTma;
  static_assert(!kSwz || (kKSteps == 18 && kOTiles == 32 && !kQShared), "the swizzled layout is the 8-warp loop's");
  // bytes from one KV row to the next, and from one 128-byte group of dims (8 chunks) to the next: the tensor
  // copies land as 9 boxes of 32 rows x 128 B
  constexpr int kPitch = kTma ? 128 : kSwz ? kLoopRowBytes : kLoopStride * 2;
  constexpr int kGroupStep = kTma ? kTmaBoxBytes : 128;
  constexpr unsigned kStageBytes = kTma ? kTmaTileBytes : kLoopTileBytes;
  constexpr bool kGather = (kParts & kPartGather) != 0 || kBulk || kHalf || kAligned || kTma;
  constexpr int kCopyChunks = (kHalf ? kLoopRowBytes / 2 : kLoopRowBytes) / 16;  // 16-byte chunks per row
  // +consumed (tensor copies only): no block barrier per tile. Each warp arrives on its buffer's "consumed"
  // mbarrier after its P.V, warp 0 waits there before copying the next tile into that buffer, and the S
  // exchange gets its second pair barrier (below): what the flash kernel's block barrier costs once the copy
  // needs no threads of the other warps.
  constexpr bool kConsumed = (kParts & kPartConsumed) != 0;
  static_assert(!kConsumed || kTma, "consumed barriers order the tensor-copy fills");
  constexpr bool kSync = ((kParts & kPartSync) != 0 || kGather) && !kConsumed;
  static_assert(!kXchg || kWarpsPerCta == 8, "the S exchange pairs warp w with w ^ 4");
  static_assert(kStages >= 2 && (!kMbar || kStages == 2), "bulk and tensor copies use two buffers");
  extern __shared__ __align__(16) unsigned char loop_smem[];
  __nv_bfloat16* kv = reinterpret_cast<__nv_bfloat16*>(loop_smem);  // kStages 32-token tiles, as in the flash kernel
  float4* xchg = reinterpret_cast<float4*>(loop_smem + kStages * kLoopTileBytes);  // [8 warps][4 n-tiles][32 lanes]
  const unsigned full =
      static_cast<unsigned>(__cvta_generic_to_shared(loop_smem + kStages * kLoopTileBytes + kLoopXchgBytes));
  loop_fill(kv, kStages * kLoopTileTokens * kLoopStride);
#if KDTREE_LOOP_BULK
  if (kMbar && threadIdx.x == 0) {  // one mbarrier per buffer, one arrival (the expect-tx) per fill
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(full) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(full + 8) : "memory");
    if constexpr (kConsumed) {  // one arrival per warp and use of the buffer
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(full + 16), "n"(kWarpsPerCta) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(full + 24), "n"(kWarpsPerCta) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // the bulk copies write through the async proxy what the generic proxy wrote above
  if constexpr (kMbar) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, mi = lane / 8;
  const int part = warp / 4;  // which dims (S) and value columns (PV) this warp's loads cover
  // the 128-byte swizzle of a tensor copy repeats every 1,024 B: its buffers start on a 1,024-byte boundary
  // (the launch adds 1 KB of room; the tiles still end before the exchange area)
  const unsigned base = kTma ? (static_cast<unsigned>(__cvta_generic_to_shared(kv)) + 1023u) & ~1023u
                             : static_cast<unsigned>(__cvta_generic_to_shared(kv));
  const unsigned k_off = (((mi / 2) * 8 + lane % 8) * kLoopStride + part * kKSteps * 16 + (mi % 2) * 8) * 2;
  const unsigned v_off = (((mi % 2) * 8 + lane % 8) * kLoopStride + part * kOTiles * 8 + (mi / 2) * 8) * 2;
  // swizzled: the two halves interleave by 16-dim steps (K: k-step ks of half `part` is chunks 4 ks + 2 part
  // + {0, 1}; V: value-column pair np likewise), so a lane's chunk within its 128-byte group takes two values
  const int swz = lane & 7;  // the row (K and V alike) of this lane's ldmatrix address, mod 8
  const unsigned k_swz[2] = {(((mi / 2) * 8 + lane % 8) * kPitch) + (((2 * part + mi % 2) ^ swz) << 4),
                             (((mi / 2) * 8 + lane % 8) * kPitch) + (((4 + 2 * part + mi % 2) ^ swz) << 4)};
  const unsigned v_swz[2] = {(((mi % 2) * 8 + lane % 8) * kPitch) + (((2 * part + mi / 2) ^ swz) << 4),
                             (((mi % 2) * 8 + lane % 8) * kPitch) + (((4 + 2 * part + mi / 2) ^ swz) << 4)};
  const unsigned q_off = ((lane % 16) * kLoopStride + part * kKSteps * 16 + (lane / 16) * 8) * 2;
  // Q fragments read from shared memory once, so they are live registers (as in the flash kernel), not
  // constants the compiler could fold; with kQShared they are re-read by ldmatrix every k-step instead
  uint32_t qf[kQShared ? 2 : kKSteps][4];
  const uint32_t* words = reinterpret_cast<const uint32_t*>(kv);
#pragma unroll
  for (int ks = 0; ks < (kQShared ? 2 : kKSteps); ++ks)
#pragma unroll
    for (int i = 0; i < 4; ++i) qf[ks][i] = words[(ks * 4 + i) * 37 + lane];
  float o[kOTiles][4];
#pragma unroll
  for (int nt = 0; nt < kOTiles; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
  float sacc[4][4] = {};
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.f, l_hi = 0.f, total = 0.f;
  auto gather = [&](int t) {  // tile t of this CTA's stream into buffer t % kStages: warp w copies rows w, w+8, ..
    const char* tile_src = loop_tile_src(src, tiles, t, src_tiles);
    const unsigned dst = base + (t % kStages) * kStageBytes;
    if constexpr (kTma) {
#if KDTREE_LOOP_BULK
      if (warp == 0) {  // 9 boxes (dims 64j.., all 32 rows), one lane each, completing on the buffer's mbarrier
        const unsigned bar = full + (t & 1) * 8;
        if (lane == 0) mbarrier_arrive_expect_tx(bar, kTmaTileBytes);
        __syncwarp();
        const int row0 = (int)((blockIdx.x * (size_t)tiles + t) % src_tiles) * kLoopTileTokens;
        if (lane < 9) kdtree::kv_box_copy(dst + lane * kTmaBoxBytes, &g_loop_tensor_map, lane * 64, row0, bar);
      }
#endif
      return;
    }
    if constexpr (kBulk) {
#if KDTREE_LOOP_BULK
      if (warp == 0) {
        const unsigned bar = full + (t & 1) * 8;
        if (lane == 0) mbarrier_arrive_expect_tx(bar, kLoopTileTokens * kLoopRowBytes);
        __syncwarp();
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                dst + lane * kLoopStride * 2),
            "l"(tile_src + (size_t)lane * kLoopRowBytes), "r"(kLoopRowBytes), "r"(bar)
            : "memory");
      }
#endif
      return;
    }
    loop_copy_tile<kWarpsPerCta, kCopyChunks, kAligned || kSwz ? kLoopRowBytes : kLoopStride * 2, kSwz>(dst, tile_src,
                                                                                                  warp, lane);
  };
  if constexpr (kGather) loop_fill_ring<kStages>(gather, tiles);
#pragma unroll 1  // one tile per iteration, as in the flash kernel (unrolled, ptxas spills on sm_120)
  for (int t = 0; t < tiles; ++t) {
    const unsigned tile = base + (t % kStages) * kStageBytes, other = base + ((t + 1) % kStages) * kStageBytes;
    if constexpr (kMbar) {
      // +consumed: before warp 0 copies tile t + 1 (below), every warp has left tile t - 1, the previous use of
      // that buffer (its (t - 1) / 2-th phase)
      if (kConsumed && warp == 0 && t >= 1) mbarrier_wait_parity(full + 16 + ((t + 1) & 1) * 8, ((t - 1) >> 1) & 1);
      mbarrier_wait_parity(full + (t & 1) * 8, (t >> 1) & 1);
    } else if constexpr (kGather) {
      asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");  // tile t landed
    }
    if constexpr (kSync) __syncthreads();
    if constexpr (kGather) {
      // into the buffer of tile t - 1, which every warp has left (the barrier above); an empty group past the
      // end keeps wait_group's count of groups in flight right
      if (t + kStages - 1 < tiles) gather(t + kStages - 1);
      else if constexpr (!kMbar) asm volatile("cp.async.commit_group;\n" ::);
    }
    uint32_t pf[2][4];
    if constexpr (kDoS) {
      if constexpr (!kRegs) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) sacc[nt][0] = sacc[nt][1] = sacc[nt][2] = sacc[nt][3] = 0.f;
      }
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        uint32_t bf[4], bg[4];
        if constexpr (kRegs) {
#pragma unroll
          for (int i = 0; i < 4; ++i) bf[i] = bg[i] = qf[kKSteps - 1 - ks][i];
        } else {
          const unsigned ka = kSwz ? tile + k_swz[ks & 1] + (ks >> 1) * kGroupStep : tile + k_off + ks * 32;
          ldmatrix_x4(bf, ka);
          ldmatrix_x4(bg, ka + 16 * kPitch);
        }
        uint32_t qs[4];
        if constexpr (kQShared) ldmatrix_x4(qs, other + q_off + ks * 32);
        const uint32_t(&a)[4] = kQShared ? qs : qf[kQShared ? 0 : ks];
        mma_bf16(sacc[0], a, bf[0], bf[1]);
        mma_bf16(sacc[1], a, bf[2], bf[3]);
        mma_bf16(sacc[2], a, bg[0], bg[1]);
        mma_bf16(sacc[3], a, bg[2], bg[3]);
      }
      if constexpr (kXchg) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
          xchg[(warp * 4 + nt) * 32 + lane] = make_float4(sacc[nt][0], sacc[nt][1], sacc[nt][2], sacc[nt][3]);
        asm volatile("bar.sync %0, 64;\n" ::"r"(1 + warp % 4) : "memory");
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const float4 v = xchg[((warp ^ 4) * 4 + nt) * 32 + lane];
          sacc[nt][0] = (sacc[nt][0] + v.x) * 0.0625f;
          sacc[nt][1] = (sacc[nt][1] + v.y) * 0.0625f;
          sacc[nt][2] = (sacc[nt][2] + v.z) * 0.0625f;
          sacc[nt][3] = (sacc[nt][3] + v.w) * 0.0625f;
        }
        // the partner may write the next tile's half only after this one is read: the kernel's block
        // barrier orders that; without kSync a second pair barrier does
        if constexpr (!kSync) asm volatile("bar.sync %0, 64;\n" ::"r"(1 + warp % 4) : "memory");
      }
      if constexpr (kSoftmax) {
        float mx_lo = m_lo, mx_hi = m_hi;
        quad_row_max(sacc, mx_lo, mx_hi);
        m_lo = mx_lo;
        m_hi = mx_hi;
        float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          sacc[nt][0] = exp2f(sacc[nt][0] - m_lo);
          sacc[nt][1] = exp2f(sacc[nt][1] - m_lo);
          sacc[nt][2] = exp2f(sacc[nt][2] - m_hi);
          sacc[nt][3] = exp2f(sacc[nt][3] - m_hi);
          sum_lo += sacc[nt][0] + sacc[nt][1];
          sum_hi += sacc[nt][2] + sacc[nt][3];
        }
#pragma unroll
        for (int off = 1; off <= 2; off *= 2) {
          sum_lo += __shfl_xor_sync(0xffffffffu, sum_lo, off);
          sum_hi += __shfl_xor_sync(0xffffffffu, sum_hi, off);
        }
        l_lo += sum_lo;
        l_hi += sum_hi;
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        pf[nt / 2][(nt % 2) * 2 + 0] = loop_pack(sacc[nt][0], sacc[nt][1]);
        pf[nt / 2][(nt % 2) * 2 + 1] = loop_pack(sacc[nt][2], sacc[nt][3]);
        if constexpr (!kDoPV && !kRegs) total += sacc[nt][0] + sacc[nt][1] + sacc[nt][2] + sacc[nt][3];
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) pf[0][i] = qf[0][i], pf[1][i] = qf[1][i];
    }
    if constexpr (kDoPV) {
#pragma unroll
      for (int kk = 0; kk < kLoopTileTokens / 16; ++kk) {
        const unsigned vrow = tile + v_off + kk * 16 * kPitch;
#pragma unroll
        for (int np = 0; np < kOTiles / 2; ++np) {
          uint32_t bf[4];
          ldmatrix_x4_trans(bf, kSwz ? tile + kk * 16 * kPitch + v_swz[np & 1] + (np >> 1) * kGroupStep : vrow + np * 32);
          mma_bf16(o[2 * np], pf[kk], bf[0], bf[1]);
          mma_bf16(o[2 * np + 1], pf[kk], bf[2], bf[3]);
        }
      }
    }
    if constexpr (kConsumed) {  // this warp is done with tile t's buffer (its fragments are in registers)
#if KDTREE_LOOP_BULK
      __syncwarp();
      if (lane == 0) kdtree::mbarrier_arrive(full + 16 + (t & 1) * 8);
#endif
    }
  }
#pragma unroll
  for (int nt = 0; nt < kOTiles; ++nt) total += o[nt][0] + o[nt][1] + o[nt][2] + o[nt][3];
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) total += sacc[nt][0] + sacc[nt][1] + sacc[nt][2] + sacc[nt][3];
  if (total + l_lo + l_hi == 1234.5f) sink[threadIdx.x] = total;  // keeps the work; practically never true
}

// The same tile's work in a 2 x 4 warp layout ("2x4"): warp w = (row group g = w / 4: 32 rows, quarter
// q = w % 4), where the flash kernel's layout is 4 x 2 (16 rows, dim / column halves).
//   S   the warp multiplies its group's 32 rows over dims [144q, 144q + 144) (Q: 2 row tiles x 9 k-steps, the
//       same 72 registers), so every K fragment feeds 4 mma instead of 2;
//   +xchg  the four quarters' partial scores meet in shared memory (fp32, one 16-token half at a time: a
//       32-token buffer would not fit sm_120 beside the KV tiles) and warp q of the group sums rows 8q..8q+7
//       (with +softmax: its max, exponentials and sums, once per row instead of twice); P goes back as bf16
//       and every warp of the group reads its A fragments by ldmatrix; 128-thread named barriers per group;
//   PV  the warp owns its group's 32 rows x value columns [128q, 128q + 128): every V fragment feeds 4 mma.
// Shared-memory wavefronts per tile (CTA): ldmatrix 1,216 instead of 2,176; the exchange 672 instead of 264.
// Whether fewer wavefronts make the loop faster is what these rungs measure.
constexpr int kGroupPBStride = 32 + 8;                 // P row: 32 tokens bf16 + 16 B (ldmatrix conflict-free)
constexpr unsigned kGroupPartBytes = 2 * 4 * 2 * 2 * 2 * 32 * 8;  // [g][q][m][row half][n][lane] float2: 16 KB
constexpr unsigned kGroupPBytes = 64 * kGroupPBStride * 2;

template <int kParts, int kStages>
__global__ void __launch_bounds__(256, 1)
    grouped_loop_kernel(int tiles, const __nv_bfloat16* src, int src_tiles, float* sink) {
  constexpr bool kSoftmax = (kParts & kPartSoftmax) != 0, kGather = (kParts & kPartGather) != 0;
  extern __shared__ __align__(16) unsigned char loop_smem[];
  __nv_bfloat16* kv = reinterpret_cast<__nv_bfloat16*>(loop_smem);
  float2* part = reinterpret_cast<float2*>(loop_smem + kStages * kLoopTileBytes);
  __nv_bfloat16* pbuf = reinterpret_cast<__nv_bfloat16*>(loop_smem + kStages * kLoopTileBytes + kGroupPartBytes);
  loop_fill(kv, kStages * kLoopTileTokens * kLoopStride);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, mi = lane / 8, g = warp / 4, q = warp % 4;
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(kv));
  const unsigned k_off = (((mi / 2) * 8 + lane % 8) * kLoopStride + q * 144 + (mi % 2) * 8) * 2;
  const unsigned v_off = (((mi % 2) * 8 + lane % 8) * kLoopStride + q * 128 + (mi / 2) * 8) * 2;
  const unsigned p_frag = static_cast<unsigned>(__cvta_generic_to_shared(pbuf)) +
                          ((g * 32 + lane % 16) * kGroupPBStride + (lane / 16) * 8) * 2;
  // this lane's row in the reduction (row 8q + lane / 4 of group g = row half q % 2 of row tile q / 2) and
  // its P words: tokens 2 (lane % 4) + {0, 1} and + 8
  const int red_row = g * 32 + 8 * q + lane / 4;
  uint32_t* p_words = reinterpret_cast<uint32_t*>(pbuf + red_row * kGroupPBStride + 2 * (lane % 4));
  uint32_t qf[2][9][4];
  const uint32_t* words = reinterpret_cast<const uint32_t*>(kv);
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int ks = 0; ks < 9; ++ks)
#pragma unroll
      for (int i = 0; i < 4; ++i) qf[m][ks][i] = words[((m * 9 + ks) * 4 + i) * 37 + lane];
  float o[2][16][4];
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) o[m][nt][0] = o[m][nt][1] = o[m][nt][2] = o[m][nt][3] = 0.f;
  float m_run = -INFINITY, l_run = 0.f, total = 0.f;
  auto gather = [&](int t) {
    loop_copy_tile<8, kLoopRowBytes / 16>(base + (t % kStages) * kLoopTileBytes, loop_tile_src(src, tiles, t, src_tiles),
                                          warp, lane);
  };
  if constexpr (kGather) loop_fill_ring<kStages>(gather, tiles);
#pragma unroll 1
  for (int t = 0; t < tiles; ++t) {
    const unsigned tile = base + (t % kStages) * kLoopTileBytes;
    if constexpr (kGather) asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");
    __syncthreads();
    if constexpr (kGather) {
      if (t + kStages - 1 < tiles) gather(t + kStages - 1);
      else asm volatile("cp.async.commit_group;\n" ::);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // 16-token halves: S, exchange and softmax, then that half's k-step of P.V
      float s[2][2][4] = {};
#pragma unroll
      for (int ks = 0; ks < 9; ++ks) {
        uint32_t bf[4];
        ldmatrix_x4(bf, tile + k_off + h * 16 * kLoopStride * 2 + ks * 32);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          mma_bf16(s[m][0], qf[m][ks], bf[0], bf[1]);
          mma_bf16(s[m][1], qf[m][ks], bf[2], bf[3]);
        }
      }
      // partials in fragment order: [g][q][m][row half][n][lane], so both stores and loads are whole wavefronts
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          part[((((g * 4 + q) * 2 + m) * 2 + 0) * 2 + n) * 32 + lane] = make_float2(s[m][n][0], s[m][n][1]);
          part[((((g * 4 + q) * 2 + m) * 2 + 1) * 2 + n) * 32 + lane] = make_float2(s[m][n][2], s[m][n][3]);
        }
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + g) : "memory");
      float x[4] = {0.f, 0.f, 0.f, 0.f};  // tokens 2 (lane % 4) + {0, 1}, 8 + 2 (lane % 4) + {0, 1}
#pragma unroll
      for (int src_q = 0; src_q < 4; ++src_q)  // a fixed order: the same bits every run
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const float2 v = part[((((g * 4 + src_q) * 2 + q / 2) * 2 + q % 2) * 2 + n) * 32 + lane];
          x[2 * n] += v.x;
          x[2 * n + 1] += v.y;
        }
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] *= 0.0625f;
      if constexpr (kSoftmax) {
        float mx = fmaxf(m_run, fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3])));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        m_run = mx;
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) sum += (x[i] = exp2f(x[i] - m_run));
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        l_run += sum;
      }
      p_words[h * 8] = loop_pack(x[0], x[1]);
      p_words[h * 8 + 4] = loop_pack(x[2], x[3]);
      asm volatile("bar.sync %0, 128;\n" ::"r"(1 + g) : "memory");
      uint32_t pa[2][4];
#pragma unroll
      for (int m = 0; m < 2; ++m) ldmatrix_x4(pa[m], p_frag + (m * 16 * kGroupPBStride + h * 16) * 2);
      const unsigned vrow = tile + v_off + h * 16 * kLoopStride * 2;
#pragma unroll
      for (int np = 0; np < 8; ++np) {
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, vrow + np * 32);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          mma_bf16(o[m][2 * np], pa[m], bf[0], bf[1]);
          mma_bf16(o[m][2 * np + 1], pa[m], bf[2], bf[3]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) total += o[m][nt][0] + o[m][nt][1] + o[m][nt][2] + o[m][nt][3];
  if (total + l_run == 1234.5f) sink[threadIdx.x] = total;  // keeps the work; practically never true
}

struct InnerLoop {
  const char* name;
  void (*kernel)(int, const __nv_bfloat16*, int, float*);
  int warps;         // per CTA, one CTA per SM
  int mma_per_tile;  // per warp
  int copy_bytes;    // read from `src` per CTA per tile: 32 rows of 1,152 B (576 B for the half gather), or 0
  bool bulk;         // bulk or tensor copies: sm_90+
  bool tensor_map;   // reads g_loop_tensor_map (kdtree_bench_loop writes it first)
  int smem_bytes;    // the tile buffers, the S exchange and four mbarriers (+1 KB to align tensor copies)
};

template <int W, int KS, int OT, int P, int S = 2>
constexpr InnerLoop inner_loop(const char* name) {
  return {name, inner_loop_kernel<W, KS, OT, P, S>, W,
          ((P & kPartS) || P == kPartRegs ? KS * 4 : 0) + ((P & kPartPV) ? 2 * OT : 0),
          (P & (kPartGather | kPartBulk | kPartAlignedFill | kPartTensorCopy)) ? kLoopTileTokens * kLoopRowBytes
          : (P & kPartHalfGather)         ? kLoopTileTokens * kLoopRowBytes / 2
                                          : 0,
          (P & (kPartBulk | kPartTensorCopy)) != 0, (P & kPartTensorCopy) != 0,
          (int)(S * kLoopTileBytes + kLoopXchgBytes + 32 + ((P & kPartTensorCopy) ? 1024 : 0))};
}

template <int P, int S = 2>
constexpr InnerLoop grouped_loop(const char* name) {
  return {name, grouped_loop_kernel<P, S>, 8, 2 * 9 * 4 + 2 * 8 * 4,
          (P & kPartGather) ? kLoopTileTokens * kLoopRowBytes : 0, false, false,
          (int)(S * kLoopTileBytes + kGroupPartBytes + kGroupPBytes)};
}

constexpr int kLadder = kPartS | kPartPV;
const InnerLoop kInnerLoops[] = {
    inner_loop<8, 18, 32, kPartRegs>("regs 8w"),
    inner_loop<8, 18, 32, kPartS>("S 8w"),
    inner_loop<8, 18, 32, kPartPV>("PV 8w"),
    inner_loop<8, 18, 32, kLadder>("S+PV 8w"),
    inner_loop<8, 18, 32, kLadder | kPartXchg>("S+PV 8w +xchg"),
    inner_loop<8, 18, 32, kLadder | kPartXchg | kPartSoftmax>("S+PV 8w +xchg +softmax"),
    inner_loop<8, 18, 32, kLadder | kPartXchg | kPartSoftmax | kPartSync>("S+PV 8w +xchg +softmax +sync"),
    inner_loop<8, 18, 32, kLadder | kPartXchg | kPartSoftmax | kPartGather>("S+PV 8w +xchg +softmax +gather"),
    inner_loop<8, 18, 32, kLadder | kPartXchg | kPartSoftmax | kPartHalfGather>("S+PV 8w +xchg +softmax +half gather"),
    inner_loop<8, 18, 32, kLadder | kPartXchg | kPartSoftmax | kPartBulk>("S+PV 8w +xchg +softmax +bulk"),
    inner_loop<8, 18, 32, kLadder | kPartXchg | kPartSoftmax | kPartAlignedFill>("S+PV 8w +xchg +softmax +aligned gather"),
    inner_loop<8, 18, 32, kLadder | kPartXchg | kPartSoftmax | kPartSync | kPartSwizzle>("S+PV 8w +xchg +softmax +sync, swizzled"),
    inner_loop<8, 18, 32, kLadder | kPartXchg | kPartSoftmax | kPartGather | kPartSwizzle>("S+PV 8w +xchg +softmax +gather, swizzled"),
    inner_loop<8, 18, 32, kLadder | kPartGather | kPartSwizzle>("S+PV 8w +gather, swizzled"),
    inner_loop<8, 18, 32, kLadder | kPartXchg | kPartSoftmax | kPartTensorCopy>("S+PV 8w +xchg +softmax +tma, swizzled"),
    inner_loop<8, 18, 32, kLadder | kPartXchg | kPartSoftmax | kPartTensorCopy | kPartConsumed>(
        "S+PV 8w +xchg +softmax +tma, swizzled, consumed barriers"),
    inner_loop<8, 18, 32, kPartTensorCopy>("tma only 8w"),
    inner_loop<8, 18, 32, kLadder | kPartGather>("S+PV 8w +gather"),
    inner_loop<8, 18, 32, kPartGather>("gather only 8w"),
    inner_loop<8, 18, 32, kPartGather, 3>("gather only 8w, 3 stages"),
    inner_loop<8, 18, 32, kPartGather, 4>("gather only 8w, 4 stages"),
    inner_loop<8, 18, 32, kPartAlignedFill>("aligned gather only 8w"),
    inner_loop<8, 18, 32, kLadder | kPartXchg | kPartSoftmax | kPartGather, 3>("S+PV 8w +xchg +softmax +gather, 3 stages"),
    inner_loop<8, 18, 32, kLadder | kPartXchg | kPartSoftmax | kPartGather, 4>("S+PV 8w +xchg +softmax +gather, 4 stages"),
    inner_loop<8, 18, 32, kPartBulk>("bulk only 8w"),
    inner_loop<8, 18, 32, kLadder | kPartQShared>("S+PV 8w, Q by ldmatrix"),
    inner_loop<16, 9, 16, kPartRegs>("regs 16w"),
    inner_loop<16, 9, 16, kLadder | kPartQShared>("S+PV 16w, Q by ldmatrix"),
    grouped_loop<kLadder | kPartXchg | kPartSoftmax | kPartSync>("S+PV 2x4 +xchg +softmax +sync"),
    grouped_loop<kLadder | kPartXchg | kPartSoftmax | kPartGather>("S+PV 2x4 +xchg +softmax +gather"),
};
constexpr int kNumInnerLoops = sizeof(kInnerLoops) / sizeof(kInnerLoops[0]);

}  // namespace

extern "C" {

int kdtree_bench_loop_count(void) { return kNumInnerLoops; }

// Name, warps per CTA and mma.sync per warp per 32-token tile of inner loop `i`; null / 0 for a bad index.
const char* kdtree_bench_loop_name(int i) { return i >= 0 && i < kNumInnerLoops ? kInnerLoops[i].name : nullptr; }
int kdtree_bench_loop_warps(int i) { return i >= 0 && i < kNumInnerLoops ? kInnerLoops[i].warps : 0; }
int kdtree_bench_loop_mma_per_tile(int i) { return i >= 0 && i < kNumInnerLoops ? kInnerLoops[i].mma_per_tile : 0; }
// Bytes each CTA copies from global memory per tile (0: the loop works on shared memory only).
int kdtree_bench_loop_tile_bytes(int i) { return i >= 0 && i < kNumInnerLoops ? kInnerLoops[i].copy_bytes : 0; }

// The +tma loops' tensor map: `src` as `rows` x 576 bf16 (1,152 B apart), boxes of 32 rows x 64 dims, 128-byte
// swizzle (encode_kv_tensor_map, as the flash kernel), into g_loop_tensor_map (stream-ordered before the
// launch). Status as kdtree_bench_loop.
static int write_loop_tensor_map(const void* src, size_t rows, cudaStream_t stream) {
  CUtensorMap map;
  if (!kdtree::encode_kv_tensor_map(src, rows, kLoopTileTokens, &map))
    return KDTREE_ERR_UNSUPPORTED;  // no encoder, or `src` refused
  // the map is copied from host memory before this call returns, so `map` may go out of scope
  return cudaMemcpyToSymbolAsync(g_loop_tensor_map, &map, sizeof(map), 0, cudaMemcpyHostToDevice, stream) ==
                 cudaSuccess
             ? KDTREE_OK
             : KDTREE_ERR_CUDA;
}

// Launch inner loop `i` as one CTA per SM (`blocks` = the SM count; the dynamic shared memory is sized so
// that no second CTA fits), each warp running `tiles` 32-token tiles; the gathering loops read `src`, which
// must hold `src_bytes` >= 36,864 (one tile) of bf16. Status as kdtree.h: KDTREE_ERR_UNSUPPORTED where this GPU
// cannot run the loop: its buffers exceed the shared memory per block (the 3- and 4-stage loops
// on sm_120), or it uses bulk or tensor copies and the GPU is older than sm_90 (or its driver has no tensor
// map encoder, or the encoder refuses `src`, e.g. not 16-byte aligned).
// FLOPs done = blocks * warps * tiles * mma_per_tile * 4096.
int kdtree_bench_loop(int i, int blocks, int tiles, const void* src, size_t src_bytes, float* sink,
                      cudaStream_t stream) {
  if (i < 0 || i >= kNumInnerLoops || blocks < 1 || tiles < 1 || sink == nullptr) return KDTREE_ERR_INVALID;
  const InnerLoop& loop = kInnerLoops[i];
  const size_t tile_src_bytes = (size_t)kLoopTileTokens * kLoopRowBytes;
  if (loop.copy_bytes && (src == nullptr || src_bytes < tile_src_bytes)) return KDTREE_ERR_INVALID;
  int dev = 0, per_sm = 0, opt_in = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&opt_in, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return KDTREE_ERR_CUDA;
  int smem = per_sm / 2 + 1024;  // more than half the SM: one CTA per SM
  if (smem < loop.smem_bytes) smem = loop.smem_bytes;
  if (smem > opt_in || (loop.bulk && major < 9)) return KDTREE_ERR_UNSUPPORTED;
  if (cudaFuncSetAttribute(loop.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
    return KDTREE_ERR_CUDA;
  const int src_tiles = loop.copy_bytes ? (int)(src_bytes / tile_src_bytes) : 1;
  if (loop.tensor_map) {
    const int st = write_loop_tensor_map(src, (size_t)src_tiles * kLoopTileTokens, stream);
    if (st != 0) return st;
  }
  loop.kernel<<<blocks, loop.warps * 32, smem, stream>>>(tiles, static_cast<const __nv_bfloat16*>(src), src_tiles,
                                                         sink);
  return cudaGetLastError() == cudaSuccess ? KDTREE_OK : KDTREE_ERR_CUDA;
}

}  // extern "C"
