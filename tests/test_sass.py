"""kdev sass: SASS parsing, loop finding, accumulator-chain distances and load leads on hand-written SASS,
and the command on a real library where nvcc is present."""

import json
import subprocess
import sys
import textwrap

import pytest

from kdev import build as kbuild
from kdev import refs
from kdev import config as kconfig
from kdev import sass
from kdev.errors import BadInput

# Two kernels as cuobjdump prints them. k_two_chains: a loop whose four HMMA form two accumulator chains
# (R8 and R12, each read two HMMAs after it was written), fragments loaded 3 and 1 instructions ahead, and a
# retry stub after EXIT that jumps back into the loop (not a loop of its own). k_carried: accumulators
# carried around the loop (each HMMA reads what the same HMMA wrote one iteration before).
SASS = textwrap.dedent("""\
    Fatbin elf code:
    ================
    arch = sm_90

    \tcode for sm_90
    \t\tFunction : k_two_chains
    \t.headerflags\t@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
            /*0000*/                   MOV R1, c[0x0][0x28] ;                     /* 0x000 */
            /*0010*/                   CS2R R8, SRZ ;                             /* 0x000 */
            /*0020*/                   LDSM.16.M88.4 R20, [R2] ;                  /* 0x000 */
            /*0030*/                   LDS.128 R24, [R3] ;                        /* 0x000 */
            /*0040*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R4], R5 ;  /* 0x000 */
            /*0050*/              @!P0 BRA 0x00c0 ;                               /* 0x000 */
            /*0060*/                   HMMA.16816.F32.BF16 R8, R24, R20, R8 ;     /* 0x000 */
            /*0070*/                   HMMA.16816.F32.BF16 R12, R24, R22, R12 ;   /* 0x000 */
            /*0080*/                   NOP ;                                      /* 0x000 */
            /*0090*/                   HMMA.16816.F32.BF16 R8, R24, R20, R8 ;     /* 0x000 */
            /*00a0*/                   HMMA.16816.F32.BF16 R12, R24, R22, R12 ;   /* 0x000 */
            /*00b0*/               @P1 BRA 0x0020 ;                               /* 0x000 */
            /*00c0*/                   EXIT ;                                     /* 0x000 */
            /*00d0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R4], R5 ;  /* 0x000 */
            /*00e0*/              @!P0 BRA 0x00d0 ;                               /* 0x000 */
            /*00f0*/                   BRA 0x0060 ;                               /* 0x000 */
    \t\t..........

    \t\tFunction : k_carried
            /*0000*/                   LDSM.16.MT88.4 R40, [R2] ;                 /* 0x000 */
            /*0010*/                   IMAD.MOV.U32 R42, RZ, RZ, R7 ;             /* 0x000 */
            /*0020*/                   HMMA.16816.F32.BF16 R0, R44, R40, R0 ;     /* 0x000 */
            /*0030*/                   HMMA.16816.F32.BF16 R4, R44, R42, R4 ;     /* 0x000 */
            /*0040*/                   HMMA.16816.F32.BF16 R16, R44, R40, RZ ;    /* 0x000 */
            /*0050*/               @P0 BRA 0x0000 ;                               /* 0x000 */
            /*0060*/                   EXIT ;                                     /* 0x000 */

    Fatbin elf code:
    ================
    arch = sm_120

    \tcode for sm_120
    \t\tFunction : k_carried
            /*0000*/                   HMMA.16816.F32.BF16 R0, R44, R40, R0 ;     /* 0x000 */
            /*0010*/               @P0 BRA 0x0000 ;                               /* 0x000 */
            /*0020*/                   EXIT ;                                     /* 0x000 */
    """)


def test_parse_splits_functions_by_arch_and_reads_instructions():
    fns = sass.parse(SASS)
    assert [(f.arch, f.name) for f in fns] == [("sm_90", "k_two_chains"), ("sm_90", "k_carried"),
                                              ("sm_120", "k_carried")]
    ins = fns[0].instrs[5]
    assert (ins.addr, ins.op, ins.opcode, ins.predicated, ins.operands) == (0x50, "BRA", "BRA", True, ["0x00c0"])
    assert fns[0].instrs[6].operands == ["R8", "R24", "R20", "R8"]


