"""Skewed batches as an engine makes them (kdev bench's engine sweep): the requests and budgets of a batch, its bounds,
the inputs each request gets, its requests alone in the same sweep, and the verdict against their sum."""

import dataclasses

import pytest
from typer.testing import CliRunner

from kdev import bench
from kdev.bench import runners
from kdev.bench.verdicts import SKEW_BOUND, judge_skew
from kdev.cli import app
from kdev.errors import BadInput


def engine():
    return bench.expand(bench.load_bench(), "engine", None, None)


def test_a_skewed_batch_has_its_requests_and_the_bounds_a_launch_is_planned_for():
    s = engine()[0]
    assert (s.batch, s.prefix, s.budget, s.page_size) == (16, 131072, 128, 1)
    assert s.prefix_lens == (131072,) + (2048,) * 15
    assert s.budget_list[:4] == (16, 64, 128, 16)  # dealt in turn
    assert s.name == "B16-L131072-N128-H8-p1-R1x131072+15x2048-N16/64/128"
    alone = {a.name for a in s.alone()}
    assert alone == {"B1-L131072-N16-H8-p1", "B1-L2048-N64-H8-p1", "B1-L2048-N128-H8-p1", "B1-L2048-N16-H8-p1"}
    assert alone <= {x.name for x in engine()}  # timed in the same sweep
    assert s.count(2048, 64) == 5 and s.count(2048, 16) == 5 and s.count(131072, 16) == 1


def test_uniform_shapes_are_what_they_were():
    s = bench.expand(bench.load_bench(), "targets", None, None)[0]
    assert s.name == "B1-L32768-N64-H8-p64" and s.prefix_lens == (32768,) and s.budget_list == (64,)


def test_each_request_gets_its_own_prefix_and_tree():
    s = engine()[2]  # 2 x 32K + 6 x 8K, budgets 64 and 16 in turn, page size 1
    x, sizes, lens = runners.make_inputs(s, seed=3, device="cpu")
    assert lens == [32768] * 2 + [8192] * 6 and sizes == [65, 17] * 4
    assert x.max_qlen == 65 and x.max_kv_len == 32768 + 65
    assert x.page_table.shape == (8, 32768 + 65) and x.q.shape[0] == sum(sizes)
    assert x.prefix_lens.tolist() == lens


def test_a_batch_is_judged_against_its_requests_alone():
    s = engine()[2]

    def result(shape, us):
        return {"shape": shape.name, "backend": "flash-hostplan", "axes": dataclasses.asdict(shape),
                "timing": {"median_us": us}}

    alone = {a.name: 10.0 * (i + 1) for i, a in enumerate(s.alone())}
    want = sum(s.count(a.prefix, a.budget) * alone[a.name] for a in s.alone())
    results = [result(s, want * 1.05), *(result(a, alone[a.name]) for a in s.alone())]
    (row,) = judge_skew(results)
    assert row["alone_sum_us"] == pytest.approx(want) and row["ratio"] == pytest.approx(1.05) and row["within"]
    results[0]["timing"]["median_us"] = want * (1 + SKEW_BOUND) * 1.01
    assert not judge_skew(results)[0]["within"]
    assert judge_skew(results[:2]) == []  # a request alone not timed: no verdict


@pytest.mark.parametrize("bad,why", [
    ("requests=1x131072+15,heads=8", "not COUNTxPREFIX"),
    ("requests=1x1024,budgets=16/x", "budgets joined by /"),
    ("budgets=16/64", "takes requests"),
    ("requests=1x9999999", "out of range"),
])
def test_a_bad_skewed_shape_is_one_line(bad, why):
    with pytest.raises(BadInput, match=why):
        bench.expand(bench.load_bench(), None, [bad], None)
    r = CliRunner().invoke(app, ["plan", "--gpu", "h200", "--shape", bad])
    assert r.exit_code == 2 and why in r.output


