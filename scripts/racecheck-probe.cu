// Racecheck probe: which shared-memory hand-offs does compute-sanitizer's racecheck credit?
// A writer warp hands a 32-int record to a reader warp eight times, ordered by
//   mode 0: bar.arrive (after writing / after reading) -> bar.sync on the other side (as flash v9 did);
//   mode 1: bar.sync on both sides;
//   mode 2: nothing (a real race: the sum comes out wrong);
//   mode 3: full / empty mbarriers (mbarrier.arrive, mbarrier.try_wait.parity; as flash v9.2 does).
// Run: nvcc -arch sm_90 -o /tmp/probe scripts/racecheck-probe.cu &&
//      for m in 0 1 2 3; do compute-sanitizer --tool racecheck /tmp/probe $m; done
// H200, CUDA 13.0 (kernels/NOTES.md, flash v9): modes 0 and 2 report 8 hazards, modes 1 and 3 none; the
// PTX memory model orders mode 0 as well, so racecheck cannot tell it from mode 2.
#include <cstdio>
#include <cuda_runtime.h>
__device__ __forceinline__ void bsync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void barrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void mb_init(unsigned a, int n) { asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(a), "r"(n) : "memory"); }
__device__ __forceinline__ void mb_arrive(unsigned a) { asm volatile("{.reg .b64 st; mbarrier.arrive.shared.b64 st, [%0];}" ::"r"(a) : "memory"); }
__device__ __forceinline__ void mb_wait(unsigned a, int par) {
  asm volatile("{.reg .pred d; W: mbarrier.try_wait.parity.shared.b64 d, [%0], %1; @!d bra W;}" ::"r"(a), "r"(par) : "memory");
}
__global__ void k3(int* out) {
  __shared__ int rec[32];
  __shared__ unsigned long long full, empty;
  unsigned fa = (unsigned)__cvta_generic_to_shared(&full), ea = (unsigned)__cvta_generic_to_shared(&empty);
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, acc = 0;
  if (threadIdx.x == 0) { mb_init(fa, 32); mb_init(ea, 32); }
  __syncthreads();
  for (int it = 0; it < 8; ++it) {
    if (warp == 0) {
      mb_wait(ea, (it & 1) ^ 1);  // a fresh barrier: the phase before 0 counts as complete
      rec[lane] = it * 100 + lane;
      mb_arrive(fa);
    } else {
      mb_wait(fa, it & 1);
      acc += rec[lane];
      mb_arrive(ea);
    }
  }
  if (warp == 1) out[lane] = acc;
}
__global__ void k(int mode, int* out) {
  __shared__ int rec[32];
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32, acc = 0;
  if (warp == 1 && mode != 2) barrive(2, 64);  // record starts free
  for (int it = 0; it < 8; ++it) {
    if (warp == 0) {
      if (mode != 2) bsync(2, 64);                   // wait: consumed
      rec[lane] = it * 100 + lane;
      if (mode == 0) barrive(1, 64); else if (mode == 1) bsync(1, 64);  // published
    } else {
      if (mode != 2) bsync(1, 64);                   // wait: published
      acc += rec[lane];
      if (mode == 0) barrive(2, 64); else if (mode == 1) bsync(2, 64);  // consumed
    }
  }
  if (warp == 0 && mode != 2) bsync(2, 64);
  if (warp == 1) out[lane] = acc;
}
int main(int argc, char** argv) {
  int mode = argc > 1 ? atoi(argv[1]) : 0;
  int* d; cudaMalloc(&d, 32 * sizeof(int));
  if (mode == 3) k3<<<1, 64>>>(d); else k<<<1, 64>>>(mode, d);
  cudaError_t e = cudaDeviceSynchronize();
  int h[32]; cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
  printf("mode %d: %s, out[5]=%d (expect %d)\n", mode, cudaGetErrorString(e), h[5], 8 * 5 + 2800);
  return e != cudaSuccess;
}
