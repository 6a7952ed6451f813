"""kdev ab: the pieces that need no GPU (arguments refused before one is asked for, the verdicts from one run's
results, the machine-code comparison of two libraries, the report lines); tests/gpu/test_bench_gpu.py runs it."""

import shutil

import pytest
from typer.testing import CliRunner

from kdev import ab
from kdev.cli import app
from kdev.cli.views import ab_lines as _ab_lines, ab_rows as _ab_rows
from kdev.errors import BadInput


def test_bad_kernels_and_references_are_refused_before_any_gpu_is_asked_for(tmp_path):
    # HEAD, not the default `main`: a clone's branch may have another name (the test must pass there too)
    for args, problem in [(["--kernel", "accept"], "kdev ab compares naive, flash, flash-portable"),
                          (["--against", "no-such-branch-here"], "no library, build folder, copy of kernels/, git"),
                          (["--shape", "B=0"], "out of range")]:
        r = CliRunner().invoke(app, ["ab", *(args if "--against" in args else ["--against", "HEAD", *args])])
        assert r.exit_code == 2 and problem in r.stderr and "Traceback" not in r.output, r.output
    import torch

    if not torch.cuda.is_available():  # main is a revision here: the arguments are good, the GPU is missing
        r = CliRunner().invoke(app, ["ab", "--against", "HEAD"])
        assert r.exit_code == 3 and "no CUDA GPU" in r.stderr
    assert ab.ref_names(["flash", "flash-portable"], "HEAD") == ["flash@HEAD", "flash-portable@HEAD"]
    patch = tmp_path / "v.patch"  # as the base a patch's verdicts would read backwards: it is a candidate
    patch.write_text("--- a/kernels/verify_attn.cu\n+++ b/kernels/verify_attn.cu\n")
    r = CliRunner().invoke(app, ["ab", "--against", str(patch)])
    assert r.exit_code == 2 and f"a patch is a candidate: kdev ab --candidate {patch}" in r.stderr, r.output
    for args, problem in [(["--against", "HEAD", "--candidate", str(patch)], "not both"),
                          (["--candidate", "no-such-branch-here"], "no library, build folder")]:
        r = CliRunner().invoke(app, ["ab", *args])
        assert r.exit_code == 2 and problem in r.output and "Traceback" not in r.output, r.output
    if not torch.cuda.is_available():
        r = CliRunner().invoke(app, ["ab", "--candidate", str(patch)])
        assert r.exit_code == 3 and "no CUDA GPU" in r.stderr
    assert ab.ref_names(["flash"], str(patch), ref_is_candidate=True) == [f"flash@{patch}"]
    with pytest.raises(BadInput):
        ab.ref_names([], "HEAD")


def _timed(shape, backend, us, sem=0.002):
    return {"shape": shape, "backend": backend, "timing": {"median_us": us, "rel_sem": sem}}


def test_verdicts_compare_this_build_with_the_other_at_each_shape_of_one_run():
    results = [_timed("s1", "flash@main", 100.0), _timed("s1", "flash", 97.0), _timed("s1", "naive", 4000.0),
               _timed("s2", "flash@main", 100.0), _timed("s2", "flash", 100.4),
               _timed("s3", "flash@main", 100.0), _timed("s3", "flash", 103.0, sem=0.02)]
    v = {x["shape"]: x for x in ab.verdicts(results, ["flash"], "main", min_change=0.01)}
    assert (v["s1"]["verdict"], round(v["s1"]["change"], 3)) == ("FAST", -0.03)
    assert v["s2"]["verdict"] == "SAME"  # inside 1 %
    assert v["s3"]["verdict"] == "SAME" and v["s3"]["threshold"] > 0.03  # 3 % inside three times a noisy median's
    assert all(x["backend"] == "flash" and x["baseline_us"] == 100.0 for x in v.values())
    # REF as the candidate (kdev ab --candidate): this build is the base, REF's change is judged
    v = {x["shape"]: x for x in ab.verdicts(results, ["flash"], "main", min_change=0.01, ref_is_candidate=True)}
    assert (v["s1"]["verdict"], v["s1"]["baseline_us"], v["s1"]["current_us"]) == ("SLOW", 97.0, 100.0)
    assert v["s2"]["verdict"] == "SAME" and v["s2"]["baseline_us"] == 100.4


def test_the_machine_code_of_two_builds_is_compared_for_this_arch(sm90_library, tmp_path):
    copy = tmp_path / "copy" / sm90_library.name
    copy.parent.mkdir()
    shutil.copy2(sm90_library, copy)
    s = ab.sass_summary(copy, sm90_library, "sm_90")
    if "skipped" in s:
        pytest.skip(f"needs cuobjdump and nvdisasm (the build extra): {s['skipped']}")
    assert s["differ"] == [] and s["identical"] == s["kernels"] > 10


def test_the_report_lines_name_what_changed_and_the_same_bits():
    doc = {"sass": {"arch": "sm_90", "kernels": 88, "identical": 86,
                    "differ": [{"kernel": "verify_attn_combine_kernel<4>", "status": "changed"},
                               {"kernel": "verify_attn_combine_kernel<2>", "status": "changed"}]},
           "verify": [{"suite": "smoke", "passed": True, "kernel": "flash", "against": "flash@main", "checks": 36,
                       "failed": 0, "comparisons": 12, "same_bits": 12, "failures": []}]}
    lines = _ab_lines(doc)
    assert lines[0] == ("machine code (sm_90): 86 of 88 kernels identical; differ: verify_attn_combine_kernel<4> "
                        "(changed), verify_attn_combine_kernel<2> (changed)")
    assert "36/36 checks passed; same bits in 12 of 12 comparisons" in lines[1]
    assert _ab_lines({"sass": {"skipped": "cuobjdump not found"}, "verify": []}) == [
        "machine code: not compared (cuobjdump not found)"]


def test_the_timing_rows_come_from_the_verdicts_of_one_run():
    results = [_timed("s1", "flash@main", 100.0), _timed("s1", "flash", 97.0)]
    rows = _ab_rows({"verdicts": ab.verdicts(results, ["flash"], "main", 0.01)})
    (*cells, mark), = rows
    assert cells == ["s1", "flash", "100.0", "97.0", "-3.0%", "±1.0%"]
    assert (mark.plain, mark.style) == ("FAST", "green")

