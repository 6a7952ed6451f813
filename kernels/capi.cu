// The C ABI: the only seam between Python (ctypes) and the kernels.
//
// Every entry point returns an int status (KDTREE_OK, or KDTREE_ERR_* from kdtree.h) and leaves a
// message for kdtree_last_error() (per calling thread). All arguments are validated before any launch:
// a call with bad arguments launches nothing. No entry point allocates or synchronises with the host, so
// every call can be captured in a CUDA graph; split-KV scratch space comes from the caller.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <utility>

#include "kdev/ddtree.cuh"
#include "kdev/flash_plan.cuh"
#include "kdev/kdtree.h"
#include "kdev/verify_attn.cuh"

namespace {

thread_local char g_last_error[512] = "";

int fail(int status, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_last_error, sizeof(g_last_error), fmt, ap);
  va_end(ap);
  return status;
}

int cuda_fail(cudaError_t err, const char* what) {
  return fail(KDTREE_ERR_CUDA, "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
}

bool aligned(const void* ptr, size_t bytes) { return (reinterpret_cast<uintptr_t>(ptr) % bytes) == 0; }

bool is_device_pointer(const void* ptr) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error this query may leave
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

// Every entry point's first check: a params struct, of the size this library was built with.
template <class Params>
int check_params_struct(const Params* p) {
  if (p == nullptr) return fail(KDTREE_ERR_INVALID, "params is NULL");
  if (p->struct_size != sizeof(Params))
    return fail(KDTREE_ERR_INVALID, "params.struct_size %u != %zu: the binding does not match this library",
                p->struct_size, sizeof(Params));
  return KDTREE_OK;
}

// The page rule (kdtree.h), for every entry point that takes a paged cache.
int check_page_size(int page_size) {
  if (!KDTREE_PAGE_SIZE_OK(page_size)) return fail(KDTREE_ERR_INVALID, "page_size %d " KDTREE_PAGE_SIZE_RULE, page_size);
  return KDTREE_OK;
}

// An e4m3 cache, validated, that no kernel of this library reads yet: refused, never run as if it were bf16.
int refuse_unread_kv_dtype(int32_t kv_dtype, const char* call) {
  if (kv_dtype == KDTREE_KV_FP8_E4M3)
    return fail(KDTREE_ERR_UNSUPPORTED, "%s: an e4m3 KV cache (kv_dtype %d) is in the contract (ABI 9) but no kernel "
                "of this library reads one yet", call, (int)kv_dtype);
  return KDTREE_OK;
}

// The shape bounds of a verify call, which the flash plan depends on (also checked alone by kdtree_flash_plan).
int validate_shape(int batch, int total_q, int num_heads, int max_qlen, int max_kv_len) {
  if (batch < 1) return fail(KDTREE_ERR_INVALID, "batch %d < 1", batch);
  if (num_heads < 1 || num_heads > KDTREE_MAX_HEADS)
    return fail(KDTREE_ERR_INVALID, "num_heads %d outside 1..%d", num_heads, KDTREE_MAX_HEADS);
  if (max_qlen < 1 || max_qlen > KDTREE_MAX_QLEN)
    return fail(KDTREE_ERR_INVALID, "max_qlen %d outside 1..%d", max_qlen, KDTREE_MAX_QLEN);
  // max_qlen is a bound (a graph's capture-time largest tree), so no request need reach it: total_q may be below it
  if (total_q < batch || (long long)total_q > (long long)batch * max_qlen)
    return fail(KDTREE_ERR_INVALID, "total_q %d inconsistent with batch %d and max_qlen %d", total_q, batch, max_qlen);
  if ((long long)total_q * num_heads > 0x7fffffffLL) return fail(KDTREE_ERR_INVALID, "total_q * num_heads too large");
  if (max_kv_len < max_qlen) return fail(KDTREE_ERR_INVALID, "max_kv_len %d < max_qlen %d", max_kv_len, max_qlen);
  return KDTREE_OK;
}

// What a plan reads of a verify call: its shapes, page size and plan_sm_count. The workspace size and the device
// schedule need no more (the schedule reads the lengths besides, checked by its entry point), so an engine sizes the
// workspace and makes the schedule once per decoding step, before any layer's queries or outputs exist.
int validate_plan_inputs(const VerifyAttnParams* p) {
  if (int st = check_params_struct(p)) return st;
  if (int st = validate_shape(p->batch, p->total_q, p->num_heads, p->max_qlen, p->max_kv_len)) return st;
  if (int st = check_page_size(p->page_size)) return st;
  if (p->plan_sm_count < 0) return fail(KDTREE_ERR_INVALID, "plan_sm_count %d < 0", p->plan_sm_count);
  return KDTREE_OK;
}

// Shared by every verify kernel: shapes, limits, pointers, alignment.
int validate(const VerifyAttnParams* p) {
  if (int st = check_params_struct(p)) return st;
  struct {
    const void* ptr;
    const char* name;
    size_t align;
  } ptrs[] = {{p->q, "q", 16},          {p->kv_cache, "kv_cache", 16}, {p->page_table, "page_table", 4},
              {p->prefix_lens, "prefix_lens", 4}, {p->q_indptr, "q_indptr", 4}, {p->tree_mask, "tree_mask", 8},
              {p->out, "out", 16},      {p->lse, "lse", 4}};
  for (const auto& a : ptrs) {
    if (a.ptr == nullptr) return fail(KDTREE_ERR_INVALID, "%s is NULL", a.name);
    if (!aligned(a.ptr, a.align)) return fail(KDTREE_ERR_INVALID, "%s is not %zu-byte aligned", a.name, a.align);
    if (!is_device_pointer(a.ptr)) return fail(KDTREE_ERR_INVALID, "%s is not device memory", a.name);
  }
  if (int st = validate_shape(p->batch, p->total_q, p->num_heads, p->max_qlen, p->max_kv_len)) return st;
  const int need_words = (p->max_qlen + 63) / 64;
  if (p->mask_words < need_words)
    return fail(KDTREE_ERR_INVALID, "mask_words %d < ceil(max_qlen / 64) = %d", p->mask_words, need_words);
  if (int st = check_page_size(p->page_size)) return st;
  if (p->num_pages < 1) return fail(KDTREE_ERR_INVALID, "num_pages %d < 1", p->num_pages);
  if (p->max_pages < 1 || (long long)p->max_pages * p->page_size < p->max_kv_len)
    return fail(KDTREE_ERR_INVALID, "max_pages %d x page_size %d cannot hold max_kv_len %d", p->max_pages,
                p->page_size, p->max_kv_len);
  if ((long long)p->num_pages * p->page_size < p->max_kv_len)
    return fail(KDTREE_ERR_INVALID, "num_pages %d x page_size %d cannot hold max_kv_len %d", p->num_pages,
                p->page_size, p->max_kv_len);
  if (!(p->scale > 0.f) || !std::isfinite(p->scale))
    return fail(KDTREE_ERR_INVALID, "scale %g must be finite and > 0", (double)p->scale);
  if (p->plan_sm_count < 0) return fail(KDTREE_ERR_INVALID, "plan_sm_count %d < 0", p->plan_sm_count);
  return KDTREE_OK;
}

int check_ptrs(std::initializer_list<std::pair<const void*, const char*>> ptrs, size_t align) {
  for (const auto& a : ptrs) {
    if (a.first == nullptr) return fail(KDTREE_ERR_INVALID, "%s is NULL", a.second);
    if (!aligned(a.first, align)) return fail(KDTREE_ERR_INVALID, "%s is not %zu-byte aligned", a.second, align);
    if (!is_device_pointer(a.first)) return fail(KDTREE_ERR_INVALID, "%s is not device memory", a.second);
  }
  return KDTREE_OK;
}

// The SM count the flash launch is planned for: params.plan_sm_count where set (another GPU's split plan and workspace,
// run and verified on this one), else this GPU's.
int plan_sm_count(const VerifyAttnParams* p, int* sm_count) {
  if (p->plan_sm_count > 0) {
    *sm_count = p->plan_sm_count;
    return KDTREE_OK;
  }
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return cuda_fail(err, "cudaGetDevice");
  err = cudaDeviceGetAttribute(sm_count, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return cuda_fail(err, "cudaDeviceGetAttribute");
  return KDTREE_OK;
}

// Every SM's shared memory filled with 0xFF bytes (NaN as bf16 and as fp32) by CTAs of the largest shared memory a
// block may take, twice as many as SMs so that each SM gets one. A verify launch after it that reads shared memory it
// never wrote (a KV buffer no copy filled) gets NaN, where it would otherwise get what the kernel before left there:
// often finite, and then the read passes by luck. The stores are asm volatile: a compiler may drop stores nothing
// reads.
__global__ void __launch_bounds__(1024) poison_shared_memory_kernel(int chunks) {
  extern __shared__ uint4 smem_to_poison[];
  const unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(smem_to_poison));
  for (int i = threadIdx.x; i < chunks; i += blockDim.x)
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(base + 16 * i), "r"(0xFFFFFFFFu) : "memory");
}

