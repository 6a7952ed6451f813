// wgmma on this GPU: the rung of the ceilings that prices it, and a check of the operand layouts the Hopper verify
// kernel is built from (kernels/include/kdev/wgmma.cuh). Both need a library built for sm_90a (kdev build --arch
// sm_90a): elsewhere they answer KDTREE_ERR_UNSUPPORTED, found as the flash call finds it (kdtree::flash_wgmma_built).
//
// The rung (kdtree_bench_wgmma_peak): one CTA per SM of two warpgroups, each issuing m64n256k16 wgmmas back to back
// from its own A [64 x 64] and B [256 x 64] tiles in shared memory (K-major, 128-byte swizzle), one commit group of
// four (a 64-wide k step) at a time with one more in flight. No memory traffic in the loop: the tensor pipe fed from
// shared memory, as the verify kernel's S = Q K^T is. FLOPs = 2 * 64 * 256 * 16 per wgmma.
//
// The check (kdtree_bench_wgmma_check): one warpgroup computes, for a query tile Q [64 x 576] and a KV tile [64 x 576]
// (bf16, row-major in global memory, copied into shared memory in the swizzled box layout TMA writes), S = Q K^T as
// 36 m64n64k16 wgmmas (both operands K-major, the dims' 9 boxes in turn), then P = bf16(S) from the accumulators as
// register A fragments and O = P V with V = the KV tile's first 512 columns read MN-major, in two halves of 256
// columns (4 k16 steps each). It writes S [64 x 64] and O [64 x 512] fp32, row-major: what a test compares with a
// matmul of the same bf16 inputs. The verify kernel's S and P V are these two products with a softmax between.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kdev/kdtree.h"
#include "kdev/verify_attn.cuh"
#include "kdev/wgmma.cuh"

namespace {

using kdtree::wgmma::kSwizzleRowBytes;
using kdtree::wgmma::swizzled_offset;

constexpr int kPeakThreads = 256;                    // two warpgroups
constexpr int kPeakGroupBytes = (64 + 256) * 128;    // A [64 x 64] and B [256 x 64] bf16 per warpgroup
constexpr int kPeakSmemBytes = 2 * kPeakGroupBytes + 1024;  // + the alignment of the 1,024-byte atoms
constexpr int kCheckRows = 64, kCheckDims = 576, kCheckLatent = 512;
constexpr int kCheckTileBytes = kCheckRows * kCheckDims * 2;
constexpr int kCheckSmemBytes = 2 * kCheckTileBytes + 1024;

__device__ __forceinline__ uint32_t aligned_base(unsigned char* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return (addr + 1023u) & ~1023u;
}

__global__ void __launch_bounds__(kPeakThreads, 1) wgmma_peak_kernel(int iters, float* sink) {
#if KDTREE_HAS_WGMMA
  namespace wg = kdtree::wgmma;
  extern __shared__ unsigned char smem[];
  const uint32_t base = aligned_base(smem);
  for (int i = threadIdx.x; i < 2 * kPeakGroupBytes / 16; i += kPeakThreads)
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(base + 16 * i), "r"(0x3c003c00u));  // bf16 1.0
  wg::fence_shared_for_async();
  __syncthreads();
  const uint32_t a = base + (threadIdx.x / 128) * kPeakGroupBytes, b = a + 64 * kSwizzleRowBytes;
  float d[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) d[i] = 0.f;
  wg::fence();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int k = 0; k < 4; ++k) wg::mma_64x256_ss<0>(d, wg::k_major(a, 64, k), wg::k_major(b, 256, k), 1);
    wg::commit();
    wg::wait<1>();
  }
  wg::wait<0>();
  wg::pin(d);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 128; ++i) sum += d[i];
  if (threadIdx.x % 128 == 0) atomicAdd(&sink[blockIdx.x % 256], sum);
#endif
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__global__ void __launch_bounds__(128, 1) wgmma_check_kernel(const __nv_bfloat16* q, const __nv_bfloat16* kv,
                                                             float* s_out, float* o_out) {
#if KDTREE_HAS_WGMMA
  namespace wg = kdtree::wgmma;
  extern __shared__ unsigned char smem[];
  const uint32_t qt = aligned_base(smem), kt = qt + kCheckTileBytes;
  // row-major global rows of 576 bf16 into 9 swizzled boxes of 64 columns, 16 bytes per thread and step
  for (int i = threadIdx.x; i < kCheckRows * kCheckDims / 8; i += 128) {
    const int row = i / (kCheckDims / 8), col = (i % (kCheckDims / 8)) * 8;
    const uint4 vq = reinterpret_cast<const uint4*>(q)[i], vk = reinterpret_cast<const uint4*>(kv)[i];
    const uint32_t off = swizzled_offset(kCheckRows, row, col);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(qt + off), "r"(vq.x), "r"(vq.y), "r"(vq.z),
                 "r"(vq.w));
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(kt + off), "r"(vk.x), "r"(vk.y), "r"(vk.z),
                 "r"(vk.w));
  }
  wg::fence_shared_for_async();
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r0 = 16 * warp + lane / 4, c0 = 2 * (lane % 4);
  float s[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = 0.f;
  wg::fence();
#pragma unroll
  for (int k = 0; k < kCheckDims / 16; ++k)
    wg::mma_64x64_ss(s, wg::k_major(qt, kCheckRows, k), wg::k_major(kt, kCheckRows, k), k > 0);
  wg::commit();
  wg::wait<0>();
  wg::pin(s);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    s_out[r0 * 64 + 8 * i + c0] = s[4 * i];
    s_out[r0 * 64 + 8 * i + c0 + 1] = s[4 * i + 1];
    s_out[(r0 + 8) * 64 + 8 * i + c0] = s[4 * i + 2];
    s_out[(r0 + 8) * 64 + 8 * i + c0 + 1] = s[4 * i + 3];
  }
  // the accumulators of tokens 16 t .. 16 t + 15 (column blocks 2 t and 2 t + 1) are k step t's A fragments
  uint32_t p[4][4];
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    p[t][0] = pack_bf16(s[8 * t], s[8 * t + 1]);
    p[t][1] = pack_bf16(s[8 * t + 2], s[8 * t + 3]);
    p[t][2] = pack_bf16(s[8 * t + 4], s[8 * t + 5]);
    p[t][3] = pack_bf16(s[8 * t + 6], s[8 * t + 7]);
  }
