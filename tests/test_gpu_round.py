"""scripts/gpu-round.sh: bad options are refused (exit 2, one line) before any GPU work starts; a variant tree from a
patch (scripts/variant-tree.sh, behind --variant-patch); the summaries of its --kernel-times step
(scripts/kernel_times.py), of its --ab step (scripts/ab_summary.py) and of its --variants step
(scripts/variants_summary.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-round.sh"


def run(tmp_path, *args):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")}, timeout=30)


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "ten", ""])
def test_step_timeout_must_be_whole_seconds(tmp_path, value):
    r = run(tmp_path, "--step-timeout", value)
    assert r.returncode == 2
    assert r.stderr.strip() == f"--step-timeout takes a whole number of seconds > 0, not '{value}'"
    assert not (tmp_path / "out" / "round.log").exists()  # refused before the round began


def test_a_round_where_kdev_does_not_start_stops_in_one_line(tmp_path):
    """A machine without kdev's dependencies (here: a python3 that lacks typer) gets one line and exit 3, before any
    step (the round would otherwise print the same traceback in every step)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'typer'\" >&2\nexit 1\n")
    (fake / "python3").chmod(0o755)
    r = subprocess.run(["bash", str(SCRIPT), "--fuzz", "0"], capture_output=True, text=True, timeout=30,
                       env={"PATH": f"{fake}:/usr/bin:/bin", "OUT": str(tmp_path / "out"), "GPU_ARCH": "sm_90"})
    assert r.returncode == 3
    assert r.stderr.strip() == ("python3 -m kdev does not start here (ModuleNotFoundError: No module named 'typer'): "
                                "pip install -e . (kdev's dependencies)")
    assert not (tmp_path / "out" / "round.log").exists()


def test_unknown_option_is_refused(tmp_path):
    r = run(tmp_path, "--fuz", "10")
    assert r.returncode == 2 and r.stderr.strip() == "unknown option --fuz"


@pytest.mark.parametrize("option", ["--kernel-times", "--fuzz", "--profile", "--profile-kernel", "--profile-backend",
                                    "--ab", "--variants", "--variant-patch", "--timeline", "--axis"])
def test_an_option_without_its_value_is_refused(tmp_path, option):
    r = run(tmp_path, option)
    assert r.returncode == 2 and r.stderr.strip() == f"{option} takes a value"
    assert not (tmp_path / "out" / "round.log").exists()


def test_ab_needs_a_kernels_tree(tmp_path):
    (tmp_path / "not-kernels").mkdir()
    r = run(tmp_path, "--ab", str(tmp_path / "not-kernels"))
    assert r.returncode == 2
    assert r.stderr.strip() == f"--ab {tmp_path / 'not-kernels'}: not a copy of kernels/ (no include/ folder)"
    assert not (tmp_path / "out" / "round.log").exists()


def test_variants_need_kernels_trees_with_distinct_names(tmp_path):
    (tmp_path / "a" / "kernels" / "include").mkdir(parents=True)
    (tmp_path / "not-kernels").mkdir()
    r = run(tmp_path, "--variants", f"{tmp_path / 'a' / 'kernels'},{tmp_path / 'not-kernels'}")
    assert r.returncode == 2
    assert r.stderr.strip() == f"--variants {tmp_path / 'not-kernels'}: not a copy of kernels/ (no include/ folder)"
    # named by the folder above kernels/: the same tree given twice (in two options) has one name twice
    r = run(tmp_path, "--variants", str(tmp_path / "a" / "kernels"), "--variants", str(tmp_path / "a" / "kernels"))
    assert r.returncode == 2 and r.stderr.strip() == "--variants: two variants named a (the folder above kernels/)"
    assert not (tmp_path / "out" / "round.log").exists()


TREE_SCRIPT = SCRIPT.parent / "variant-tree.sh"
KERNELS = SCRIPT.parents[1] / "kernels"