def test_loops_are_back_edges_but_not_retry_stubs_jumping_over_exit():
    two, carried, _ = sass.parse(SASS)
    # 0x0020..0x00b0, and the stub's own wait loop at 0x00d0..0x00e0; the stub's jump from 0x00f0 back into
    # the loop crosses EXIT and is no loop
    assert sass.loops(two) == [(2, 11), (13, 14)]
    assert sass.loops(carried) == [(0, 5)]


def test_chain_distances_and_load_leads():
    two, carried, _ = sass.parse(SASS)
    r = sass.loop_report(two, 2, 11)
    assert (r["instructions"], r["hmma"], r["loads"], r["nop"]) == (10, 4, 2, 1)
    # shared-memory wavefronts per warp: an ldmatrix .x4 (four 128-byte matrices) and a 128-bit load (512 B)
    assert r["smem_wavefronts"] == 8 and r["smem_wavefronts_by_op"] == {"LDSM.16.M88.4": 4, "LDS.128": 4}
    assert r["smem_wavefronts_hot"] == 8  # no branch in the body skips a stretch
    # R8 and R12 chains: the first two read values carried from the previous iteration (4 - 2 = 2 back),
    # the last two the HMMA two places before
    assert r["chains"] == {"2": 4} and (r["chain_min"], r["chain_median"]) == (2, 2)
    # fragments: LDSM R20..R23 at 0, LDS.128 R24..R27 at 1; HMMAs at 4, 5, 7, 8 -> leads 3, 4, 6, 7
    assert (r["lead_min"], r["lead_median"]) == (3, 5)

    c = sass.loop_report(carried, 0, 5)
    # R0 and R4 are carried (3 HMMAs per iteration: 3 back); R16 starts from RZ (no chain)
    assert c["chains"] == {"3": 2}
    # R42 was overwritten by the IMAD after the LDSM: only the HMMAs reading R40 count (leads 2 and 4)
    assert (c["lead_min"], c["lead_median"]) == (2, 3)


# A warpgroup-MMA loop as ptxas writes it for sm_90a: S by two HGMMA waited for once, an empty group closed by an
# HGMMA on RZ, P.V by one; the same loop with every HGMMA waited for alone (what ptxas does when it serializes them).
WGMMA_SASS = textwrap.dedent("""\
    \tcode for sm_90a
    \t\tFunction : k_wg
            /*0000*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R4], R5 ;  /* 0x000 */
            /*0010*/                   WARPGROUP.ARRIVE ;                            /* 0x000 */
            /*0020*/                   HGMMA.64x32x16.F32.BF16 R152, gdesc[UR20], RZ, !UPT ;  /* 0x000 */
            /*0030*/                   HGMMA.64x32x16.F32.BF16 R152, gdesc[UR20], R152, gsb0 ;  /* 0x000 */
            /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;               /* 0x000 */
            /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x100 ;          /* 0x000 */
            /*0060*/                   HGMMA.64x8x16.F16 RZ, gdesc[URZ], RZ, !UPT, gsb0 ;  /* 0x000 */
            /*0070*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8].tnspB, R24, gsb0 ;  /* 0x000 */
            /*0080*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;               /* 0x000 */
            /*0090*/               @P1 BRA 0x0000 ;                                  /* 0x000 */
            /*00a0*/                   EXIT ;                                        /* 0x000 */
    """)


def test_wgmma_loops_count_hgmma_by_shape_and_say_when_ptxas_serialized_them():
    (fn,) = sass.parse(WGMMA_SASS)
    (r,) = sass.wgmma_report([fn], "k_wg")
    assert r["hgmma_by_shape"] == {"64x32x16": 2, "64x256x16": 1} and r["hgmma"] == 3  # the RZ one does no work
    assert r["flop_per_warpgroup"] == 2 * 2 * 64 * 32 * 16 + 2 * 64 * 256 * 16
    assert (r["wgmma_waits"], r["serialized"], r["block_barriers"], r["mbarrier_waits"]) == (2, False, 1, 1)
    assert sass.report([fn], "k_wg") == []  # no HMMA loop: the mma.sync table has nothing to say of it
    serial = WGMMA_SASS.replace("R152, gdesc[UR20], RZ, !UPT ;", "R152, gdesc[UR20], RZ, !UPT, gsb0 ;\n"
                                "        /*0025*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;  /* 0x000 */")
    (r,) = sass.wgmma_report(sass.parse(serial), "k_wg")
    assert (r["wgmma_waits"], r["serialized"]) == (3, True)


