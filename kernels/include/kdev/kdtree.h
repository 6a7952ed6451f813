/* libkdtree: the public C interface of the tree-verify kernels for absorbed MLA.
 *
 * The one statement of the contract a caller binds to: shape limits, the page rule, the flash tiling constants a
 * planner or a report needs, the status codes, the params structs and every exported function. kdev's Python side
 * reads the constants and the structs from this file (kdev/cabi.py) and a test compiles it to compare every field's
 * offset with the binding (tests/test_cabi.py); nothing here is restated by hand elsewhere. Plain C, so that a server
 * written in C, C++ or Rust includes it as it is; docs/architecture.md explains the contract.
 *
 * Layouts of a verify call (all device memory, row-major, contiguous):
 *   q           [total_q, num_heads, 576] bf16   absorbed queries: 512 latent, then 64 RoPE'd
 *   kv_cache    [num_pages, page_size, 576] bf16 rows of 512 latent (c_kv) then 64 RoPE'd k_pe; V = first 512
 *               (or fp8 e4m3 rows of 576 bytes, each value times kv_scale: KDTREE_KV_FP8_E4M3 below)
 *   page_table  [batch, max_pages] int32         logical page -> physical page
 *   prefix_lens [batch] int32                    tokens before the tree
 *   q_indptr    [batch + 1] int32                tree node ranges per request (T_b = q_indptr[b+1] - q_indptr[b])
 *   tree_mask   [total_q, mask_words] uint64     bit j of node i's row: node j is an ancestor-or-self of i
 *   out         [total_q, num_heads, 512] bf16   attention output in latent space
 *   lse         [total_q, num_heads] fp32        natural-log sum of exp(scale * score)
 * The tree's own K/V rows sit at logical positions prefix_lens[b] + i. Node i attends to every prefix position and to
 * tree position j iff bit j of its mask row is set. Logical position pos of request b lives in pool row (slot)
 *   page_table[b][pos / page_size] * page_size + pos % page_size
 * (KDTREE_KV_SLOT below; kernels use the shift form, the same number for the page sizes the page rule allows).
 */
#ifndef KDEV_KDTREE_H
#define KDEV_KDTREE_H

#include <stddef.h>
#include <stdint.h>

/* ------------------------------------------------------------------------------------------- the contract */
/* The version of this interface (kdtree_abi_version returns it). A library is bound only with the header it was built
 * from: `kdev build` keeps this file beside the library, and the sha256 of its bytes is in kdtree_build_info's
 * "sources". History: 2 plan_sm_count; 3 the narrow row tiles' own split count; 4 the device schedule; 5 the page size
 * to the plan functions; 6 wgmma_built to kdtree_flash_launch_plan; 7 kdtree_poison_shared_memory; 8 this constant,
 * and the header kept beside the library; 9 the KV cache's dtypes (KDTREE_KV_*) and CompactParams.kv_dtype. */
#define KDTREE_ABI_VERSION 9
#define KDTREE_LATENT_DIM 512   /* c_kv: the value row, and the first part of a query / key row */
#define KDTREE_ROPE_DIM 64      /* k_pe / q_pe: the rest of a query / key row */
#define KDTREE_QK_DIM 576       /* KDTREE_LATENT_DIM + KDTREE_ROPE_DIM */
#define KDTREE_V_DIM 512        /* KDTREE_LATENT_DIM */
#define KDTREE_MAX_QLEN 1025    /* rows per request: 1 root + a budget of 1024 nodes */
#define KDTREE_MAX_HEADS 128    /* query heads sharing the one latent KV head */
#define KDTREE_MAX_PREFIX 262144 /* tokens before a tree (the golden vectors' bound and the plan's) */
#define KDTREE_MAX_DEPTH 15     /* drafter depths of a DDTree (block size 16) */
#define KDTREE_MAX_TOPK 1024    /* log-probs per depth */

/* The page rule: a page holds a power of two of tokens, 1 to KDTREE_MAX_PAGE_SIZE. Every entry point that takes a
 * paged cache checks it (KDTREE_PAGE_SIZE_OK) and refuses with KDTREE_PAGE_SIZE_RULE's words. */
#define KDTREE_MAX_PAGE_SIZE 4096
#define KDTREE_PAGE_SIZE_OK(n) ((n) >= 1 && (n) <= KDTREE_MAX_PAGE_SIZE && ((n) & ((n) - 1)) == 0)
#define KDTREE_PAGE_SIZE_RULE "is not a power of two in 1..4096"
#define KDTREE_KV_SLOT(page_row, pos, page_size) \
  ((size_t)(page_row)[(pos) / (page_size)] * (size_t)(page_size) + (size_t)((pos) % (page_size)))

