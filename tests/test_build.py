"""kdev build without a GPU: both archs, the resource report, provenance, cache hit and rebuild, errors."""

import ctypes
import hashlib
import json
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

from kdev import abi
from kdev import build as kbuild
from kdev import cabi, config, refs, resources
from kdev.errors import CheckFailed, EnvironmentMissing

needs_nvcc = pytest.mark.nvcc


@needs_nvcc
def test_builds_both_archs_with_clean_resource_report(both_archs):
    cfg, res = both_archs
    assert not res.cached and res.problems == [] and res.library.is_file()
    kernels = {r["kernel"] for r in res.resources}
    flash = {f"verify_attn_flash_kernel<{b}>" for b in ("true", "false")} | {"verify_attn_flash_teams_kernel"}
    flash |= {f"verify_attn_flash_narrow_kernel<{b}>" for b in ("false, false", "true, false", "true, true")}
    combine = {f"verify_attn_combine_kernel<{g}>" for g in (1, 2, 4)}
    assert {"verify_attn_naive_kernel"} | flash | combine <= kernels
    for k in kernels:
        assert {r["arch"] for r in res.resources if r["kernel"] == k} == {"sm_90", "sm_120"}
    for r in res.resources:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["registers"] > 0
    if res.embedded["sass"] is not None:
        assert res.embedded["sass"] == ["sm_90", "sm_120"] and res.embedded["ptx"] == ["sm_120"]
    latest = json.loads((cfg.output_dir / "latest.json").read_text())
    assert latest["library"] == str(res.library)


@needs_nvcc
def test_launch_table_names_the_kernels_each_call_takes_and_their_dynamic_shared_memory(both_archs):
    cfg, res = both_archs
    by = {(r["arch"], r["kernel"]): r for r in res.launches}
    calls = {(r["arch"], c): set() for r in res.launches for c in r["calls"]}
    for r in res.launches:
        for c in r["calls"]:
            calls[(r["arch"], c)].add(r["kernel"])
    # sm_90's flash call with pages of >= 32 tokens: the teams kernels, over sm_120's 101,376 B
    assert calls[("sm_90", "flash (pages >= 32)")] == {"verify_attn_flash_teams_kernel",
                                                       "verify_attn_flash_narrow_kernel<true, true>"}
    teams = by[("sm_90", "verify_attn_flash_teams_kernel")]
    assert 101376 < teams["dynamic_smem"] <= teams["limit"] == 232448
    # the sm_120 path: the lockstep kernels within 101,376 B, whichever call; the portable call takes it on sm_90 too
    lockstep = {"verify_attn_flash_kernel<true>", "verify_attn_flash_narrow_kernel<true, false>"}
    for arch in ("sm_90", "sm_120"):
        assert calls[(arch, "flash-portable (pages >= 32)")] == lockstep
        assert all(by[(arch, k)]["dynamic_smem"] <= 101376 for k in lockstep)
        assert "verify_attn_flash_kernel<false>" in calls[(arch, "flash-portable (pages < 32)")]
    assert calls[("sm_120", "flash (pages >= 32)")] == lockstep
    # the names the library gives are the kernels' names in the ptxas report (the launcher's rule and the kernels agree)
    built = {(r["kernel"], r["arch"]) for r in res.resources}
    assert all((r["kernel"], r["arch"]) in built for r in res.launches)
    # and they are stored with the build: a cache hit reports the same
    again = kbuild.build(cfg)
    assert again.cached and again.launches == res.launches


