// Flash tree-verify attention for absorbed MLA (tensor cores, heads x nodes packed, split-KV, paged KV).
//
// Computes exactly what the naive oracle computes (verify_attn.cu): for every tree node i of request b
// and head h, softmax(scale * q . k) over the prefix and node i's ancestors-or-self, times V = K[:, :512],
// plus the natural-log LSE.
//
// How:
// * Rows. One latent KV head serves every query head, so a request's T nodes x H heads form R = T*H rows
//   (row = node*H + head, contiguous in q) and every KV tile is read once per CTA for 64 rows.
// * CTA = 8 warps, 64 rows x 32-token KV tiles, one CTA per SM. The lockstep kernels (91,136 B of dynamic shared
//   memory: fits sm_120's 101,376 B limit) run on sm_120, wherever pages are under 32 tokens, and in every portable
//   call (kdtree_verify_attn_flash_portable): warp w = (row group g = w%4, half c = w/4), a block barrier per tile.
//   Otherwise, where a block holds 186 KB (sm_90), the tensor-copy path runs
//   as two teams of warps out of phase (verify_attn_flash_teams_kernel, below): no barrier that all warps meet per
//   tile, a four-deep KV ring, the two warps of a scheduler in different teams (v21 in NOTES.md: 2-8 % faster), and
//   P.V over a team's 32 rows, a tile behind S (v23: 1.5-3.6 % faster at six target shapes).
// * S = Q K^T (64 x 32 x 576): warp (g, c) multiplies its 16 rows over half the dims (the 16-dim k-steps
//   2j + c, j < 18) with Q held in registers (72 per thread, loaded once) and K read by ldmatrix; the two
//   half-sums meet in shared memory. Splitting by dims rather than tokens keeps Q at 72 registers instead
//   of 144.
// * Softmax in fp32 registers on the mma accumulator layout (a row's 32 scores sit in one quad), exp2
//   (ex2.approx) with log2(e) folded into the scale, against a lazy reference max that moves only when a row's
//   max rises by more than 2^8 (so the O rescale runs on few tiles). Each thread tests its own scores for that
//   rise and the warp votes, so only a tile that moves a max runs the quad reductions; each thread keeps its
//   share of the row sums, added across the quad once before the epilogue. Tiles entirely inside the prefix skip
//   the mask; the others read the node's bitmask row. P feeds P.V directly as bf16 A fragments; the row
//   sum adds the unrounded fp32 values, so lse stays fp32-exact (summing the rounded values biased lse by
//   up to ~1e-3 on peaked rows: measured, see NOTES.md).
// * O += P V (64 x 512 x 32): warp (g, c) owns rows 16g.. and the 16-column value blocks 2j + c (j < 16):
//   128 fp32 accumulators per thread; V fragments via ldmatrix.trans from the same K tile (V = first 512
//   dims). (The teams kernel: a warp owns its team's 32 rows in the blocks 4j + q, the same 128 accumulators.)
// * KV tiles go into a double buffer (lockstep: tile i+1 loads while tile i computes) or the teams' four-deep ring
//   as 9 boxes of 32 rows x 64 dims (128 B per row), 16-byte chunk c of a box row r stored at chunk c ^ (r & 7): the
//   fills write whole
//   128-byte lines (rows padded to 1,168 B for conflict-free ldmatrix cost 2.6 shared-memory wavefronts per
//   128 B filled, measured; see NOTES.md) and the 8 rows of every ldmatrix still fall in 8 different banks.
//   Interleaving the halves by 16 dims / columns (above) leaves a lane two swizzled offsets per tile
//   instead of one per k-step.
// * With pages of >= 32 tokens (sm_90+), a full tile is one page-table lookup and TMA tensor copies (the box
//   layout above is the hardware's 128-byte swizzle) that complete on an mbarrier: no per-thread copy
//   instructions: one 3-D copy from one lane, the 9 boxes of the tile in one instruction (nine box copies from
//   lanes 0-8 were 10-14 % slower in the teams kernels, v22 in NOTES.md, 7-11 % in the lockstep ones, v25).
//   kdtree_verify_attn_flash_portable runs the lockstep kernels on any GPU: how the sm_120 path is verified and
//   timed on an H200. Smaller pages, and a range's last partial tile,
//   gather each row through the page table with cp.async (16-byte chunks) into the same layout: its zero-fill
//   past the end is needed there (TMA has none, and the slots past a range may hold NaN, which times P = 0 is
//   NaN). (The teams kernels copy their partial tail tile by TMA too and zero its V elements past the end.)
// * Narrow row tiles: a request's last row tile of <= 16 rows (with H = 8 every tree of 2^k + 1 nodes leaves 8)
//   runs in verify_attn_flash_narrow_kernel: its four row groups take the same 16 rows, each on 8 of every
//   tile's 32 tokens (a quarter of the tensor work per tile), keep four online softmaxes and merge them at the
//   end; one such CTA covers the KV range of one or two splits. It is launched programmatically behind the
//   full-tile kernel, so its CTAs take the SMs the full tiles leave.
// * Split-KV: when batch x row tiles cannot fill the GPU, each request's KV range is cut into equal
//   chunks; each split writes fp32 partial O (normalised) and its LSE to the caller's workspace and a
//   combine kernel merges them weighted by exp(lse_s - lse), launched programmatically on sm_90+ behind the
//   last of the kernels above so that its launch overlaps the last tiles. The grids are 1-D: a plain call's CTA
//   decodes its (request, split, row tile) from its index as the host plan lays them out (one split count for every
//   request, from the bounds); a scheduled call's CTA reads it from the table the schedule kernel wrote
//   (flash/schedule.cuh: each request cut by its own length, the longest first). The split counts depend only on
//   the shapes or the lengths, and every reduction runs in a fixed order: the same inputs give the same bits.
// mma.sync m16n8k16 / m16n8k8 bf16 -> fp32, ldmatrix, cp.async: all available on sm_80+ (no wgmma).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kdev/flash_plan.cuh"
#include "kdev/kv_pages.cuh"
#include "kdev/kv_tensor_map.cuh"
#include "kdev/mbarrier.cuh"
#include "kdev/mma_sync.cuh"
#include "kdev/verify_attn.cuh"
#include "flash/common.cuh"
#include "flash/schedule.cuh"
#include "flash/narrow.cuh"
#include "flash/lockstep.cuh"
#include "flash/teams.cuh"
#include "flash/wgmma.cuh"
#include "flash/combine.cuh"

