"""kdev plan without a GPU: the library's launch plan at the target shapes for GPUs that are not here (the H200's
plans are the grids measured there, kernels/NOTES.md), its arithmetic, and bad input as one line."""

import dataclasses
import json
import types

import pytest
from typer.testing import CliRunner

from kdev import bench, config
from kdev import plan as kplan
from kdev.cli import app
from kdev.errors import BadInput, EnvironmentMissing

# The seven target shapes on the H200: (splits, full-tile CTAs, narrow CTAs, waves of full-tile CTAs), as Nsight
# Compute and the timeline probe saw the grids there (NOTES.md: "where a v24 call's time goes", "the timeline probe
# run"), except B4 and B16, whose narrow tiles have their own split count since v29 (the entry "flash v29").
H200_TARGETS = {
    "B1-L32768-N64-H8-p64": (15, 120, 8, 1),
    "B1-L131072-N64-H8-p64": (31, 248, 16, 2),
    "B4-L32768-N64-H8-p64": (4, 128, 192, 1),
    "B16-L8192-N32-H8-p64": (2, 128, 160, 1),
    "B1-L32768-N16-H8-p64": (52, 104, 26, 1),
    "B1-L32768-N128-H8-p64": (8, 128, 4, 1),
    "B1-L32768-N64-H64-p64": (2, 130, 0, 1),
}


@pytest.fixture(scope="module")
def library(both_archs):  # both_archs skips where there is no nvcc
    return kplan.PlanLibrary(both_archs[1].library)


def targets(**axes):
    """The seven target shapes whose grids were measured (the targets' DDTree budgets of 256 and 512 joined later)."""
    measured = {name.rsplit("-p", 1)[0] for name in H200_TARGETS}
    return [s for s in bench.expand(bench.load_bench(), "targets", None, [f"{k}={v}" for k, v in axes.items()])
            if s.name.rsplit("-p", 1)[0] in measured]


def test_h200_plans_are_the_grids_measured_there(library):
    gpu = kplan.resolve_gpu("h200")
    doc = kplan.plan(library, targets(), gpu)
    got = {p["shape"]: (p["splits"], p["full_ctas"], p["narrow_ctas"], p["waves"]) for p in doc["plans"]}
    assert got == H200_TARGETS
    for p in doc["plans"]:
        B, T, H = p["axes"]["batch"], p["axes"]["budget"] + 1, p["axes"]["heads"]
        assert p["full_kernel"] == "verify_attn_flash_teams_kernel" and 101376 < p["full_smem"] <= 232448
        assert p["ctas_per_sm"] == 1  # 255 registers x 256 threads: the whole register file
        assert p["workspace_bytes"] == workspace_bytes(p["splits"], p["narrow_splits"], B, T * H)
        assert p["kv_read_bytes"] == p["row_tiles"] * p["kv_bytes"] == p["row_tiles"] * B * (p["axes"]["prefix"] + T) * 1152
        assert 0 < p["slot_use"] <= 1 and 0 < p["row_use"] <= 1
    floor = {p["shape"]: p["floor_us"] for p in doc["plans"]}
    # the targets' roofline floors (58, 233, 233, 119, 15, 116, 465 µs, rounded its own way) from 638 TFLOP/s and 3,984 GB/s
    issue = [58, 233, 233, 119, 15, 116, 465]
    assert all(abs(floor[s] - f) < 1 for s, f in zip(H200_TARGETS, issue)), floor
    assert doc["largest_workspace"] == {"shape": "B1-L131072-N64-H8-p64", "bytes": workspace_bytes(31, 16, 1, 65 * 8)}


def test_an_h100_plans_the_h200s_grids(library):
    """The same chip (132 SMs, 227 KB per block): a round that lands on an H100 launches what the H200 does, so its
    A/B ratios speak of the H200's grids; only the memory (and so the times) differ."""
    h100 = kplan.resolve_gpu("h100")
    assert (h100.arch, h100.sms, h100.ceilings_measured) == ("sm_90", 132, True)  # its own ceilings, measured there
    got = {p["shape"]: (p["splits"], p["full_ctas"], p["narrow_ctas"], p["waves"])
           for p in kplan.plan(library, targets(), h100)["plans"]}
    assert got == H200_TARGETS


