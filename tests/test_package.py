"""kdev as a server installs it: the wheel built from this checkout, installed into a fresh virtual environment and run
from a folder with no checkout near ($KDEV_REPO unset). It imports from its own site (the ops, the SGLang backend, the
plugin entry point where pyproject declares one), reads the kernels, configs and golden vectors it ships, and writes its
builds to $KDEV_HOME, never into the package."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kdev.project import MARKERS

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python, env, cwd) of a fresh venv with the wheel and torch 2.13.0 installed."""
    tmp = tmp_path_factory.mktemp("installed")
    env = {k: v for k, v in os.environ.items() if k not in ("KDEV_REPO", "KDEV_LIB", "KDEV_LEDGER", "PYTHONPATH")}
    # the tracked files alone, built outside the checkout (a build writes its egg-info and build/lib beside the sources)
    src = tmp / "src"
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, src / rel)
    dist = tmp / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                        str(src)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = dist.glob("kdev-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
    python = venv / "bin" / "python"
    # torch pinned to the CPU build that lies on this machine's disk (a range would pull the CUDA build)
    r = subprocess.run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0", str(wheel)], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    env["KDEV_HOME"] = str(tmp / "home")
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    assert not any((p / MARKERS[0]).exists() for p in (cwd, *cwd.parents))
    return python, env, cwd


def _run(installed, *args, check=True):
    python, env, cwd = installed
    r = subprocess.run([str(python), *args], capture_output=True, text=True, env=env, cwd=cwd)
    if check:
        assert r.returncode == 0, (args, r.stdout[-2000:], r.stderr[-2000:])
    return r


def test_the_installed_package_imports_and_reads_what_it_ships(installed):
    python, env, _ = installed
    r = _run(installed, "-c", "import json, kdev, kdev.ops, kdev.integrations.sglang.backend, kdev.project as p; "
             "print(json.dumps([kdev.__file__, str(p.REPO_ROOT), str(p.WORK_ROOT), p.INSTALLED]))")
    file, repo_root, work_root, installed_flag = json.loads(r.stdout.strip().splitlines()[-1])
    venv = python.parent.parent
    assert Path(file).is_relative_to(venv) and Path(repo_root).is_relative_to(venv) and installed_flag
    assert work_root == env["KDEV_HOME"]
    assert "gen-refs" in _run(installed, "-m", "kdev", "--help").stdout
    r = _run(installed, "-m", "kdev", "gen-refs", "--suite", "smoke", "--check")
    assert "smoke" in r.stdout + r.stderr
    # the plugin loads through its entry point without SGLang installed, and never raises
    r = _run(installed, "-c", "from importlib.metadata import entry_points; "
             "eps = [e for e in entry_points(group='sglang.srt.plugins') if e.value.startswith('kdev')]; "
             "assert eps, 'no kdev entry point'; [e.load() for e in eps]; print(len(eps))")
    assert int(r.stdout.strip().splitlines()[-1]) >= 1


def test_outside_a_checkout_the_ops_refuse_to_build_and_name_what_to_do(installed):
    """A serving process never starts nvcc: with no library built or named, the CUDA path is refused in one line (on
    this machine, first for want of a GPU; then, as on an RTX PRO 6000, for want of a library, with nothing built)."""
    _, env, cwd = installed
    home = cwd / "probe-home"  # a home of its own: nothing built there before
    probe = (f"import os\nos.environ['KDEV_HOME'] = {str(home)!r}\nfrom kdev import gpu, ops\n{{}}try:\n"
             "    ops.library()\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    out = _run(installed, "-c", probe.format("")).stdout.strip()
    assert out == "EnvironmentMissing no CUDA GPU visible to torch", out
    out = _run(installed, "-c", probe.format("gpu.current_arch = lambda: 'sm_120'\n")).stdout.strip()
    assert out.startswith("EnvironmentMissing no current kdev library") and "KDEV_LIB" in out, out
    assert not (home / "build").exists()


@pytest.mark.nvcc
def test_the_installed_package_builds_into_its_home_and_plans(installed):
    _, env, _ = installed
    r = _run(installed, "-m", "kdev", "build", "--arch", "sm_120", "--json", check=False)
    library = Path(json.loads(r.stdout)["library"])
    assert library.is_relative_to(env["KDEV_HOME"]) and (library.parent / "kdtree.h").is_file()
    r = _run(installed, "-m", "kdev", "plan", "--gpu", "rtx-pro-6000", "--library", str(library), "--json")
    doc = json.loads(r.stdout)
    assert doc["plans"] and Path(doc["library"]) == library