/* The KV cache's element type (CompactParams.kv_dtype; ABI 9). bf16 is 0, so a struct whose new field is left at
 * zero is the bf16 call it was before. An e4m3 cache holds float8 e4m3fn values (SGLang's fp8_e4m3 pool: k / k_scale
 * stored), and a row's value is the stored value times one scale for the whole row: for MLA V is the first 512 columns
 * of K, so scores and P.V take the same one. Every row is read from the pool, the tree's own too (a caller writes the
 * tree's rows into the pool first). Output and LSE stay bf16 / fp32. No other 8-bit or narrower format is taken: e5m2,
 * mxfp8 and fp4 caches are refused. VerifyAttnParams gains kv_dtype and kv_scale with the first verify kernel that
 * reads an e4m3 cache: two fields more in the flash kernels' by-value argument made the lockstep kernel spill
 * (verify_attn_flash_kernel<true>: 12 B on sm_120, 8 B on sm_90), so they come with the kernels whose register budget
 * takes them. Until then the compaction answers KDTREE_ERR_UNSUPPORTED for an e4m3 cache, never a result. */
#define KDTREE_KV_BF16 0                /* bf16 rows: 576 x 2 bytes; kv_scale 0 (unused) or 1 */
#define KDTREE_KV_FP8_E4M3 1            /* float8 e4m3fn rows: 576 x 1 byte; kv_scale finite and > 0 */
#define KDTREE_KV_DTYPE_RULE "is not a KV dtype kdtree takes: bf16 (0) or e4m3 (1); e5m2, mxfp8 and fp4 are refused"

/* The flash call's tiling (kernels/include/kdev/flash_plan.cuh takes it from here). */
#define KDTREE_FLASH_BLOCK_M 64       /* rows (node x head) per CTA of the full-tile kernels */
#define KDTREE_FLASH_BLOCK_N 32       /* KV tokens per tile */
#define KDTREE_FLASH_NARROW_ROWS 16   /* a request's last row tile of at most this many rows runs in the narrow kernel */
#define KDTREE_FLASH_MAX_SPLITS 128   /* KV splits the combine kernel can merge */
#define KDTREE_FLASH_THREADS 256      /* threads per flash CTA (8 warps) */
#define KDTREE_FLASH_TENSOR_COPY_MIN_PAGE KDTREE_FLASH_BLOCK_N /* pages of >= this many tokens: a tile is one copy */

/* ------------------------------------------------------------------------------------------- status codes */
/* Every int-returning entry point returns one of these and leaves a message for kdtree_last_error(). */
#define KDTREE_OK 0               /* ok */
#define KDTREE_ERR_INVALID 1      /* invalid argument: nothing was launched */
#define KDTREE_ERR_CUDA 2         /* CUDA error: a CUDA call or launch failed */
#define KDTREE_ERR_WORKSPACE 3    /* workspace missing or too small: nothing was launched */
#define KDTREE_ERR_UNSUPPORTED 4  /* not on this GPU: its shared memory per block or its arch cannot run it */
/* KDTREE_ERR_UNSUPPORTED also answers a KV dtype that no kernel of this library reads (e4m3, until its kernels). */

/* A CUDA stream, as the runtime's cudaStream_t (the same type) without including the CUDA headers. */
typedef struct CUstream_st* kdtree_stream_t;

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------- params structs */
/* Every struct starts with struct_size = sizeof(the struct) as the caller sees it: a stale binding is refused. */

typedef struct VerifyAttnParams {
  uint32_t struct_size;
  int32_t batch;
  int32_t total_q;       /* N_q = q_indptr[batch] */
  int32_t num_heads;
  int32_t max_qlen;      /* >= every T_b (host-side bound: sizes the grid) */
  int32_t mask_words;    /* W >= ceil(max_qlen / 64) */
  int32_t num_pages;
  int32_t page_size;     /* the page rule */
  int32_t max_pages;     /* page_table row stride */
  int32_t max_kv_len;    /* >= every prefix_lens[b] + T_b (host-side bound: plans the KV split) */
  float scale;           /* softmax scale (YaRN-adjusted) */
  int32_t plan_sm_count; /* 0: plan the flash launch for this GPU's SMs; > 0: as for a GPU of that many (ABI 2) */
  const void* q;
  const void* kv_cache;
  const int32_t* page_table;
  const int32_t* prefix_lens;
  const int32_t* q_indptr;
  const uint64_t* tree_mask;
  void* out;
  float* lse;
  void* workspace;       /* flash calls: kdtree_verify_attn_workspace_size bytes (ABI 4: the schedule and partials) */
  size_t workspace_bytes;
} VerifyAttnParams;

