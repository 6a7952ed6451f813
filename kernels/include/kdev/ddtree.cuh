// The DDTree kernels' launchers (tree build, greedy accept, KV compaction); their params structs are in kdtree.h.
// node_count[b] is 1 + budget whenever the drafter's paths allow it, which is when the verify layout is
// q_indptr[b] = b * t_stride.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kdev/kdtree.h"

#ifdef __CUDACC__
namespace kdtree {
cudaError_t launch_build_ddtree(const DDTreeBuildParams& p, cudaStream_t stream);
cudaError_t launch_accept_greedy(const AcceptParams& p, cudaStream_t stream);
cudaError_t launch_compact_kv(const CompactParams& p, cudaStream_t stream);
size_t build_ddtree_smem_bytes(int budget, int depth, int topk);
}  // namespace kdtree
#endif
