"""bench without a GPU: FLOP and byte counts, sweep expansion and overrides, baseline verdicts and exit code,
plots and CSV from a stored result."""

import dataclasses
import json
import types

import pytest
from typer.testing import CliRunner

from kdev import abi, bench, refs
from kdev.cli import app
from kdev.errors import BadInput


def test_flops_and_bytes_match_the_design_formula():
    flops, nbytes = bench.flops_bytes([65], [32768], 8)
    assert flops == 2 * 8 * 65 * (32768 + 65) * 1088
    assert nbytes == (32768 + 65) * 576 * 2 + 65 * 8 * 576 * 2 + 65 * 8 * 512 * 2
    # the roofline floor for B1 L32K T65 H8 at 638 TFLOP/s (the H200's, docs/architecture.md §3): 58 µs
    assert round(flops / 638e12 * 1e6) == 58
    f4, _ = bench.flops_bytes([65] * 4, [32768] * 4, 8)
    assert f4 == 4 * flops


def test_sweeps_expand_and_override():
    cfg = bench.load_bench()
    assert {"smoke", "targets", "ddtree", "grid"} <= set(cfg.sweeps)
    ddtree = bench.expand(cfg, "ddtree", None, None)
    names = {s.name for s in ddtree}
    assert "B1-L32768-N64-H8-p64" in names and "B16-L32768-N64-H8-p64" in names and "B1-L32768-N64-H8-p1" in names
    assert {s.prefix for s in ddtree} == {1024, 4096, 16384, 32768, 131072}
    assert {s.budget for s in ddtree} == {16, 32, 64, 128, 256, 512}  # where DDTree's speedup peaks: 256-512
    assert len(bench.expand(cfg, "grid", None, None)) == 225
    over = bench.expand(cfg, "smoke", None, ["H=8,64"])
    assert sorted({s.heads for s in over}) == [8, 64] and len(over) == 2 * len(bench.expand(cfg, "smoke", None, None))
    one = bench.expand(cfg, None, ["B=2,L=100,N=5,H=3,page=1"], None)
    assert one == [bench.Shape(batch=2, prefix=100, budget=5, heads=3, page_size=1)]


@pytest.mark.parametrize("bad", [["X=1"], ["H=abc"], ["H"]])
def test_bad_overrides(bad):
    with pytest.raises(BadInput):
        bench.expand(bench.load_bench(), "smoke", None, bad)


@pytest.mark.parametrize("sweep, shape, over, message", [
    (None, ["B="], None, "--shape: 'B=': no values"),
    (None, ["B=1,2"], None, "--shape B=1,2: one value per axis (batch has 2)"),
    (None, ["B=1,L=10,B=2"], None, "--shape: axis 'batch' given twice"),
    ("smoke", None, ["batch="], "-a: 'batch=': no values"),
    ("smoke", None, ["H=8", "heads=64"], "-a: axis 'heads' given twice"),
    ("targets", ["B=1"], None, "--shape and --sweep targets: give one of them"),
])
def test_shapes_that_would_drop_a_value_or_run_nothing_are_refused(sweep, shape, over, message):
    """Each of these ran before: the last value of a repeated axis, the first of a --shape list, --shape over a
    --sweep, and an empty axis (no shape at all, or an IndexError for --shape)."""
    with pytest.raises(BadInput) as e:
        bench.expand(bench.load_bench(), sweep, shape, over)
    assert str(e.value).startswith(message)


def test_unknown_sweep():
    with pytest.raises(BadInput, match="no sweep named 'nope'"):
        bench.expand(bench.load_bench(), "nope", None, None)


def _result(shape, backend, median, rel_sem=0.002, floor=50.0):
    return {"shape": shape, "axes": {"batch": 1, "prefix": int(shape.split("-L")[1].split("-")[0]), "budget": 64,
                                     "heads": 8, "page_size": 64, "tree": "ddtree"},
            "backend": backend, "flops": 1e12, "bytes": 1e8, "floor_us": floor, "bound": "compute", "agrees": True,
            "check": "ok", "splits": None,
            "timing": {"median_us": median, "p10_us": median * 0.99, "p90_us": median * 1.01, "samples": 20,
                       "rel_sem": rel_sem, "dropped_throttled": 0, "stop": "spread", "sm_clock_mhz": [1980, 1980]}}


