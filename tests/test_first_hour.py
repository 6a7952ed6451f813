"""What a new user meets first: what kdev writes is readable by another account, every command works on the checkout
around the current directory, and no kill of a command leaves debris (temp folders, temp libraries, compilers running
on)."""

import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kdev import config, fsutil, project, vectors

REPO = Path(__file__).resolve().parent.parent


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def kdev(*args, cwd=REPO, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "kdev", *args], cwd=cwd, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


# --------------------------------------------------------------------------------------------- modes
def test_written_files_and_folders_get_the_umasks_modes(tmp_path, umask_022, tiny_suites):
    fsutil.atomic_write_bytes(tmp_path / "record.json", b"{}")
    assert _mode(tmp_path / "record.json") == 0o644
    assert _mode(fsutil.make_temp_dir(tmp_path, "x")) == 0o755
    spec = config.load_suite("tiny", tiny_suites)
    vectors.write_suite(spec, tmp_path / "vec")
    assert _mode(tmp_path / "vec" / "tiny") == 0o755
    assert {_mode(f) for f in (tmp_path / "vec" / "tiny").iterdir()} == {0o644}
    os.umask(0o027)
    fsutil.atomic_write_bytes(tmp_path / "group.json", b"{}")
    assert _mode(tmp_path / "group.json") == 0o640


@pytest.mark.nvcc
def test_the_built_library_and_its_records_are_readable_by_others(sm90_library):
    lib = Path(sm90_library)
    others = stat.S_IROTH | stat.S_IXOTH
    assert _mode(lib) & others == others * (fsutil.umask() & 0o005 == 0)
    assert _mode(lib.parent / "build.json") & stat.S_IROTH == stat.S_IROTH * (fsutil.umask() & 0o004 == 0)
    assert not list(lib.parent.glob(".*"))  # no temp library, no nvcc scratch folder


# ---------------------------------------------------------------------------------------- project root
def test_the_project_root_is_found_from_the_current_directory_upward(tmp_path):
    assert project.find_root(REPO / "kernels" / "include") == REPO
    assert project.find_root(tmp_path) is None
    fake = tmp_path / "clone"
    for m in project.MARKERS:
        (fake / m).parent.mkdir(parents=True, exist_ok=True)
        (fake / m).write_text("")
    assert project.find_root(fake / "kernels") == fake


def test_a_command_in_a_subfolder_works_on_that_checkout_and_outside_one_says_so(tmp_path):
    p = kdev("deploy-check", "--json", cwd=REPO / "kernels")
    out, _ = p.communicate(timeout=120)
    import json

    assert json.loads(out)["repo"] == str(REPO)
    p = kdev("build", cwd=tmp_path, env={"KDEV_REPO": ""})
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2 and err.strip().endswith("not inside a kdev checkout (no kernels/include/kdev/kdtree.h "
                                                       "and configs/build.yaml here or above): cd into one, or set "
                                                       "KDEV_REPO") and "Traceback" not in err
    p = kdev("deploy-check", "--repo", str(tmp_path / "none"), cwd=tmp_path)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and len(err.strip().splitlines()) == 1 and "not a kdev checkout" in err


# --------------------------------------------------------------------------------------------- kills
def test_sigterm_during_gen_refs_leaves_nothing(tmp_path):
    out = tmp_path / "vec"
    # the full suite takes tens of seconds on a CPU: the signal lands mid-run even where a loaded machine is slow to see
    # the temp folder (the smoke suite's second or two could end first)
    p = kdev("gen-refs", "--suite", "full", "--out", str(out))
    deadline = time.time() + 60
    while time.time() < deadline and not (out.is_dir() and any(out.iterdir())):
        time.sleep(0.05)
    assert out.is_dir() and any(out.iterdir()), "gen-refs made no temp folder in time"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and "terminated (SIGTERM)" in err
    assert list(out.iterdir()) == []


def test_temp_folders_of_a_killed_writer_are_removed_by_the_next_run(tmp_path, tiny_suites):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a PID that ran and is gone
    root = tmp_path / "vec"
    stale = root / f".tiny.{dead.pid}.abcd1234.tmp"
    (stale / "x").mkdir(parents=True)
    ours = root / f".other.{os.getpid()}.abcd1234.tmp"  # a live writer's (this process): kept
    ours.mkdir()
    vectors.write_suite(config.load_suite("tiny", tiny_suites), root)
    assert not stale.exists() and ours.exists()
    assert sorted(p.name for p in root.iterdir()) == sorted([ours.name, "tiny"])


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan killed here waits for a reaper that a container's init may never be)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


FAKE_NVCC = """#!/bin/sh
case "$1" in
  --version) echo "Cuda compilation tools, release 13.0, V99.0.0"; exit 0;;
  --list-gpu-code) echo sm_90; echo sm_120; exit 0;;
esac
# a driver that starts a compiler and waits on it, as nvcc runs cicc and ptxas; it leaves a temp file in TMPDIR
echo scratch > "$TMPDIR/tmpxft_fake.cpp"
sleep 300 &
echo $! > "{pids}"
wait
"""