@needs_nvcc
def test_launch_plan_entry_point_refuses_what_no_gpu_runs(both_archs):
    _, res = both_archs
    lib = ctypes.CDLL(str(res.library))
    lib.kdtree_last_error.restype = ctypes.c_char_p
    full, narrow, full_smem, narrow_smem = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_int(), ctypes.c_int()
    args = (ctypes.byref(full), ctypes.byref(full_smem), ctypes.byref(narrow), ctypes.byref(narrow_smem))
    assert lib.kdtree_flash_launch_plan(8, 166912, 1, 0, 0, *args) == 1
    assert b"tensor copies need sm_90+" in lib.kdtree_last_error()
    assert lib.kdtree_flash_launch_plan(7, 65536, 0, 0, 0, *args) == 1
    assert lib.kdtree_flash_launch_plan(9, 232448, 1, 0, 0, None, *args[1:]) == 1
    # a GPU whose blocks cannot hold the teams' ring gets the lockstep kernels even on sm_90
    assert lib.kdtree_flash_launch_plan(9, 101376, 1, 0, 0, *args) == 0
    assert full.value == b"verify_attn_flash_kernel<true>"
    assert full_smem.value == narrow_smem.value <= 101376
    # code with the wgmma kernel: its full tiles where tensor copies bring them, and the teams' narrow kernel; not in
    # the portable call, not at pages of < 32 tokens, and not on an sm_120 GPU (which has no wgmma)
    assert lib.kdtree_flash_launch_plan(9, 232448, 1, 0, 1, *args) == 0
    assert full.value == b"verify_attn_flash_wgmma_kernel"
    assert narrow.value == b"verify_attn_flash_narrow_kernel<true, true>"
    assert narrow_smem.value < full_smem.value <= 232448
    for flags in ((9, 232448, 1, 1, 1), (9, 232448, 0, 0, 1), (12, 101376, 1, 0, 1)):
        assert lib.kdtree_flash_launch_plan(*flags, *args) == 0 and b"wgmma" not in full.value, flags


