"""The verify calls, once: for each, its C entry point (kernels/include/kdev/kdtree.h), the product it belongs to, where
it runs, and how its split-KV work is planned. abi, ops, bench, verify, e2e, the SGLang backend and the CLI's help read
this table; tests/test_registry.py bans verify-call names written anywhere else in the package.

One call per product. `flash` (the Hopper product) and `flash-portable` (the sm_120 product) run on the device
schedule: kdtree_flash_schedule cuts each request's KV by its own length on the GPU, and the call reads that schedule,
made once per decoding step for every layer (an engine's skewed batch of 1 x 128K + 15 x 2K costs its parts, where a
plan for the longest request costs 12x them). The host-plan calls, which plan every request as if it were the longest,
stay as the reference the schedule is tested against: `flash-hostplan`, `flash-portable-hostplan`, for no engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VerifyCall:
    name: str  # kdev's name: --kernel, --backend, torch.ops.kdev.verify_attn's kernel=, the SGLang backend's kernel=
    entry: str  # the C entry point (kdtree.h)
    product: str  # "hopper" (may use all of Hopper), "sm_120" (within sm_120's 99 KB per block, any GPU), "oracle"
    scheduled: bool  # reads the device schedule, which kdtree_flash_schedule makes first in its workspace
    split_kv: bool  # takes a workspace (the schedule and the split-KV partials)
    engine: bool  # what an engine calls; False: a reference, or a call that must run one kernel
    verified_by_default: bool  # on kdev verify's default list
    runs: str  # where and how, in words (the CLI's help and docs/architecture.md §2)


CALLS = (
    VerifyCall("naive", "kdtree_verify_attn", "oracle", False, False, False, True,
               "the oracle: fp32, one thread block per row, obviously right"),
    VerifyCall("flash", "kdtree_verify_attn_flash_scheduled", "hopper", True, True, True, True,
               "Hopper's call on the device schedule: full row tiles by wgmma in an sm_90a build at pages of >= 32 "
               "tokens, else by mma.sync"),
    VerifyCall("flash-portable", "kdtree_verify_attn_flash_portable_scheduled", "sm_120", True, True, True, True,
               "sm_120's call on the device schedule: the kernels within 101,376 B of shared memory, on any GPU"),
    VerifyCall("flash-hostplan", "kdtree_verify_attn_flash", "hopper", False, True, False, True,
               "flash planned on the host from the bounds (every request as the longest): the schedule's reference"),
    VerifyCall("flash-portable-hostplan", "kdtree_verify_attn_flash_portable", "sm_120", False, True, False, True,
               "flash-portable planned on the host from the bounds: the schedule's reference"),
    VerifyCall("flash-wgmma", "kdtree_verify_attn_flash_wgmma", "hopper", False, True, False, False,
               "the host-planned flash call that must run its full tiles by wgmma (sm_90a code on an sm_90 GPU; "
               "elsewhere it answers 4, not on this GPU)"),
)

BY_NAME = {c.name: c for c in CALLS}
ORACLE = next(c.name for c in CALLS if c.product == "oracle")  # what every other call is checked against
VERIFY_KERNELS = {c.name: c.entry for c in CALLS}  # name -> C entry point
SCHEDULED = tuple(c.name for c in CALLS if c.scheduled)
SPLIT_KV = tuple(c.name for c in CALLS if c.split_kv)
ENGINE = tuple(c.name for c in CALLS if c.engine)
DEFAULT = ENGINE[0]  # the call an engine gets when it names none: `flash`
# the product each engine call is (kdev plan --call, the projection's measured calls, deploy-check's proxy)
PRODUCTS = {c.product: c.name for c in CALLS if c.engine}
HOPPER, PORTABLE = PRODUCTS["hopper"], PRODUCTS["sm_120"]
WGMMA_ONLY = tuple(c.name for c in CALLS if "wgmma" in c.entry)  # answers 4 where the code has no wgmma kernel
VERIFIED_BY_DEFAULT = tuple(c.name for c in CALLS if c.verified_by_default)
LAYER_SUFFIX = "-layer"  # a bench backend: the scheduled call timed without its schedule (made once per step)
LAYER_BACKENDS = {f"{name}{LAYER_SUFFIX}": name for name in SCHEDULED}
HOST_PLAN_OF = {c.name: next(h.name for h in CALLS if h.product == c.product and h.split_kv and not h.scheduled
                              and h.name not in WGMMA_ONLY) for c in CALLS if c.scheduled}  # the schedule's reference


def describe() -> str:
    """The calls, one clause each, for a --kernel / --backend help text."""
    return "; ".join(f"{c.name}: {c.runs}" for c in CALLS)