def test_an_interrupted_build_kills_its_compilers_and_leaves_no_files(tmp_path, write_yaml):
    pids = tmp_path / "child.pid"
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(FAKE_NVCC.replace("{pids}", str(pids)))
    nvcc.chmod(0o755)
    cfg = write_yaml("build.yaml", f"""
        archs: [sm_90]
        flags: [-O3]
        output_dir: {tmp_path / 'out'}
        allow_spills: false
        smem_limit_bytes: {{sm_90: 232448}}
        """)
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)):
        pids.unlink(missing_ok=True)
        p = kdev("build", "--force", "--config", str(cfg), env={"NVCC": str(nvcc)})
        deadline = time.time() + 60
        while time.time() < deadline and not pids.is_file():
            time.sleep(0.05)
        assert pids.is_file(), p.communicate(timeout=10)
        time.sleep(0.2)
        p.send_signal(sig)
        p.communicate(timeout=60)
        assert p.returncode == code
        child = int(pids.read_text())
        time.sleep(0.2)
        assert not _running(child)
        folder = next((tmp_path / "out").iterdir())
        assert [f.name for f in folder.iterdir() if f.name.startswith(".")] == []


def test_json_is_one_document_even_for_an_error(tmp_path):
    p = kdev("build", "--json", cwd=tmp_path, env={"KDEV_REPO": ""})
    out, _ = p.communicate(timeout=120)
    import json

    doc = json.loads(out)
    assert p.returncode == 2 and doc["exit_code"] == 2 and "not inside a kdev checkout" in doc["error"]


def test_a_config_that_is_not_utf8_is_one_line(tmp_path):
    bad = tmp_path / "l1.yaml"
    bad.write_bytes(b"# \xb5s\narchs: [sm_90]\n")
    p = kdev("build", "--config", str(bad))
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and len(err.strip().splitlines()) == 1 and "UTF-8" in err, err



# ------------------------------------------------------------------------------------------ small ones
def run_kdev(*args, env=None, cwd=REPO) -> tuple[int, str, str]:
    p = kdev(*args, env=env, cwd=cwd)
    out, err = p.communicate(timeout=120)
    return p.returncode, out, err


@pytest.mark.parametrize("prefix", ["4294967396", "2147483647", "262145"])
def test_a_prefix_past_the_contract_is_refused_not_wrapped(prefix):
    code, out, err = run_kdev("plan", "--gpu", "h200", "--shape", f"B=1,L={prefix},N=64,H=8", "--json")
    import json

    assert code == 2 and f"prefix {prefix} outside 0..262144 tokens" in json.loads(out)["error"]
    assert len(err.strip().splitlines()) == 1


def test_the_h100s_measured_ceilings_are_recorded():
    h100 = config.load_gpus()["h100"]
    assert h100.ceilings_measured and round(h100.flops / 1e12) == 646 and round(h100.bytes_per_s / 1e9) == 3020
    assert "2026-12-05" in h100.ceilings_source


def test_small_ones_say_one_true_line(tmp_path):
    code, _, err = run_kdev("build", "--force", "--arch", "sm_90", env={"NVCC": "/bin/false"})
    assert code == 3 and err.strip() == "error: /bin/false: not nvcc (its --version names no CUDA release)"
    code, _, err = run_kdev("plan", "--gpu", "h200", "--library", "README.md")
    assert code == 3 and "does not load" in err and "No such file" not in err
    (tmp_path / "afile").write_text("")
    code, _, err = run_kdev("gen-refs", "--suite", "smoke", "--out", str(tmp_path / "afile" / "vec"))
    assert code == 2 and f"{tmp_path / 'afile' / 'vec'}:" in err and ".tmp" not in err
    code, _, err = run_kdev("deploy-check", "--repo", "/nonexistent")
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_bench_without_a_gpu_says_that_first():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    code, _, err = run_kdev("bench", "--sweep", "smoke")
    assert code == 3 and err.strip().splitlines() == ["error: kdev bench: no CUDA GPU visible to torch"]


def test_a_build_outside_git_is_said_so():
    from kdev.cli.views import git_words

    assert git_words({"git_sha": None}) == "not from a git checkout"
    assert git_words({"git_sha": "0123456789abcdef"}) == "git 0123456789ab"