def _older_library(tmp_path, source: str, header_text: str) -> Path:
    """A library of older sources, as `kdev build` leaves one: `source` compiled with a build record that states the
    sha256 of `header_text`, which is kept beside it."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    digest = hashlib.sha256(header_text.encode()).hexdigest()
    info = json.dumps({"sources": {"kernels/include/kdev/kdtree.h": digest}})
    src = tmp_path / "old.c"
    src.write_text(source + f'const char* kdtree_build_info(void) {{ return {json.dumps(info)}; }}\n')
    lib = tmp_path / "libold.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    (tmp_path / "kdtree.h").write_text(header_text)
    return lib


def test_launch_table_of_a_library_from_older_sources_is_none(tmp_path):
    lib = _older_library(tmp_path, 'const char* kdtree_last_error(void) { return ""; }\n', cabi.HEADER.read_text())
    assert resources.flash_launches(lib, config.load_build()) is None
    (tmp_path / "broken.so").write_bytes(b"not a library")
    with pytest.raises(CheckFailed, match="does not load"):
        resources.flash_launches(tmp_path / "broken.so", config.load_build())


def test_a_library_before_abi_6_is_asked_its_launches_without_the_wgmma_argument(tmp_path):
    """A variant of older kernels/ (an A/B base) has the launch-plan entry point without wgmma_built, as its own header
    (kept beside it) declares it: asked in that form (an argument too many would be read as its first output
    pointer)."""
    old_header = cabi.HEADER.read_text().replace("int portable, int wgmma_built,", "int portable,")
    assert old_header != cabi.HEADER.read_text()
    lib = _older_library(tmp_path, 'int kdtree_abi_version(void) { return 5; }\n'
                         'const char* kdtree_last_error(void) { return ""; }\n'
                         'int kdtree_flash_launch_plan(int major, int smem, int tc, int portable, const char** full,\n'
                         '                             int* full_smem, const char** narrow, int* narrow_smem) {\n'
                         '  *full = portable ? "k_portable" : "k_flash"; *full_smem = 1000 * major + tc;\n'
                         '  *narrow = "k_narrow"; *narrow_smem = 7; return 0; }\n', old_header)
    rows = resources.flash_launches(lib, config.load_build(None, ["sm_90a"]))
    # one row per kernel, from its first ask (tensor copies): major 9 and tensor_copy 1 read where they stand
    assert {(r["kernel"], r["dynamic_smem"]) for r in rows} == {("k_flash", 9001), ("k_portable", 9001), ("k_narrow", 7)}


def test_launch_gate_names_kernel_arch_and_limit():
    rows = [{"arch": "sm_120", "kernel": "a", "dynamic_smem": 110592, "limit": 101376, "calls": ["flash"]},
            {"arch": "sm_90", "kernel": "b", "dynamic_smem": 91136, "limit": 232448, "calls": ["flash"]}]
    assert resources.launch_problems(rows) == ["a [sm_120]: 110592 B dynamic shared memory per block > 101376 B limit"]


@needs_nvcc
def test_build_info_embedded_in_library(both_archs):
    _, res = both_archs
    lib = ctypes.CDLL(str(res.library))
    lib.kdtree_build_info.restype = ctypes.c_char_p
    info = json.loads(lib.kdtree_build_info())
    assert info["source_hash"] == kbuild.source_hash()
    assert info["archs"] == ["sm_90", "sm_120"] and "-O3" in info["flags"]
    assert info["nvcc_version"] == kbuild.nvcc_version(kbuild.find_nvcc())
    assert "git_sha" in info and "git_dirty" in info
    lib.kdtree_max_qlen.restype = ctypes.c_int
    assert lib.kdtree_max_qlen() == 1025


@pytest.fixture(scope="module")
def sm90_builds(tmp_path_factory):
    """(cfg, this checkout's sm_90 build, latest.json as it stood, a variant build of a copy of kernels/ with one source
    edited): the two full builds the cache, variant and candidate tests share (only nvcc-marked tests take it)."""
    tmp = tmp_path_factory.mktemp("sm90")
    c = config.load_build(None, ["sm_90"])
    cfg = config.BuildConfig(c.archs, c.flags, tmp / "build", False, c.smem_limit_bytes, c.path)
    main = kbuild.build(cfg)
    latest = (cfg.output_dir / "latest.json").read_text()
    cand = tmp / "candidate" / "kernels"
    shutil.copytree(kbuild.KERNEL_DIR, cand)
    src = cand / "verify_attn_flash.cu"
    src.write_text(src.read_text() + "\n// candidate\n")
    return cfg, main, latest, kbuild.build(cfg, kernel_dir=cand, variant=True)


@needs_nvcc
def test_cache_hit_then_rebuild_on_source_change(sm90_builds):
    cfg, first, _, edited = sm90_builds
    again = kbuild.build(cfg)
    assert not first.cached and again.cached and again.key == first.key
    assert not edited.cached and edited.key != first.key


@needs_nvcc
def test_variant_build_has_its_own_folder_and_leaves_latest_alone(sm90_builds):
    cfg, main, latest, var = sm90_builds
    assert not var.problems and var.library.is_file() and var.library != main.library
    assert var.folder.name == f"{main.folder.name}-variant-{var.build_info['source_hash'][:12]}"
    assert var.build_info["variant"] is True and main.build_info["variant"] is False
    with warnings.catch_warnings():  # it differs from kernels/ on purpose: loading it is not called stale
        warnings.simplefilter("error")
        assert abi.Library(var.library).stale
    assert (cfg.output_dir / "latest.json").read_text() == latest and main.library.is_file()
    cand = var.folder.parent.parent / "candidate" / "kernels"
    assert kbuild.build(cfg, kernel_dir=cand, variant=True).cached
    assert var.build_info["sources"]["kernels/verify_attn_flash.cu"] != main.build_info["sources"][
        "kernels/verify_attn_flash.cu"]


def test_variant_needs_a_kernels_copy_or_a_patch(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from kdev.cli import app

    r = CliRunner().invoke(app, ["build", "--kernels", str(tmp_path)])
    assert r.exit_code == 2 and "not a copy of kernels/" in r.stderr and "Traceback" not in r.output
    # a patch: this checkout's kernels/ with it applied (refs.patch_kernels, tested with KERNEL@REF), then built
    patch = tmp_path / "v.patch"
    patch.write_text("--- a/kernels/verify_attn.cu\n+++ b/kernels/verify_attn.cu\n")
    applied, built = [], []
    monkeypatch.setattr(refs, "patch_kernels", lambda p: applied.append(p) or tmp_path / "patched" / "kernels")

    def fake_build(cfg, force=False, log=None, variant=False, kernel_dir=None):
        built.append((variant, kernel_dir))
        raise CheckFailed("stand-in build")

    monkeypatch.setattr(kbuild, "build", fake_build)
    r = CliRunner().invoke(app, ["build", "--kernels", str(patch), "--arch", "sm_90"])
    assert applied == [patch] and built == [(True, (tmp_path / "patched" / "kernels").resolve())], r.output


@needs_nvcc
def test_compiler_error_names_file_and_line(tmp_path, build_config):
    kdir = tmp_path / "kernels"
    shutil.copytree(kbuild.KERNEL_DIR, kdir)
    src = kdir / "verify_attn.cu"
    lines = src.read_text().splitlines()
    lines.insert(20, "this is not C++;")
    src.write_text("\n".join(lines))
    with pytest.raises(CheckFailed, match=r"verify_attn\.cu:21: error"):
        kbuild.build(build_config(tmp_path / "build", ["sm_90"]), kernel_dir=kdir)


def test_compiler_errors_read_device_and_host_diagnostics_not_ptxas_info():
    """The host compiler's file:line:col form counts as an error too, so a failed build names it first rather
    than a ptxas info line of another file."""
    text = "\n".join([
        "ptxas info    : Compiling entry function '_Z4peakiPf' for 'sm_90'",
        "kernels/a.cu: In constructor 'Ring<kCopy>::Ring(int)':",
        "kernels/a.cu:277:146: error: there are no arguments to '__ffs' that depend on a template parameter",
        "kernels/b.cu(12): error: identifier \"x\" is undefined",
        "kernels/b.cu(13): warning #177-D: variable \"y\" was declared but never referenced",
        "kernels/c.cu:3:10: fatal error: missing.cuh: No such file or directory",
    ])
    assert kbuild._compiler_errors(text) == [
        "kernels/a.cu:277: error: there are no arguments to '__ffs' that depend on a template parameter",
        'kernels/b.cu:12: error: identifier "x" is undefined',
        "kernels/c.cu:3: error: missing.cuh: No such file or directory",
    ]


def test_missing_nvcc_is_environment_error(monkeypatch, tmp_path):
    monkeypatch.delenv("NVCC", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(kbuild, "CUDA_HOMES", [str(tmp_path)])
    with pytest.raises(EnvironmentMissing, match="nvcc not found"):
        kbuild.find_nvcc()


PTXAS = """
ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90'
ptxas info    : Function properties for _Z3fooPf
    24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 24 bytes cumulative stack size, 120000 bytes smem
