"""deploy-check on a GPU machine after build + verify: local probes pass, and with only this GPU's arch
verified the ledger warns that the deploy target (sm_120) has no verify record."""

import shutil
import subprocess

import pytest
import torch

from kdev import build as kbuild
from kdev import config, deploy, verify
from kdev.config import REPO_ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc]


def test_build_verify_then_deploy_check(tmp_path, monkeypatch):
    repo = tmp_path / "proj"
    repo.mkdir()
    for d in ("kernels", "configs"):
        shutil.copytree(REPO_ROOT / d, repo / d)
    shutil.copytree(REPO_ROOT / "vectors" / "smoke", repo / "vectors" / "smoke")
    (repo / ".gitignore").write_text("build/\n.kdev/\n")
    for args in (["init", "-q"], ["add", "-A"], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "s"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    c = config.load_build(None, sorted({arch, "sm_120"}))
    res = kbuild.build(config.BuildConfig(c.archs, c.flags, repo / "build", False, c.smem_limit_bytes, c.path),
                       kernel_dir=repo / "kernels")
    assert not res.problems
    ledger = repo / ".kdev" / "ledger"
    monkeypatch.setenv("KDEV_LEDGER", str(ledger))
    run = verify.run_suite("smoke", ["naive", "flash", "flash-portable"], lib_path=res.library)
    assert run.passed and run.ledger_path.parent == ledger
    probes = {p.name: p for p in deploy.run_checks(repo)[0]}
    for name in ("git", "build provenance", "vectors", "toolchain"):
        assert probes[name].status == "pass", (name, probes[name].reason)
    gpus = [p for n, p in probes.items() if n.startswith("gpu")]
    assert gpus and all(p.status != "fail" for p in gpus), [p.reason for p in gpus]
    if arch != "sm_120":
        assert probes["ledger"].status == "warn" and "sm_120" in probes["ledger"].reason  # flash-portable ran here
    (repo / "kernels" / "verify_attn.cu").write_text((repo / "kernels" / "verify_attn.cu").read_text() + "\n// x\n")
    probes = {p.name: p for p in deploy.run_checks(repo)[0]}
    assert probes["build provenance"].status == "fail" and "kernels/verify_attn.cu" in probes["build provenance"].reason
    assert probes["ledger"].status == "fail"