def _doc(results):
    return {"provenance": {"gpu": {"name": "NVIDIA H200", "arch": "sm_90"}, "ceilings": None}, "sweep": "t",
            "results": results}


def test_the_floor_is_priced_at_wgmma_where_it_was_measured_and_the_table_says_which(tmp_path):
    from kdev.bench import ceilings

    measured = {"flops": 642e12, "bytes_per_s": 3.04e12, "wgmma_flops": 984e12}
    assert ceilings.floor_ceiling(measured) == {"name": "wgmma", "flops": 984e12}
    assert ceilings.floor_ceiling({**measured, "wgmma_flops": None}) == {"name": "mma.sync", "flops": 642e12}
    doc = _doc([_result("B1-L1024-N64-H8-p64", "flash", 100.0)])
    doc["provenance"].update(ceilings=measured, floor_ceiling=ceilings.floor_ceiling(measured))
    (tmp_path / "new.json").write_text(json.dumps(doc))
    r = CliRunner().invoke(app, ["bench", "--from", str(tmp_path / "new.json")], terminal_width=200)
    assert r.exit_code == 0 and "floor at wgmma 984 TFLOP/s, 3040 GB/s" in r.output, r.output
    del doc["provenance"]["floor_ceiling"]  # a result from before the ceiling was recorded: its floors are mma.sync's
    (tmp_path / "new.json").write_text(json.dumps(doc))
    r = CliRunner().invoke(app, ["bench", "--from", str(tmp_path / "new.json")], terminal_width=200)
    assert r.exit_code == 0 and "floor at mma.sync 642 TFLOP/s" in r.output, r.output


def test_baseline_verdicts():
    base = [_result("B1-L1024-N64-H8-p64", "flash", 100.0), _result("B1-L4096-N64-H8-p64", "flash", 100.0),
            _result("B1-L8192-N64-H8-p64", "flash", 100.0, rel_sem=0.05)]
    cur = [_result("B1-L1024-N64-H8-p64", "flash", 110.0), _result("B1-L4096-N64-H8-p64", "flash", 90.0),
           _result("B1-L8192-N64-H8-p64", "flash", 110.0, rel_sem=0.05)]
    v = {x["shape"]: x["verdict"] for x in bench.baseline_verdicts(cur, base)}
    # +10 % with 0.3 % noise is a regression; -10 % is faster; +10 % inside 3 sigma of 7 % noise is the same
    assert v == {"B1-L1024-N64-H8-p64": "SLOW", "B1-L4096-N64-H8-p64": "FAST", "B1-L8192-N64-H8-p64": "SAME"}


