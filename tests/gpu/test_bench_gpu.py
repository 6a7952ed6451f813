"""kdev bench on the GPU: the smoke sweep runs every backend and every output agrees with the naive oracle. (The triton
peer's tests are tests/test_triton_peer.py, compiled on a GPU: gpu-round runs them in a process of their own.)"""

import pytest

from kdev import abi, bench
from kdev.errors import BadInput

pytestmark = pytest.mark.gpu


def test_smoke_sweep_runs_every_backend_and_all_agree(lib):
    cfg = bench.load_bench()
    shapes = bench.expand(cfg, "smoke", None, None)
    backends = ["flash", "naive", "torch-eager", "torch-sdpa"]
    results, prov = bench.run_bench(shapes, backends, cfg, lib, {}, seed=3)
    assert len(results) == len(shapes) * len(backends)
    for r in results:
        assert r.agrees, (r.shape, r.backend, r.check)
        t = r.timing
        assert t["samples"] >= 3 and t["p10_us"] <= t["median_us"] <= t["p90_us"] and t["median_us"] > 0
        assert r.flops > 0 and r.bytes > 0
    assert prov["gpu"]["arch"].startswith("sm_") and prov["build_info"]["source_hash"]


def test_a_wrong_peer_is_reported_not_ranked(lib):
    import torch

    def wrong(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale):
        return torch.zeros(q.shape[0], q.shape[1], 512, device=q.device) + 0.5

    cfg = bench.load_bench()
    shape = bench.expand(cfg, None, ["B=1,L=2048,N=16,H=8"], None)
    results, _ = bench.run_bench(shape, ["flash", "wrong"], cfg, lib, {"wrong": wrong}, seed=1)
    by = {r.backend: r for r in results}
    assert by["flash"].agrees and by["flash"].timing
    assert not by["wrong"].agrees and by["wrong"].timing is None and "disagrees with naive" in by["wrong"].check


def test_a_peer_that_raises_is_reported_and_the_run_goes_on(lib):
    def broken(q, kv_cache, page_table, prefix_lens, q_indptr, tree_mask, scale):
        raise RuntimeError("cannot compile here\nsecond line")

    cfg = bench.load_bench()
    shape = bench.expand(cfg, None, ["B=1,L=2048,N=16,H=8"], None)
    results, _ = bench.run_bench(shape, ["broken", "flash"], cfg, lib, {"broken": broken}, seed=1)
    by = {r.backend: r for r in results}
    assert by["broken"].check == "failed: RuntimeError: cannot compile here" and by["broken"].timing is None
    assert by["flash"].agrees and by["flash"].timing


def test_a_kernel_from_a_second_library_runs_beside_the_first_in_one_run(lib, tmp_path):
    """flash@REF: a copy of the library (another file, so a second instance of the library and of its CUDA runtime
    in this process, as an A/B base is) and a copy of kernels/ (built for this GPU on first use) are checked against
    naive and timed in the same run as the first."""
    import shutil

    from kdev import build as kbuild

    copy = tmp_path / "base" / lib.path.name
    copy.parent.mkdir()
    shutil.copy2(lib.path, copy)
    tree = tmp_path / "tree" / "kernels"
    shutil.copytree(kbuild.KERNEL_DIR, tree)
    # sources of its own: a copy equal to kernels/ would be this checkout's build of the config, reused as it is
    with open(tree / "verify_attn.cu", "a") as f:
        f.write("// a copy under test\n")
    cfg = bench.load_bench()
    shape = bench.expand(cfg, None, ["B=2,L=3000,N=16,H=8"], None)
    backends = ["flash", f"flash@{copy.parent}", f"flash-portable@{copy}", f"flash@{tree}"]
    others = abi.load_kernel_refs(backends)
    assert others[f"flash@{tree}"][0].build_info["variant"] is True
    results, prov = bench.run_bench(shape, backends, cfg, lib, {}, seed=4, others=others)
    by = {r.backend: r for r in results}
    assert all(r.agrees and r.timing for r in results), [(r.backend, r.check) for r in results]
    assert by[f"flash@{copy.parent}"].splits == by["flash"].splits > 1  # the split plan and its combine ran there too
    assert prov["libraries"][f"flash@{copy.parent}"]["library"] == str(copy)


def test_graph_replays_are_checked_and_timed_for_every_kind_of_backend(lib):
    """bench --graph: each backend's call captured once into a CUDA graph and its replays timed; the outputs the
    last replay wrote over NaN are checked against naive as in eager timing."""
    from dataclasses import replace

    cfg = bench.load_bench()
    cfg = replace(cfg, method=replace(cfg.method, graph=True, max_seconds=1.0))
    shape = bench.expand(cfg, None, ["B=2,L=3000,N=16,H=8"], None)
    backends = ["flash", "flash-portable", "naive", "torch-eager", "torch-sdpa"]
    results, prov = bench.run_bench(shape, backends, cfg, lib, {}, seed=6)
    assert prov["method"]["graph"] is True and [r.backend for r in results] == backends
    assert all(r.agrees and r.timing and r.timing["samples"] >= 3 for r in results), [(r.backend, r.check)
                                                                                       for r in results]
    tree = bench.expand(cfg, None, ["B=2,L=1000,N=16"], None)
    for r in bench.run_tree_bench(tree, list(bench.TREE_BACKENDS), cfg, lib, seed=6)[0]:
        assert r.agrees and r.timing["median_us"] > 0, (r.backend, r.check)


