// Shared-memory mbarriers as the tensor-copy paths use them (sm_90+: transaction counts and the parity form of
// try_wait; sm_120 has them too). One definition for the flash kernel and the loop ladder (ceilings.cu), so
// that the rungs arrive and wait as the kernel does. Callers compile these only for sm_90+.
#pragma once

#include <cstdint>

namespace kdtree {

// Returns once phase `parity` (0 or 1) of the mbarrier at shared-window address `bar` has completed. The loop is
// C++ around a single try_wait, not a branch inside the asm: with the branch in the asm, ptxas spilled 4-8 B
// in the flash kernel on sm_90 and in the ladder's consumed-barrier loop on sm_120.
__device__ __forceinline__ void mbarrier_wait_parity(unsigned bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  for (uint32_t done = 0; !done;)
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
#endif
}

// One arrival on the mbarrier at `bar` that also expects `bytes` of copies to complete on it (a tensor copy's
// complete_tx); its phase completes when both have happened.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// One arrival on the mbarrier at `bar` (release: this thread's earlier shared-memory reads are ordered before
// whatever a waiter on the completed phase does next, e.g. a tensor copy into the buffer just read).
__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

}  // namespace kdtree
