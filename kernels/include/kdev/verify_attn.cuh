// VerifyAttnParams: the one argument struct every tree-verify attention kernel takes (naive and flash),
// and the C ABI's view of a call. Layouts follow the kernel contract:
//   q           [total_q, num_heads, 576] bf16   absorbed queries: 512 latent, then 64 RoPE'd
//   kv_cache    [num_pages, page_size, 576] bf16 rows of 512 latent (c_kv) then 64 RoPE'd k_pe; V = first 512
//   page_table  [batch, max_pages] int32         logical page -> physical page
//   prefix_lens [batch] int32                    tokens before the tree
//   q_indptr    [batch + 1] int32                tree node ranges per request (T_b = q_indptr[b+1] - q_indptr[b])
//   tree_mask   [total_q, mask_words] uint64     bit j of node i's row: node j is an ancestor-or-self of i
//   out         [total_q, num_heads, 512] bf16   attention output in latent space
//   lse         [total_q, num_heads] fp32        natural-log sum of exp(scale * score)
// The tree's own K/V rows sit at logical positions prefix_lens[b] + i. Node i attends to every prefix
// position and to tree position j iff bit j of its mask row is set.
#pragma once

#include <cstddef>
#include <cstdint>

#define KDTREE_QK_DIM 576
#define KDTREE_V_DIM 512
#define KDTREE_MAX_QLEN 1025  // 1 root + a budget of 1024 nodes
#define KDTREE_MAX_HEADS 128

#ifdef __cplusplus
extern "C" {
#endif

typedef struct VerifyAttnParams {
  uint32_t struct_size;  // sizeof(VerifyAttnParams) as the caller sees it: catches a stale binding
  int32_t batch;
  int32_t total_q;       // N_q = q_indptr[batch]
  int32_t num_heads;
  int32_t max_qlen;      // >= every T_b (host-side bound: sizes the grid)
  int32_t mask_words;    // W >= ceil(max_qlen / 64)
  int32_t num_pages;
  int32_t page_size;
  int32_t max_pages;     // page_table row stride
  int32_t max_kv_len;    // >= every prefix_lens[b] + T_b (host-side bound: plans the KV split)
  float scale;           // softmax scale (YaRN-adjusted)
  int32_t plan_sm_count;  // 0: plan the flash launch for this GPU's SMs; > 0: as for a GPU of that many (ABI 2)
  const void* q;
  const void* kv_cache;
  const int32_t* page_table;
  const int32_t* prefix_lens;
  const int32_t* q_indptr;
  const uint64_t* tree_mask;
  void* out;
  float* lse;
  void* workspace;          // flash split-KV partials; NULL when the planned split count is 1
  size_t workspace_bytes;
} VerifyAttnParams;

#ifdef __cplusplus
}
#endif

// Status codes returned by every entry point.
#define KDTREE_OK 0
#define KDTREE_ERR_INVALID 1      // bad argument: nothing was launched
#define KDTREE_ERR_CUDA 2         // a CUDA call or launch failed
#define KDTREE_ERR_WORKSPACE 3    // workspace missing or too small: nothing was launched

#ifdef __CUDACC__
namespace kdtree {
// Internal launchers (capi.cu validates before calling them).
cudaError_t launch_verify_attn_naive(const VerifyAttnParams& p, cudaStream_t stream);
struct FlashPlan {
  int num_m_tiles;    // ceil(max_qlen * num_heads / 64)
  int num_splits;     // KV splits per (request, full row tile)
  int narrow_splits;  // KV splits of a request's narrow last row tile (<= 16 rows); 0: no narrow kernel
  size_t workspace_bytes;
};
// The flash call's plan for a launch's shape bounds (VerifyAttnParams' batch, total_q, num_heads, max_qlen, max_kv_len)
// on a GPU of sm_count SMs: plain host arithmetic, so that kdtree_flash_plan reports it without a GPU.
FlashPlan plan_verify_attn_flash(int batch, int total_q, int num_heads, int max_qlen, int max_kv_len, int sm_count);
// How many groups of splits the combine kernel gives each row (1, 2 or 4; 0: no combine kernel) for a call of `batch`
// requests and `rows` rows in all, on a GPU of sms x threads_per_sm threads.
int flash_combine_groups(const FlashPlan& plan, long batch, long rows, int sms, int threads_per_sm);
// Which kernels a flash call launches and the dynamic shared memory per block they take, on a GPU of compute
// capability `major` whose blocks may hold `smem_optin` bytes: full tiles by tensor copy (sm_90+, pages of >= 32
// tokens) or by cp.async, the flash or the portable call. The launcher decides by it; kdtree_flash_launch_plan reports
// it.
struct FlashKernels {
  bool teams;          // the teams kernels (a four-deep ring: sm_90 to sm_11x), else the lockstep ones
  const char* full;    // the full-tile kernel, as `kdev build` names kernels
  int full_smem;       // its dynamic shared memory per block
  const char* narrow;  // the narrow kernel (a request's last row tile of <= 16 rows)
  int narrow_smem;
};
FlashKernels flash_kernels(int major, int smem_optin, bool tensor_copy, bool portable);
// portable: only the kernels that fit 101,376 B of shared memory per block (sm_120's), on any GPU.
cudaError_t launch_verify_attn_flash(const VerifyAttnParams& p, const FlashPlan& plan, bool portable,
                                     cudaStream_t stream);
}  // namespace kdtree
#endif
