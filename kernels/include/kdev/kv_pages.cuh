// A request's KV pages as the kernels address them: the one device statement of kdtree.h's slot rule
//   slot(pos) = page_table[b][pos / page_size] * page_size + pos % page_size.
// Two ways to hold the page size, one formula: the flash kernels keep a shift and a mask (the same numbers for the
// powers of two the page rule allows, checked in capi.cu before any launch, and no division per row), the naive oracle
// and the compaction kernel keep the size itself, as the rule reads.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kdtree {

// page_size as a power of two: page = pos >> shift, offset = pos & mask, page * size = page << shift
struct KvPages {
  const int32_t* row;  // request b's page-table row
  int shift, mask;     // log2(page_size), page_size - 1
  __device__ __forceinline__ int page(int pos) const { return pos >> shift; }
  __device__ __forceinline__ int offset(int pos) const { return pos & mask; }
  template <class Slot>
  __device__ __forceinline__ Slot first_slot(int page_index) const { return (Slot)row[page_index] << shift; }
};

// page_size as it is given
struct KvPagesBySize {
  const int32_t* row;
  int size;
  __device__ __forceinline__ int page(int pos) const { return pos / size; }
  __device__ __forceinline__ int offset(int pos) const { return pos % size; }
  template <class Slot>
  __device__ __forceinline__ Slot first_slot(int page_index) const { return (Slot)row[page_index] * size; }
};

__device__ __forceinline__ KvPages kv_pages(const int32_t* page_table, int max_pages, int b, int page_size) {
  return {page_table + (size_t)b * max_pages, __ffs(page_size) - 1, page_size - 1};
}

__device__ __forceinline__ KvPagesBySize kv_pages_by_size(const int32_t* page_table, int max_pages, int b,
                                                          int page_size) {
  return {page_table + (size_t)b * max_pages, page_size};
}

// The pool row of logical position `pos`, computed in Slot (int where the caller knows it fits, size_t otherwise).
template <class Slot, class Pages>
__device__ __forceinline__ Slot kv_slot(const Pages& pages, int pos) {
  return pages.template first_slot<Slot>(pages.page(pos)) + pages.offset(pos);
}

}  // namespace kdtree