kdtree::FlashPlan flash_plan(const VerifyAttnParams* p, int sm_count) {
  return kdtree::plan_verify_attn_flash(p->batch, p->total_q, p->num_heads, p->max_qlen, p->max_kv_len, p->page_size,
                                        sm_count);
}

}  // namespace

extern "C" {

// 2: VerifyAttnParams.plan_sm_count (the field that was `reserved` in 1, which ignored it).
// 3: kdtree_flash_plan and kdtree_flash_split_cost speak of the narrow tiles' own split count (in 2: how many of the
// full tiles' splits one narrow CTA covered), and the workspace holds the narrow tiles' partials apart.
// 4: the device schedule (kdtree_flash_schedule and the scheduled calls); the workspace holds it beside the partials
// (kernels/include/kdev/flash_plan.cuh), and kdtree_verify_attn_workspace_size covers it.
// 5: the plan prices a narrow tile by how the tiles are copied, so kdtree_flash_plan, kdtree_flash_split_cost and
// kdtree_flash_schedule_plan take the page size; kdtree_flash_schedule_plan takes the call's bounds too.
// 6: kdtree_flash_launch_plan takes wgmma_built (whether the code holds the wgmma kernel).
// 7: kdtree_poison_shared_memory.
// 8: KDTREE_ABI_VERSION in the header, and the header kept beside the library.
// 9: the KV dtypes and CompactParams.kv_dtype (kdtree.h): an e4m3 cache is validated and, until a kernel reads one,
// answered KDTREE_ERR_UNSUPPORTED by the compaction (VerifyAttnParams takes the dtype with the kernels that read it).
int kdtree_abi_version(void) { return KDTREE_ABI_VERSION; }

size_t kdtree_params_size(void) { return sizeof(VerifyAttnParams); }

int kdtree_max_qlen(void) { return KDTREE_MAX_QLEN; }

const char* kdtree_last_error(void) { return g_last_error; }

int kdtree_poison_shared_memory(cudaStream_t stream) {
  g_last_error[0] = '\0';
  int dev = 0, sm_count = 0, optin = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return cuda_fail(err, "cudaGetDevice");
  err = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err != cudaSuccess) return cuda_fail(err, "cudaDeviceGetAttribute");
  err = cudaFuncSetAttribute(poison_shared_memory_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
  if (err == cudaSuccess)  // the whole unified L1 / shared memory as shared memory
    err = cudaFuncSetAttribute(poison_shared_memory_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               cudaSharedmemCarveoutMaxShared);
  if (err != cudaSuccess) return cuda_fail(err, "cudaFuncSetAttribute (poison_shared_memory_kernel)");
  poison_shared_memory_kernel<<<2 * sm_count, 1024, optin, stream>>>(optin / 16);
  err = cudaGetLastError();
  if (err != cudaSuccess) return cuda_fail(err, "poison_shared_memory_kernel launch");
  return KDTREE_OK;
}

int kdtree_verify_attn(const VerifyAttnParams* p, cudaStream_t stream) {
  g_last_error[0] = '\0';
  if (int st = validate(p)) return st;
  cudaError_t err = kdtree::launch_verify_attn_naive(*p, stream);
  if (err != cudaSuccess) return cuda_fail(err, "verify_attn_naive launch");
  return KDTREE_OK;
}

int kdtree_verify_attn_workspace_size(const VerifyAttnParams* p, size_t* bytes) {
  g_last_error[0] = '\0';
  if (bytes == nullptr) return fail(KDTREE_ERR_INVALID, "bytes is NULL");
  if (int st = validate_plan_inputs(p)) return st;
  int sm_count = 0;
  if (int st = plan_sm_count(p, &sm_count)) return st;
  *bytes = flash_plan(p, sm_count).workspace_bytes;
  return KDTREE_OK;
}

// Split count the flash kernel will use for these shapes (exposed for reports and benchmarks).
int kdtree_verify_attn_flash_splits(const VerifyAttnParams* p, int* num_splits) {
  g_last_error[0] = '\0';
  if (num_splits == nullptr) return fail(KDTREE_ERR_INVALID, "num_splits is NULL");
  if (int st = validate(p)) return st;
  int sm_count = 0;
  if (int st = plan_sm_count(p, &sm_count)) return st;
  *num_splits = flash_plan(p, sm_count).launch.splits;
  return KDTREE_OK;
}

// The workspace a flash call or the schedule needs: `need` bytes, 16-byte aligned device memory (NULL where need is 0).
static int check_workspace(const VerifyAttnParams* p, size_t need) {
  if (need == 0) return KDTREE_OK;
  if (p->workspace == nullptr)
    return fail(KDTREE_ERR_WORKSPACE, "workspace is NULL but %zu bytes are needed (the schedule and split partials)",
                need);
  if (p->workspace_bytes < need)
    return fail(KDTREE_ERR_WORKSPACE, "workspace_bytes %zu < %zu needed (the schedule and split partials)",
                p->workspace_bytes, need);
  if (!aligned(p->workspace, 16)) return fail(KDTREE_ERR_INVALID, "workspace is not 16-byte aligned");
  if (!is_device_pointer(p->workspace)) return fail(KDTREE_ERR_INVALID, "workspace is not device memory");
  return KDTREE_OK;
}

// The flash call; `portable`: only the kernels whose blocks fit 101,376 B of shared memory, the ones an sm_120 GPU
// runs, whatever this GPU allows (on an sm_90 GPU the tensor-copy path would otherwise take the teams kernels);
// `scheduled`: the kernels take their work from the schedule kdtree_flash_schedule wrote into the workspace. The
// Hopper call (not portable) runs its full row tiles in the wgmma kernel where the loaded code has it (a library built
// for sm_90a, on an sm_90 GPU) and tensor copies bring the tiles; `need_wgmma`: elsewhere it refuses instead of running
// the mma.sync kernels (kdtree_verify_attn_flash_wgmma).
static int verify_attn_flash(const VerifyAttnParams* p, bool portable, bool scheduled, cudaStream_t stream,
                             bool need_wgmma = false) {
  if (int st = validate(p)) return st;
  bool wgmma = false;
  if (!portable) {
    const cudaError_t err = kdtree::flash_wgmma_built(&wgmma);
    if (err != cudaSuccess) return cuda_fail(err, "flash_wgmma_built");
  }
  if (need_wgmma && !wgmma)
    return fail(KDTREE_ERR_UNSUPPORTED, "flash-wgmma: the code loaded for this GPU has no wgmma kernel (a library "
                "built for sm_90a has it, on an sm_90 GPU: kdev build --arch sm_90a)");
  int sm_count = 0;
  if (int st = plan_sm_count(p, &sm_count)) return st;
  const kdtree::FlashPlan plan = flash_plan(p, sm_count);
  if (int st = check_workspace(p, scheduled ? plan.workspace_bytes : plan.plain_workspace_bytes)) return st;
  cudaError_t err = kdtree::launch_verify_attn_flash(*p, plan, portable, scheduled, wgmma, stream);
  if (err != cudaSuccess) return cuda_fail(err, "verify_attn_flash launch");
  return KDTREE_OK;
}

int kdtree_verify_attn_flash(const VerifyAttnParams* p, cudaStream_t stream) {
  g_last_error[0] = '\0';
  return verify_attn_flash(p, false, false, stream);
}

// The same contract, plan and workspace as kdtree_verify_attn_flash, run by the kernels that fit sm_120's shared
// memory: how the sm_120 code path is verified and timed on a GPU that would pick others.
int kdtree_verify_attn_flash_portable(const VerifyAttnParams* p, cudaStream_t stream) {
  g_last_error[0] = '\0';
  return verify_attn_flash(p, true, false, stream);
}

// The flash call, its full row tiles in the wgmma kernel (flash/wgmma.cuh; pages of >= 32 tokens) or refused: what
// kdtree_verify_attn_flash runs in a library built for sm_90a on an sm_90 GPU, KDTREE_ERR_UNSUPPORTED elsewhere.
int kdtree_verify_attn_flash_wgmma(const VerifyAttnParams* p, cudaStream_t stream) {
  g_last_error[0] = '\0';
  return verify_attn_flash(p, false, false, stream, true);
}

// The schedule for the lengths in p's device arrays (flash_plan.cuh, schedule.cuh), into p's workspace; the scheduled
// calls below read it until it is made again.
int kdtree_flash_schedule(const VerifyAttnParams* p, cudaStream_t stream) {
  g_last_error[0] = '\0';
  if (int st = validate_plan_inputs(p)) return st;
  for (const auto& [ptr, name] : {std::pair<const void*, const char*>{p->prefix_lens, "prefix_lens"},
                                  std::pair<const void*, const char*>{p->q_indptr, "q_indptr"}}) {
    if (ptr == nullptr) return fail(KDTREE_ERR_INVALID, "%s is NULL", name);
    if (!aligned(ptr, 4)) return fail(KDTREE_ERR_INVALID, "%s is not 4-byte aligned", name);
    if (!is_device_pointer(ptr)) return fail(KDTREE_ERR_INVALID, "%s is not device memory", name);
  }
  int sm_count = 0;
  if (int st = plan_sm_count(p, &sm_count)) return st;
  const kdtree::FlashPlan plan = flash_plan(p, sm_count);
  if (int st = check_workspace(p, plan.workspace_bytes)) return st;
  cudaError_t err = kdtree::launch_flash_schedule(*p, plan, stream);
  if (err != cudaSuccess) return cuda_fail(err, "flash_schedule launch");
  return KDTREE_OK;
}

int kdtree_verify_attn_flash_scheduled(const VerifyAttnParams* p, cudaStream_t stream) {
  g_last_error[0] = '\0';
  return verify_attn_flash(p, false, true, stream);
}

int kdtree_verify_attn_flash_portable_scheduled(const VerifyAttnParams* p, cudaStream_t stream) {
  g_last_error[0] = '\0';
  return verify_attn_flash(p, true, true, stream);
}

// What the flash call (portable = 0) or the portable call launches on a GPU of compute capability `major` whose
// blocks may hold `smem_optin` bytes of shared memory, for full tiles by tensor copy (tensor_copy = 1: sm_90+, pages
// of >= 32 tokens) or by cp.async, from code with the wgmma kernel (wgmma_built = 1: a library built for sm_90a) or
// without: the full-tile and the narrow kernel, by name, and the dynamic shared memory per block of each (ABI 6 added
// wgmma_built). Needs no GPU: `kdev build` reports it per arch beside the ptxas table and gates on it.
int kdtree_flash_launch_plan(int major, int smem_optin, int tensor_copy, int portable, int wgmma_built,
                             const char** full_kernel, int* full_smem, const char** narrow_kernel, int* narrow_smem) {
  g_last_error[0] = '\0';
  if (full_kernel == nullptr || full_smem == nullptr || narrow_kernel == nullptr || narrow_smem == nullptr)
    return fail(KDTREE_ERR_INVALID, "an output pointer is NULL");
  if (major < 8) return fail(KDTREE_ERR_INVALID, "compute capability major %d: the flash kernels need sm_80+", major);
  if (tensor_copy && major < 9) return fail(KDTREE_ERR_INVALID, "tensor copies need sm_90+, not major %d", major);
  const kdtree::FlashKernels k = kdtree::flash_kernels(major, smem_optin, tensor_copy != 0, portable != 0,
                                                       wgmma_built != 0);
  *full_kernel = k.full;
  *full_smem = k.full_smem;
  *narrow_kernel = k.narrow;
  *narrow_smem = k.narrow_smem;
  return KDTREE_OK;
}

// The flash call's plan for a launch's shape bounds and page size (batch, total_q, num_heads, max_qlen, max_kv_len,
// page_size: as in VerifyAttnParams) on a GPU of sm_count SMs of threads_per_sm threads each, as the flash and the
// portable call would launch it there: row tiles per request, KV splits of the full row tiles and of the narrow ones
// (0: no narrow kernel), the combine kernel's groups per row (0: no combine) and the workspace it needs. Needs no GPU:
// `kdev plan`.
int kdtree_flash_plan(int batch, int total_q, int num_heads, int max_qlen, int max_kv_len, int page_size,
                      int sm_count, int threads_per_sm, int* num_m_tiles, int* num_splits, int* narrow_splits,
                      int* combine_groups, size_t* workspace_bytes) {
  g_last_error[0] = '\0';
  if (num_m_tiles == nullptr || num_splits == nullptr || narrow_splits == nullptr || combine_groups == nullptr ||
      workspace_bytes == nullptr)
    return fail(KDTREE_ERR_INVALID, "an output pointer is NULL");
  if (int st = validate_shape(batch, total_q, num_heads, max_qlen, max_kv_len)) return st;
  if (int st = check_page_size(page_size)) return st;
  if (sm_count < 1) return fail(KDTREE_ERR_INVALID, "sm_count %d < 1", sm_count);
  if (threads_per_sm < 256) return fail(KDTREE_ERR_INVALID, "threads_per_sm %d < 256 (one flash CTA)", threads_per_sm);
  const kdtree::FlashPlan plan = kdtree::plan_verify_attn_flash(batch, total_q, num_heads, max_qlen, max_kv_len,
                                                                page_size, sm_count);
  *num_m_tiles = plan.num_m_tiles;
  *num_splits = plan.launch.splits;
  *narrow_splits = plan.launch.narrow_splits;
  *combine_groups = kdtree::flash_combine_groups(plan, batch, (long)total_q * num_heads, sm_count, threads_per_sm);
  *workspace_bytes = plan.workspace_bytes;
  return KDTREE_OK;
}

// The planner's model cost, in KV tiles, of one choice for the same shape bounds: `splits` KV splits of every full row
// tile and `narrow_splits` of every narrow one (0 where there is no narrow tile); +infinity for a choice the planner
// may not take. The plan is the cheapest choice (kdtree_flash_plan); this says by how much (`kdev plan --costs`). Needs
// no GPU.
int kdtree_flash_split_cost(int batch, int total_q, int num_heads, int max_qlen, int max_kv_len, int page_size,
                            int sm_count, int splits, int narrow_splits, double* cost) {
  g_last_error[0] = '\0';
  if (cost == nullptr) return fail(KDTREE_ERR_INVALID, "cost is NULL");
  if (int st = validate_shape(batch, total_q, num_heads, max_qlen, max_kv_len)) return st;
  if (int st = check_page_size(page_size)) return st;
  if (sm_count < 1) return fail(KDTREE_ERR_INVALID, "sm_count %d < 1", sm_count);
  *cost = kdtree::flash_split_cost(batch, max_qlen, num_heads, max_kv_len, sm_count, splits, narrow_splits,
                                   kdtree::gathered_tiles(page_size));
  return KDTREE_OK;
}

// The planner's schedule of one flash launch (one CTA per SM): when the last CTA ends, for full-tile CTAs that each take
// `full_cta` and narrow CTAs that take `narrow_cta` beside them and `narrow_cold_cta` once the full-tile kernel has ended,
// in whatever unit the times are given. The planner weighs its choices with it in KV tiles; `kdev plan --project` gives
// it projected microseconds, so the projection's waves are the planner's own. Needs no GPU.
int kdtree_flash_launch_time(int full_ctas, double full_cta, int narrow_ctas, double narrow_cta,
                             double narrow_cold_cta, int sm_count, double* time) {
  g_last_error[0] = '\0';
  if (time == nullptr) return fail(KDTREE_ERR_INVALID, "time is NULL");
  if (full_ctas < 0 || narrow_ctas < 0 || full_ctas + narrow_ctas < 1)
    return fail(KDTREE_ERR_INVALID, "CTA counts %d + %d: need >= 0 each and one CTA at least", full_ctas, narrow_ctas);
  if (!(full_cta >= 0.0) || !(narrow_cta >= 0.0) || !(narrow_cold_cta >= 0.0))
    return fail(KDTREE_ERR_INVALID, "CTA times must be >= 0 (got %g, %g, %g)", full_cta, narrow_cta, narrow_cold_cta);
  if (sm_count < 1) return fail(KDTREE_ERR_INVALID, "sm_count %d < 1", sm_count);
  *time = kdtree::flash_launch_time(full_ctas, full_cta, narrow_ctas, narrow_cta, narrow_cold_cta, sm_count);
  return KDTREE_OK;
}

// The device schedule the schedule kernel makes for these lengths (request b: prefix_lens[b] tokens and a tree of
// qlens[b] nodes) in pages of page_size tokens, on a GPU of sm_count SMs, for a call whose bounds are max_qlen and
// max_kv_len (a graph's capture-time ones; 0: the lengths' own): the split factor k, each request's full and narrow
// split counts (narrow 0: its tail, if any, runs as a full-tile CTA), the CTAs of each kernel and the schedule's model
// time in tokens. The same integer arithmetic as the kernel (flash_plan.cuh), on the host; where every request has the
// bounds' lengths the kernel writes the host plan instead (at_bounds = 1). Needs no GPU: `kdev plan`.
int kdtree_flash_schedule_plan(int batch, int num_heads, int page_size, int sm_count, const int* prefix_lens,
                               const int* qlens, int max_qlen, int max_kv_len, int* k, int* splits, int* narrow_splits,
                               int* ctas, int* narrow_ctas, long long* model_tokens, int* at_bounds) {
  g_last_error[0] = '\0';
  if (prefix_lens == nullptr || qlens == nullptr || k == nullptr || splits == nullptr || narrow_splits == nullptr ||
      ctas == nullptr || narrow_ctas == nullptr || model_tokens == nullptr || at_bounds == nullptr)
    return fail(KDTREE_ERR_INVALID, "a pointer argument is NULL");
  if (batch < 1 || batch > kdtree::kScheduleMaxBatch)
    return fail(KDTREE_ERR_INVALID, "batch %d outside 1..%d (the schedule's bound)", batch, kdtree::kScheduleMaxBatch);
  if (sm_count < 1) return fail(KDTREE_ERR_INVALID, "sm_count %d < 1", sm_count);
  if (int st = check_page_size(page_size)) return st;
  int own_qlen = 0, kv_max = 0, total_q = 0;
  for (int b = 0; b < batch; ++b) {
    if (prefix_lens[b] < 0 || prefix_lens[b] > KDTREE_MAX_PREFIX || qlens[b] < 1 || qlens[b] > KDTREE_MAX_QLEN)
      return fail(KDTREE_ERR_INVALID, "request %d: prefix %d, tree %d outside the contract", b, prefix_lens[b],
                  qlens[b]);
    own_qlen = qlens[b] > own_qlen ? qlens[b] : own_qlen;
    kv_max = prefix_lens[b] + qlens[b] > kv_max ? prefix_lens[b] + qlens[b] : kv_max;
    total_q += qlens[b];
  }
  if (max_qlen == 0 && max_kv_len == 0) max_qlen = own_qlen, max_kv_len = kv_max;
  if (max_qlen < own_qlen || max_kv_len < kv_max)
    return fail(KDTREE_ERR_INVALID, "bounds %d / %d below the lengths' %d / %d", max_kv_len, max_qlen, kv_max, own_qlen);
  if (int st = validate_shape(batch, total_q, num_heads, max_qlen, max_kv_len)) return st;
  const kdtree::FlashSplitPlan host = kdtree::plan_flash_splits(batch, max_qlen, num_heads, max_kv_len, sm_count,
                                                                kdtree::gathered_tiles(page_size));
  const kdtree::FlashLaunch l = kdtree::flash_launch(host, batch, max_qlen, num_heads, sm_count, true);
  auto request = [&](int b) { return kdtree::schedule_request(prefix_lens[b], qlens[b], num_heads); };
  static thread_local kdtree::HostSchedule s;
  kdtree::schedule_host(batch, sm_count, l, request, s, [](long, int, int, int) {}, [](long, int, int) {});
  *k = s.k;
  for (int b = 0; b < batch; ++b) splits[b] = s.splits[b], narrow_splits[b] = s.narrow_splits[b];
  *ctas = (int)s.units;
  *narrow_ctas = (int)s.narrow_units;
  *model_tokens = kdtree::schedule_cost(s.k, batch, kv_max, sm_count, l, request);
  *at_bounds = 1;
  for (int b = 0; b < batch; ++b) *at_bounds &= qlens[b] == max_qlen && prefix_lens[b] + qlens[b] == max_kv_len;
  return KDTREE_OK;
}

// ------------------------------------------------------------------------------------------ DDTree kernels
int kdtree_build_ddtree(const DDTreeBuildParams* p, cudaStream_t stream) {
  g_last_error[0] = '\0';
  if (int st = check_params_struct(p)) return st;
  if (p->batch < 1) return fail(KDTREE_ERR_INVALID, "batch %d < 1", p->batch);
  if (p->depth < 0 || p->depth > KDTREE_MAX_DEPTH)  // 0: no drafter depth, the root alone
    return fail(KDTREE_ERR_INVALID, "depth %d outside 0..%d", p->depth, KDTREE_MAX_DEPTH);
  if (p->topk < 1 || p->topk > KDTREE_MAX_TOPK)
    return fail(KDTREE_ERR_INVALID, "topk %d outside 1..%d", p->topk, KDTREE_MAX_TOPK);
  if (p->budget < 1 || p->budget > KDTREE_MAX_QLEN - 1)
    return fail(KDTREE_ERR_INVALID, "budget %d outside 1..%d", p->budget, KDTREE_MAX_QLEN - 1);
  if (p->mask_words < (p->budget + 1 + 63) / 64)
    return fail(KDTREE_ERR_INVALID, "mask_words %d < ceil((1 + budget) / 64)", p->mask_words);
  if (p->depth > 0)  // with no depth there is nothing to read there (an empty tensor's pointer may be NULL)
    if (int st = check_ptrs({{p->log_probs, "log_probs"}, {p->token_ids, "token_ids"}}, 4)) return st;
  if (int st = check_ptrs({{p->root_tokens, "root_tokens"},
                           {p->prefix_lens, "prefix_lens"}, {p->node_tokens, "node_tokens"}, {p->parents, "parents"},
                           {p->depths, "depths"}, {p->positions, "positions"}, {p->node_count, "node_count"}}, 4))
    return st;
  if (int st = check_ptrs({{p->tree_mask, "tree_mask"}}, 8)) return st;
  cudaError_t err = kdtree::launch_build_ddtree(*p, stream);
  if (err != cudaSuccess) return cuda_fail(err, "build_ddtree launch");
  return KDTREE_OK;
}

int kdtree_accept_greedy(const AcceptParams* p, cudaStream_t stream) {
  g_last_error[0] = '\0';
  if (int st = check_params_struct(p)) return st;
  if (p->batch < 1) return fail(KDTREE_ERR_INVALID, "batch %d < 1", p->batch);
  if (p->t_stride < 1 || p->t_stride > KDTREE_MAX_QLEN)
    return fail(KDTREE_ERR_INVALID, "t_stride %d outside 1..%d", p->t_stride, KDTREE_MAX_QLEN);
  if (int st = check_ptrs({{p->node_tokens, "node_tokens"}, {p->parents, "parents"}, {p->node_count, "node_count"},
                           {p->target_argmax, "target_argmax"}, {p->accepted, "accepted"}, {p->accept_len, "accept_len"},
                           {p->bonus_token, "bonus_token"}}, 4))
    return st;
  cudaError_t err = kdtree::launch_accept_greedy(*p, stream);
  if (err != cudaSuccess) return cuda_fail(err, "accept_greedy launch");
  return KDTREE_OK;
}

int kdtree_compact_kv(const CompactParams* p, cudaStream_t stream) {
  g_last_error[0] = '\0';
  if (int st = check_params_struct(p)) return st;
  if (p->batch < 1) return fail(KDTREE_ERR_INVALID, "batch %d < 1", p->batch);
  if (p->t_stride < 1 || p->t_stride > KDTREE_MAX_QLEN)
    return fail(KDTREE_ERR_INVALID, "t_stride %d outside 1..%d", p->t_stride, KDTREE_MAX_QLEN);
  if (int st = check_page_size(p->page_size)) return st;
  if (p->max_pages < 1 || p->num_pages < 1) return fail(KDTREE_ERR_INVALID, "max_pages / num_pages < 1");
  if (p->kv_dtype != KDTREE_KV_BF16 && p->kv_dtype != KDTREE_KV_FP8_E4M3)
    return fail(KDTREE_ERR_INVALID, "kv_dtype %d " KDTREE_KV_DTYPE_RULE, (int)p->kv_dtype);
  if (int st = check_ptrs({{p->kv_cache, "kv_cache"}}, 16)) return st;
  if (int st = check_ptrs({{p->page_table, "page_table"}, {p->prefix_lens, "prefix_lens"}, {p->accepted, "accepted"},
                           {p->accept_len, "accept_len"}}, 4))
    return st;
  if (int st = refuse_unread_kv_dtype(p->kv_dtype, "kdtree_compact_kv")) return st;
  cudaError_t err = kdtree::launch_compact_kv(*p, stream);
  if (err != cudaSuccess) return cuda_fail(err, "compact_kv launch");
  return KDTREE_OK;
}

}  // extern "C"