def comment_patch(path: Path, text: str, context: str | None = None) -> Path:
    """A unified diff (paths kernels/...) that adds a comment line after the first line of kernels/verify_attn.cu;
    with `context`, its context line is that text instead of the file's (so it does not apply)."""
    lines = (KERNELS / "verify_attn.cu").read_text().splitlines()
    first = context if context is not None else lines[0]
    path.write_text(f"--- a/kernels/verify_attn.cu\n+++ b/kernels/verify_attn.cu\n@@ -1,2 +1,3 @@\n {first}\n+{text}\n"
                    f" {lines[1]}\n")
    return path


def test_variant_tree_is_the_working_kernels_with_the_patch_applied(tmp_path):
    patch = comment_patch(tmp_path / "flash-probe.patch", "// probe line")
    r = subprocess.run(["bash", str(TREE_SCRIPT), str(patch), str(tmp_path / "trees")], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"}, timeout=30)
    assert r.returncode == 0, r.stderr
    tree = Path(r.stdout.strip())
    assert tree == tmp_path / "trees" / "flash-probe" / "kernels"  # named by the patch
    patched = (tree / "verify_attn.cu").read_text().splitlines()
    assert patched[1] == "// probe line" and patched[2:] == (KERNELS / "verify_attn.cu").read_text().splitlines()[1:]
    for f in KERNELS.rglob("*"):  # everything else as in the working tree; the working tree itself untouched
        if f.is_file() and f.name != "verify_attn.cu":
            assert (tree / f.relative_to(KERNELS)).read_bytes() == f.read_bytes()
    assert "// probe line" not in (KERNELS / "verify_attn.cu").read_text()


def test_variant_patch_that_is_missing_or_does_not_apply_is_refused(tmp_path):
    r = run(tmp_path, "--variant-patch", str(tmp_path / "none.patch"))
    assert r.returncode == 2 and r.stderr.strip() == f"--variant-patch {tmp_path / 'none.patch'}: no such file"
    stale = comment_patch(tmp_path / "stale.patch", "// probe line", context="// not the first line of the file")
    r = run(tmp_path, "--variant-patch", str(stale))
    assert r.returncode == 2
    assert r.stderr.strip().startswith(f"--variant-patch {stale}: does not apply to the working tree's kernels/ (")
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "round.log").exists()