def test_clean_lists_then_removes_what_nothing_needs(tmp_path):
    import json

    repo = tmp_path / "clone"
    for m in project.MARKERS:
        (repo / m).parent.mkdir(parents=True, exist_ok=True)
        (repo / m).write_text((REPO / m).read_text())
    build = repo / "build"
    for name in ("kept", "verified", "old", "ab-0123456789ab"):
        (build / name).mkdir(parents=True)
        (build / name / "libkdtree.so").write_bytes(b"x" * 1000)
    (build / "latest.json").write_text(json.dumps({"library": str(build / "kept" / "libkdtree.so")}))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (build / "kept" / f".libkdtree.{dead.pid}.abcd1234.so").write_bytes(b"")
    ledger = repo / ".kdev" / "ledger"
    ledger.mkdir(parents=True)
    recs = [("20260101T000000-a", {"passed": True, "source_hash": "s1", "gpu": {"arch": "sm_90"},
                                   "library": str(build / "verified" / "libkdtree.so")}),
            ("20260102T000000-b", {"passed": False, "source_hash": "s1", "gpu": {"arch": "sm_90"}}),
            ("20260103T000000-c", {"passed": False, "source_hash": "s2", "gpu": {"arch": "sm_90"}})]
    for name, r in recs:
        (ledger / f"{name}.json").write_text(json.dumps(r))
    code, out, _ = run_kdev("clean", "--keep-records", "1", "--json", cwd=repo / "build")
    doc = json.loads(out)
    listed = sorted(Path(i["path"]).relative_to(repo).as_posix() for i in doc["items"])
    assert code == 0 and not doc["removed"] and listed == [
        ".kdev/ledger/20260102T000000-b.json", "build/ab-0123456789ab", f"build/kept/.libkdtree.{dead.pid}.abcd1234.so",
        "build/old"]
    assert (build / "old").exists()  # a dry run
    code, _, _ = run_kdev("clean", "--keep-records", "1", "--yes", cwd=repo)
    assert code == 0 and sorted(p.name for p in build.iterdir()) == ["kept", "latest.json", "verified"]
    assert sorted(p.name for p in ledger.iterdir()) == ["20260101T000000-a.json", "20260103T000000-c.json"]
    assert list((build / "kept").iterdir()) == [build / "kept" / "libkdtree.so"]


def test_a_table_wider_than_the_terminal_keeps_every_figure_whole(both_archs):
    lib = str(both_archs[1].library)
    code, out, _ = run_kdev("plan", "--gpu", "h200", "--library", lib, env={"COLUMNS": "80"})
    assert code == 0 and "…" not in out
    assert "  slot use         90.2%" in out and "  KV read by CTAs  340 MB (9x)" in out
    code, out, _ = run_kdev("plan", "--gpu", "h200", "--library", lib, env={"COLUMNS": "250"})
    assert code == 0 and "│ B1-L32768-N64-H8-p64 " in out  # a terminal it fits keeps the table


def test_a_stop_that_library_code_swallowed_still_stops_the_next_write(tmp_path):
    """Cython's module initialisation clears an exception raised while it registers its types with collections.abc; a
    SIGTERM whose handler raised there (numpy.random's first import) was lost, and gen-refs wrote its suite and exited
    0. The handler's record stops the next write."""
    script = textwrap.dedent("""
        import os, signal, sys
        from pathlib import Path
        from kdev import fsutil
        signal.signal(signal.SIGTERM, fsutil.stop_on_signal)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(200_000):  # bytecodes at which the handler runs
                pass
        except BaseException:
            print("swallowed", flush=True)
        fsutil.atomic_write_bytes(Path(sys.argv[1]), b"written after a stop")
        """)
    p = subprocess.run([sys.executable, "-c", script, str(tmp_path / "out.bin")], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.stdout == "swallowed\n" and p.returncode == 1 and "kdev.errors.Terminated: 15" in p.stderr
    assert list(tmp_path.iterdir()) == []


def test_after_a_swallowed_stop_no_tree_is_put_in_place(tmp_path, monkeypatch):
    """A variant's kernel tree (as a build's library) is put in place only if no stop was taken meanwhile."""
    from kdev import refs
    from kdev.errors import Terminated

    patch = sorted((REPO / "variants").glob("*.patch"))[0]
    taken: list[int] = []
    monkeypatch.setattr(fsutil, "_stops_taken", taken)
    copytree = shutil.copytree

    def copy_then_a_stop_is_swallowed(*args, **kwargs):
        copytree(*args, **kwargs)
        taken.append(signal.SIGTERM)

    monkeypatch.setattr(shutil, "copytree", copy_then_a_stop_is_swallowed)
    with pytest.raises(Terminated):
        refs.patch_kernels(patch, output_dir=tmp_path / "build")
    assert list((tmp_path / "build").iterdir()) == []  # the temp tree removed, none put in place
    with pytest.raises(Terminated):  # and none started
        refs.patch_kernels(patch, output_dir=tmp_path / "build")
    taken.clear()
    monkeypatch.setattr(shutil, "copytree", copytree)
    assert refs.patch_kernels(patch, output_dir=tmp_path / "build").is_dir()


def test_a_signal_in_a_deferred_block_lands_after_it():
    """fsutil.signals_deferred: a SIGTERM sent while a temp is being made is delivered as the block ends (inside the
    caller's try that removes the temp), not between the temp's creation and that try."""
    from kdev import fsutil

    import threading

    seen = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append("handled"))
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)  # a thread the signal may reach (torch and thread pools have them)
    other.start()
    try:
        with fsutil.signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(200_000):  # bytecodes at which a handler would run
                pass
            seen.append("block still running")
        seen.append("after")
    finally:
        signal.signal(signal.SIGTERM, old)
        stop.set()
        other.join()
    assert seen == ["block still running", "handled", "after"]