#pragma unroll 1
  for (int half = 0; half < 2; ++half) {
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    wg::fence();
#pragma unroll
    for (int t = 0; t < 4; ++t) wg::mma_64x256_rs_mn(o, p[t], wg::mn_major(kt, kCheckRows, 4 * half, t), t > 0);
    wg::commit();
    wg::wait<0>();
    wg::pin(o);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int col = 256 * half + 8 * i + c0;
      o_out[r0 * kCheckLatent + col] = o[4 * i];
      o_out[r0 * kCheckLatent + col + 1] = o[4 * i + 1];
      o_out[(r0 + 8) * kCheckLatent + col] = o[4 * i + 2];
      o_out[(r0 + 8) * kCheckLatent + col + 1] = o[4 * i + 3];
    }
  }
#endif
}

// KDTREE_OK where the code loaded for the current GPU has wgmma (the flash call's own question: one build compiles
// every wgmma body or none); KDTREE_ERR_UNSUPPORTED where it has not, or where the library has no code for this GPU.
int wgmma_available() {
  bool built = false;
  if (kdtree::flash_wgmma_built(&built) != cudaSuccess) return KDTREE_ERR_CUDA;
  return built ? KDTREE_OK : KDTREE_ERR_UNSUPPORTED;
}

}  // namespace

extern "C" {

// Launch `blocks` CTAs (one per SM: the dynamic shared memory is sized so that no second fits) of two warpgroups, each
// issuing iters * 4 m64n256k16 wgmmas. FLOPs done = blocks * 2 * iters * 4 * 524,288. `sink`: 256 floats of device
// memory. KDTREE_ERR_UNSUPPORTED: no wgmma in the code loaded for this GPU (not an sm_90a build, or not an sm_90 GPU).
int kdtree_bench_wgmma_peak(int blocks, int iters, float* sink, cudaStream_t stream) {
  if (blocks < 1 || iters < 1 || sink == nullptr) return KDTREE_ERR_INVALID;
  if (int st = wgmma_available()) return st;
  int dev = 0, per_sm = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) != cudaSuccess)
    return KDTREE_ERR_CUDA;
  const int smem = per_sm / 2 + 1024 > kPeakSmemBytes ? per_sm / 2 + 1024 : kPeakSmemBytes;
  if (cudaFuncSetAttribute(wgmma_peak_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
    return KDTREE_ERR_CUDA;
  wgmma_peak_kernel<<<blocks, kPeakThreads, smem, stream>>>(iters, sink);
  return cudaGetLastError() == cudaSuccess ? KDTREE_OK : KDTREE_ERR_CUDA;
}

// S = Q K^T [64 x 64] and O = bf16(S) V [64 x 512] (fp32, row-major) for q and kv [64 x 576] bf16 row-major, 16-byte
// aligned device memory, by the wgmma primitives (this file's header). KDTREE_ERR_UNSUPPORTED as
// kdtree_bench_wgmma_peak.
int kdtree_bench_wgmma_check(const void* q, const void* kv, float* s, float* o, cudaStream_t stream) {
  if (q == nullptr || kv == nullptr || s == nullptr || o == nullptr) return KDTREE_ERR_INVALID;
  if (reinterpret_cast<uintptr_t>(q) % 16 || reinterpret_cast<uintptr_t>(kv) % 16) return KDTREE_ERR_INVALID;
  if (int st = wgmma_available()) return st;
  if (cudaFuncSetAttribute(wgmma_check_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kCheckSmemBytes) !=
      cudaSuccess)
    return KDTREE_ERR_CUDA;
  wgmma_check_kernel<<<1, 128, kCheckSmemBytes, stream>>>(static_cast<const __nv_bfloat16*>(q),
                                                          static_cast<const __nv_bfloat16*>(kv), s, o);
  return cudaGetLastError() == cudaSuccess ? KDTREE_OK : KDTREE_ERR_CUDA;
}

}  // extern "C"