namespace kdtree {

FlashPlan plan_verify_attn_flash(int batch, int total_q, int num_heads, int max_qlen, int max_kv_len, int page_size,
                                 int sm_count) {
  const FlashSplitPlan split = plan_flash_splits(batch, max_qlen, num_heads, max_kv_len, sm_count,
                                                 gathered_tiles(page_size));
  FlashPlan plan{};
  plan.num_m_tiles = split.num_m_tiles;
  plan.launch = flash_launch(split, batch, max_qlen, num_heads, sm_count, false);
  plan.scheduled = flash_launch(split, batch, max_qlen, num_heads, sm_count, true);
  plan.plain_workspace_bytes = flash_workspace(batch, plan.launch).bytes;
  plan.workspace_bytes = flash_workspace(batch, plan.scheduled).bytes;
  return plan;
}

// Groups of splits per row: as few as fill the GPU's threads (1, 2 or 4, at most the split count). Few rows (T x H
// small) need the groups to have loads enough in flight; with many rows, groups only add the shared-memory sum and its
// barrier (measured: NOTES.md, flash v13). Counted for the full tiles' rows where they have partials, else for the
// narrow tiles' (at most 16 per request); 0 where no row has partials (no combine kernel).
int flash_combine_groups(const FlashPlan& plan, long batch, long rows, int sms, int threads_per_sm) {
  const bool full = plan.launch.splits > 1;
  const int splits = full ? plan.launch.splits : plan.launch.narrow_splits;
  if (splits <= 1) return 0;
  const long merged = full ? rows : batch * kNarrowRows;
  const long want = (long)sms * threads_per_sm;
  int groups = 1;
  while (groups < 4 && 2 * groups <= splits && merged * kCombineColumnThreads * groups < want) groups *= 2;
  return groups;
}

// The KV pool for the tensor-copy path: num_pages * page_size rows of 576 bf16, 1,152 B apart, read with the 128-byte
// swizzle, as a 3-D tensor copied a whole 32-row tile at a time. False when it cannot be used: pages of fewer than 32
// tokens (a tile would span pages), no encoder in the driver, or a pool the encoder refuses (e.g. not 16-byte
// aligned); the cp.async path then runs.
static bool encode_kv_map(const VerifyAttnParams& p, CUtensorMap* map) {
  const uint64_t rows = (uint64_t)p.num_pages * p.page_size;
  return p.page_size >= KDTREE_FLASH_TENSOR_COPY_MIN_PAGE && encode_kv_tile_tensor_map(p.kv_cache, rows, kBlockN, map);
}

// Launches `kernel` on `grid` behind the previous launch in the stream: programmatically (it may start once every
// CTA of that one has started; it waits in griddepcontrol.wait for that grid's writes) on sm_90+.
template <class... Params, class... Args>
static cudaError_t launch_behind(void (*kernel)(Params...), dim3 grid, unsigned threads, size_t smem, bool programmatic,
                                cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

template <int kGroups>
static cudaError_t launch_combine(const VerifyAttnParams& p, const FlashLaunch& l, bool programmatic,
                                  cudaStream_t stream) {
  return launch_behind(verify_attn_combine_kernel<kGroups>, dim3((unsigned)(p.max_qlen * p.num_heads), p.batch),
                       kGroups * kCombineColumnThreads, 0, programmatic, stream, p, l);
}

cudaError_t launch_flash_schedule(const VerifyAttnParams& p, const FlashPlan& plan, cudaStream_t stream) {
  flash_schedule_kernel<<<1, kScheduleThreads, 0, stream>>>(p, plan.scheduled);
  return cudaGetLastError();
}

FlashKernels flash_kernels(int major, int smem_optin, bool tensor_copy, bool portable, bool wgmma_built) {
  // The teams kernels where a block holds their ring (sm_90: measured faster, NOTES.md) unless the call is portable,
  // else the lockstep ones; the arch window is the one KDTREE_FLASH_TEAMS gives a body. Where the loaded code has the
  // wgmma kernel (only sm_90 runs it), it takes the full tiles of the teams' place (faster at every target, NOTES.md).
  // The names are those of the kernels launch_verify_attn_flash picks by the same flags (wgmma, teams, tensor_copy).
  const bool teams = tensor_copy && !portable && major < 12 && smem_optin >= kTeamsSmemBytes;
  if (teams && wgmma_built && major == 9 && smem_optin >= kWgmmaSmemBytes)
    return {true, true, "verify_attn_flash_wgmma_kernel", kWgmmaSmemBytes,
            "verify_attn_flash_narrow_kernel<true, true>", kTeamsSmemBytes};
  if (teams)
    return {false, true, "verify_attn_flash_teams_kernel", kTeamsSmemBytes,
            "verify_attn_flash_narrow_kernel<true, true>", kTeamsSmemBytes};
  if (tensor_copy)
    return {false, false, "verify_attn_flash_kernel<true>", kSmemBytes, "verify_attn_flash_narrow_kernel<true, false>",
            kSmemBytes};
  return {false, false, "verify_attn_flash_kernel<false>", kSmemBytes,
          "verify_attn_flash_narrow_kernel<false, false>", kSmemBytes};
}

// Where the wgmma kernel's body is compiled (an sm_90a build) it keeps O's 128 fp32 accumulators a thread, so ptxas
// gives it more than 128 registers; in every other build it is an empty kernel of a few (tests/test_wgmma.py checks
// both in the ptxas report). Asked of the loaded function's attributes: no copy and no launch, so a call made while
// the stream is being captured may ask.
constexpr int kWgmmaBodyMinRegisters = 129;

cudaError_t flash_wgmma_built(bool* built) {
  static int known[64] = {};  // per device: 0 not asked yet, 1 no, 2 yes (every flash call asks)
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev >= 64) return cudaErrorInvalidDevice;
  if (known[dev] == 0) {
    cudaFuncAttributes attr{};
    err = cudaFuncGetAttributes(&attr, verify_attn_flash_wgmma_kernel);
    if (err == cudaErrorInvalidDeviceFunction || err == cudaErrorNoKernelImageForDevice) {
      cudaGetLastError();  // no code for this GPU at all: the flash launch will say so
      attr.numRegs = 0;
    } else if (err != cudaSuccess) {
      return err;
    }
    known[dev] = attr.numRegs >= kWgmmaBodyMinRegisters ? 2 : 1;
  }
  *built = known[dev] == 2;
  return cudaSuccess;
}

cudaError_t launch_verify_attn_flash(const VerifyAttnParams& p, const FlashPlan& plan, bool portable, bool scheduled,
                                     bool wgmma_built, cudaStream_t stream) {
  int dev = 0, major = 0, sms = 0, threads_per_sm = 0, smem_optin = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&threads_per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, dev);
  if (err != cudaSuccess) return err;
  const bool sm90 = major >= 9;  // tensor copies and the programmatic launches
  CUtensorMap kv_map{};
  const bool tensor_copy = sm90 && encode_kv_map(p, &kv_map);
  const FlashKernels choice = flash_kernels(major, smem_optin, tensor_copy, portable, wgmma_built);
  const bool teams = choice.teams;
  const auto kernel = choice.wgmma ? verify_attn_flash_wgmma_kernel
                      : teams      ? verify_attn_flash_teams_kernel
                                   : (tensor_copy ? verify_attn_flash_kernel<true> : verify_attn_flash_kernel<false>);
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, choice.full_smem);
  if (err != cudaSuccess) return err;
  const FlashLaunch& l = scheduled ? plan.scheduled : plan.launch;
  kernel<<<dim3((unsigned)l.units), choice.wgmma ? kWgThreads : kThreads, choice.full_smem, stream>>>(p, l, kv_map);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (l.narrow_splits > 0) {  // the rows of the requests' narrow last tiles, on the SMs the full tiles leave
    const auto narrow = teams ? verify_attn_flash_narrow_kernel<true, true>
                              : (tensor_copy ? verify_attn_flash_narrow_kernel<true, false>
                                             : verify_attn_flash_narrow_kernel<false, false>);
    err = cudaFuncSetAttribute(narrow, cudaFuncAttributeMaxDynamicSharedMemorySize, choice.narrow_smem);
    if (err != cudaSuccess) return err;
    err = launch_behind(narrow, dim3((unsigned)l.narrow_units), kThreads, choice.narrow_smem, sm90, stream, p, l,
                        kv_map);
    if (err != cudaSuccess) return err;
  }
  // The combine: the host plan's groups per row; one where the host plan has no split but the schedule may cut one.
  int groups = flash_combine_groups(plan, p.batch, (long)p.total_q * p.num_heads, sms, threads_per_sm);
  if (groups == 0 && scheduled) groups = 1;
  if (groups == 0) return cudaSuccess;
  err = groups == 4   ? launch_combine<4>(p, l, sm90, stream)
        : groups == 2 ? launch_combine<2>(p, l, sm90, stream)
                      : launch_combine<1>(p, l, sm90, stream);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace kdtree