ptxas info    : Compiling entry function '_Z3barv' for 'sm_120'
ptxas info    : Function properties for _Z3barv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers
"""


def test_ptxas_report_and_gate():
    rows = resources.parse_ptxas(PTXAS)
    assert [(r.kernel, r.arch, r.registers, r.spill_stores, r.spill_loads, r.stack_frame, r.smem) for r in rows] == [
        ("_Z3fooPf", "sm_90", 255, 8, 12, 24, 120000), ("_Z3barv", "sm_120", 40, 0, 0, 0, 0)]
    cfg = config.load_build()
    problems = resources.resource_problems(rows, cfg)
    assert len(problems) == 1 and "spills 8 B" in problems[0]
    rows[1].smem = 200000  # beyond sm_120's 101,376 B
    assert any("sm_120" in p and "limit" in p for p in resources.resource_problems(rows, cfg))
    lenient = config.BuildConfig(cfg.archs, cfg.flags, cfg.output_dir, True, cfg.smem_limit_bytes, cfg.path)
    assert len(resources.resource_problems(rows, lenient)) == 1


def test_a_kernel_whose_wgmma_ptxas_serialized_fails_the_gate():
    """ptxas names the kernel in a note printed before its entry line; the note goes with that kernel's row only."""
    text = ("ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
            "program dependence on compiler-inserted WG.AR in divergent path in the function '_Z3wgv'\n" + PTXAS
            + PTXAS.replace("_Z3fooPf", "_Z3wgv").replace("'sm_90'", "'sm_90a'").replace("8 bytes spill stores, 12",
                                                                                       "0 bytes spill stores, 0"))
    rows = resources.parse_ptxas(text)
    assert [(r.kernel, r.arch, bool(r.wgmma_serialized)) for r in rows] == [
        ("_Z3fooPf", "sm_90", False), ("_Z3barv", "sm_120", False), ("_Z3wgv", "sm_90a", True), ("_Z3barv", "sm_120", False)]
    lenient = config.BuildConfig(("sm_90a",), (), Path("build"), True, {"sm_90": 232448, "sm_120": 101376}, None)
    (problem,) = resources.resource_problems(rows, lenient)
    assert problem == ("_Z3wgv [sm_90a]: ptxas serialized its wgmma (program dependence on compiler-inserted WG.AR in "
                       "divergent path)")


