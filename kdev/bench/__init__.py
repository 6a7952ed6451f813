"""kdev bench: timing method, DDTree sweeps, roofline, peers, baseline comparison.

Separate concerns, one module each (as in nvbench): the sweep (sweeps: configs/bench.yaml -> shapes), the backends
(runners: a registry by name), the measurement (measure: cold-L2 samples timed with CUDA events, stopped on a noise
target or a time limit, throttled samples dropped; ceilings: this GPU's), a run (run), the verdicts (verdicts:
roofline, speedups, targets, baseline) and stored results (results: JSON, CSV, plots). This package re-exports the
names other modules use, listed below by the module that owns each, so `from kdev import bench; bench.expand(...)`
reads as before and a reader sees where a name lives.

Shapes: batch B, prefix L, budget N (T = N + 1 tree rows from a DDTree built by the reference over
synthetic drafter distributions), heads H, page size, tree kind. Inputs are random on the GPU (never zeros)
and the page table is shuffled. FLOPs = 2·H·Σ_b T_b·(L_b+T_b)·(576+512); bytes >= Σ_b (L_b+T_b)·576·2 + q + out.

Peers: triton (kdev/triton_peer.py: the flash kernel's tiling written in Triton, split-KV included; it reads the
paged cache itself, like the flash and naive kernels; needs the `peers` extra), torch-eager (float32 einsum with
the mask) and torch-sdpa (scaled_dot_product_attention with a boolean mask); the torch peers get the request's KV
gathered into contiguous tensors before timing. A `--peer module:function` is called as
    fn(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale) -> out  or  (out, lse)
with the contract's tensors (docs/architecture.md §2) and must return out [N_q, H, 512] (any float dtype).
Every backend's output is checked against the naive oracle before it is timed, and the output of its last
timed run (written over NaN) after; one that disagrees is reported and not ranked.
"""

from kdev.bench.ceilings import load_ceilings, measure_ceilings, measure_inner_loops
from kdev.bench.results import load_results
from kdev.bench.run import run_bench, run_tree_bench
from kdev.bench.runners import LAYER_BACKENDS, RUNNERS, AbiRunner, make_inputs, make_runner
from kdev.bench.sweeps import (ATTENTION_BACKENDS, PEER_LSE_TOLERANCE, TREE_BACKENDS, Shape, expand, flops_bytes,
                               load_bench)
from kdev.bench.verdicts import baseline_verdicts, judge_targets

__all__ = ["load_ceilings", "measure_ceilings", "measure_inner_loops", "load_results", "run_bench", "run_tree_bench",
           "LAYER_BACKENDS", "RUNNERS", "AbiRunner", "make_inputs", "make_runner", "ATTENTION_BACKENDS",
           "PEER_LSE_TOLERANCE", "TREE_BACKENDS", "Shape", "expand", "flops_bytes", "load_bench", "baseline_verdicts",
           "judge_targets"]
