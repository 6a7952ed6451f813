// VerifyAttnParams, the status codes and the contract's constants are in kdtree.h (the public C interface); this
// header adds the verify launchers that capi.cu calls after validating.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kdev/flash_plan.cuh"
#include "kdev/kdtree.h"

#ifdef __CUDACC__
namespace kdtree {
// Internal launchers (capi.cu validates before calling them).
cudaError_t launch_verify_attn_naive(const VerifyAttnParams& p, cudaStream_t stream);
struct FlashPlan {
  int num_m_tiles;               // ceil(max_qlen * num_heads / 64)
  FlashLaunch launch;            // the plain call: the host plan's split counts (narrow 0: no narrow kernel), grids
  FlashLaunch scheduled;         // the scheduled call's (and the schedule kernel's)
  size_t plain_workspace_bytes;  // what the plain call needs (its partials; 0: none)
  size_t workspace_bytes;        // what the schedule and the scheduled call need, which covers the plain call's
};
// The flash call's plan for a launch's shape bounds (VerifyAttnParams' batch, total_q, num_heads, max_qlen, max_kv_len)
// on a GPU of sm_count SMs: plain host arithmetic, so that kdtree_flash_plan reports it without a GPU.
FlashPlan plan_verify_attn_flash(int batch, int total_q, int num_heads, int max_qlen, int max_kv_len, int page_size,
                                 int sm_count);
// How many groups of splits the combine kernel gives each row (1, 2 or 4; 0: no combine kernel) for a call of `batch`
// requests and `rows` rows in all, on a GPU of sms x threads_per_sm threads.
int flash_combine_groups(const FlashPlan& plan, long batch, long rows, int sms, int threads_per_sm);
// Which kernels a flash call launches and the dynamic shared memory per block they take, on a GPU of compute
// capability `major` whose blocks may hold `smem_optin` bytes: full tiles by tensor copy (sm_90+, pages of >= 32
// tokens) or by cp.async, the flash or the portable call, with the loaded code holding the wgmma kernel or not (a
// library built for sm_90a on an sm_90 GPU). The launcher decides by it; kdtree_flash_launch_plan reports it.
struct FlashKernels {
  bool wgmma;          // the full tiles in the wgmma kernel (flash/wgmma.cuh), the narrow ones in the teams' kernel
  bool teams;          // the teams kernels (a four-deep ring: sm_90 to sm_11x), else the lockstep ones
  const char* full;    // the full-tile kernel, as `kdev build` names kernels
  int full_smem;       // its dynamic shared memory per block
  const char* narrow;  // the narrow kernel (a request's last row tile of <= 16 rows)
  int narrow_smem;
};
FlashKernels flash_kernels(int major, int smem_optin, bool tensor_copy, bool portable, bool wgmma_built);
// portable: only the kernels that fit 101,376 B of shared memory per block (sm_120's), on any GPU; scheduled: the
// kernels read their work from the schedule that launch_flash_schedule wrote into the workspace before; wgmma_built:
// the loaded code holds the wgmma kernel (flash_wgmma_built), which flash_kernels then picks where it applies.
cudaError_t launch_verify_attn_flash(const VerifyAttnParams& p, const FlashPlan& plan, bool portable, bool scheduled,
                                     bool wgmma_built, cudaStream_t stream);
// Whether the code loaded for the current GPU holds the wgmma kernel (a library built for sm_90a, on an sm_90 GPU),
// from the loaded function's attributes: allowed while a stream is being captured.
cudaError_t flash_wgmma_built(bool* built);
cudaError_t launch_flash_schedule(const VerifyAttnParams& p, const FlashPlan& plan, cudaStream_t stream);
}  // namespace kdtree
#endif