def test_report_filters_kernel_and_arch_and_names_what_exists():
    fns = sass.parse(SASS)
    rows = sass.report(fns, "k_carried")
    assert [(r["arch"], r["hmma"]) for r in rows] == [("sm_90", 3), ("sm_120", 1)]
    assert [r["arch"] for r in sass.report(fns, "k_carried", ["sm_120"])] == ["sm_120"]
    with pytest.raises(BadInput, match="no kernel matching 'nope'.*k_carried, k_two_chains"):
        sass.report(fns, "nope")


def _edited(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new, 1)


def test_compare_of_a_build_with_itself_is_all_same():
    fns = sass.parse(SASS)
    rows = sass.compare(fns, sass.parse(SASS))
    assert [(r["arch"], r["kernel"], r["status"], r["changed_instructions"]) for r in rows] == [
        ("sm_120", "k_carried", "same", 0), ("sm_90", "k_carried", "same", 0), ("sm_90", "k_two_chains", "same", 0)]
    assert rows[1]["base_hmma_loops"] == rows[1]["hmma_loops"] == [6]


def test_compare_counts_changed_instructions_and_ignores_moved_branch_targets():
    # one instruction inserted into k_two_chains' loop: every later address and both branch targets behind it move,
    # which counts as the one inserted instruction only; k_carried on sm_90 gets a changed operand
    edited = _edited(SASS, "/*0080*/                   NOP ;",
                     "/*0080*/                   NOP ;\n        /*0081*/                   NOP ;")
    edited = _edited(edited, "@!P0 BRA 0x00c0", "@!P0 BRA 0x00d0")
    edited = _edited(edited, "BRA 0x0060 ;", "BRA 0x0070 ;")
    edited = _edited(edited, "IMAD.MOV.U32 R42, RZ, RZ, R7", "IMAD.MOV.U32 R42, RZ, RZ, RZ")
    rows = {(r["arch"], r["kernel"]): r for r in sass.compare(sass.parse(SASS), sass.parse(edited))}
    two = rows[("sm_90", "k_two_chains")]
    assert (two["status"], two["changed_instructions"]) == ("changed", 1)
    assert (two["base_instructions"], two["instructions"]) == (16, 17)
    assert (two["base_hmma_loops"], two["hmma_loops"]) == ([10], [11])
    assert two["base_hmma_loop_wavefronts"] == two["hmma_loop_wavefronts"] == [8]  # a NOP moves nothing
    # an ldmatrix .x4 narrowed to .x2: four wavefronts less of shared memory per iteration
    narrowed = sass.compare(sass.parse(SASS), sass.parse(_edited(SASS, "LDSM.16.M88.4 R20", "LDSM.16.M88.2 R20")),
                            "k_two_chains")
    assert (narrowed[0]["base_hmma_loop_wavefronts"], narrowed[0]["hmma_loop_wavefronts"]) == ([8], [6])
    assert (rows[("sm_90", "k_carried")]["status"], rows[("sm_90", "k_carried")]["changed_instructions"]) == ("changed", 1)
    assert rows[("sm_120", "k_carried")]["status"] == "same"
    # a changed guard predicate is a change too (text compared as printed, predicate included)
    guard = _edited(SASS, "@P1 BRA 0x0020", "@!P1 BRA 0x0020")
    assert [r["status"] for r in sass.compare(sass.parse(SASS), sass.parse(guard), "k_two_chains")] == ["changed"]


def test_compare_tells_other_registers_from_other_instructions():
    # k_carried on sm_120 with its accumulator in R4 instead of R0: identical but for register numbers
    renamed = _edited(SASS, "HMMA.16816.F32.BF16 R0, R44, R40, R0 ;     /* 0x000 */\n        /*0010*/",
                      "HMMA.16816.F32.BF16 R4, R44, R40, R4 ;     /* 0x000 */\n        /*0010*/")
    rows = {(r["arch"], r["kernel"]): r for r in sass.compare(sass.parse(SASS), sass.parse(renamed))}
    assert (rows[("sm_120", "k_carried")]["status"], rows[("sm_120", "k_carried")]["changed_instructions"]) == (
        "registers", 0)
    assert rows[("sm_90", "k_carried")]["status"] == "same"
    # an operand that is no register (RZ for R0) is a change
    other = _edited(SASS, "HMMA.16816.F32.BF16 R0, R44, R40, R0 ;     /* 0x000 */\n        /*0010*/",
                    "HMMA.16816.F32.BF16 R4, R44, R40, RZ ;     /* 0x000 */\n        /*0010*/")
    assert [r["status"] for r in sass.compare(sass.parse(SASS), sass.parse(other), "k_carried", ["sm_120"])] == [
        "changed"]