def test_ab_against_a_copy_of_the_library_finds_the_same_code_and_the_same_bits(lib, tmp_path, monkeypatch):
    """kdev ab with REF a copy of this library: identical machine code, both builds pass the smoke suite with the
    same bits at every comparison, and one verdict per shape from a run that timed both."""
    import shutil
    from dataclasses import replace

    from kdev import ab

    monkeypatch.setenv("KDEV_LEDGER", str(tmp_path / "ledger"))
    copy = tmp_path / "base" / lib.path.name
    copy.parent.mkdir()
    shutil.copy2(lib.path, copy)
    cfg = bench.load_bench()
    cfg = replace(cfg, method=replace(cfg.method, max_seconds=1.0))
    shapes = bench.expand(cfg, None, ["B=2,L=3000,N=16,H=8", "B=1,L=2000,N=64,H=8,page=1"], None)
    doc = ab.run_ab(str(copy), ["flash"], shapes, cfg, lib.path, seed=7)
    assert doc["passed"] and doc["verify"][0]["same_bits"] == doc["verify"][0]["comparisons"] > 0
    assert "skipped" in doc["sass"] or doc["sass"]["differ"] == []
    assert [v["shape"] for v in doc["verdicts"]] == [s.name for s in shapes]
    assert {r["backend"] for r in doc["bench"]["results"]} == {"flash", f"flash@{copy}", "naive"}
    # the copy as the candidate (kdev ab --candidate): this build is the base, the copy's kernels are judged
    doc = ab.run_ab(str(copy), ["flash"], shapes[:1], cfg, lib.path, seed=7, ref_is_candidate=True)
    assert doc["ref_is"] == "candidate" and doc["candidate"]["library"] == str(copy)
    assert doc["passed"] and doc["verify"][0]["kernel"] == f"flash@{copy}" and doc["verify"][0]["against"] == "flash"
    assert doc["verify"][0]["same_bits"] == doc["verify"][0]["comparisons"] > 0
    assert [v["shape"] for v in doc["verdicts"]] == [shapes[0].name]


def test_tree_kernel_bench_checks_against_the_reference_and_times(lib):
    cfg = bench.load_bench()
    shapes = bench.expand(cfg, None, ["B=2,L=1000,N=16", "B=3,L=70,N=64,page=1"], None)
    results, _ = bench.run_tree_bench(shapes, list(bench.TREE_BACKENDS), cfg, lib, seed=5)
    assert len(results) == 2 * len(bench.TREE_BACKENDS)
    for r in results:
        assert r.agrees, (r.shape, r.backend, r.check)
        assert r.timing["median_us"] > 0
        if r.backend == "compact":
            assert r.bytes >= 2 * 1152 * 2  # at least each request's root row, read and written


def test_inner_loop_ceilings_are_below_the_peak_and_reject_a_bad_index(lib):
    import ctypes

    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    peak = 0.0
    loops = bench.measure_inner_loops(lib, device, peak)
    names = [r["loop"] for r in loops]
    assert len(names) == len(set(names)) >= 4
    for r in loops:
        assert r["warps_per_sm"] in (8, 16), r
        if not r["runs"]:  # more stages than the shared memory per block holds (sm_120), bulk or tensor copies
            # before sm_90
            assert any(k in r["loop"] for k in ("stages", "bulk", "tma")) and r["flops"] is None, r
            continue
        if r["mma_per_warp_tile"]:
            assert r["flops"] > 1e12, r
        else:  # a copy-only loop
            assert r["flops"] == 0 and r["copy_bytes_per_s"] > 1e11, r
        assert r["of_peak"] is None  # no peak given, no fraction invented
    # an inner loop is the peak microbenchmark's work with less parallelism: it cannot beat it by more than noise
    c = bench.measure_ceilings(lib, device)
    for r in c["inner_loops"]:
        assert not r["runs"] or 0.0 <= r["of_peak"] <= 1.05, r
    L = lib.lib
    sink = torch.zeros(512, device=device)
    gathers = names.index(next(n for n in names if "gather" in n))
    assert L.kdtree_bench_loop(len(loops), 1, 1, None, 0, ctypes.c_void_p(sink.data_ptr()), None) == 1
    assert L.kdtree_bench_loop(0, 1, 0, None, 0, ctypes.c_void_p(sink.data_ptr()), None) == 1
    assert L.kdtree_bench_loop(gathers, 1, 1, None, 0, ctypes.c_void_p(sink.data_ptr()), None) == 1  # no source
    assert L.kdtree_bench_loop_name(-1) is None and L.kdtree_bench_loop_warps(len(loops)) == 0
    # one rung by name (what a profiler run uses), and a name the library lacks answered with the list
    one = bench.measure_inner_loops(lib, device, 0.0, only=[names[3]])
    assert [r["loop"] for r in one] == [names[3]] and one[0]["flops"] > 1e12
    with pytest.raises(BadInput, match="it has: 'regs 8w'"):
        bench.measure_inner_loops(lib, device, 0.0, only=["no such rung"])


def test_a_baseline_from_another_gpu_is_refused_before_anything_is_timed(lib, tmp_path):
    import json

    from typer.testing import CliRunner

    from kdev import gpu
    from kdev.cli import app

    here = gpu.current_gpu().name
    other = {"provenance": {"gpu": {"name": f"not {here}", "arch": "sm_90"}, "ceilings": None}, "sweep": "smoke",
             "results": []}
    (tmp_path / "other.json").write_text(json.dumps(other))
    r = CliRunner().invoke(app, ["bench", "--shape", "B=1,L=64,N=4,H=8", "--backend", "naive", "--library",
                                 str(lib.path), "--baseline", str(tmp_path / "other.json")])
    assert r.exit_code == 2 and f"was timed on not {here}, this run on {here}" in r.stderr, r.output
