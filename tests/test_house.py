"""The house keeps only what is current: every variant patch applies to today's kernels, every stored bench result is
indexed and readable, and the kernel notes stay a page of current state."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kdev import bench

REPO = Path(__file__).resolve().parent.parent
PATCHES = sorted((REPO / "variants").glob("*.patch"))


@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_every_kept_variant_applies_to_todays_kernels(patch, tmp_path):
    shutil.copytree(REPO / "kernels", tmp_path / "kernels")
    r = subprocess.run(["git", "apply", str(patch)], cwd=tmp_path, capture_output=True, text=True,
                       env={"GIT_CEILING_DIRECTORIES": str(tmp_path.parent), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert patch.name in (REPO / "variants" / "INDEX.md").read_text()


def test_a_stale_patch_is_caught(tmp_path):
    """The negative control: a patch whose context is not in today's kernels does not apply."""
    stale = tmp_path / "stale.patch"
    stale.write_text("--- a/kernels/verify_attn.cu\n+++ b/kernels/verify_attn.cu\n@@ -1,1 +1,1 @@\n"
                     "-// a line the file does not start with\n+// probe\n")
    shutil.copytree(REPO / "kernels", tmp_path / "kernels")
    r = subprocess.run(["git", "apply", str(stale)], cwd=tmp_path, capture_output=True, text=True,
                       env={"GIT_CEILING_DIRECTORIES": str(tmp_path.parent), "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0


def test_every_index_entry_is_a_patch_here():
    rows = [line.split("|")[1].strip() for line in (REPO / "variants" / "INDEX.md").read_text().splitlines()
            if line.startswith("| flash")]
    assert sorted(rows) == [p.name for p in PATCHES]


def test_stored_results_are_indexed_and_found_by_gpu_name():
    index = yaml.safe_load((REPO / "benchmarks" / "index.yaml").read_text())
    files = sorted(p.name for p in (REPO / "benchmarks").glob("*.json"))
    named = sorted(f for entry in index.values() for f in entry.values())
    assert named == files
    for gpu, entry in index.items():
        doc = bench.load_results(Path(gpu))  # `kdev bench --baseline h200`
        assert doc == bench.load_results(REPO / "benchmarks" / entry["current"])
        assert entry["current"].startswith(f"{gpu}-") and doc["provenance"]["build_info"]["git_sha"][:12] in \
            entry["current"]


def test_the_kernel_notes_are_a_page_of_current_state():
    assert len((REPO / "kernels" / "NOTES.md").read_text().splitlines()) <= 200


def test_seed_probe(seed):
    """Used by the test below: prints its seed (the fixture does)."""
    assert isinstance(seed, int)


def test_a_tests_seed_replays_from_the_run_seed_and_its_id():
    import os
    import re
    import sys

    def run(base: str) -> str:
        r = subprocess.run([sys.executable, "-m", "pytest", "-s", "-p", "no:cacheprovider",
                            "tests/test_house.py::test_seed_probe"], cwd=REPO, capture_output=True, text=True,
                           env={**os.environ, "KDEV_TEST_SEED": base})
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"kdev test seed {base}" in r.stdout
        return re.search(r"seed (\d+) \(KDEV_TEST_SEED=", r.stdout).group(1)

    assert run("7") == run("7") != run("8")


def test_the_bench_backends_are_the_verify_kernels_and_the_registered_runners():
    from kdev import abi

    assert set(bench.ATTENTION_BACKENDS) == set(abi.VERIFY_KERNELS) | set(bench.RUNNERS) | set(bench.LAYER_BACKENDS)
    assert set(bench.LAYER_BACKENDS.values()) == set(abi.SCHEDULED_KERNELS)  # each times a scheduled kernel


def test_no_bench_module_is_over_400_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (REPO / "kdev" / "bench").glob("*.py")}
    assert max(sizes.values()) <= 400, sizes
