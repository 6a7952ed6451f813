"""The rough edges a new user met in the first hour (issue 58's small ones): clean sees every dead temp once, the
option parser's errors read as kdev's and keep --json's one document, config files with a duplicate key are refused,
the CLI reference and help say what the commands do."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kdev import clean, project

REPO = Path(__file__).resolve().parent.parent


def run_kdev(*args, cwd=REPO, env=None, timeout=120) -> tuple[int, str, str]:
    import os

    p = subprocess.run([sys.executable, "-m", "kdev", *args], cwd=cwd, env={**os.environ, **(env or {})},
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _clone(tmp_path: Path) -> Path:
    repo = tmp_path / "clone"
    for m in project.MARKERS:
        (repo / m).parent.mkdir(parents=True, exist_ok=True)
        (repo / m).write_text((REPO / m).read_text())
    return repo


# ------------------------------------------------------------------------------------------------ clean
def test_clean_sees_a_killed_gen_refs_half_suite_and_counts_each_byte_once(tmp_path):
    repo = _clone(tmp_path)
    pid = _dead_pid()
    half = repo / "vectors" / f".full.{pid}.k3j2h1ab.tmp"  # what a SIGKILLed gen-refs --suite full leaves
    half.mkdir(parents=True)
    (half / "case0.safetensors").write_bytes(b"x" * 3000)
    (half / f".case1.safetensors.{pid}.zz11yy22.tmp").write_bytes(b"x" * 500)
    old = repo / "build" / "old"  # a build nothing names, a killed nvcc's scratch inside it
    scratch = old / f".nvcc.{pid}.abcd1234.tmp"
    scratch.mkdir(parents=True)
    (old / "libkdtree.so").write_bytes(b"x" * 1000)
    (scratch / "a.cubin").write_bytes(b"x" * 2000)
    items = {i.path.relative_to(repo).as_posix(): i.bytes for i in clean.plan(repo)}
    assert items == {"build/old": 3000, f"vectors/.full.{pid}.k3j2h1ab.tmp": 3500}
    code, out, _ = run_kdev("clean", "--json", cwd=repo)
    assert code == 0 and json.loads(out)["bytes"] == 6500
    code, out, _ = run_kdev("clean", "--yes", cwd=repo)
    assert code == 0 and "removed 2 item(s), 0.0 MB" in out
    assert not half.exists() and not old.exists()
