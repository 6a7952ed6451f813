// Host side of the tensor-copy (TMA) path: KV rows of 576 bf16, 1,152 B apart, described as a 2-D tensor that
// the copy engine reads in boxes of `box_rows` rows x 64 dims (128 B), or as a 3-D one read a whole tile (9 such
// boxes) per copy, with the 128-byte swizzle. Shared by the flash kernel and the loop ladder (ceilings.cu), so that
// the rung times the same copies the kernel issues.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only: the encoder is fetched through the runtime
#include <cuda_runtime.h>

#include <cstdint>

namespace kdtree {

constexpr unsigned kKvRowDims = 576;       // one KV row: 512 latent + 64 RoPE
constexpr unsigned kKvBoxDims = 64;        // one box row is 128 B, the swizzle's span

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
// The driver's cuTensorMapEncodeTiled, fetched once through the runtime (null where the driver has none).
inline EncodeTiled tensor_map_encoder() {
  static const EncodeTiled encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    return cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) ==
                       cudaSuccess &&
                   found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<EncodeTiled>(fn)
               : nullptr;
  }();
  return encode;
}

// Encodes a bf16 tensor of `rank` dims at `base` into `map`, read in `box` boxes with the 128-byte swizzle. False when
// the driver has no encoder or refuses the tensor (e.g. `base` not 16-byte aligned). The encoder is a driver function,
// fetched once through the runtime, so that the library links no more than cudart. The map is a plain 128-byte value:
// pass it as a __grid_constant__ kernel parameter or copy it to a __constant__ symbol.
inline bool encode_swizzled_bf16(const void* base, cuuint32_t rank, const cuuint64_t* dims, const cuuint64_t* strides,
                                 const cuuint32_t* box, CUtensorMap* map) {
  const EncodeTiled encode = tensor_map_encoder();
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  return encode != nullptr &&
         encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// `rows` KV rows at `base` as a 2-D tensor, read in boxes of `box_rows` rows x 64 dims.
inline bool encode_kv_tensor_map(const void* base, uint64_t rows, uint32_t box_rows, CUtensorMap* map) {
  const cuuint64_t dims[2] = {kKvRowDims, rows}, strides[1] = {kKvRowDims * 2};
  const cuuint32_t box[2] = {kKvBoxDims, box_rows};
  return encode_swizzled_bf16(base, 2, dims, strides, box, map);
}

// A whole tile in one tensor copy: the same rows as a 3-D tensor (64 dims, `rows` rows 1,152 B apart, 9 boxes 128 B
// apart) read in boxes of 64 x `box_rows` x 9, which land box-major ([box][row][64 dims]: the 2-D boxes' layout) with
// the same 128-byte swizzle. One copy instruction per tile instead of nine.
inline bool encode_kv_tile_tensor_map(const void* base, uint64_t rows, uint32_t box_rows, CUtensorMap* map) {
  const cuuint64_t dims[3] = {kKvBoxDims, rows, kKvRowDims / kKvBoxDims}, strides[2] = {kKvRowDims * 2, kKvBoxDims * 2};
  const cuuint32_t box[3] = {kKvBoxDims, box_rows, kKvRowDims / kKvBoxDims};
  return encode_swizzled_bf16(base, 3, dims, strides, box, map);
}

// Device side: the whole tile of KV rows `row`.. (the map's box) into shared memory at `dst`, as one tensor copy whose
// bytes complete on the mbarrier at `bar` (sm_90+; `dst` on the swizzle's 1,024-byte period).
__device__ __forceinline__ void kv_tile_copy(unsigned dst, const CUtensorMap* map, int row, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %2}], [%4];\n" ::
          "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(0), "r"(row), "r"(bar)
      : "memory");
}

// Device side: box (`dim0` / 64) of KV rows `row`.. (the map's box height) into shared memory at `dst`, as one
// tensor copy whose bytes complete on the mbarrier at `bar` (sm_90+; `dst` on the swizzle's 1,024-byte period).
__device__ __forceinline__ void kv_box_copy(unsigned dst, const CUtensorMap* map, int dim0, int row, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(dim0), "r"(row), "r"(bar)
      : "memory");
}

}  // namespace kdtree