def test_the_timeline_probe_patch_applies_to_the_working_tree(tmp_path):
    """--timeline builds the working tree's kernels with this patch: a kernel change that breaks it shows here, not in
    a GPU round."""
    patch = Path(__file__).resolve().parents[1] / "variants" / "flash-v24-probe-timeline.patch"
    r = subprocess.run(["bash", str(TREE_SCRIPT), str(patch), str(tmp_path / "trees")], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"}, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "kdtree_cta_probe_read" in (Path(r.stdout.strip()) / "verify_attn_flash.cu").read_text()


@pytest.mark.parametrize("patch,marker", [("flash-v25-teams16.patch", "verify_attn_flash_teams_kernel<16>")])
def test_the_candidates_for_the_next_round_apply_to_the_working_tree(tmp_path, patch, marker):
    """The variants NOTES names for the next GPU round (--variant-patch) must apply to the kernels as they are now."""
    path = Path(__file__).resolve().parents[1] / "variants" / patch
    r = subprocess.run(["bash", str(TREE_SCRIPT), str(path), str(tmp_path / "trees")], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"}, timeout=30)
    assert r.returncode == 0, r.stderr
    tree = Path(r.stdout.strip())
    assert any(marker in f.read_text() for f in [*tree.glob("*.cu"), *tree.glob("include/kdev/*.cuh")])


NCU_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
              '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def ncu_row(i, kernel, grid, value, unit="nsecond"):
    return (f'"{i}","1","python3","h","{kernel}","1","7","(256, 1, 1)","{grid}","0","9.0",'
            f'"Command line profiler metrics","gpu__time_duration.sum","{unit}","{value}"')


def test_kernel_times_groups_launches_by_kernel_and_grid(tmp_path):
    flash = "void kdtree::<unnamed>::verify_attn_flash_kernel<1>(VerifyAttnParams, int, CUtensorMap)"
    combine = "void kdtree::(anonymous namespace)::verify_attn_combine_kernel<4>(VerifyAttnParams, int)"
    rows = [ncu_row(0, flash, "(9, 14, 1)", "170,000"), ncu_row(1, combine, "(520, 1, 1)", "9,000"),
            ncu_row(2, flash, "(9, 14, 1)", "160,000"), ncu_row(3, flash, "(9, 14, 1)", "0.5", unit="msecond"),
            ncu_row(4, flash, "(65, 2, 1)", "1,083,400")]
    csv_path = tmp_path / "times.csv"
    csv_path.write_text("==PROF== Connected to process 1\n" + NCU_HEADER + "\n" + "\n".join(rows) + "\n")
    r = subprocess.run([sys.executable, str(SCRIPT.parent / "kernel_times.py"), str(csv_path)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    lines = [line.split() for line in r.stdout.splitlines()[1:]]
    assert [line[0] for line in lines] == ["verify_attn_flash_kernel<1>", "verify_attn_combine_kernel<4>",
                                           "verify_attn_flash_kernel<1>"]
    assert lines[0][-2:] == ["3", "170.0"]  # median of 170, 160 and 500 µs
    assert lines[1][-2:] == ["1", "9.0"] and lines[2][-2:] == ["1", "1083.4"]


def test_kernel_times_refuses_a_file_without_times(tmp_path):
    csv_path = tmp_path / "empty.csv"
    csv_path.write_text("==PROF== No kernels were profiled.\n")
    r = subprocess.run([sys.executable, str(SCRIPT.parent / "kernel_times.py"), str(csv_path)], capture_output=True,
                       text=True)
    assert r.returncode == 1 and "no gpu__time_duration.sum rows" in r.stderr


def bench_doc(path, times):
    """A bench --out-json document with the given medians: {(shape, backend): µs}."""
    results = [{"shape": shape, "backend": backend, "timing": {"median_us": us}} for (shape, backend), us in times.items()]
    path.write_text(json.dumps({"results": results}))
    return str(path)


def ab_summary(*args):
    return subprocess.run([sys.executable, str(SCRIPT.parent / "ab_summary.py"), *args], capture_output=True, text=True)


def test_ab_summary_takes_out_the_drift_of_the_normalising_backend(tmp_path):
    shape = "B1-L32768-N64-H8-p64"
    # pair 1: the machine ran 10 % slow during the candidate's run (naive 1.1x), flash 1.1 * 0.95 = 1.045x;
    # pair 2: no drift, flash 0.95x. Both say the candidate is 5 % faster.
    files = [bench_doc(tmp_path / "b1.json", {(shape, "flash"): 100.0, (shape, "naive"): 1000.0}),
             bench_doc(tmp_path / "c1.json", {(shape, "flash"): 104.5, (shape, "naive"): 1100.0}),
             bench_doc(tmp_path / "b2.json", {(shape, "flash"): 100.0, (shape, "naive"): 1000.0}),
             bench_doc(tmp_path / "c2.json", {(shape, "flash"): 95.0, (shape, "naive"): 1000.0})]
    r = ab_summary("--normalize-by", "naive", *files)
    assert r.returncode == 0, r.stderr
    rows = {tuple(line.split()[:2]): line.split() for line in r.stdout.splitlines()[1:]}
    flash = rows[(shape, "flash")]
    assert flash[2:8] == ["100.0", "104.5", "0.950", "100.0", "95.0", "0.950"]
    assert flash[8:] == ["-5.0%", "0.0%"]
    assert rows[(shape, "naive")][8:] == ["+5.0%", "10.0%"]  # its own drift, unnormalised
    raw = ab_summary(*files)  # without normalising, pair 1 reads as 4.5 % slower
    flash_raw = {tuple(line.split()[:2]): line.split() for line in raw.stdout.splitlines()[1:]}[(shape, "flash")]
    assert flash_raw[4] == "1.045" and flash_raw[9] == "9.5%"
    assert float(flash_raw[8].rstrip("%")) == pytest.approx(-0.25, abs=0.051)


def test_ab_summary_refuses_odd_or_unreadable_input(tmp_path):
    assert ab_summary(str(tmp_path / "one.json")).returncode == 2
    r = ab_summary(str(tmp_path / "missing.json"), str(tmp_path / "missing2.json"))
    assert r.returncode == 1 and r.stderr.startswith("cannot read a bench result")


def variants_summary(*args):
    return subprocess.run([sys.executable, str(SCRIPT.parent / "variants_summary.py"), *args], capture_output=True,
                          text=True)


def test_variants_summary_compares_each_variant_with_the_mean_of_the_tree_runs(tmp_path):
    shape = "B1-L32768-N16-H8-p64"
    files = [bench_doc(tmp_path / "t1.json", {(shape, "flash"): 60.0}),
             bench_doc(tmp_path / "t2.json", {(shape, "flash"): 62.0}),
             "q2=" + bench_doc(tmp_path / "q2.json", {(shape, "flash"): 64.05}),
             "comb2=" + bench_doc(tmp_path / "comb2.json", {(shape, "flash"): 58.56})]
    r = variants_summary(*files)
    assert r.returncode == 0, r.stderr
    head, row = r.stdout.splitlines()[0].split(), r.stdout.splitlines()[1].split()
    assert head[5:] == ["q2", "vs-tree", "comb2", "vs-tree"]
    assert row[2:5] == ["60.0", "62.0", "+3.3%"]  # the tree's drift over the round
    assert row[5:] == ["64.0", "+5.0%", "58.6", "-4.0%"]  # against (60 + 62) / 2 = 61


def test_variants_summary_refuses_bad_input(tmp_path):
    t = bench_doc(tmp_path / "t.json", {("s", "flash"): 1.0})
    assert variants_summary(t, t).returncode == 2  # no variant
    assert variants_summary(t, t, t).returncode == 2  # a variant without its name
    r = variants_summary(t, t, "x=" + str(tmp_path / "missing.json"))
    assert r.returncode == 1 and r.stderr.startswith("cannot read a bench result")
    other = bench_doc(tmp_path / "o.json", {("other", "flash"): 1.0})
    r = variants_summary(t, t, "x=" + other)
    assert r.returncode == 1 and r.stderr.strip() == "no shape and backend timed in every file"


def _cta_timeline(*args):
    return subprocess.run([sys.executable, str(SCRIPT.parent / "cta_timeline.py"), *map(str, args)], capture_output=True,
                          text=True)


def test_cta_timeline_splits_calls_and_times_each_interval(tmp_path):
    import numpy as np

    # three calls (the first and the last dropped): on SM 1 two teams-kernel CTAs one after the other, on SM 2 one and
    # a narrow CTA behind it; times in ns
    records = []
    for t in (0, 1_000_000, 2_000_000):
        for x, (sm, start) in enumerate(((1, 1000), (1, 110_000), (2, 1100))):
            e = t + start
            records.append([0 | sm << 8, x, e, e + 500, e + 3000, e + 2500, e + 99_000, e + 97_000, e + 101_000,
                            e + 100_000, e + 101_100])
        records.append([1 | 2 << 8, 0, t + 105_000, t + 190_000] + [0] * 7)
        # two combine CTAs on SM 3, waiting from the start of the call until the tile kernels end
        for x, release in ((0, 212_100), (1, 213_100)):
            records.append([2 | 3 << 8, x, t + 2000, t + release, t + release + 4000] + [0] * 6)
    path = tmp_path / "records.npy"
    np.save(path, np.array(records, dtype=np.uint64))
    r = _cta_timeline("--records", path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "3 calls, 9 teams-kernel CTAs, 3 narrow CTAs, 6 combine CTAs"
    out = {line[:45].strip(): line[45:].split() for line in lines[1:]}
    assert out["call: first entry -> last teams-kernel exit"][1] == "210.10"  # 110,000 + 101,100 - 1,000
    assert out["call: first entry -> last narrow exit"][1] == "189.00"
    assert out["call: last teams exit -> last narrow exit"][1] == "-21.10"  # 190,000 - 211,100
    assert out["narrow CTA beside teams: entry -> exit"][1] == "85.00" and "narrow CTA after teams: entry -> exit" not in out
    assert out["CTA: entry -> team 0 first tile landed"][1] == "3.00"
    assert out["CTA: team 1 loop end - team 0 loop end"][1] == "-2.00"
    gaps = out["SM: one CTA's exit -> the next one's entry"]
    assert gaps[1] == "5.35" and gaps[-1] == "n=2"  # SM 1: 110,000 - 102,100 = 7.9 us; SM 2: 105,000 - 102,200
    # the tile kernels end at 211,100 (the second teams CTA on SM 1)
    assert out["call: tiles end -> first combine release"][1] == "1.00"
    assert out["call: tiles end -> last combine exit"][1] == "6.00"
    assert out["combine CTA: release -> exit"][1] == "4.00" and out["combine CTA: release -> exit"][-1] == "n=2"


def test_cta_timeline_refuses_bad_arguments_and_empty_records(tmp_path):
    import numpy as np

    r = _cta_timeline()
    assert r.returncode == 2 and "give --records" in r.stderr
    r = _cta_timeline("--records", tmp_path / "missing.npy")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    path = tmp_path / "empty.npy"
    np.save(path, np.zeros((0, 11), dtype=np.uint64))
    r = _cta_timeline("--records", path)
    assert r.returncode == 1 and "no probe records" in r.stderr
    np.save(path, np.full((3, 11), 7, dtype=np.uint64))  # kind 7: not a record the probe writes
    r = _cta_timeline("--records", path)
    assert r.returncode == 2 and r.stderr.strip() == f"{path}: a record of kind 7: not a probe record"


def _dry_round(tmp_path, args, compute_cap="", env=None):
    """gpu-round.sh with stand-ins for python3 (logs its arguments; `python3 -c`, which reads a build record, answers
    with a library path, but the questions for the sanitizer cases and the build arch, which kdev answers),
    nvidia-smi (answers the compute capability query with `compute_cap`), compute-sanitizer and ncu (log their
    arguments).
    (result, calls)"""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text('#!/bin/bash\necho "python3 $*" >> "$FAKE_LOG"\n'
                                  '[[ "$1" = -c && ( "$2" == *SANITIZER_CASES* || "$2" == *build_arch_for* ) ]] && '
                                  f'PYTHONPATH={SCRIPT.parents[1]} exec {sys.executable} "$@"\n'
                                  '[ "$1" = -c ] && echo /base/libkdtree.so\nexit 0\n')
    (fake / "nvidia-smi").write_text(f'#!/bin/bash\n[[ "$*" == *compute_cap* ]] && echo "{compute_cap}" && exit 0\n'
                                     'echo fake-gpu\n')
    for tool in ("compute-sanitizer", "ncu"):
        (fake / tool).write_text(f'#!/bin/bash\necho "{tool} $*" >> "$FAKE_LOG"\nexit 0\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    log = tmp_path / "calls.log"
    r = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                       env={"PATH": f"{fake}:/usr/bin:/bin", "OUT": str(tmp_path / "out"), "FAKE_LOG": str(log),
                            **(env or {})})
    assert r.returncode == 0, r.stdout + r.stderr
    return r, log.read_text().splitlines()


def _ab_base(tmp_path):
    base = tmp_path / "ab-base" / "kernels"
    (base / "include").mkdir(parents=True)
    return base


def test_the_sanitizers_run_the_field_reports_cases(tmp_path):
    """--sanitize: memcheck and racecheck on the sanitizer cases kdev names once (kdev/field_report.py), not the
    whole smoke suite, whose racecheck alone takes minutes."""
    from kdev.field_report import SANITIZER_CASES

    _, calls = _dry_round(tmp_path, ["--skip-tests", "--fuzz", "0", "--sweep", "smoke", "--sanitize"])
    cases = " ".join(f"--case {c}" for c in SANITIZER_CASES)
    sanitized = [c for c in calls if c.startswith("compute-sanitizer")]
    assert [c.split()[2] for c in sanitized] == ["memcheck", "racecheck"]
    assert all(f"python3 -m kdev verify --suite smoke {cases} --kernel " in c for c in sanitized), sanitized


def test_an_axis_reaches_every_bench_step_of_a_sweep(tmp_path):
    """--axis page_size=1,64: the plain bench, the A/B pairs and their one-run table all vary the page size."""
    _, calls = _dry_round(tmp_path, ["--skip-tests", "--fuzz", "0", "--sweep", "targets", "--backend", "flash",
                                     "--ab", str(_ab_base(tmp_path)), "--axis", "page_size=1,64"])
    benches = [c for c in calls if c.startswith("python3 -m kdev bench --") and "--sweep targets" in c]
    assert len(benches) == 6, benches  # the plain step, two pairs, the one-run table
    assert all(" --sweep targets -a page_size=1,64 " in c for c in benches), benches


def test_a_profile_takes_the_full_tile_kernel_of_the_call_named(tmp_path):
    """--profile: Nsight Compute on the full-tile kernel of one call, whichever family runs it (the wgmma kernel in
    an sm_90a build); --profile-backend flash-portable profiles the lockstep kernel the sm_120 product runs."""
    _, calls = _dry_round(tmp_path, ["--profile-only", "--profile", "B=1,L=32768,N=64,H=8,page=1",
                                     "--profile-backend", "flash-portable"], "9.0")
    (profile,) = [c for c in calls if c.startswith("ncu --clock-control")]  # then its report read back as text
    assert "--kernel-name regex:verify_attn_flash_(teams_|wgmma_)?kernel " in profile
    assert profile.endswith("python3 -m kdev bench --shape B=1,L=32768,N=64,H=8,page=1 --backend flash-portable")


def test_the_timeline_probe_is_built_for_the_mma_sync_kernels(tmp_path):
    """--timeline on a Hopper GPU: the round builds sm_90a, the probe's tree sm_90 (its records come from the teams and
    lockstep kernels; the flash call of an sm_90a build would run the wgmma kernel, which carries no probe)."""
    _, calls = _dry_round(tmp_path, ["--profile-only", "--timeline", "B=16,L=8192,N=32,H=8"], "9.0")
    assert "python3 -m kdev build --arch sm_90a" in calls
    (probe,) = [c for c in calls if c.startswith("python3 -m kdev build --kernels")]
    assert probe.endswith("--arch sm_90 --json"), probe


def test_the_triton_peer_runs_in_steps_of_its_own(tmp_path):
    """A dry round: the triton peer's tests and its bench run in processes of their own, so a fault in a Triton kernel
    cannot lose the flash kernels' tests or timings."""
    _, calls = _dry_round(tmp_path, ["--fuzz", "0", "--sweep", "targets", "--backend", "flash,naive,triton"])
    assert "python3 -m pytest -q -m gpu tests/gpu -rs" in calls
    assert "python3 -m pytest -q tests/test_triton_peer.py -rs" in calls
    benches = [c for c in calls if c.startswith("python3 -m kdev bench --sweep targets")]
    assert benches == [f"python3 -m kdev bench --sweep targets --out-json {tmp_path}/out/bench-targets.json --csv "
                       f"{tmp_path}/out/bench-targets.csv --backend flash,naive",
                       "python3 -m kdev bench --sweep targets --backend flash-portable,triton"]


def test_an_ab_round_also_times_both_libraries_in_one_bench_run(tmp_path):
    """A dry --ab round: after the two pairs of processes, one bench run times each flash backend from the base's
    library beside the working tree's (KERNEL@REF)."""
    _, calls = _dry_round(tmp_path, ["--skip-tests", "--fuzz", "0", "--sweep", "targets", "--backend",
                                     "flash,flash-portable,naive", "--ab", str(_ab_base(tmp_path))])
    assert sum(c.startswith("python3 -m kdev bench --library /base/libkdtree.so --sweep targets") for c in calls) == 2
    assert calls.count("python3 -m kdev bench --sweep targets --backend flash,flash@/base/libkdtree.so,flash-portable,"
                       "flash-portable@/base/libkdtree.so,naive") == 1


@pytest.mark.parametrize("compute_cap, env_arch, arch", [("9.0", None, "sm_90a"), ("12.0", None, "sm_120"),
                                                         ("9.0", "sm_90", "sm_90"), ("12.0", "sm_90", "sm_90"),
                                                         ("", None, "sm_90a")])
def test_a_round_builds_for_the_gpu_it_runs_on(tmp_path, compute_cap, env_arch, arch):
    """The round's builds (the tree, an A/B base) and its SASS tables take the GPU's arch from nvidia-smi's compute
    capability, GPU_ARCH overriding it: a Hopper GPU gets sm_90a (the flash call by wgmma, as build.yaml's default),
    GPU_ARCH=sm_90 the mma.sync kernels alone; where nvidia-smi says nothing usable, sm_90a (Hopper)."""
    base = _ab_base(tmp_path)
    _, calls = _dry_round(tmp_path, ["--skip-tests", "--fuzz", "0", "--sweep", "smoke", "--ab", str(base)], compute_cap,
                          {"GPU_ARCH": env_arch} if env_arch else None)
    assert f"python3 -m kdev build --arch {arch}" in calls and f"python3 -m kdev sass --arch {arch}" in calls
    assert f"python3 -m kdev build --kernels {base} --arch {arch} --json" in calls
    assert all("--arch" not in c or f"--arch {arch}" in c for c in calls if "kdev" in c)


def test_a_round_refuses_a_gpu_arch_that_is_no_arch(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), "--fuzz", "0"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "GPU_ARCH": "hopper"})
    assert r.returncode == 2 and "GPU_ARCH=hopper: not an arch" in r.stderr


def test_fuzz_0_leaves_the_fuzz_steps_out_and_a_count_that_is_no_number_is_refused(tmp_path):
    _, calls = _dry_round(tmp_path, ["--skip-tests", "--fuzz", "0", "--sweep", "smoke"])
    assert not any("--fuzz" in c for c in calls)  # not the smoke suite a second time through `kdev verify --fuzz 0`
    r = subprocess.run(["bash", str(SCRIPT), "--fuzz", "many"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out2")})
    assert r.returncode == 2 and "--fuzz takes a whole number of cases" in r.stderr


def test_graph_adds_a_bench_of_graph_replays_per_sweep(tmp_path):
    _, calls = _dry_round(tmp_path, ["--skip-tests", "--fuzz", "0", "--sweep", "targets", "--backend", "flash,naive",
                                     "--graph"])
    assert "python3 -m kdev bench --sweep targets --graph --backend flash,naive" in calls


def test_a_variant_is_verified_beside_the_tree_kernel_before_it_is_timed(tmp_path):
    variant = tmp_path / "v1" / "kernels"
    (variant / "include").mkdir(parents=True)
    _, calls = _dry_round(tmp_path, ["--skip-tests", "--fuzz", "0", "--sweep", "smoke", "--variants", str(variant)])
    assert "python3 -m kdev verify --suite smoke --kernel flash,flash@/base/libkdtree.so" in calls
    assert "python3 -m kdev verify --fuzz 20 --kernel flash,flash@/base/libkdtree.so" in calls
