// Naive tree-verify attention: the oracle.
//
// Computes, for every query row (tree node i of request b) and head h,
//   score_p = scale * q[i,h,:] . k_p           over attended KV positions p
//   out     = sum_p softmax(score)_p * v_p      (v_p = k_p[:512]),  lse = ln sum_p exp(score_p)
// where p runs over the prefix 0..L_b-1 and the tree positions L_b + j with bit j of node i's mask row.
//
// How: one block of 4 warps per (query row, head). Each warp walks every 4th KV position, computes the
// 576-wide dot product with a warp reduction, and keeps its own online softmax (running max, running sum,
// a 512-wide fp32 accumulator spread 16 per lane). The four warps merge through shared memory at the end.
// Everything is fp32; exp is expf on max-subtracted scores. Obviously right over fast.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "kdev/kv_pages.cuh"
#include "kdev/verify_attn.cuh"

namespace kdtree {
namespace {

constexpr int kWarps = 4;
constexpr int kQkPerLane = KDTREE_QK_DIM / 32;  // 18
constexpr int kVPerLane = KDTREE_V_DIM / 32;    // 16

__global__ void __launch_bounds__(kWarps * 32) verify_attn_naive_kernel(VerifyAttnParams p) {
  const int row = blockIdx.x;  // global tree node index in 0..total_q-1
  const int h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Which request owns this row (linear search: batch is small and this is the oracle).
  int b = 0;
  while (b + 1 < p.batch && p.q_indptr[b + 1] <= row) ++b;
  const int T = p.q_indptr[b + 1] - p.q_indptr[b];
  const int L = p.prefix_lens[b];
  const int kv_len = L + T;

  const __nv_bfloat16* q = static_cast<const __nv_bfloat16*>(p.q) + ((size_t)row * p.num_heads + h) * KDTREE_QK_DIM;
  const __nv_bfloat16* kv = static_cast<const __nv_bfloat16*>(p.kv_cache);
  const uint64_t* mask_row = p.tree_mask + (size_t)row * p.mask_words;

  // Lane l holds dims l, l+32, ... (strided: coalesced across the warp).
  float qreg[kQkPerLane];
#pragma unroll
  for (int i = 0; i < kQkPerLane; ++i) qreg[i] = __bfloat162float(q[lane + 32 * i]);

  float m = -INFINITY, l = 0.f, acc[kVPerLane];
#pragma unroll
  for (int i = 0; i < kVPerLane; ++i) acc[i] = 0.f;

  for (int pos = warp; pos < kv_len; pos += kWarps) {
    if (pos >= L) {
      const int j = pos - L;
      if (!((mask_row[j / 64] >> (j % 64)) & 1ull)) continue;
    }
    const __nv_bfloat16* k =
        kv + kv_slot<size_t>(kv_pages_by_size(p.page_table, p.max_pages, b, p.page_size), pos) * KDTREE_QK_DIM;
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < kQkPerLane; ++i) dot += qreg[i] * __bfloat162float(k[lane + 32 * i]);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    const float s = dot * p.scale;
    const float m_new = fmaxf(m, s);
    const float alpha = expf(m - m_new);  // m = -inf on the first hit: expf(-inf) = 0
    const float w = expf(s - m_new);
    l = l * alpha + w;
#pragma unroll
    for (int i = 0; i < kVPerLane; ++i) acc[i] = acc[i] * alpha + w * __bfloat162float(k[lane + 32 * i]);
    m = m_new;
  }

  // Merge the warps: rescale each to the common max.
  __shared__ float s_m[kWarps], s_l[kWarps];
  __shared__ float s_acc[kWarps][KDTREE_V_DIM];
  if (lane == 0) {
    s_m[warp] = m;
    s_l[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < kVPerLane; ++i) s_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  float m_all = -INFINITY;
  for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, s_m[w]);
  float l_all = 0.f;
  float factor[kWarps];
  for (int w = 0; w < kWarps; ++w) {
    factor[w] = (s_m[w] == -INFINITY) ? 0.f : expf(s_m[w] - m_all);
    l_all += s_l[w] * factor[w];
  }
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + ((size_t)row * p.num_heads + h) * KDTREE_V_DIM;
  for (int c = threadIdx.x; c < KDTREE_V_DIM; c += blockDim.x) {
    float o = 0.f;
    for (int w = 0; w < kWarps; ++w) o += s_acc[w][c] * factor[w];
    out[c] = __float2bfloat16(l_all > 0.f ? o / l_all : 0.f);
  }
  if (threadIdx.x == 0) p.lse[(size_t)row * p.num_heads + h] = l_all > 0.f ? m_all + logf(l_all) : -INFINITY;
}

}  // namespace

cudaError_t launch_verify_attn_naive(const VerifyAttnParams& p, cudaStream_t stream) {
  dim3 grid(p.total_q, p.num_heads);
  verify_attn_naive_kernel<<<grid, kWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kdtree