def test_baseline_regression_exits_1_and_plot_and_csv(tmp_path):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(_doc([_result("B1-L1024-N64-H8-p64", "flash", 100.0),
                                    _result("B1-L4096-N64-H8-p64", "flash", 300.0)])))
    new.write_text(json.dumps(_doc([_result("B1-L1024-N64-H8-p64", "flash", 101.0),
                                    _result("B1-L4096-N64-H8-p64", "flash", 300.5)])))
    runner = CliRunner()
    r = runner.invoke(app, ["bench", "--from", str(new), "--baseline", str(old), "--csv", str(tmp_path / "r.csv")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "r.csv").read_text().count("\n") == 3
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(_doc([_result("B1-L1024-N64-H8-p64", "flash", 150.0)])))
    r = runner.invoke(app, ["bench", "--from", str(slow), "--baseline", str(old), "--json"])
    assert r.exit_code == 1
    assert json.loads(r.stdout)["baseline"]["verdicts"][0]["verdict"] == "SLOW"
    # a baseline timed on another GPU gives no verdict: an H100's slower memory is not a regression
    h100 = _doc([_result("B1-L1024-N64-H8-p64", "flash", 150.0)])
    h100["provenance"]["gpu"]["name"] = "NVIDIA H100 80GB HBM3"
    (tmp_path / "h100.json").write_text(json.dumps(h100))
    r = runner.invoke(app, ["bench", "--from", str(tmp_path / "h100.json"), "--baseline", str(old)])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.output
    assert f"--baseline {old} was timed on NVIDIA H200, {tmp_path / 'h100.json'} on NVIDIA H100 80GB HBM3" in r.stderr
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    r = runner.invoke(app, ["bench", "--from", str(new), "--plot", str(png), "--plot-metric", "roofline"])
    assert r.exit_code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_verdicts_normalized_by_a_reference_backend_cancel_clock_drift():
    s1, s2, s3 = "B1-L1024-N64-H8-p64", "B1-L4096-N64-H8-p64", "B1-L8192-N64-H8-p64"
    base = [_result(s1, "flash", 100.0), _result(s1, "naive", 1000.0), _result(s2, "flash", 100.0),
            _result(s2, "naive", 1000.0), _result(s3, "flash", 100.0)]
    # this run's clocks are 5 % slower: naive +5 %. flash +5 % at s1 is no change; +1 % at s2 is 4 % faster
    # against naive; s3 has no naive timing in either run, so nothing to judge it by
    cur = [_result(s1, "flash", 105.0), _result(s1, "naive", 1050.0), _result(s2, "flash", 101.0),
           _result(s2, "naive", 1050.0), _result(s3, "flash", 100.0)]
    raw = {x["shape"]: x["verdict"] for x in bench.baseline_verdicts(cur, base) if x["backend"] == "flash"}
    assert raw[s1] == "SLOW"
    v = bench.baseline_verdicts(cur, base, normalize_by="naive")
    assert [(x["shape"], x["backend"], x["verdict"]) for x in v] == [(s1, "flash", "SAME"), (s2, "flash", "FAST")]
    assert v[0]["change"] == pytest.approx(0.0, abs=1e-12) and v[1]["change"] == pytest.approx(101 / 1050 / 0.1 - 1)
    assert v[0]["reference"] == "naive" and v[0]["reference_change"] == pytest.approx(0.05)
    # four medians' noise: 3 sigma of sqrt(4) x 2 % is 12 %, so a 10 % change is the same
    def noisy(rs, flash_factor=1.0):
        return [dict(r, timing=dict(r["timing"], rel_sem=0.02, median_us=r["timing"]["median_us"] *
                                    (flash_factor if r["backend"] == "flash" else 1))) for r in rs]
    v = bench.baseline_verdicts(noisy(cur, 1.1), noisy(base), normalize_by="naive")
    assert {x["verdict"] for x in v} == {"SAME"} and v[0]["threshold"] == pytest.approx(0.12)