def test_an_arch_specific_build_runs_on_its_gpu_and_no_other():
    assert kbuild.runs_on(["sm_90a", "sm_120"], "sm_90") and kbuild.runs_on(["sm_90", "sm_120"], "sm_90")
    assert kbuild.runs_on(["sm_90a"], "sm_90a") and not kbuild.runs_on(["sm_90a"], "sm_120")
    assert not kbuild.runs_on(["sm_90"], "sm_100") and not kbuild.runs_on(["sm_120"], "sm_90")


def test_gencode_embeds_ptx_for_newest_only():
    assert kbuild.gencode_flags(("sm_90", "sm_120")) == [
        "-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_120,code=[sm_120,compute_120]"]


def test_bad_arch_override():
    from kdev.errors import BadInput

    with pytest.raises(BadInput, match="--arch: 'ampere'"):
        config.load_build(None, ["ampere"])


@needs_nvcc
def test_an_arch_this_nvcc_does_not_build_is_refused_before_compiling():
    from typer.testing import CliRunner

    from kdev.cli import app

    known = kbuild.nvcc_archs(kbuild.find_nvcc())
    assert known and "sm_90" in known and "sm_120" in known
    r = CliRunner().invoke(app, ["build", "--arch", "sm_99"])
    assert r.exit_code == 2 and "does not build sm_99" in r.stderr and "Traceback" not in r.output


@needs_nvcc
@pytest.mark.parametrize("arch, message", [
    ("sm_75", "sm_75: the kernels need sm_80 or newer"),
    ("sm_87", "sm_87: build.yaml has no smem_limit_bytes for it"),  # nvcc builds it; the gate could not judge it
])
def test_an_arch_the_kernels_or_the_gate_cannot_take_is_refused_before_compiling(tmp_path, build_config, arch,
                                                                                 message):
    from kdev.errors import BadInput

    with pytest.raises(BadInput, match=message):
        kbuild.build(build_config(tmp_path / "build", [arch]))
    assert not (tmp_path / "build").exists()


@pytest.mark.parametrize("damage", ["{garbage", '{"library": 5}', "[]", ""])
def test_a_damaged_build_record_is_no_record(tmp_path, monkeypatch, damage):
    """build/latest.json and build.json are kdev's own; one that is damaged stands for none (no traceback): the
    last build is then unknown, and a build rebuilds."""
    from kdev import fsutil

    monkeypatch.delenv("KDEV_LIB", raising=False)
    (tmp_path / kbuild.LATEST).write_text(damage)
    assert kbuild.latest_library(tmp_path) is None
    if damage != '{"library": 5}':  # an object with the key: read, and refused by latest_library for its type
        assert fsutil.read_json_record(tmp_path / kbuild.LATEST, ("library",)) is None
    assert fsutil.read_json_record(tmp_path / "absent.json") is None
    (tmp_path / "ok.json").write_text('{"library": "x", "n": 1}')
    assert fsutil.read_json_record(tmp_path / "ok.json", ("library",)) == {"library": "x", "n": 1}