/* The DDTree kernels use a padded per-request layout of stride t_stride = 1 + budget rows: request b's node i lives at
 * row b * t_stride + i, and node_count[b] says how many rows are real. */
typedef struct DDTreeBuildParams {
  uint32_t struct_size;
  int32_t batch;
  int32_t depth;               /* D: drafter depths 1..D (0: the root alone) */
  int32_t topk;                /* K: log-probs per depth (descending) */
  int32_t budget;              /* N: nodes besides the root */
  int32_t mask_words;          /* W >= ceil((1 + budget) / 64) */
  const float* log_probs;      /* [batch, depth, topk] */
  const int32_t* token_ids;    /* [batch, depth, topk] */
  const int32_t* root_tokens;  /* [batch] */
  const int32_t* prefix_lens;  /* [batch] */
  int32_t* node_tokens;        /* [batch, 1 + budget] */
  int32_t* parents;            /* [batch, 1 + budget]  (-1 for the root and for padding rows) */
  int32_t* depths;             /* [batch, 1 + budget] */
  int32_t* positions;          /* [batch, 1 + budget]  prefix_len + depth */
  uint64_t* tree_mask;         /* [batch, 1 + budget, mask_words] */
  int32_t* node_count;         /* [batch] */
} DDTreeBuildParams;

typedef struct AcceptParams {
  uint32_t struct_size;
  int32_t batch;
  int32_t t_stride;              /* rows per request in the padded layout */
  const int32_t* node_tokens;    /* [batch, t_stride] */
  const int32_t* parents;        /* [batch, t_stride] */
  const int32_t* node_count;     /* [batch] */
  const int32_t* target_argmax;  /* [batch, t_stride]: the target's argmax token at every node */
  int32_t* accepted;             /* [batch, t_stride]: accepted node indices, root first; -1 after the end */
  int32_t* accept_len;           /* [batch] */
  int32_t* bonus_token;          /* [batch] */
} AcceptParams;

typedef struct CompactParams {
  uint32_t struct_size;
  int32_t batch;
  int32_t t_stride;
  int32_t page_size;             /* the page rule */
  int32_t max_pages;
  int32_t num_pages;
  void* kv_cache;                /* [num_pages, page_size, 576] of kv_dtype, updated in place */
  const int32_t* page_table;     /* [batch, max_pages] */
  const int32_t* prefix_lens;    /* [batch] */
  const int32_t* accepted;       /* [batch, t_stride] */
  const int32_t* accept_len;     /* [batch] */
  int32_t kv_dtype;              /* KDTREE_KV_BF16 or KDTREE_KV_FP8_E4M3: a row of 1152 or 576 bytes (ABI 9) */
} CompactParams;

/* ------------------------------------------------------------------------------------------- entry points */
/* Library facts. */
int kdtree_abi_version(void);            /* KDTREE_ABI_VERSION */
size_t kdtree_params_size(void);         /* sizeof(VerifyAttnParams) */
int kdtree_max_qlen(void);               /* KDTREE_MAX_QLEN */
const char* kdtree_last_error(void);     /* the calling thread's last message ("" after a success) */
const char* kdtree_build_info(void);     /* provenance JSON: git sha and dirty flag, source hash, nvcc, archs, flags */
/* Every SM's shared memory filled with NaN (0xFF bytes) on `stream` (ABI 7), before a verify launch: a kernel that
 * reads shared memory it never wrote then gives NaN, not what the kernel before it left there. */
int kdtree_poison_shared_memory(kdtree_stream_t stream);

/* Tree-verify attention. Nothing allocates or synchronises: every call can be captured in a CUDA graph. */
int kdtree_verify_attn(const VerifyAttnParams* p, kdtree_stream_t stream);           /* the naive oracle */
/* The flash call (tensor cores, split-KV): in a library built for sm_90a, on an sm_90 GPU, its full row tiles by
 * wgmma where pages hold >= 32 tokens (the Hopper product); elsewhere by mma.sync. */
int kdtree_verify_attn_flash(const VerifyAttnParams* p, kdtree_stream_t stream);
int kdtree_verify_attn_flash_portable(const VerifyAttnParams* p, kdtree_stream_t stream); /* sm_120's kernels */
/* The flash call with its full row tiles by wgmma (pages of >= 32 tokens; smaller ones take the cp.async kernels, as
 * the flash call does), or KDTREE_ERR_UNSUPPORTED where the loaded code has no wgmma kernel (not a library built for
 * sm_90a on an sm_90 GPU): a run that must time or verify the wgmma kernel. */