def test_normalize_by_on_the_command_line(tmp_path):
    s1 = "B1-L1024-N64-H8-p64"
    old, new, bare = tmp_path / "old.json", tmp_path / "new.json", tmp_path / "bare.json"
    old.write_text(json.dumps(_doc([_result(s1, "flash", 100.0), _result(s1, "naive", 1000.0)])))
    new.write_text(json.dumps(_doc([_result(s1, "flash", 108.0), _result(s1, "naive", 1080.0)])))
    bare.write_text(json.dumps(_doc([_result(s1, "flash", 100.0)])))
    runner = CliRunner()
    r = runner.invoke(app, ["bench", "--from", str(new), "--baseline", str(old), "--json"])
    assert r.exit_code == 1  # +8 % in time alone
    r = runner.invoke(app, ["bench", "--from", str(new), "--baseline", str(old), "--normalize-by", "naive", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)["baseline"]
    assert doc["normalized_by"] == "naive" and [v["verdict"] for v in doc["verdicts"]] == ["SAME"]
    r = runner.invoke(app, ["bench", "--from", str(new), "--baseline", str(old), "--normalize-by", "naive"],
                      env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "reference" in r.stdout and "SAME +0.0%" in r.stdout
    r = runner.invoke(app, ["bench", "--from", str(new), "--normalize-by", "naive"])
    assert r.exit_code == 2 and "needs --baseline" in r.stderr
    r = runner.invoke(app, ["bench", "--from", str(new), "--baseline", str(bare), "--normalize-by", "naive"])
    assert r.exit_code == 2 and "no timing of that backend in" in r.stderr and "Traceback" not in r.output


def test_bad_stored_result_is_exit_2(tmp_path):
    f = tmp_path / "x.json"
    f.write_text("{}")
    r = CliRunner().invoke(app, ["bench", "--from", str(f)])
    assert r.exit_code == 2 and "not a kdev bench result" in r.stderr


@pytest.mark.parametrize("spoil, says", [
    (lambda d: d.update(results=3), "'results' is not a list"),
    (lambda d: d["results"][0].pop("backend"), "results[0].backend missing"),
    (lambda d: d["results"][0]["timing"].pop("median_us"), "results[0].timing lacks"),
    (lambda d: d["results"][0].update(flops="many"), "results[0].flops missing or not a number"),
    (lambda d: d.pop("provenance"), "no provenance.gpu.name"),
    (lambda d: d["provenance"].update(ceilings={"flops": 1.0}), "provenance.ceilings without"),
])
def test_a_malformed_stored_result_is_one_line_and_exit_2(tmp_path, spoil, says):
    doc = _doc([_result("B1-L1024-N64-H8-p64", "flash", 100.0)])
    spoil(doc)
    f = tmp_path / "r.json"
    f.write_text(json.dumps(doc))
    for args in (["bench", "--from", str(f)], ["bench", "--sweep", "smoke", "--baseline", str(f)]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and says in r.stderr and "Traceback" not in r.output, (args, r.output)


def test_no_gpu_is_exit_3():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = CliRunner().invoke(app, ["bench", "--sweep", "smoke"])
    assert r.exit_code == 3 and "no CUDA GPU" in r.stderr


def test_a_stored_run_under_another_gpus_plan_says_so_and_a_bad_plan_is_exit_2(tmp_path):
    doc = _doc([_result("B1-L1024-N64-H8-p64", "flash", 100.0)])
    doc["provenance"]["plan"] = {"gpu": "rtx-pro-6000", "name": "NVIDIA RTX PRO 6000 Blackwell", "arch": "sm_120",
                                 "sms": 188}
    f = tmp_path / "r.json"
    f.write_text(json.dumps(doc))
    r = CliRunner().invoke(app, ["bench", "--from", str(f)], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "flash calls planned as for NVIDIA RTX PRO 6000 Blackwell (188 SMs)" in r.output
    r = CliRunner().invoke(app, ["bench", "--sweep", "smoke", "--plan-gpu", "a100"])
    assert r.exit_code == 2 and "--plan-gpu 'a100': not in configs/gpus.yaml" in r.output


def test_tree_kernel_sweep_and_backend_validation(write_yaml):
    cfg = bench.load_bench()
    shapes = bench.expand(cfg, "tree-kernels", None, None)
    assert {s.budget for s in shapes} == {16, 64, 256, 1024} and {s.batch for s in shapes} == {1, 4, 16}
    assert cfg.sweep_backends["tree-kernels"] == bench.TREE_BACKENDS
    p = write_yaml("b.yaml", "sweeps:\n  x:\n    backends: [flash, fastest]\n    axes: {batch: [1]}\n")
    with pytest.raises(BadInput, match="unknown backend 'fastest'"):
        bench.load_bench(p)


def test_loop_needs_ceilings_before_any_gpu_work():
    r = CliRunner().invoke(app, ["bench", "--loop", "S+PV 8w"])
    assert r.exit_code == 2 and "needs --ceilings" in r.stderr and "Traceback" not in r.output


def test_a_report_into_a_pipe_keeps_each_row_on_one_line():
    """Through a pipe (a round's log, CI), tables are not folded at 80 columns; COLUMNS still decides where set."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    stored = Path(__file__).resolve().parent / "data" / "h200-flash-v25-portable-targets.json"
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    r = subprocess.run([sys.executable, "-m", "kdev", "bench", "--from", str(stored)], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if "B16-L8192-N32-H8-p64" in line]
    assert len(rows) == 3 and any("flash-portable" in line and "334.2" in line for line in rows)
    narrow = subprocess.run([sys.executable, "-m", "kdev", "bench", "--from", str(stored)], capture_output=True,
                            text=True, env={**env, "COLUMNS": "80"})
    assert narrow.returncode == 0 and max(map(len, narrow.stdout.splitlines())) <= 80


def test_an_output_path_that_cannot_be_written_is_one_line_and_exit_2(tmp_path):
    f = tmp_path / "r.json"
    f.write_text(json.dumps(_doc([_result("B1-L1024-N64-H8-p64", "flash", 100.0)])))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for flag in ("--csv", "--out-json"):  # written through a temp file beside it: the error names the file asked for
        r = CliRunner().invoke(app, ["bench", "--from", str(f), flag, str(blocker / "r.out")])
        assert r.exit_code == 2 and "Traceback" not in r.output
        assert r.stderr.strip() == f"error: {blocker / 'r.out'}: Not a directory"


def test_a_kernel_of_another_build_is_a_backend_named_kernel_at_ref(tmp_path):
    """KERNEL@REF: our verify kernels only; REF a library or build folder, a copy of kernels/ or a git revision;
    checked before the GPU is looked for."""
    lib = tmp_path / "base" / "libkdtree.so"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    tree = tmp_path / "copy" / "kernels"
    (tree / "include").mkdir(parents=True)
    (tree / "verify_attn.cu").write_text("")
    assert abi.kernel_ref("flash") is None
    assert abi.kernel_ref(f"flash-portable@{lib.parent}") == ("flash-portable", str(lib.parent))
    assert abi.kernel_ref(f"flash@{tree}") == ("flash", str(tree))
    assert abi.kernel_ref("naive@HEAD") == ("naive", "HEAD")
    for name, problem in [("triton@x", "takes one of naive, flash, flash-portable"), ("flash@", "takes one of"),
                          ("accept@x", "takes one of"),
                          (f"flash@{tmp_path}/nope", "nope: no library, build folder, copy of kernels/, git revision"),
                          ("flash@no-such-branch-here", "no-such-branch-here: no library")]:
        with pytest.raises(BadInput, match=problem):
            abi.kernel_ref(name)
        r = CliRunner().invoke(app, ["bench", "--sweep", "smoke", "--backend", f"flash,{name}"])
        assert r.exit_code == 2 and problem.split(": ")[-1] in r.stderr and "Traceback" not in r.output, r.output


def _stand_in_build(monkeypatch, tmp_path) -> list:
    """kbuild.build replaced by a stand-in that records (archs, kernel_dir, variant) and returns tmp_path/lib.so (the
    build itself is kdev build --kernels, tested with the build)."""
    from kdev import build as kbuild

    built = []

    def fake_build(cfg, log=None, kernel_dir=None, variant=False):
        built.append((cfg.archs, kernel_dir, variant))
        return kbuild.BuildResult(library=tmp_path / "lib.so", folder=tmp_path, cached=False, key="k",
                                  build_info={}, resources=[], problems=[], launches=[], embedded={}, seconds=0.0)

    monkeypatch.setattr(kbuild, "build", fake_build)
    return built


def test_a_revision_is_built_from_its_own_kernels_tree(tmp_path, monkeypatch):
    """flash@REV: kernels/ as that commit has it, extracted once under build/ab-<commit> and built as an A/B variant
    for the arch asked (the build itself stood in for: it is kdev build --kernels, tested with the build)."""
    from kdev import build as kbuild

    sha = refs.git_revision("HEAD")
    assert sha and refs.describe_library_ref("HEAD") == "revision"
    built = _stand_in_build(monkeypatch, tmp_path)
    tree = refs.revision_kernels("HEAD", output_dir=tmp_path / "build")
    assert tree == tmp_path / "build" / f"ab-{sha[:12]}" / "kernels" and refs.is_kernel_tree(tree)
    assert sorted(p.name for p in tree.glob("*.cu")) == sorted(p.name for p in kbuild.KERNEL_DIR.glob("*.cu"))
    assert refs.revision_kernels(sha, output_dir=tmp_path / "build") == tree  # found again, not extracted twice
    assert [p.name for p in (tmp_path / "build").iterdir()] == [f"ab-{sha[:12]}"]  # no temporary folder left
    res = refs.library_for(str(tree), ["sm_90"])
    assert res.library == tmp_path / "lib.so" and built == [(("sm_90",), tree.resolve(), True)]
    with pytest.raises(BadInput, match="no such git revision"):
        refs.revision_kernels("no-such-branch-here")


def _kernels_patch(path, old: str, new: str):
    """A patch of kernels/verify_attn.cu, as variants/ holds them (paths kernels/...), that replaces one line."""
    import difflib

    from kdev import build as kbuild

    lines = (kbuild.KERNEL_DIR / "verify_attn.cu").read_text().splitlines(keepends=True)
    assert old in lines
    after = [new if line == old else line for line in lines]
    path.write_text("".join(difflib.unified_diff(lines, after, "a/kernels/verify_attn.cu", "b/kernels/verify_attn.cu")))
    return path


def test_a_patch_is_applied_to_this_checkouts_kernels_once_and_built(tmp_path, monkeypatch):
    """flash@variants/NAME.patch: this checkout's kernels/ with the patch applied, written once under
    build/ab-patch-<hash> (the hash over the patch and the sources), built as an A/B variant; a patch that does not
    apply is one line of bad input."""
    from kdev import build as kbuild

    first = (kbuild.KERNEL_DIR / "verify_attn.cu").read_text().splitlines(keepends=True)[0]
    patch = _kernels_patch(tmp_path / "v.patch", first, "// a variant's first line\n")
    assert refs.describe_library_ref(str(patch)) == "patch"
    assert abi.kernel_ref(f"flash@{patch}") == ("flash", str(patch))
    tree = refs.patch_kernels(patch, output_dir=tmp_path / "build")
    assert tree.parent.parent == tmp_path / "build" and tree.parent.name.startswith("ab-patch-")
    assert (tree / "verify_attn.cu").read_text().startswith("// a variant's first line\n")
    same = [p.name for p in kbuild.KERNEL_DIR.glob("*.cu") if p.name != "verify_attn.cu"]
    assert same and all((tree / n).read_bytes() == (kbuild.KERNEL_DIR / n).read_bytes() for n in same)
    assert refs.patch_kernels(patch, output_dir=tmp_path / "build") == tree  # found again, not applied twice
    assert [p.name for p in (tmp_path / "build").iterdir()] == [tree.parent.name]  # no temporary folder left
    with pytest.raises(BadInput, match="v2.patch: does not apply to"):
        refs.patch_kernels(_stale_patch(tmp_path / "v2.patch"), output_dir=tmp_path / "build")
    assert [p.name for p in (tmp_path / "build").iterdir()] == [tree.parent.name]
    built = _stand_in_build(monkeypatch, tmp_path)
    monkeypatch.setattr(refs, "REPO_ROOT", tmp_path)  # build/ab-patch-* under tmp_path/build
    res = refs.library_for(str(patch), ["sm_90"])
    assert res.library == tmp_path / "lib.so" and built == [(("sm_90",), tree, True)]


def _stale_patch(path):
    """A patch whose context is not in kernels/ (made against another version of the file)."""
    path.write_text("--- a/kernels/verify_attn.cu\n+++ b/kernels/verify_attn.cu\n@@ -1,2 +1,2 @@\n"
                    "-// no such line in this file\n+// its replacement\n // nor this one\n")
    return path


def test_kernel_refs_load_each_library_once_and_refuse_a_missing_entry_point(sm90_library, monkeypatch):
    others = abi.load_kernel_refs(["flash", f"flash@{sm90_library}", f"naive@{sm90_library.parent}"],
                                         plan_sms=188)
    assert sorted(others) == [f"flash@{sm90_library}", f"naive@{sm90_library.parent}"]
    (a, ka), (b, kb) = others[f"flash@{sm90_library}"], others[f"naive@{sm90_library.parent}"]
    assert a is b and (ka, kb) == ("flash", "naive") and a.plan_sm_count == 188  # the run's --plan-gpu applies
    monkeypatch.setitem(abi.VERIFY_KERNELS, "flash-next", "kdtree_verify_attn_flash_next")
    with pytest.raises(BadInput, match="has no flash-next entry point"):
        abi.load_kernel_refs([f"flash-next@{sm90_library}"])


def test_a_wgmma_kernel_of_another_tree_is_built_for_sm90a(monkeypatch, sm90_library):
    """flash-wgmma@REF on an sm_90 GPU: REF built with the arch-specific code that holds the wgmma kernel (an sm_90
    build would only say unsupported); the other kernels of the same run are built as this checkout's library is
    (build.yaml lists sm_90a: flash@REF is the Hopper flash call as shipped), or for the GPU's own arch where
    build.yaml does not."""
    from kdev import build as kbuild
    from kdev import config, gpu

    asked = []

    def fake_library_for(ref, archs, log=None):
        asked.append((ref, tuple(archs)))
        return types.SimpleNamespace(library=sm90_library, problems=[])

    monkeypatch.setattr(refs, "library_for", fake_library_for)
    monkeypatch.setattr(gpu, "current_arch", lambda: "sm_90")
    abi.load_kernel_refs(["flash-wgmma@variants/flash-v33-combine-rows.patch", "flash@HEAD"])
    assert asked == [("variants/flash-v33-combine-rows.patch", ("sm_90a",)), ("HEAD", ("sm_90a",))]
    asked.clear()
    default = config.load_build(None)
    monkeypatch.setattr(kbuild, "load_build", lambda *a: dataclasses.replace(default, default_archs=("sm_90", "sm_120")))
    abi.load_kernel_refs(["flash-wgmma@variants/flash-v33-combine-rows.patch", "flash@HEAD"])
    assert asked == [("variants/flash-v33-combine-rows.patch", ("sm_90a",)), ("HEAD", ("sm_90",))]
    assert kbuild.build_arch_for("sm_120") == "sm_120"


def test_the_targets_sweep_carries_the_issue_targets_and_a_bad_one_is_refused(write_yaml):
    cfg = bench.load_bench()
    targets = {s.name: cfg.targets_us[s.name] for s in bench.expand(cfg, "targets", None, None)}
    assert list(targets.values()) == [116, 466, 466, 238, 30, 232, 930, 463, 932]
    assert set(cfg.min_naive_speedup.values()) == {30} and set(cfg.min_naive_speedup) == set(targets)
    assert cfg.target_gpu == {name: "NVIDIA H200" for name in targets}  # the targets are set for the H200
    for text, problem in [
        ("sweeps:\n  x:\n    shapes: [{batch: 1, target_us: -1}]\n", "target_us: must be > 0"),
        ("sweeps:\n  x:\n    min_naive_speedup: 0\n    shapes: [{batch: 1}]\n", "min_naive_speedup: must be > 0"),
        ("sweeps:\n  x:\n    shapes: [{batch: 1, target_us: 5}]\n  y:\n    shapes: [{batch: 1, target_us: 6}]\n",
         "has target_us 5 elsewhere"),
        ("sweeps:\n  x:\n    target_gpu: a100\n    shapes: [{batch: 1, target_us: 5}]\n",
         r"sweeps.x.target_gpu: 'a100' is not in configs/gpus.yaml \(have: h200, h100, rtx-pro-6000\)"),
        ("sweeps:\n  x:\n    target_gpu: h200\n    shapes: [{batch: 1, target_us: 5}]\n  y:\n    target_gpu: h100\n"
         "    shapes: [{batch: 1, target_us: 5}]\n", "has a target set for NVIDIA H200 elsewhere"),
    ]:
        with pytest.raises(BadInput, match=problem):
            bench.load_bench(write_yaml("b.yaml", text))


def _timed(shape: str, backend: str, us: float | None) -> dict:
    return {"shape": shape, "backend": backend, "timing": {"median_us": us} if us is not None else None}


def test_judging_the_targets_names_what_is_met_missed_and_too_slow_against_naive(write_yaml):
    cfg = bench.load_bench(write_yaml("b.yaml", """
        sweeps:
          t:
            min_naive_speedup: 30
            shapes: [{batch: 1, target_us: 100}, {batch: 2, target_us: 200}, {batch: 3}]
        """))
    a, b, c = (s.name for s in bench.expand(cfg, "t", None, None))
    results = [_timed(a, "naive", 3100), _timed(a, "flash", 99), _timed(b, "naive", 5000), _timed(b, "flash", 201),
               _timed(c, "naive", 900), _timed(c, "flash", 31), _timed(a, "flash-portable", None)]
    by = {j["backend"]: j for j in bench.judge_targets(results, cfg)}
    assert set(by) == {"flash", "flash-portable"}  # naive is the yardstick, not judged
    f = by["flash"]
    assert f["met"] == [a] and f["missed"] == [{"shape": b, "median_us": 201, "target_us": 200}]
    assert f["fast_enough"] == [a] and [(t["shape"], round(t["speedup"], 1)) for t in f["too_slow"]] == [(b, 24.9),
                                                                                                         (c, 29.0)]
    p = by["flash-portable"]  # not timed (disagreed with naive, or failed): missed, and not fast enough
    assert p["met"] == [] and p["missed"][0]["median_us"] is None and p["too_slow"][0]["speedup"] is None


def test_targets_set_for_one_gpu_are_indicative_on_another(write_yaml):
    cfg = bench.load_bench(write_yaml("b.yaml", """
        sweeps:
          t:
            target_gpu: h200
            min_naive_speedup: 30
            shapes: [{batch: 1, target_us: 100}]
          u:
            shapes: [{batch: 2, target_us: 200}]
        """))
    (a,), (b,) = (bench.expand(cfg, name, None, None) for name in ("t", "u"))
    results = [_timed(a.name, "naive", 3100), _timed(a.name, "flash", 99)]
    here, there = (bench.judge_targets(results, cfg, gpu)[0] for gpu in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"))
    assert here["targets_set_for"] == there["targets_set_for"] == ["NVIDIA H200"]
    assert not here["indicative"] and there["indicative"] and there["met"] == here["met"] == [a.name]
    # a target that names no GPU is judged on any
    anywhere = bench.judge_targets([_timed(b.name, "flash", 250)], cfg, "NVIDIA H100 80GB HBM3")[0]
    assert not anywhere["indicative"] and anywhere["targets_set_for"] == [] and anywhere["missed"][0]["shape"] == b.name


def test_a_stored_targets_run_is_judged_against_the_issue_targets():
    """kdev bench --from on the committed v25 run: the table's verdict in two lines per kernel (no GPU)."""
    from kdev.config import REPO_ROOT

    stored = str(REPO_ROOT / "tests" / "data" / "h200-flash-v25-portable-targets.json")
    r = CliRunner().invoke(app, ["bench", "--from", stored], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    assert "flash-portable: first targets met at 0 of 7 shapes" in r.output
    assert "flash: first targets met at 3 of 7 shapes" in r.output and "B1 L32768 N16 H8 50.9 > 30 µs" in r.output
    assert "flash: at least 30x faster than naive at 6 of 7 shapes; short: B16 L8192 N32 H8 29.1x" in r.output
    assert "indicative" not in r.output  # timed on the H200, the GPU the targets are set for
    doc = json.loads(CliRunner().invoke(app, ["bench", "--from", stored, "--json"]).stdout)
    assert {j["backend"]: len(j["met"]) for j in doc["targets"]} == {"flash-portable": 0, "flash": 3}
    assert not any(j["indicative"] for j in doc["targets"])


def test_a_stored_run_from_another_gpu_is_compared_to_the_targets_as_indicative(tmp_path):
    from kdev.config import REPO_ROOT

    doc = json.loads((REPO_ROOT / "tests" / "data" / "h200-flash-v25-portable-targets.json").read_text())
    doc["provenance"]["gpu"]["name"] = "NVIDIA H100 80GB HBM3"
    stored = tmp_path / "h100.json"
    stored.write_text(json.dumps(doc))
    r = CliRunner().invoke(app, ["bench", "--from", str(stored)], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    assert ("flash: first targets met at 3 of 7 shapes" in r.output and "(targets set for NVIDIA H200, timed on NVIDIA "
            "H100 80GB HBM3: indicative only)" in r.output)
    assert "flash: at least 30x faster than naive at 6 of 7 shapes" in r.output  # a ratio in one run: judged anywhere


def test_graph_replay_timing_is_a_method_setting_and_a_flag_and_a_stored_run_says_so(tmp_path, write_yaml):
    from kdev.config import REPO_ROOT

    assert bench.load_bench().method.graph is False
    assert bench.load_bench(write_yaml("b.yaml", "method: {graph: true}\nsweeps:\n  x:\n    shapes: [{batch: 1}]\n")
                            ).method.graph is True
    with pytest.raises(BadInput, match="graph: expected bool"):
        bench.load_bench(write_yaml("c.yaml", "method: {graph: 1}\nsweeps:\n  x:\n    shapes: [{batch: 1}]\n"))
    doc = json.loads((REPO_ROOT / "tests" / "data" / "h200-flash-v25-portable-targets.json").read_text())
    doc["provenance"]["method"]["graph"] = True
    stored = tmp_path / "graph.json"
    stored.write_text(json.dumps(doc))
    r = CliRunner().invoke(app, ["bench", "--from", str(stored)], env={"COLUMNS": "400"})
    assert r.exit_code == 0 and "CUDA-graph replays" in r.output
