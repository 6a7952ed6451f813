"""kdev bench on the GPU: the smoke sweep runs every backend and every output agrees with the naive oracle."""

import pytest

from kdev import bench

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
