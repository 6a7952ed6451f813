// Waiting on a shared-memory mbarrier (sm_90+: the parity form of try_wait; sm_120 has it too). One
// definition for the flash kernel and the loop ladder (ceilings.cu), so that the rungs wait as the kernel does.
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

}  // namespace kdtree