@needs_nvcc
def test_a_cached_build_is_judged_by_the_gate_in_force(both_archs, tmp_path):
    """The cache key holds what the compile depends on, not build.yaml's gate: a build made under one gate and reused
    under a stricter one fails it (the launcher asked again with the new limits, latest.json no longer naming it),
    and passes again once the gate is as before, all without compiling. A record from before the gate was kept in it
    is judged anew too. `kdev build` prints the report and each problem with its arch."""
    from typer.testing import CliRunner

    from kdev.cli import app

    built, _ = both_archs
    out = tmp_path / "build"
    shutil.copytree(built.output_dir, out)  # the session's build stays as it is for the other tests
    text = (config.CONFIG_DIR / "build.yaml").read_text().replace("output_dir: build", f"output_dir: {out}")
    # the archs of the session's build, so that the first build below is its cache entry
    text = re.sub(r"^archs: .*$", f"archs: [{', '.join(built.archs)}]", text, count=1, flags=re.M)
    assert f"output_dir: {out}" in text and "sm_120: 101376" in text
    ok, tight = tmp_path / "ok.yaml", tmp_path / "tight.yaml"
    ok.write_text(text)
    tight.write_text(text.replace("sm_120: 101376", "sm_120: 50000"))

    first = kbuild.build(config.load_build(ok, None))
    assert first.cached and first.problems == [] and kbuild.latest_library(out) == first.library
    record = first.folder / "build.json"
    assert json.loads(record.read_text())["gate"]["smem_limit_bytes"] == {"sm_90": 232448, "sm_120": 101376}

    strict = kbuild.build(config.load_build(tight, None))
    assert strict.cached and strict.key == first.key and strict.problems
    assert all("[sm_120]" in p and "> 50000 B limit" in p for p in strict.problems)
    assert {r["limit"] for r in strict.launches if r["arch"] == "sm_120"} == {50000}
    assert kbuild.latest_library(out) is None
    assert json.loads(record.read_text())["problems"] == strict.problems

    r = CliRunner().invoke(app, ["build", "--config", str(tight)])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "ptxas resources" in r.stdout and "up to date, nothing compiled" in r.stdout
    said = [x for x in r.stderr.splitlines() if "[sm_120]: " in x and "> 50000 B limit" in x]
    assert len(said) == len(strict.problems)

    doc = json.loads(record.read_text())
    del doc["gate"]  # a record written before the gate was kept in it
    record.write_text(json.dumps(doc))
    again = kbuild.build(config.load_build(ok, None))
    assert again.cached and again.problems == [] and kbuild.latest_library(out) == first.library
    assert {r["limit"] for r in again.launches if r["arch"] == "sm_120"} == {101376}
    assert "gate" in json.loads(record.read_text())
    r = CliRunner().invoke(app, ["build", "--config", str(ok)])
    assert r.exit_code == 0 and "up to date, nothing compiled" in r.stdout and "flash calls" in r.stdout


def test_a_one_arch_build_is_its_own_latest_and_leaves_the_default_alone(tmp_path):
    """kdev build --arch sm_90 after a plain kdev build: latest.json (the default library: deploy-check, plan) still
    names the build of build.yaml's archs; the one-arch build is latest-sm_90.json."""
    from dataclasses import replace

    base = config.load_build(None, None)
    out = tmp_path / "build"
    for archs, lib in ((base.default_archs, "both"), (("sm_90",), "one")):
        cfg = replace(config.load_build(None, list(archs)), output_dir=out)
        (out / lib).mkdir(parents=True)
        (out / lib / kbuild.LIB_NAME).write_bytes(b"")
        res = kbuild.BuildResult(library=out / lib / kbuild.LIB_NAME, folder=out / lib, key=lib, cached=False,
                                 seconds=0.0, build_info={"source_hash": "x"}, resources=[], problems=[],
                                 embedded={})
        kbuild._point_latest(cfg, res)
    assert kbuild.latest_library(out) == out / "both" / kbuild.LIB_NAME
    assert kbuild.latest_library(out, archs=["sm_90"]) == out / "one" / kbuild.LIB_NAME
    assert kbuild.latest_library(out, archs=list(base.default_archs)) == out / "both" / kbuild.LIB_NAME


