// A request's KV pages as the kernels address them: the one device form of kdtree.h's slot rule
//   slot(pos) = page_table[b][pos / page_size] * page_size + pos % page_size,
// written with a shift and a mask, which give the same number for every page size the page rule allows (powers of
// two, checked in capi.cu before any launch) and cost no division.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kdtree {

struct KvPages {
  const int32_t* row;  // request b's page-table row
  int shift, mask;     // log2(page_size), page_size - 1
};

__device__ __forceinline__ KvPages kv_pages(const int32_t* page_table, int max_pages, int b, int page_size) {
  return {page_table + (size_t)b * max_pages, __ffs(page_size) - 1, page_size - 1};
}

// The pool row of logical position `pos`, computed in Slot (int where the caller knows it fits, size_t otherwise).
template <class Slot>
__device__ __forceinline__ Slot kv_slot(const KvPages& pages, int pos) {
  return ((Slot)pages.row[pos >> pages.shift] << pages.shift) + (pos & pages.mask);
}

}  // namespace kdtree
