// Parameter structs of the DDTree kernels (tree build, greedy accept, KV compaction). Trees use a padded
// per-request layout of stride t_stride = 1 + budget rows: request b's node i lives at row b * t_stride + i,
// and node_count[b] says how many rows are real (1 + budget whenever the drafter's paths allow it, which is
// when the verify layout is q_indptr[b] = b * t_stride).
#pragma once

#include <cstddef>
#include <cstdint>

#define KDTREE_MAX_DEPTH 15  // block size 16
#define KDTREE_MAX_TOPK 1024

#ifdef __cplusplus
extern "C" {
#endif

typedef struct DDTreeBuildParams {
  uint32_t struct_size;
  int32_t batch;
  int32_t depth;          // D: drafter depths 1..D
  int32_t topk;           // K: log-probs per depth (descending)
  int32_t budget;         // N: nodes besides the root
  int32_t mask_words;     // W >= ceil((1 + budget) / 64)
  const float* log_probs;      // [batch, depth, topk]
  const int32_t* token_ids;    // [batch, depth, topk]
  const int32_t* root_tokens;  // [batch]
  const int32_t* prefix_lens;  // [batch]
  int32_t* node_tokens;   // [batch, 1 + budget]
  int32_t* parents;       // [batch, 1 + budget]  (-1 for the root and for padding rows)
  int32_t* depths;        // [batch, 1 + budget]
  int32_t* positions;     // [batch, 1 + budget]  prefix_len + depth
  uint64_t* tree_mask;    // [batch, 1 + budget, mask_words]
  int32_t* node_count;    // [batch]
} DDTreeBuildParams;

typedef struct AcceptParams {
  uint32_t struct_size;
  int32_t batch;
  int32_t t_stride;            // rows per request in the padded layout
  const int32_t* node_tokens;  // [batch, t_stride]
  const int32_t* parents;      // [batch, t_stride]
  const int32_t* node_count;   // [batch]
  const int32_t* target_argmax;  // [batch, t_stride]: the target's argmax token at every node
  int32_t* accepted;           // [batch, t_stride]: accepted node indices, root first; -1 after the end
  int32_t* accept_len;         // [batch]
  int32_t* bonus_token;        // [batch]
} AcceptParams;

typedef struct CompactParams {
  uint32_t struct_size;
  int32_t batch;
  int32_t t_stride;
  int32_t page_size;
  int32_t max_pages;
  int32_t num_pages;
  void* kv_cache;               // [num_pages, page_size, 576] bf16, updated in place
  const int32_t* page_table;    // [batch, max_pages]
  const int32_t* prefix_lens;   // [batch]
  const int32_t* accepted;      // [batch, t_stride]
  const int32_t* accept_len;    // [batch]
} CompactParams;

#ifdef __cplusplus
}
#endif

#ifdef __CUDACC__
namespace kdtree {
cudaError_t launch_build_ddtree(const DDTreeBuildParams& p, cudaStream_t stream);
cudaError_t launch_accept_greedy(const AcceptParams& p, cudaStream_t stream);
cudaError_t launch_compact_kv(const CompactParams& p, cudaStream_t stream);
size_t build_ddtree_smem_bytes(int budget, int depth, int topk);
}  // namespace kdtree
#endif