def test_compare_names_the_removed_kernel_whose_code_an_added_one_has():
    # k_two_chains renamed k_four_chains with the same code, and on sm_120 k_carried renamed with other registers
    renamed = SASS.replace("Function : k_two_chains", "Function : k_four_chains")
    renamed = _edited(renamed, "Function : k_carried\n        /*0000*/                   HMMA.16816.F32.BF16 R0, R44, R40, R0",
                      "Function : k_carried2\n        /*0000*/                   HMMA.16816.F32.BF16 R4, R44, R40, R4")
    rows = {(r["arch"], r["kernel"]): r for r in sass.compare(sass.parse(SASS), sass.parse(renamed))}
    four = rows[("sm_90", "k_four_chains")]
    assert (four["status"], four["code_of"], four["code_likeness"]) == ("added", "k_two_chains", "same")
    again = rows[("sm_120", "k_carried2")]
    assert (again["status"], again["code_of"], again["code_likeness"]) == ("added", "k_carried", "registers")
    assert rows[("sm_90", "k_two_chains")]["status"] == "removed" and rows[("sm_90", "k_two_chains")]["code_of"] is None


def test_compare_names_kernels_only_in_one_build_and_filters_by_kernel_and_arch():
    renamed = SASS.replace("Function : k_two_chains", "Function : k_four_chains")
    rows = sass.compare(sass.parse(SASS), sass.parse(renamed), "chains", ["sm_90"])
    assert [(r["kernel"], r["status"], r["base_instructions"], r["instructions"], r["changed_instructions"])
            for r in rows] == [("k_four_chains", "added", None, 16, 16), ("k_two_chains", "removed", 16, None, 16)]
    with pytest.raises(BadInput, match="no kernel matching 'nope' in either library.*k_carried"):
        sass.compare(sass.parse(SASS), sass.parse(renamed), "nope")
    with pytest.raises(BadInput, match=r"no SASS for sm_86 \(the base has: sm_90, sm_120\)"):  # not left out silently
        sass.compare(sass.parse(SASS), sass.parse(renamed), "chains", ["sm_90", "sm_86"])


def test_anonymous_namespace_hash_does_not_count_as_a_change():
    # nvcc names a file's anonymous namespace with a hash of its own: builds of the same source may differ there
    sym = "_ZN6kdtree53_GLOBAL__N__{}_20_verify_attn_flash_cu_{}8g_probeE"
    a = _edited(SASS, "MOV R1, c[0x0][0x28]", "MOV R1, 32@lo(" + sym.format("50670c2e", "d303a9c4") + ")")
    b = _edited(SASS, "MOV R1, c[0x0][0x28]", "MOV R1, 32@lo(" + sym.format("1234abcd", "0badf00d") + ")")
    assert {r["status"] for r in sass.compare(sass.parse(a), sass.parse(b))} == {"same"}