def test_the_flex_peer_matches_the_float64_reference_on_the_cpu():
    """torch FlexAttention as a bench peer (document masking over the batch, the tree mask by table): eager on the CPU,
    it gives the reference's outputs and LSEs on a skewed batch with pages of 16."""
    import warnings

    from kdev import mla

    s = bench.expand(bench.load_bench(), None, ["requests=2x300+1x150,budgets=8/16,heads=3,page_size=16"], None)[0]
    x, sizes, _ = runners.make_inputs(s, seed=5, device="cpu")
    r = runners.make_runner("torch-flex", x, None, {})
    r.poison()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex says it is not the fused kernel
        r.run()
    out, lse = mla.reference_verify_attn(x.q, x.kv_cache, x.page_table, x.prefix_lens, x.q_indptr, x.tree_mask,
                                         x.scale)
    assert r.out.shape == out.shape and not r.out.isnan().any()
    assert (r.out.double() - out).abs().max() < 2e-2 and (r.lse.double() - lse).abs().max() < 1e-4
    # a flipped ancestor bit moves the rows it belongs to: the mask reaches the peer
    x.tree_mask[sizes[0] + 3] ^= 1  # request 1's node 3 sees (or stops seeing) that request's root
    flipped = runners.make_runner("torch-flex", x, None, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flipped.run()
    moved = (flipped.out.float() - r.out.float()).abs().amax(dim=(1, 2)) > 1e-3
    assert moved.nonzero().flatten().tolist() == [sizes[0] + 3]


# ---- replays at a capture's bounds (the replay sweep)
def replay():
    return bench.expand(bench.load_bench(), "replay", None, None)


def test_a_captured_shape_is_made_with_the_capture_s_bounds_and_its_twin_joins_the_sweep():
    shapes = replay()
    s = shapes[0]
    assert s.name == "B1-L32768-N64-H8-p64-C131072/128" and s.bounds == (131072 + 129, 129)
    assert s.own().name == "B1-L32768-N64-H8-p64" and s.own().bounds is None
    names = {x.name for x in shapes}
    assert all(x.own().name in names for x in shapes if x.capture)
    x, sizes, lens = runners.make_inputs(s, seed=5, device="cpu")
    assert (x.max_kv_len, x.max_qlen) == s.bounds and max(sizes) <= 65
    # the call's contract at those bounds: page table, pool and mask rows as wide as they need
    assert x.page_table.shape[1] * 64 >= x.max_kv_len and x.kv_cache.shape[0] * 64 >= x.max_kv_len
    assert x.tree_mask.shape[1] >= -(-x.max_qlen // 64)
    own, own_sizes, _ = runners.make_inputs(s.own(), seed=5, device="cpu")
    assert own_sizes == sizes and (own.max_kv_len, own.max_qlen) == (32768 + max(sizes), max(sizes))


@pytest.mark.parametrize("capture,match", [("131072", "PREFIX/BUDGET"), ("1000/128", "smaller than the batch"),
                                           ("131072/8", "smaller than the batch"), ("999999/64", "out of range")])
def test_a_capture_that_cannot_hold_the_batch_is_refused(capture, match):
    with pytest.raises(BadInput, match=match):
        bench.expand(bench.load_bench(), None, ["B=1,L=32768,N=64,H=8"], [f"capture={capture}"])


def test_a_replay_is_judged_against_its_twin():
    from kdev.bench.verdicts import CAPTURE_BOUND, judge_capture

    s = replay()[0]
    rows = [{"shape": x.name, "backend": "flash", "axes": dataclasses.asdict(x),
             "timing": {"median_us": t}} for x, t in ((s, 104.0), (s.own(), 100.0))]
    (k,) = judge_capture(rows)
    assert (k["ratio"], k["within"], k["own_shape"]) == (1.04, True, s.own().name)
    rows[0]["timing"]["median_us"] = 100.0 * (1 + CAPTURE_BOUND) + 1
    assert not judge_capture(rows)[0]["within"]
    assert judge_capture(rows[:1]) == []  # the twin not timed: no verdict
