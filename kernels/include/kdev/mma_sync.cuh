// The warp-level tensor-core primitives every mma.sync kernel here uses (sm_80+, so sm_90 and sm_120 alike):
// fragment loads from shared memory and the bf16 m16n8k16 mma with fp32 accumulation. One definition, so
// the flash kernel and the loop ladder that times it (ceilings.cu) issue the same instructions.
#pragma once

#include <cstdint>

namespace kdtree {

// ldmatrix takes 32-bit shared-window addresses: cheaper in registers than generic pointers.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], unsigned a) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
// D += A(16x16, row) * B(16x8, col), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// D += A(16x8, row) * B(8x8, col), bf16 in, fp32 accumulate: the half-depth form, for 8-token P.V steps.
__device__ __forceinline__ void mma_bf16_k8(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(b));
}

// The running max of the two rows of a 16 x 8NT score tile held in mma accumulator layout (c0 c1 in row gid,
// c2 c3 in row gid + 8 of each n-tile): a row's scores sit in the 4 threads of a quad, so 2 shuffles.
template <int NT>
__device__ __forceinline__ void quad_row_max(const float (&acc)[NT][4], float& mx_lo, float& mx_hi) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    mx_lo = fmaxf(mx_lo, fmaxf(acc[nt][0], acc[nt][1]));
    mx_hi = fmaxf(mx_hi, fmaxf(acc[nt][2], acc[nt][3]));
  }
#pragma unroll
  for (int off = 1; off <= 2; off *= 2) {
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, off));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, off));
  }
}

}  // namespace kdtree