def workspace_bytes(splits: int, narrow_splits: int, batch: int, rows: int, sms: int = 132) -> int:
    """kernels/include/kdev/flash_plan.cuh's layout, derived again: the schedule (16 B, 16 per request, per full-tile CTA
    and per narrow CTA), then fp32 partial O and LSE rows for the full-tile CTAs (64 per row tile x split of every
    request, or two waves of CTAs' worth with one split) and the narrow ones (16 per narrow CTA), parts 256-byte aligned.
    The grids: the host plan's full-tile CTAs or one per SM, whichever is more; its narrow CTAs."""
    def align(n):
        return -(-n // 256) * 256
    m_tiles = -(-rows // 64)
    narrow = 1 if narrow_splits else 0
    units = max(batch * (m_tiles - narrow) * splits, sms)
    narrow_units = batch * narrow_splits
    full_rows = 64 * (batch * m_tiles * splits if splits > 1 else min(units, 2 * sms))
    head = align(16 + 16 * batch + 16 * units + 16 * narrow_units)
    full = align(full_rows * 513 * 4)
    return align(head + full + 16 * narrow_units * 513 * 4)


def test_the_sm120_plan_takes_the_lockstep_kernels_within_99_kb(library):
    gpu = kplan.resolve_gpu("rtx-pro-6000")
    assert (gpu.arch, gpu.sms, gpu.smem_per_block_optin) == ("sm_120", 188, 101376)
    for page_size, kernel in ((64, "verify_attn_flash_kernel<true>"), (1, "verify_attn_flash_kernel<false>")):
        for p in kplan.plan(library, targets(page_size=page_size), gpu)["plans"]:
            assert p["full_kernel"] == kernel and p["full_smem"] <= 101376 and p["ctas_per_sm"] == 1
            assert p["narrow_kernel"] in (None, f"verify_attn_flash_narrow_kernel<{str(page_size == 64).lower()}, false>")
    # the flash-portable call on the H200 plans what sm_120 runs, at the H200's size
    portable = kplan.plan(library, targets(), kplan.resolve_gpu("h200"), "flash-portable")["plans"]
    assert {p["full_kernel"] for p in portable} == {"verify_attn_flash_kernel<true>"}
    assert [p["splits"] for p in portable] == [v[0] for v in H200_TARGETS.values()]


def test_more_sms_more_splits_same_rows(library):
    shape = bench.expand(bench.load_bench(), None, ["B=1,L=32768,N=64,H=8"], None)
    small, big = (kplan.plan_shape(library, shape[0], kplan.resolve_gpu("h200", sms=n)) for n in (66, 264))
    assert small.row_tiles == big.row_tiles == 9 and small.narrow_rows == big.narrow_rows == 8
    assert small.splits < big.splits and small.workspace_bytes < big.workspace_bytes


@pytest.mark.parametrize("kv_len,splits", [(32833, 15), (8225, 7), (65, 3), (100, 4), (1025, 64)])
def test_split_tiles_cover_the_range_in_whole_tiles(kv_len, splits):
    tiles = kplan.split_tiles(kv_len, splits)
    assert len(tiles) == splits and sum(tiles) == -(-kv_len // 32)
    # equal chunks, the last one shorter; past the range's end (more splits than chunks) empty ones
    assert tiles == sorted(tiles, reverse=True) and len(set(tiles) - {0, tiles[0]}) <= 1


def test_the_library_refuses_a_shape_it_would_refuse_to_launch(library):
    gpu = kplan.resolve_gpu("h200")
    with pytest.raises(BadInput, match="max_qlen 1026 outside 1..1025"):
        library.split_plan(1, 1026, 8, 1026, 5000, 64, gpu)
    with pytest.raises(BadInput, match="total_q 9 inconsistent with batch 2 and max_qlen 4"):
        library.split_plan(2, 9, 8, 4, 5000, 64, gpu)
    # a bound, not the largest tree: a graph captured for 129-node trees replays one of 65 nodes
    assert library.split_plan(1, 65, 8, 129, 5000, 64, gpu) == library.split_plan(1, 129, 8, 129, 5000, 64, gpu)
    with pytest.raises(BadInput, match="sm_count 0 < 1"):
        library.split_plan(1, 65, 8, 65, 5000, 64, dataclasses.replace(gpu, sms=0))


def test_no_gpu_here_plans_for_the_deploy_target(monkeypatch):
    monkeypatch.setattr(kplan, "gpu_here", lambda: None)
    assert kplan.resolve_gpu(None).key == "rtx-pro-6000"  # configs/deploy.yaml target_arch: sm_120
    with pytest.raises(BadInput, match="--gpu 'a100'"):
        kplan.resolve_gpu("a100")
    with pytest.raises(BadInput, match="--sms 0"):
        kplan.resolve_gpu("h200", sms=0)


def test_the_gpu_here_from_its_device_properties(monkeypatch):
    import torch

    from kdev import gpu

    props = types.SimpleNamespace(name="NVIDIA H200", multi_processor_count=132, shared_memory_per_block_optin=232448,
                                  shared_memory_per_multiprocessor=233472, max_threads_per_multi_processor=2048,
                                  regs_per_multiprocessor=65536)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(gpu, "current_gpu", lambda: gpu.GpuIdentity(0, "NVIDIA H200", "sm_90", "GPU-none", None))
    here = kplan.resolve_gpu(None)
    h200 = kplan.resolve_gpu("h200")
    for f in ("name", "arch", "sms", "smem_per_block_optin", "smem_per_sm", "threads_per_sm", "registers_per_sm",
              "flops", "bytes_per_s", "ceilings_clock_mhz", "rates"):
        assert getattr(here, f) == getattr(h200, f), f
    # what kdev plan --project prices with, on the GPU here (a field report's calibration runs there)
    assert here.rates and here.ceilings_clock_mhz
    # a torch that does not report a figure: the table's, for a GPU it names; otherwise one line asking for --gpu
    del props.regs_per_multiprocessor
    assert kplan.resolve_gpu(None).registers_per_sm == 65536
    props.name = "NVIDIA A100-SXM4-80GB"
    monkeypatch.setattr(gpu, "current_gpu", lambda: gpu.GpuIdentity(0, props.name, "sm_80", "GPU-none", None))
    with pytest.raises(EnvironmentMissing, match="does not report regs_per_multiprocessor for NVIDIA A100"):
        kplan.resolve_gpu(None)


def test_bench_takes_only_measured_ceilings_from_the_gpu_table():
    assert bench.load_ceilings({"name": "NVIDIA H200", "uuid": "GPU-not-cached"})["flops"] == 638e12
    assert bench.load_ceilings({"name": "NVIDIA RTX PRO 6000 Blackwell", "uuid": "GPU-not-cached"}) is None


def test_gpu_table_errors_name_file_and_key(write_yaml):
    p = write_yaml("gpus.yaml", """
        gpus:
          x: {name: X, arch: sm_90, sms: 0, smem_per_block_optin: 1, smem_per_sm: 1, threads_per_sm: 1,
              registers_per_sm: 1}
        """)
    with pytest.raises(BadInput, match=r"gpus.yaml: gpus.x.sms: must be > 0"):
        config.load_gpus(p)


def test_cli_table_json_and_bad_input(both_archs):
    runner = CliRunner()
    lib = str(both_archs[1].library)
    r = runner.invoke(app, ["plan", "--gpu", "h200", "--library", lib], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "flash plan on NVIDIA H200 (sm_90, 132 SMs" in r.output and "teams_kernel 190,464 B" in r.output
    assert "up to 35.4 MiB" in r.output
    r = runner.invoke(app, ["plan", "--gpu", "rtx-pro-6000", "--library", lib, "--shape", "B=2,L=4096,N=16,H=16",
                            "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["gpu"]["arch"] == "sm_120" and [p["shape"] for p in doc["plans"]] == ["B2-L4096-N16-H16-p64"]
    for args, code, msg in ((["--gpu", "a100"], 2, "not in configs/gpus.yaml"),
                            (["--gpu", "h200", "--call", "fast"], 2, "--call"),
                            (["--gpu", "h200", "--shape", "B=1,L=100,N=2000,H=8"], 2, "out of range"),
                            (["--gpu", "h200", "--library", "/nonexistent/libkdtree.so"], 2, "no such library"),
                            (["--gpu", "h200", "--library", __file__], 3, "does not load")):
        r = runner.invoke(app, ["plan", "--library", lib, *args] if "--library" not in args else ["plan", *args])
        assert r.exit_code == code, (args, r.output)
        assert msg in r.output and "Traceback" not in r.output


def test_a_library_from_other_sources_is_named_before_its_plan(both_archs, monkeypatch):
    from kdev import build

    lib = kplan.PlanLibrary(both_archs[1].library)
    assert lib.stale_note() is None
    monkeypatch.setattr(build, "source_hash", lambda *a: "f" * 64)
    assert "kernels/ is now ffffffffffff: run 'kdev build'" in lib.stale_note()
    r = CliRunner().invoke(app, ["plan", "--gpu", "h200", "--library", str(both_archs[1].library), "--json"])
    assert r.exit_code == 0 and "run 'kdev build'" in r.stderr and json.loads(r.stdout)["plans"]


def test_the_planners_costs_say_why_it_took_its_plan(library):
    """The plan is the cheapest choice of the planner's model, or one within 0.1 % with fewer splits; the model's costs
    come from the library (kdtree_flash_split_cost), so `kdev plan --costs` shows the margins the plan was taken by."""
    for gpu in (kplan.resolve_gpu("h200"), kplan.resolve_gpu("rtx-pro-6000")):
        for shape, p in zip(targets(), kplan.plan(library, targets(), gpu, costs=True)["plans"]):
            costs = p["split_costs"]
            # relative to the least cost of all; a split count's entry is the narrow count the rule takes with it
            assert costs[0]["relative"] <= 1.001 and all(c["relative"] >= 1 for c in costs)
            taken = [c for c in costs if (c["splits"], c["narrow_splits"]) == (p["splits"], p["narrow_splits"])]
            assert len(taken) == 1 and taken[0]["relative"] <= 1.001, (gpu.key, shape.name)
            assert not [c for c in costs if c["relative"] < 0.999 or (c["relative"] <= 1.001 and c["splits"] < p["splits"])]
            assert len({c["splits"] for c in costs}) == len(costs)  # one choice per full-tile split count
            assert max(c["splits"] for c in costs) <= 128 and max(c["narrow_splits"] for c in costs) <= 128  # the cap
            assert (min(c["narrow_splits"] for c in costs) > 0) == bool(p["narrow_kernel"])
    # H64 on the RTX PRO 6000: 14 splits in 5 waves against one wave at 2, by the model's 6-tile fixed cost
    h64 = kplan.split_costs(library, targets()[-1], kplan.resolve_gpu("rtx-pro-6000"))
    two = next(c for c in h64 if c["splits"] == 2)
    assert h64[0]["splits"] == 14 and 1.3 < two["relative"] < 1.32


def test_costs_cli_and_a_library_without_them(library, both_archs, monkeypatch):
    lib = str(both_archs[1].library)
    r = CliRunner().invoke(app, ["plan", "--gpu", "h200", "--library", lib, "--costs"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "the planner's model" in r.output and "15/8:" in r.output
    monkeypatch.setattr(kplan.PlanLibrary, "__init__", _without_costs(kplan.PlanLibrary.__init__))
    r = CliRunner().invoke(app, ["plan", "--gpu", "h200", "--library", lib, "--costs"])
    assert r.exit_code == 3 and "without kdtree_flash_split_cost" in r.output
    r = CliRunner().invoke(app, ["plan", "--gpu", "h200", "--library", lib])  # the plan itself needs no costs
    assert r.exit_code == 0, r.output


def _without_costs(init):
    def wrapped(self, path):
        init(self, path)
        self.has_costs = False
    return wrapped


def test_a_skewed_batch_shows_the_device_schedule_beside_the_host_plan(library):
    """kdev plan asks the library for the schedule the schedule kernel would make (kdtree_flash_schedule_plan, the same
    integer arithmetic on the host): the 128K request of the engine sweep's batch cut many ways, the 2K ones not, where
    the host plan gives every request one split."""
    gpu = kplan.resolve_gpu("h100")
    shapes = bench.expand(bench.load_bench(), "engine", None, None)
    doc = kplan.plan(library, shapes, gpu)
    skewed = [p for p in doc["plans"] if p["axes"]["requests"]]
    assert skewed and all(p["schedule"] for p in skewed)
    assert all(p["schedule"] is None for p in doc["plans"] if not p["axes"]["requests"])
    first = skewed[0]
    s = first["schedule"]
    assert first["splits"] == 1 and s["k"] > 8 and s["splits"][0] == s["k"] and set(s["splits"][1:]) == {1}
    assert not s["host_plan"] and s["ctas"] <= max(first["full_ctas"], gpu.sms)
    # every request at the bounds: the kernel writes the host plan there, and says so
    uniform = bench.Shape(batch=4, prefix=8192, budget=16, heads=8, requests="4x8192", budgets="16")
    assert library.schedule_plan(uniform, [17] * 4, gpu)["host_plan"]
    with pytest.raises(BadInput, match="batch 300 outside"):
        library.schedule_plan(bench.Shape(batch=300, prefix=100, budget=4, heads=8, requests="300x100"), [5] * 300, gpu)


def test_a_replay_is_planned_at_its_captures_bounds_and_a_narrow_tile_by_its_page_size(library):
    """A shape with a capture axis is the call a replayed graph makes: its plain launch and its device schedule are
    planned at the capture's bounds, its KV and floor are its own. The page size prices a narrow tile (flash_plan.cuh,
    narrow_price): at page size 1 the same batch takes more narrow splits; the plan of a shape without one is the same."""
    gpu = kplan.resolve_gpu("h100")
    own = bench.Shape(batch=1, prefix=32768, budget=64, heads=8, page_size=64)
    replay = dataclasses.replace(own, capture="131072/128")
    p_own, p_replay = kplan.plan_shape(library, own, gpu), kplan.plan_shape(library, replay, gpu)
    at_bounds = library.split_plan(1, 65, 8, 129, 131072 + 129, 64, gpu)
    assert (p_replay.splits, p_replay.narrow_splits, p_replay.row_tiles) == \
        (at_bounds["splits"], at_bounds["narrow_splits"], at_bounds["row_tiles"]) != \
        (p_own.splits, p_own.narrow_splits, p_own.row_tiles)
    assert (p_replay.kv_bytes, p_replay.floor_us) == (p_own.kv_bytes, p_own.floor_us)
    assert p_own.schedule is None and p_replay.schedule and not p_replay.schedule["host_plan"]
    assert library.schedule_plan(own, [65], gpu)["host_plan"]  # at its own bounds the kernel writes the host plan
    page1 = kplan.plan_shape(library, dataclasses.replace(own, page_size=1), gpu)
    assert (page1.splits, page1.narrow_splits) == (15, 10) and (p_own.splits, p_own.narrow_splits) == (15, 8)
    wide = dataclasses.replace(own, heads=64)  # 4,160 rows: whole tiles, no narrow one
    assert kplan.plan_shape(library, wide, gpu).splits == \
        kplan.plan_shape(library, dataclasses.replace(wide, page_size=1), gpu).splits
    with pytest.raises(BadInput, match="page_size 3"):
        library.split_plan(1, 65, 8, 65, 5000, 3, gpu)