int kdtree_verify_attn_flash_wgmma(const VerifyAttnParams* p, kdtree_stream_t stream);
/* The device schedule (ABI 4): split counts from each request's own lengths, made on the GPU into the workspace; then any
 * number of scheduled calls with the same lengths (every layer of a decoding step) read it; make it again whenever
 * prefix_lens or q_indptr change (a schedule for other lengths is not detected). A scheduled call on a workspace the
 * schedule was not made in for these shapes writes nothing. A plain call runs the host plan, from the bounds
 * (max_kv_len, max_qlen) and the page size. The schedule and the workspace size read only the shapes, page_size,
 * plan_sm_count and (the schedule) prefix_lens, q_indptr and the workspace: the other pointers may be NULL there, so an
 * engine makes the schedule before any layer's queries exist. */
int kdtree_flash_schedule(const VerifyAttnParams* p, kdtree_stream_t stream);
int kdtree_verify_attn_flash_scheduled(const VerifyAttnParams* p, kdtree_stream_t stream);
int kdtree_verify_attn_flash_portable_scheduled(const VerifyAttnParams* p, kdtree_stream_t stream);
int kdtree_verify_attn_workspace_size(const VerifyAttnParams* p, size_t* bytes); /* covers every call above */
int kdtree_verify_attn_flash_splits(const VerifyAttnParams* p, int* num_splits);

/* The flash call's plan and launches, asked without a GPU. */
int kdtree_flash_launch_plan(int major, int smem_optin, int tensor_copy, int portable, int wgmma_built,
                             const char** full_kernel, int* full_smem, const char** narrow_kernel, int* narrow_smem);
int kdtree_flash_plan(int batch, int total_q, int num_heads, int max_qlen, int max_kv_len, int page_size,
                      int sm_count, int threads_per_sm, int* num_m_tiles, int* num_splits, int* narrow_splits,
                      int* combine_groups, size_t* workspace_bytes);
int kdtree_flash_split_cost(int batch, int total_q, int num_heads, int max_qlen, int max_kv_len, int page_size,
                            int sm_count, int splits, int narrow_splits, double* cost);
int kdtree_flash_launch_time(int full_ctas, double full_cta, int narrow_ctas, double narrow_cta,
                             double narrow_cold_cta, int sm_count, double* time);
int kdtree_flash_schedule_plan(int batch, int num_heads, int page_size, int sm_count, const int* prefix_lens,
                               const int* qlens, int max_qlen, int max_kv_len, int* k, int* splits, int* narrow_splits,
                               int* ctas, int* narrow_ctas, long long* model_tokens, int* at_bounds);

/* DDTree: tree build, greedy accept, KV compaction. */
int kdtree_build_ddtree(const DDTreeBuildParams* p, kdtree_stream_t stream);
int kdtree_accept_greedy(const AcceptParams* p, kdtree_stream_t stream);
int kdtree_compact_kv(const CompactParams* p, kdtree_stream_t stream);

/* Microbenchmarks (kdev bench --ceilings). Status codes as above; KDTREE_ERR_UNSUPPORTED: not on this GPU. */
int kdtree_bench_mma_peak(int blocks, int iters, float* sink, kdtree_stream_t stream);
int kdtree_bench_mma_chains(void);
int kdtree_bench_loop_count(void);
const char* kdtree_bench_loop_name(int i);
int kdtree_bench_loop_warps(int i);
int kdtree_bench_loop_mma_per_tile(int i);
int kdtree_bench_loop_tile_bytes(int i);
int kdtree_bench_loop(int i, int blocks, int tiles, const void* src, size_t src_bytes, float* sink,
                      kdtree_stream_t stream);
/* wgmma (kernels/wgmma.cu): its ceiling rung and a check of its operand layouts. KDTREE_ERR_UNSUPPORTED where the code
 * loaded for this GPU has no wgmma (a library built for sm_90a has it, on an sm_90 GPU). */
int kdtree_bench_wgmma_peak(int blocks, int iters, float* sink, kdtree_stream_t stream);
int kdtree_bench_wgmma_check(const void* q, const void* kv, float* s, float* o, kdtree_stream_t stream);

/* Exported only by a library built with a variant that adds it (never defined here, so never compiled in): the CTA
 * timeline probe of variants/flash-v24-probe-timeline.patch, read by scripts/cta_timeline.py. Copies up to max_records
 * records to `host` and sets *count to those written since the last read. */
#ifdef KDTREE_VARIANT_EXPORTS
int kdtree_cta_probe_read(unsigned long long* host, int max_records, int* count);
#endif

#ifdef __cplusplus
}
#endif

#endif /* KDEV_KDTREE_H */
