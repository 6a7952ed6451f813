"""The `triton` bench peer: the verify contract (docs/architecture.md §2) as a Triton kernel and a Triton combine.

What a compiler makes of the flash kernel's tiling, for `kdev bench` to rank the CUDA kernels against (on sm_90
Triton's dots can take wgmma, which the flash kernels do not use; on sm_120 both are mma.sync):
* Rows. A request's T nodes x H heads are packed into BLOCK_M-row tiles (row = node*H + head, contiguous in q), so
  every KV tile a program loads serves all its rows: the same packing as the flash kernel.
* Scores. 576 is no power of two (Triton's block shapes are): each score is the 512-wide latent dot plus the
  64-wide RoPE dot, both bf16 with fp32 accumulation. Softmax is online, in exp2 with log2(e) folded into the
  scale; the prefix needs no mask, the tree part reads bit j of the node's bitmask row.
* KV. Through the page table: one lookup per step where a page holds whole steps (pages of >= BLOCK_N tokens, as
  the flash kernel's tensor copies), else one per token; values = the first 512 dims of the same rows.
* Split-KV. When a batch's row tiles are fewer than the GPU's SMs, each request's KV range is cut into
  `splits` equal runs of whole tiles (splits = SMs / row tiles, rounded: one program per SM, no cost model);
  each run writes its normalised fp32 partial O and LSE, and a second Triton kernel merges a row's partials
  weighted by exp(lse_s - lse) in split order (deterministic). One split writes bf16 out and lse directly.
* Tile sizes. A short list (TILE_CONFIGS): on a GPU each that its shared memory holds is compiled and timed at the
  inputs, and the fastest kept (`config`; sm_120's 99 KB refuses the 64-row ones).

Under the Triton interpreter (TRITON_INTERPRET=1 before triton is imported: how the tests run it without a GPU)
the dots widen their bf16 operands to fp32 first: exact, the same products, where the interpreter's bf16 dot reads
its operands wrongly (triton 3.9).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from kdev.config import LATENT_DIM, QK_DIM
from kdev.errors import BadInput

ROPE_DIM = QK_DIM - LATENT_DIM
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # packed rows per program
    block_n: int  # KV tokens per loop step
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"


# The tile sizes tuned over, each compiled ahead of time without a GPU as the JIT compiles it on one (pointers 16-byte
# aligned): shared memory, the tensor op, ptxas spills under Triton 3.6 / 3.9. The KV loads of every size but the
# one-stage one are pipelined (cp.async into shared memory).
#   64x32 w8 s2   sm_90 160 KB, wgmma, 0 / 48 B       sm_120 128 KB: does not fit its 99 KB
#   64x32 w8 s3   sm_90 160 KB, wgmma, 8 / 88 B
#   64x16 w8 s2   sm_90 128 KB, wgmma, 0 / 0 B        sm_120 100 KB: does not fit
#   32x32 w4 s2   sm_90  82 KB, mma.sync, 0 / 4 B     sm_120  82 KB, 4 / 0 B
#   16x32 w4 s2   sm_90  59 KB, mma.sync, 0 / 0 B     (16 rows: four times the KV reads of 64)
#   32x16 w4 s1   sm_90 / sm_120 68 KB, not pipelined
# Which size is fastest is the GPU's to say, so a GPU run times them all.
TILE_CONFIGS = (TileConfig(64, 32, 8, 2), TileConfig(64, 32, 8, 3), TileConfig(64, 16, 8, 2), TileConfig(32, 32, 4, 2),
                TileConfig(16, 32, 4, 2), TileConfig(32, 16, 4, 1))
TUNE_RUNS = 10  # timed launches per tile size (after one untimed), warm caches: enough to rank them
MAX_SPLITS = 128


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET, read as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def _kernels():
    """The two jitted kernels, defined at first use: triton is an optional dependency (the `peers` extra)."""
    try:
        import triton
    except ImportError:
        raise BadInput("backend triton needs the triton package (pip install -e '.[peers]')") from None

    from kdev import triton_peer_kernels as k

    return triton, k.split_attn, k.combine


def plan_splits(row_tiles: int, max_kv_tiles: int, sm_count: int) -> int:
    """One program per SM: SMs / row tiles, rounded, at least one KV tile per split and at most MAX_SPLITS."""
    if row_tiles <= 0:
        return 1
    return max(1, min(round(sm_count / row_tiles), max_kv_tiles, MAX_SPLITS))


class TritonTreeVerify:
    """Prepared once for one input set (work list, split count, buffers); __call__ launches on the current
    stream and leaves out [N_q, H, 512] bf16 and lse [N_q, H] fp32.

    Construction compiles each tile size of `configs` that this GPU holds; with `tune` (the default on a GPU,
    never in the interpreter) it times them at these inputs and keeps the fastest (`tuned`: µs per tile size),
    otherwise the first that launches. A tile size the GPU cannot hold is skipped."""

    def __init__(self, x, sm_count: int, configs: tuple | None = None, tune: bool | None = None):
        import torch

        configs = configs or TILE_CONFIGS

        self.widen = interpreting()
        tune = not self.widen if tune is None else tune
        self.triton, self.split_attn, self.combine = _kernels()
        self.x = x
        self.sm_count = sm_count
        self.prefix = [int(v) for v in x.prefix_lens.tolist()]
        ind = [int(v) for v in x.q_indptr.tolist()]
        self.sizes = [ind[b + 1] - ind[b] for b in range(len(self.prefix))]
        n_q, self.heads = x.q.shape[0], x.q.shape[1]
        self.rows_total = n_q * self.heads
        dev = x.q.device
        self.out = torch.empty(n_q, self.heads, LATENT_DIM, dtype=torch.bfloat16, device=dev)
        self.lse = torch.empty(n_q, self.heads, dtype=torch.float32, device=dev)
        self.tuned, last = {}, None
        for cfg in configs:
            self._prepare(cfg)
            try:
                self()  # compiles; refused where this GPU's shared memory cannot hold the tile
            except self.triton.runtime.errors.OutOfResources as e:
                last = e
                continue
            if not tune:
                break
            self.tuned[str(cfg)] = self._time_us()
        else:
            if self.tuned:
                best = min(self.tuned, key=self.tuned.get)
                cfg = next(c for c in configs if str(c) == best)
            else:
                raise BadInput(f"backend triton: no tile size fits this GPU ({last})")
        if cfg != self.cfg:
            self._prepare(cfg)
        self()  # out and lse hold the chosen tile size's result

    @property
    def config(self) -> TileConfig:
        """The tile size chosen (the one prepared last)."""
        return self.cfg

    def _time_us(self) -> float:
        """Mean time of TUNE_RUNS back-to-back launches, after one more (CUDA events)."""
        import torch

        self()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(TUNE_RUNS):
            self()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) * 1e3 / TUNE_RUNS

    def _prepare(self, cfg: TileConfig) -> None:
        import torch

        dev = self.x.q.device
        work = [(b, t) for b, T in enumerate(self.sizes) for t in range(-(-T * self.heads // cfg.block_m))]
        self.work = torch.tensor(work or [(0, 0)], dtype=torch.int32, device=dev).reshape(-1)
        self.programs = len(work)
        max_kv_tiles = max((-(-(L + T) // cfg.block_n) for L, T in zip(self.prefix, self.sizes)), default=1)
        self.splits = plan_splits(self.programs, max_kv_tiles, self.sm_count)
        if self.splits > 1:
            self.part_o = torch.empty(self.splits, self.rows_total, LATENT_DIM, dtype=torch.float32, device=dev)
            self.part_lse = torch.empty(self.splits, self.rows_total, dtype=torch.float32, device=dev)
        self.cfg = cfg

    def __call__(self) -> None:
        x, cfg = self.x, self.cfg
        if self.programs == 0:
            return
        direct = self.splits == 1
        o, lse = (self.out, self.lse) if direct else (self.part_o, self.part_lse)
        self.split_attn[(self.programs, self.splits)](
            x.q, x.kv_cache, x.page_table, x.prefix_lens, x.q_indptr, x.tree_mask, self.work, o, lse,
            x.scale * LOG2E, x.page_table.stride(0), x.tree_mask.shape[1], self.rows_total, self.splits,
            H=self.heads, PAGE=x.kv_cache.shape[1], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DIRECT=direct,
            WIDEN=self.widen, QK=QK_DIM, LAT=LATENT_DIM, ROPE=ROPE_DIM, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        if not direct:
            self.combine[(self.rows_total,)](self.part_o, self.part_lse, self.out, self.lse, self.rows_total,
                                             self.splits, BLOCK_S=self.triton.next_power_of_2(self.splits),
                                             LAT=LATENT_DIM, num_warps=4)
