"""The triton bench peer against the float64 reference on ragged batches, pages of 1, 16 and 64 tokens, split and
unsplit plans, outputs poisoned with NaN first. Without a GPU its kernels run in Triton's interpreter (conftest.py
chooses it), with one compiled on it."""

import pytest
import torch

from kdev import abi, bench, cases, triton_peer
from kdev.compare import compare
from kdev.config import CaseSpec, Tolerances, TreeSpec

triton = pytest.importorskip("triton", reason="the triton peer needs the `peers` extra (pip install -e '.[peers]')")

_TOL = Tolerances(out=bench.load_bench().method.tolerance, lse=bench.PEER_LSE_TOLERANCE)


DEVICE = "cpu" if triton_peer.interpreting() else "cuda"


def _case(prefix_lens, tree, heads, page_size, seed):
    spec = CaseSpec("triton-peer", tuple(prefix_lens), tree, heads, page_size, seed, "kimi-k2.6", _TOL)
    case = cases.generate_case(spec)
    return abi.VerifyInputs.from_case(case.tensors, case.scale, DEVICE), case.golden64


@pytest.mark.parametrize("prefix_lens, tree, heads, page_size, tile, sms, want_splits", [
    # ragged DDTree batch, pages of 64, a split plan (the combine kernel runs)
    ((130, 7, 64), TreeSpec("ddtree", budget=12, depth=6, topk=4, vocab=500), 4, 64,
     triton_peer.TileConfig(16, 16, 4, 1), 24, 2),
    # pages of one token, a chain that crosses row tiles, one split (direct stores)
    ((45,), TreeSpec("chain", nodes=9), 2, 1, triton_peer.TileConfig(16, 16, 4, 1), 1, 1),
    # 32-row tiles over 16 heads: a tile holds two nodes with different masks; 32-token KV steps
    ((40, 0), TreeSpec("random", nodes=11), 16, 16, triton_peer.TileConfig(32, 32, 4, 2), 40, 2),
    # a 150-node tree over one head: mask rows of three 64-bit words, the tree spanning several KV steps
    ((20,), TreeSpec("random", nodes=150), 1, 16, triton_peer.TileConfig(16, 16, 4, 1), 3, 1),
    # the tile list bench uses (64 x 32 first), a DDTree over 8 heads, 9 splits
    ((300,), TreeSpec("ddtree", budget=16, depth=8, topk=4, vocab=500), 8, 64, None, 24, None),
])
def test_the_triton_peer_matches_the_float64_reference(prefix_lens, tree, heads, page_size, tile, sms,
                                                      want_splits):
    x, golden = _case(prefix_lens, tree, heads, page_size, seed=11)
    if tile is None:
        peer = triton_peer.TritonTreeVerify(x, sm_count=sms)
        assert peer.config in triton_peer.TILE_CONFIGS and peer.splits > 1
    else:
        peer = triton_peer.TritonTreeVerify(x, sm_count=sms, configs=(tile,))
        assert peer.config == tile and peer.splits == want_splits
    peer.out.fill_(float("nan"))
    peer.lse.fill_(float("nan"))
    peer()  # every row written again over NaN
    c = compare("out", peer.out.float(), golden["out"], _TOL.out)
    assert c.passed, c.reason
    c = compare("lse", peer.lse, golden["lse"], _TOL.lse)
    assert c.passed, c.reason


def test_a_wrong_mask_bit_fails_the_comparison():
    """The comparison can fail: mask rows that let every leaf of a star see its siblings give other outputs."""
    x, golden = _case((4,), TreeSpec("star", nodes=6), 2, 16, seed=3)
    x.tree_mask[:, 0] = 0b111111
    peer = triton_peer.TritonTreeVerify(x, sm_count=1, configs=(triton_peer.TileConfig(16, 16, 4, 1),))
    assert not compare("out", peer.out.float(), golden["out"], _TOL.out).passed


def test_split_plan_fills_the_sms_once():
    assert triton_peer.plan_splits(9, 1026, 132) == 15  # B1 L32K N64 H8: 9 row tiles
    assert triton_peer.plan_splits(65, 1026, 132) == 2  # H64
    assert triton_peer.plan_splits(80, 258, 132) == 2  # B16 L8K N32 H8
    assert triton_peer.plan_splits(200, 258, 132) == 1
    assert triton_peer.plan_splits(1, 3, 132) == 3  # never more splits than KV tiles
    assert triton_peer.plan_splits(1, 10_000, 1000) == triton_peer.MAX_SPLITS


def test_the_first_tile_size_the_gpu_holds_is_kept(monkeypatch):
    x, _ = _case((10,), TreeSpec("chain", nodes=3), 2, 16, seed=1)
    big, small = triton_peer.TileConfig(64, 32, 8, 2), triton_peer.TileConfig(16, 16, 4, 1)
    launch = triton_peer.TritonTreeVerify.__call__

    def refuse_big(self):
        if self.cfg == big:
            raise triton.runtime.errors.OutOfResources(200_000, 101_376, "shared memory")
        launch(self)

    monkeypatch.setattr(triton_peer.TritonTreeVerify, "__call__", refuse_big)
    assert triton_peer.TritonTreeVerify(x, sm_count=4, configs=(big, small)).config == small
    with pytest.raises(Exception, match="no tile size fits"):
        triton_peer.TritonTreeVerify(x, sm_count=4, configs=(big,))


