// wgmma (sm_90a's warpgroup matrix multiply) from shared memory in the 128-byte swizzle, the primitives the Hopper
// verify kernel is built from (docs/kernels.md) and the ceilings rung that prices them (kernels/ceilings.cu).
//
// A warpgroup (4 consecutive warps, 128 threads) issues one wgmma.mma_async for a 64-row tile: D[64 x N] (+)=
// A[64 x 16] B[16 x N], bf16 operands, fp32 accumulators in registers (N / 2 per thread, the mma.sync m16n8 layout per
// warp: warp w of the group holds rows 16 w + lane / 4 and + 8, columns 8 i + 2 (lane % 4) + {0, 1} in registers
// 4 i .. 4 i + 3).
// B, and A unless it comes from registers, are read from shared memory through a descriptor. Every operand here is laid
// out as TMA's SWIZZLE_128B writes a box whose rows are 128 bytes (64 bf16): rows 128 B apart, 16-byte chunk c of row r
// at chunk c ^ (r % 8), 8-row atoms of 1,024 B on 1,024-byte boundaries. So a [rows x 576] bf16 tile (Q, or a KV tile)
// is 9 such boxes of 64 columns, one after the other.
// - K-major (the reduced dimension contiguous: Q and K for S = Q K^T): a k16 step is 32 bytes into every row of its
//   box, the next 8 rows 1,024 B on (SBO); the leading offset is not used.
// - MN-major (the output columns contiguous: V = the KV tile read as [tokens][latent] for O += P V): the next 64 output
//   columns are the next box (LBO = the box's bytes), the next 8 tokens 1,024 B on (SBO); a k16 step is 16 rows on.
// P comes from registers (the S accumulators packed to bf16 are the A fragments of P V, in place).
#pragma once

#include <cstdint>

// wgmma is an sm_90a feature (in no other target, sm_90 included): only a library built for sm_90a has it.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KDTREE_HAS_WGMMA 1
#else
#define KDTREE_HAS_WGMMA 0
#endif

namespace kdtree {
namespace wgmma {

constexpr int kSwizzleRowBytes = 128;      // a box row: 64 bf16
constexpr int kSwizzleAtomBytes = 1024;    // 8 rows
constexpr int kSwizzleColumns = 64;        // bf16 columns per box

// Where element (row, col) of a box-tiled [rows x cols] bf16 tile lies, in bytes from the tile's start (boxes of
// `rows` x 64 columns, one after the other): the layout TMA writes and the descriptors below read.
__host__ __device__ __forceinline__ uint32_t swizzled_offset(int rows, int row, int col) {
  const int box = col / kSwizzleColumns, chunk = (col % kSwizzleColumns) / 8;
  return (uint32_t)(box * rows * kSwizzleRowBytes + row * kSwizzleRowBytes + ((chunk ^ (row % 8)) * 16) +
                    (col % 8) * 2);
}

// The descriptor of a 128-byte-swizzled operand at shared address `addr` (1,024-byte aligned atoms: base offset 0).
__device__ __forceinline__ uint64_t descriptor(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo_bytes >> 4) & 0x3FFF) << 16) |
         ((uint64_t)((sbo_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}
// K-major: k16 step `k` of a box-tiled tile of `rows` rows starting at `tile`.
__device__ __forceinline__ uint64_t k_major(uint32_t tile, int rows, int k) {
  return descriptor(tile + (k / 4) * rows * kSwizzleRowBytes + (k % 4) * 32, 16, kSwizzleAtomBytes);
}
// MN-major: k16 step `k` (rows 16 k ..) of the output columns from box `box` of a box-tiled tile of `rows` rows.
__device__ __forceinline__ uint64_t mn_major(uint32_t tile, int rows, int box, int k) {
  return descriptor(tile + box * rows * kSwizzleRowBytes + k * 16 * kSwizzleRowBytes, rows * kSwizzleRowBytes,
                    kSwizzleAtomBytes);
}

#if KDTREE_HAS_WGMMA
// Order the warpgroup's register accesses before the wgmmas that read or write them (needed before the first wgmma
// and after registers they use were written by other instructions).
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most N committed groups are pending: their accumulators may be read after it.
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared memory written by threads (the generic proxy) is read by wgmma through the async proxy: this fence, then a
// barrier, before the wgmma.
__device__ __forceinline__ void fence_shared_for_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving reads or writes of accumulator registers across a wgmma that is in flight.
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64 x 64] (+)= A[64 x 16] B[16 x 64], both K-major in shared memory. accumulate 0: D = A B.
__device__ __forceinline__ void mma_64x64_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,"
      "%29,%30,%31}, "
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D[64 x 32] (+)= A[64 x 16] B[16 x 32], both K-major in shared memory.
__device__ __forceinline__ void mma_64x32_ss(float (&d)[16], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
      "%16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// The 128 fp32 accumulators of an m64n256 wgmma: the register list ({%0 .. %127}) and its "+f" operands, the same in
// every 64x256 form (shared memory A, register A).
#define KDTREE_WGMMA_D128 \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28," \
    "%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55," \
    "%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82," \
    "%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107," \
    "%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}"
#define KDTREE_WGMMA_D128_OPERANDS(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
  "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), \
  "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
  "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), \
  "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), \
  "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
  "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), \
  "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), \
  "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), \
  "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), \
  "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), \
  "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), \
  "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), \
  "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), \
  "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), \
  "+f"(d[126]), "+f"(d[127])

// D[64 x 256] (+)= A[64 x 16] B[16 x 256] from shared memory: A K-major, B K-major (kMnMajorB 0) or MN-major (1).
template <int kMnMajorB>
__device__ __forceinline__ void mma_64x256_ss(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      KDTREE_WGMMA_D128 ", "
      "%128, %129, p, 1, 1, 0, %131;\n}\n"
      : KDTREE_WGMMA_D128_OPERANDS(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(kMnMajorB));
}

// D[64 x 256] (+)= A[64 x 16] B[16 x 256]: A from registers (the m16n8k16 A fragments of the warp's 16 rows, bf16
// pairs), B MN-major in shared memory.
__device__ __forceinline__ void mma_64x256_rs_mn(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b,
                                                 int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      KDTREE_WGMMA_D128 ", "
      "{%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
      : KDTREE_WGMMA_D128_OPERANDS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
}
#endif  // KDTREE_HAS_WGMMA

}  // namespace wgmma
}  // namespace kdtree
