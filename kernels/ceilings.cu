// Ceiling microbenchmark: the bf16 mma.sync m16n8k16 (fp32 accumulate) issue rate of this GPU.
//
// Every warp runs kChains independent accumulator chains (enough to cover the tensor pipe's latency) for
// `iters` iterations on register operands; no memory traffic inside the loop. FLOPs = 2*16*8*16 per mma.
// The result is folded into `sink` so the compiler cannot drop the work. kdev bench --ceilings times it
// with CUDA events and caches the figure per GPU.
#include <cuda_runtime.h>

#include <cstdint>

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

// Launch `blocks` CTAs of 256 threads, each warp issuing iters * kChains mma.sync. Returns a status
// (0 ok, 1 invalid argument, 2 CUDA error); FLOPs done = blocks * 8 * iters * kChains * 4096.
int kdtree_bench_mma_peak(int blocks, int iters, float* sink, cudaStream_t stream) {
  if (blocks < 1 || iters < 1 || sink == nullptr) return 1;
  mma_peak_kernel<<<blocks, 256, 0, stream>>>(iters, sink);
  return cudaGetLastError() == cudaSuccess ? 0 : 2;
}

int kdtree_bench_mma_chains(void) { return kChains; }

}  // extern "C"