def test_sass_against_command_exit_codes(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from kdev.cli import app

    base, cand = tmp_path / "base" / "libkdtree.so", tmp_path / "cand" / "libkdtree.so"
    for lib in (base, cand):  # stand-ins: their SASS comes from the texts below
        lib.parent.mkdir()
        lib.touch()
    texts = {base: SASS, cand: _edited(SASS, "IMAD.MOV.U32 R42, RZ, RZ, R7", "IMAD.MOV.U32 R42, RZ, RZ, RZ")}
    monkeypatch.setattr(sass, "dump", lambda lib: texts[lib])
    runner = CliRunner()
    args = ["sass", "--library", str(cand), "--against", str(base)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and "k_carried" in r.stdout and "2 of 3 kernels x archs identical" in r.stdout
    r = runner.invoke(app, args + ["--expect-same", "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and doc["same"] is False
    assert [(k["arch"], k["status"]) for k in doc["kernels"] if k["kernel"] == "k_carried"] == [
        ("sm_120", "same"), ("sm_90", "changed")]
    r = runner.invoke(app, args + ["--expect-same", "--arch", "sm_120"])
    assert r.exit_code == 0 and "1 of 1 kernels x archs identical" in r.stdout
    r = runner.invoke(app, ["sass", "--library", str(cand), "--expect-same"])
    assert r.exit_code == 2 and "needs --against" in r.output and "Traceback" not in r.output


def test_sass_builds_a_kernels_copy_a_revision_or_a_patch_first(monkeypatch, tmp_path):
    """--library / --against REF: what is not a library is built first (refs.library_for) for the archs asked,
    else build.yaml's; a build that fails the resource gate is read with a warning; a REF naming nothing is exit 2."""
    from typer.testing import CliRunner

    from kdev.cli import app

    patch = tmp_path / "v.patch"
    patch.write_text("--- a/kernels/verify_attn.cu\n+++ b/kernels/verify_attn.cu\n")
    built = {}
    libs = {str(patch): tmp_path / "variant" / "libkdtree.so", "HEAD": tmp_path / "head" / "libkdtree.so"}

    def fake_library_for(ref, archs, log=None):
        built[ref] = tuple(archs)
        return kbuild.BuildResult(library=libs[ref], folder=libs[ref].parent, cached=True, key="k", build_info={},
                                  resources=[], problems=["k: spills 8 B"] if ref == "HEAD" else [], launches=[],
                                  embedded={}, seconds=0.0)

    monkeypatch.setattr(refs, "library_for", fake_library_for)
    texts = {libs[str(patch)]: _edited(SASS, "IMAD.MOV.U32 R42, RZ, RZ, R7", "IMAD.MOV.U32 R42, RZ, RZ, RZ"),
             libs["HEAD"]: SASS}
    monkeypatch.setattr(sass, "dump", lambda lib: texts[lib])
    runner = CliRunner()
    r = runner.invoke(app, ["sass", "--library", str(patch), "--against", "HEAD", "--arch", "sm_90"])
    assert r.exit_code == 0 and "k_carried" in r.stdout and built == {str(patch): ("sm_90",), "HEAD": ("sm_90",)}
    assert "HEAD: its build fails the resource gate (k: spills 8 B)" in r.stderr
    built.clear()
    r = runner.invoke(app, ["sass", "--library", str(patch), "--against", "HEAD", "--expect-same"])
    assert r.exit_code == 1 and "2 of 3 kernels x archs identical" in r.stdout, r.output
    assert set(built.values()) == {tuple(kconfig.load_build(None, None).archs)}  # build.yaml's archs
    r = runner.invoke(app, ["sass", "--against", str(tmp_path / "nope.patch")])
    assert r.exit_code == 2 and "nope.patch: no library, build folder, copy of kernels/, git revision" in r.stderr


def test_missing_library_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="no such library"):
        sass.dump(tmp_path / "libnone.so")


@pytest.mark.nvcc
def test_sass_command_on_a_built_library(sm90_library):
    if kbuild.find_cuobjdump() is None:
        pytest.skip("cuobjdump not found (pip install 'kdev[build]')")
    out = subprocess.run([sys.executable, "-m", "kdev", "sass", "--library", str(sm90_library), "--arch", "sm_90",
                          "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    loops = doc["loops"]
    assert all(r["arch"] == "sm_90" for r in loops)
    # the full-tile and the narrow kernel: lockstep with tensor copies (pages >= 32 tokens) or cp.async only, and
    # the teams form (tensor copies where a block holds the three-deep ring)
    full = {f"verify_attn_flash_kernel<{b}>" for b in ("true", "false")} | {"verify_attn_flash_teams_kernel"}
    narrow = {f"verify_attn_flash_narrow_kernel<{b}>" for b in ("false, false", "true, false", "true, true")}
    assert {r["kernel"] for r in loops} == full | narrow
    for r in loops:
        assert r["hmma"] > 0 and sum(r["chains"].values()) <= r["hmma"]
    bad = subprocess.run([sys.executable, "-m", "kdev", "sass", "--library", str(sm90_library), "--arch", "sm_100"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "no SASS for sm_100 (the library has: sm_90, sm_120)" in bad.stderr
    # the library against itself (named by its build folder): every kernel of it, identical
    same = subprocess.run([sys.executable, "-m", "kdev", "sass", "--library", str(sm90_library), "--against",
                           str(sm90_library.parent), "--expect-same", "--json"], capture_output=True, text=True)
    assert same.returncode == 0, same.stderr
    doc = json.loads(same.stdout)
    assert doc["same"] and {k["status"] for k in doc["kernels"]} == {"same"}
    assert full | narrow | {"verify_attn_naive_kernel"} <= {k["kernel"] for k in doc["kernels"]}


def test_cuobjdump_without_nvdisasm_is_an_environment_error(tmp_path, monkeypatch):
    from kdev.errors import EnvironmentMissing

    fake = tmp_path / "cuobjdump"
    fake.write_text("#!/bin/sh\necho \"cuobjdump fatal   : Could not find executable file 'nvdisasm'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    lib = tmp_path / "libkdtree.so"
    lib.write_bytes(b"\x7fELF")
    monkeypatch.setattr(sass, "find_cuobjdump", lambda nvcc=None: str(fake))
    with pytest.raises(EnvironmentMissing, match="needs nvdisasm"):
        sass.dump(lib)


@pytest.mark.parametrize("text, wavefronts", [
    ("LDSM.16.M88.4 R20, [R2]", 4), ("LDSM.16.MT88.2 R20, [R2]", 2), ("LDSM.16.M88 R20, [R2]", 1),
    ("LDS.128 R24, [R3]", 4), ("LDS.U.64 R24, [R3]", 2), ("LDS R24, [R3]", 1), ("STS.128 [R3], R24", 4),
    ("STS.U16 [R3], R24", 1), ("LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64]", 4), ("ATOMS.ADD RZ, [R3], R4", 1),
    ("UTMALDG.3D [UR8], [UR4]", 0), ("LDG.E.128 R4, desc[UR4][R2.64]", 0), ("HMMA.16816.F32.BF16 R8, R24, R20, R8", 0),
])
def test_shared_memory_wavefronts_of_one_warp_wide_instruction(text, wavefronts):
    assert sass.smem_wavefronts(sass.parse_instr(text, 0)) == wavefronts


def test_the_hot_path_leaves_out_stretches_a_branch_skips_without_hmma_and_guarded_instructions():
    body = [sass.parse_instr(t, a) for a, t in [
        (0x00, "LDSM.16.M88.4 R20, [R2]"),
        (0x10, "@P0 BRA 0x0040"),                        # skips a fallback copy: no HMMA in it, rare
        (0x20, "LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64]"),
        (0x30, "LDS R9, [R3]"),
        (0x40, "@P1 LDS R10, [R3]"),                     # guarded: left out
        (0x50, "@P2 BRA 0x0080"),                        # skips tensor work: the hot path, kept
        (0x60, "LDSM.16.MT88.4 R24, [R2]"),
        (0x70, "HMMA.16816.F32.BF16 R8, R24, R20, R8"),
        (0x80, "@P3 BRA 0x0000"),
    ]]
    assert sass.rare_stretches(body) == [False, False, True, True, False, False, False, False, False]
    fn = sass.Function("sm_90", "k", body)
    r = sass.loop_report(fn, 0, len(body) - 1)
    assert (r["smem_wavefronts"], r["smem_wavefronts_hot"]) == (4 + 4 + 1 + 1 + 4, 4 + 4)



def test_sass_with_arch_reads_the_last_build_of_that_arch(monkeypatch, tmp_path):
    """kdev build --arch sm_90 names its library in latest-sm_90.json, not latest.json: kdev sass --arch sm_90 finds it
    there (a GPU round builds one arch, then reads its SASS)."""
    import typer

    from kdev.cli import app, tools

    one_arch = tmp_path / "libkdtree.so"
    monkeypatch.setattr(kbuild, "latest_library", lambda output_dir=None, archs=None: one_arch if archs else None)
    read = []

    def stop(ref, archs):
        read.append((ref, archs))
        raise typer.Exit(0)

    monkeypatch.setattr(tools, "_sass_library", stop)
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["sass", "--arch", "sm_90"])
    assert r.exit_code == 0 and read == [(str(one_arch), ["sm_90"])], r.output
    r = CliRunner().invoke(app, ["sass"])
    assert r.exit_code == 3 and "no library" in r.output
