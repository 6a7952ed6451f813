"""The rough edges a new user met in the first hour (issue 58's small ones): clean sees every dead temp once, the
option parser's errors read as kdev's and keep --json's one document, config files with a duplicate key are refused,
the CLI reference and help say what the commands do."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kdev import clean, project

REPO = Path(__file__).resolve().parent.parent


def run_kdev(*args, cwd=REPO, env=None, timeout=120) -> tuple[int, str, str]:
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


# ------------------------------------------------------------------------------------- the option parser
@pytest.mark.parametrize("args, says", [
    (["verify", "--repeat", "0"], "kdev verify: --repeat: "),
    (["e2e", "--prompts", "0"], "kdev e2e: --prompts: "),
    (["verify", "--repeat", "x"], "kdev verify: --repeat: "),
    (["verify", "--no-such-option"], "No such option: --no-such-option"),
    (["no-such-command"], "No such command 'no-such-command'"),
    (["verify", "--kernel", "bogus"], "kdev verify: --kernel: unknown kernel 'bogus'"),
])
def test_the_option_parsers_errors_are_one_kdev_line_and_one_json_document(args, says):
    from typer.testing import CliRunner

    from kdev.cli import app

    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and r.stdout == "", r.output
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr
    assert "Usage:" not in r.stderr and "Error:" not in r.stderr
    r = CliRunner().invoke(app, args + ["--json"])
    assert r.exit_code == 2, r.output
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == 2 and says in doc["error"] and r.stderr.strip() == f"error: {doc['error']}"


def test_a_parser_error_through_the_installed_entry_point_is_one_json_document():
    code, out, err = run_kdev("verify", "--repeat", "0", "--json")
    assert code == 2 and json.loads(out) == {"error": "kdev verify: --repeat: Input should be greater than or equal "
                                             "to 1 (see kdev verify -h)", "exit_code": 2}
    assert err.count("\n") == 1 and "Traceback" not in err


# --------------------------------------------------------------------------------------------- e2e and all
@pytest.mark.parametrize("args, says", [
    (["--attention", "t.json"], "--attention: only with --acceptance"),
    (["--step-costs", "s.yaml", "--batch", "4"], "--step-costs, --batch: only with --acceptance"),
    (["--budget", ""], "--budget '': no budget given"),
    (["--budget", " , "], "--budget ' , ': no budget given"),
    (["--backend", "bogus"], "--backend 'bogus': one of reference, naive, flash"),
])
def test_e2e_refuses_what_it_would_ignore_or_misreport(args, says):
    from typer.testing import CliRunner

    from kdev.cli import app

    r = CliRunner().invoke(app, ["e2e", *args])
    assert r.exit_code == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


def test_all_refuses_a_sweep_that_does_not_exist_before_any_stage_runs(monkeypatch):
    from typer.testing import CliRunner

    from kdev.cli import app

    def no_stage(*a, **kw):
        raise AssertionError(f"a stage ran: {a}")

    monkeypatch.setattr(subprocess, "run", no_stage)
    r = CliRunner().invoke(app, ["all", "--sweep", "nosuch", "--json"])
    assert r.exit_code == 2 and "no sweep named 'nosuch' (have: smoke, targets" in json.loads(r.stdout)["error"], \
        r.output


# ------------------------------------------------------------------------------------------------- deploy-check
def test_deploy_checks_gpu_probe_says_why_nvml_is_missing(monkeypatch):
    import types

    from kdev import deploy

    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: its import fails
    (probe,) = deploy.probe_gpus(None, 8.0, require_gpu=False)
    assert probe.status == deploy.WARN and probe.reason.startswith("nvidia-ml-py is not installed")

    def no_driver():
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=no_driver))
    (probe,) = deploy.probe_gpus(None, 8.0, require_gpu=True)
    assert probe.status == deploy.FAIL and "nvidia-ml-py" not in probe.reason
    assert probe.reason.startswith("NVML did not start (RuntimeError: NVML Shared Library Not Found; no NVIDIA driver")


def test_deploy_checks_git_probe_works_in_a_checkout_whose_path_is_not_utf8(tmp_path):
    from kdev import deploy

    repo = Path(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9"))
    repo.mkdir()
    (repo / "README.md").write_text("x\n")
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-qm", "caf\xe9 \xe0 la carte"]):
        subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", *args], check=True,
                       capture_output=True)
    probe = deploy.probe_git(repo)
    assert probe.status == deploy.PASS and probe.details["last_commits"][0].endswith("café à la carte"), probe


# --------------------------------------------------------------------------------------------------- help
def test_kdev_help_command_prints_what_dash_h_does():
    from typer.testing import CliRunner

    from kdev.cli import app

    runner = CliRunner()
    assert runner.invoke(app, ["help", "clean"]).stdout == runner.invoke(app, ["clean", "-h"]).stdout
    assert runner.invoke(app, ["help"]).stdout == runner.invoke(app, ["-h"]).stdout
    r = runner.invoke(app, ["help", "nosuch"])
    assert r.exit_code == 2 and "no command 'nosuch' (have: gen-refs, build" in r.stderr


def test_a_placeholder_says_what_a_value_is_not_the_options_name():
    from typer.testing import CliRunner

    from kdev.cli import app

    out = CliRunner().invoke(app, ["bench", "-h"], env={"COLUMNS": "200"}).stdout
    assert "--normalize-by BACKEND " in out and "--plot-metric METRIC " in out and "--plan-gpu GPU " in out
    for cmd in ("verify", "bench", "plan", "e2e", "sass"):
        out = CliRunner().invoke(app, [cmd, "-h"], env={"COLUMNS": "200"}).stdout
        assert not re.search(r"NORMALIZE_BY|PLAN_GPU|PLOT_METRIC", out), cmd


# -------------------------------------------------------------------------------------------------- build
def test_the_build_table_marks_a_kernel_that_is_an_empty_stub_on_an_arch(capsys):
    import types

    from kdev.cli import views

    def row(kernel, arch, registers, smem=0):
        return {"kernel": kernel, "arch": arch, "registers": registers, "spill_stores": 0, "spill_loads": 0,
                "stack_frame": 0, "smem": smem, "wgmma_serialized": ""}

    resources = [row("verify_attn_flash_wgmma_kernel", "sm_90a", 215), row("verify_attn_flash_wgmma_kernel", "sm_120", 4),
                 row("accept_greedy_kernel", "sm_90a", 8), row("accept_greedy_kernel", "sm_120", 8)]
    res = types.SimpleNamespace(resources=resources, folder=Path("kdtree-sm_90a-sm_120-0"), launches=[],
                                embedded={"sass": ["sm_90a", "sm_120"], "ptx": []}, cached=True, seconds=0.0,
                                build_info={"source_hash": "0" * 12, "git_sha": None, "nvcc_version": "13.0"},
                                library=Path("libkdtree.so"), problems=[])
    views.show_build(res, verbose=False)
    out = capsys.readouterr().out
    assert "215 / 4*" in out and "8 / 8 " in out and "8*" not in out
    assert "* an empty stub there, never launched on that arch (sm_120: 1 kernel)" in out