def test_bench_lists_the_triton_peer():
    assert "triton" in bench.ATTENTION_BACKENDS
    assert "triton" in bench.load_bench().backends


_AOT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kdev import triton_peer_kernels as k

cap, bm, bn, warps, stages = map(int, sys.argv[1:6])
sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "table_ptr": "*i32", "prefix_ptr": "*i32", "indptr_ptr": "*i32",
       "mask_ptr": "*i64", "work_ptr": "*i32", "o_ptr": "*fp32", "lse_ptr": "*fp32", "scale_log2": "fp32",
       "table_stride": "i32", "mask_words": "i32", "rows_total": "i32", "splits": "i32"}
const = {"H": 8, "PAGE": 64, "BLOCK_M": bm, "BLOCK_N": bn, "DIRECT": False, "WIDEN": False, "QK": 576, "LAT": 512,
         "ROPE": 64}
sig.update({name: "constexpr" for name in const})
# what the JIT assumes on a GPU of torch's tensors (16-byte aligned): without it no load is vectorised or pipelined
aligned = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(sig.values()) if kind.startswith("*")}
c = triton.compile(ASTSource(k.split_attn, sig, const, attrs=aligned), target=GPUTarget("cuda", cap, 32),
                   options={"num_warps": warps, "num_stages": stages})
kv_step = re.compile(rf"async_copy_global_to_local[^\n]*tensor<{bn}x512x!tt\.ptr<bf16>")
comb_sig = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "rows_total": "i32",
            "splits": "i32", "BLOCK_S": "constexpr", "LAT": "constexpr"}
triton.compile(ASTSource(k.combine, comb_sig, {"BLOCK_S": 16, "LAT": 512}), target=GPUTarget("cuda", cap, 32),
               options={"num_warps": 4})
print(json.dumps({"shared": c.metadata.shared, "wgmma": "wgmma" in c.asm["ptx"], "mma_sync": "mma.sync" in c.asm["ptx"],
                  "kv_pipelined": bool(kv_step.search(c.asm["ttgir"]))}))
"""


@pytest.mark.parametrize("cap, tile, fits, tensor_op", [
    (90, triton_peer.TILE_CONFIGS[0], True, "wgmma"),
    (120, triton_peer.TileConfig(32, 32, 4, 2), True, "mma_sync"),
    (120, triton_peer.TILE_CONFIGS[0], False, "mma_sync"),
])
def test_the_triton_kernel_compiles_for_both_archs_without_a_gpu(cap, tile, fits, tensor_op):
    """What the interpreter cannot say: Triton compiles the kernels for sm_90 (wgmma) and sm_120 (mma.sync), the KV
    steps' loads are pipelined (asynchronous copies into shared memory, as on a GPU), and the tile list holds a size
    within sm_120's 101,376 B of shared memory per block."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    args = [str(v) for v in (cap, tile.block_m, tile.block_n, tile.num_warps, tile.num_stages)]
    run = subprocess.run([sys.executable, "-c", _AOT, *args], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got[tensor_op] and got["kv_pipelined"], got
    limit = {90: 232_448, 120: 101_376}[cap]  # dynamic shared memory a block may opt in to
    assert (got["shared"] <= limit) == fits, got


def test_bench_refuses_a_missing_triton_asked_for_and_leaves_it_out_of_the_defaults(monkeypatch):
    """Backends are checked before the GPU is looked for: a bad one is exit 2 on any machine."""
    from typer.testing import CliRunner

    from kdev.cli import app

    monkeypatch.setattr(triton_peer, "available", lambda: False)
    r = CliRunner().invoke(app, ["bench", "--sweep", "smoke", "--backend", "flash,triton"])
    assert r.exit_code == 2 and "triton needs the triton package" in r.stderr and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["bench", "--sweep", "smoke", "--backend", "flash,nope"])
    assert r.exit_code == 2 and "unknown backend 'nope'" in r.stderr
    if not torch.cuda.is_available():  # the defaults name triton: without a GPU, that is the one thing said
        r = CliRunner().invoke(app, ["bench", "--sweep", "smoke"])
        assert r.exit_code == 3 and "the triton peer is left out" not in r.output and "no CUDA GPU" in r.stderr


def test_the_bench_runner_wraps_the_peer(monkeypatch):
    """bench's TritonRunner as run_bench drives it: constructed (the SM count from the device), poisoned, run."""
    from types import SimpleNamespace

    x, golden = _case((50, 3), TreeSpec("chain", nodes=5), 4, 16, seed=2)
    if DEVICE == "cpu":
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(multi_processor_count=12))
        monkeypatch.setattr(triton_peer, "TILE_CONFIGS", (triton_peer.TileConfig(16, 16, 4, 1),))  # quick to run
    runner = bench.make_runner("triton", x, None, {})
    assert runner.splits >= 1 and runner.tiles in {str(c) for c in triton_peer.TILE_CONFIGS}
    assert (runner.tiles_tuned is None) == (DEVICE == "cpu")  # tuned on a GPU only
    runner.poison()
    assert torch.isnan(runner.out.float()).all() and torch.isnan(runner.lse).all()
    runner.run()
    assert compare("out", runner.out.float(), golden["out"], _TOL.out).passed
    assert compare("lse", runner.lse, golden["lse"], _TOL.lse).passed