@pytest.mark.nvcc
def test_a_candidate_with_this_checkouts_sources_reuses_its_build(tmp_path, sm90_builds):
    """kdev sass --against HEAD (or a copy of kernels/ that was not edited) finds this checkout's library instead of
    compiling the same sources into a folder of their own; an edited copy gets a folder of its own."""
    cfg, own, _, edited = sm90_builds
    copy = tmp_path / "copy" / "kernels"
    shutil.copytree(kbuild.KERNEL_DIR, copy)
    again = kbuild.build(cfg, kernel_dir=copy, variant=True)
    assert again.cached and again.library == own.library
    assert not edited.cached and edited.library != own.library and "-variant-" in edited.folder.name


@pytest.mark.nvcc
def test_the_sass_identity_check_passes_a_move_and_catches_one_changed_instruction(tmp_path, build_config):
    """scripts/sass-identical.sh, the proof that a source move changed no machine code, cannot pass vacuously: the same
    sources split differently pass, a one-constant change in one kernel fails (the negative control)."""
    cfg = build_config(tmp_path / "build", ["sm_90"])
    base = kbuild.build(cfg)
    moved = tmp_path / "moved" / "kernels"  # the naive kernel's file split in two: the same translation unit
    shutil.copytree(kbuild.KERNEL_DIR, moved)
    text = (moved / "verify_attn.cu").read_text()
    cut = text.index("namespace kdtree {")
    (moved / "naive_head.cuh").write_text(text[:cut])
    (moved / "verify_attn.cu").write_text('#include "naive_head.cuh"\n' + text[cut:])
    changed = tmp_path / "changed" / "kernels"
    shutil.copytree(kbuild.KERNEL_DIR, changed)
    src = (changed / "verify_attn.cu").read_text()
    assert "l = 0.f" in src
    (changed / "verify_attn.cu").write_text(src.replace("l = 0.f", "l = 0.5f", 1))
    script = Path(__file__).resolve().parents[1] / "scripts" / "sass-identical.sh"
    for tree, code in ((moved, 0), (changed, 1)):
        lib = kbuild.build(cfg, kernel_dir=tree, variant=True).library
        r = subprocess.run(["bash", str(script), str(base.library), "--library", str(lib), "--arch", "sm_90"],
                           capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        assert r.returncode == code, r.stdout + r.stderr
    assert "verify_attn_naive_kernel" in r.stdout and "changed" in r.stdout


def test_names_and_tool_output_that_are_not_utf8_are_read(tmp_path):
    """A checkout under a path that is not UTF-8 (caf\\xe9/) and a file of such a name in kernels/: the source hash takes
    the name's bytes, and the compiler's output (which echoes paths) is read with the bad byte replaced."""
    kdir = tmp_path / "kernels"
    shutil.copytree(kbuild.KERNEL_DIR, kdir)
    before = kbuild.source_hash(kdir)
    odd = Path(os.fsdecode(bytes(kdir) + b"/caf\xe9.cuh"))
    odd.write_text("// a header of a name that is not UTF-8\n")
    after = kbuild.source_hash(kdir)
    assert after != before and len(after) == 64
    rc, text = kbuild.run_tool_group(["printf", "nvcc: caf\\351/kernels/x.cu\\n"], dict(os.environ))
    assert rc == 0 and text == "nvcc: caf\ufffd/kernels/x.cu\n"


@needs_nvcc
def test_a_current_build_in_a_read_only_checkout_writes_nothing_and_goes_on(both_archs, monkeypatch):
    """`kdev build` with everything up to date rewrites no file (a read-only checkout: any write fails there)."""
    cfg, _ = both_archs
    kbuild.build(cfg)  # the latest records as they stand

    def refuse(path, data):
        raise PermissionError(13, "Read-only file system", str(path))

    monkeypatch.setattr(kbuild, "atomic_write_bytes", refuse)
    again = kbuild.build(cfg)
    assert again.cached and not again.problems
