"""deploy-check on real temporary git repositories, with a fake NVML layer for the GPU probes."""

import json
import shutil
import subprocess
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from kdev import build as kbuild
from kdev import config, deploy, ledger
from kdev.cli import app
from kdev.config import REPO_ROOT

pytestmark = pytest.mark.nvcc  # deploy-check needs a built library


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("deploy") / "proj"
    root.mkdir()
    for d in ("kernels", "configs"):
        shutil.copytree(REPO_ROOT / d, root / d)
    shutil.copytree(REPO_ROOT / "vectors" / "smoke", root / "vectors" / "smoke")
    (root / "README.md").write_text("test project\n")
    (root / ".gitignore").write_text("build/\n.kdev/\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init")
    c = config.load_build(None, ["sm_90", "sm_120"])
    cfg = config.BuildConfig(c.archs, c.flags, root / "build", False, c.smem_limit_bytes, c.path)
    res = kbuild.build(cfg, kernel_dir=root / "kernels")
    assert not res.problems
    return root


class FakeNvml:
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    def __init__(self, n=1, free_gib=100.0, ecc=0, reasons=0, procs=0, cc=(12, 0), pending=False):
        self.n, self.free, self.ecc, self.reasons, self.procs, self.cc, self.pending = n, free_gib, ecc, reasons, procs, cc, pending

    def nvmlDeviceGetCount(self): return self.n
    def nvmlSystemGetDriverVersion(self): return "580.159.04"
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetName(self, h): return "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    def nvmlDeviceGetCudaComputeCapability(self, h): return self.cc
    def nvmlDeviceGetMemoryInfo(self, h): return SimpleNamespace(free=int(self.free * 2**30), total=96 * 2**30)
    def nvmlDeviceGetComputeRunningProcesses(self, h): return [object()] * self.procs
    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter): return self.ecc
    def nvmlDeviceGetRetiredPagesPendingStatus(self, h): return int(self.pending)
    def nvmlDeviceGetRemappedRows(self, h): return (0, 0, 0, 0)
    def nvmlDeviceGetCurrentClocksEventReasons(self, h): return self.reasons
    def nvmlDeviceGetPersistenceMode(self, h): return 1


def ledger_with(tmp_path, repo, arch, passed=True, suite="smoke", kernels=("naive", "flash", "flash-portable"),
                plan=None, kind="suite"):
    folder = tmp_path / "ledger"
    rec = {"schema_version": 1, "timestamp": ledger.now_iso(), "kind": kind, "passed": passed,
           "source_hash": kbuild.source_hash(repo / "kernels"), "suite": {"name": suite},
           "gpu": {"name": "GPU", "arch": arch}, "plan": plan, "kernels": {k: {"passed": passed} for k in kernels}}
    ledger.append_record(rec, folder)
    return folder


def by_name(probes):
    return {p.name: p for p in probes}


def test_clean_repo_after_build_and_verify(repo, tmp_path):
    probes, cfg = deploy.run_checks(repo, nvml=FakeNvml(), ledger=ledger_with(tmp_path, repo, "sm_120"))
    p = by_name(probes)
    assert cfg.target_arch == "sm_120"
    assert [p[n].status for n in ("git", "build provenance", "vectors", "ledger", "gpu 0", "toolchain")] == ["pass"] * 6
    assert len(p["git"].details["last_commits"]) == 1


def test_only_another_arch_verified_warns_and_names_it(repo, tmp_path):
    p = by_name(deploy.run_checks(repo, nvml=FakeNvml(), ledger=ledger_with(tmp_path, repo, "sm_90"))[0])
    assert p["ledger"].status == "warn" and "sm_90" in p["ledger"].reason and "sm_120" in p["ledger"].reason
    assert "flash-portable" in p["ledger"].reason


def test_a_proxy_run_with_the_targets_split_plan_is_named(repo, tmp_path):
    """A flash-portable run planned as for the target GPU (kdev verify --plan-gpu) ran the target's kernels and grids;
    the ledger probe says so (still a warning: no verify on the target itself)."""
    p = by_name(deploy.run_checks(repo, nvml=FakeNvml(), ledger=ledger_with(tmp_path, repo, "sm_90"))[0])
    assert "not yet with a sm_120 GPU's split plan" in p["ledger"].reason and "--plan-gpu" in p["ledger"].reason
    ledger = ledger_with(tmp_path, repo, "sm_90")
    ledger_with(tmp_path, repo, "sm_90", kernels=("flash-portable",), kind="fuzz", suite="fuzz:100",
                plan={"gpu": "rtx-pro-6000", "name": "NVIDIA RTX PRO 6000 Blackwell", "arch": "sm_120", "sms": 188})
    p = by_name(deploy.run_checks(repo, nvml=FakeNvml(), ledger=ledger)[0])
    assert p["ledger"].status == "warn"
    assert "and the sm_120 split plan (rtx-pro-6000, 188 SMs) passing there" in p["ledger"].reason


def test_another_arch_without_the_target_code_path_fails(repo, tmp_path):
    """An H200 verify of naive and flash alone never ran the kernels an sm_120 GPU runs: no deploy to sm_120."""
    ledger = ledger_with(tmp_path, repo, "sm_90", kernels=("naive", "flash"))
    p = by_name(deploy.run_checks(repo, nvml=FakeNvml(), ledger=ledger)[0])
    assert p["ledger"].status == "fail" and "sm_120 code path never ran" in p["ledger"].reason
    assert "--kernel naive,flash,flash-portable" in p["ledger"].reason
    # on the target itself the flash call is that code path: naive and flash suffice
    p = by_name(deploy.run_checks(repo, nvml=FakeNvml(), ledger=ledger_with(tmp_path / "t", repo, "sm_120",
                                                                             kernels=("naive", "flash")))[0])
    assert p["ledger"].status == "pass"


def test_no_record_for_current_hash_fails(repo, tmp_path):
    p = by_name(deploy.run_checks(repo, nvml=FakeNvml(), ledger=tmp_path / "empty")[0])
    assert p["ledger"].status == "fail" and "no passing 'kdev verify'" in p["ledger"].reason
    p = by_name(deploy.run_checks(repo, nvml=FakeNvml(), ledger=ledger_with(tmp_path, repo, "sm_120", passed=False))[0])
    assert p["ledger"].status == "fail"


def test_untracked_kernel_file_fails_git_and_provenance(repo, tmp_path):
    extra = repo / "kernels" / "extra.cu"
    extra.write_text("// new kernel\n")
    try:
        p = by_name(deploy.run_checks(repo, nvml=FakeNvml(), ledger=tmp_path)[0])
        assert p["git"].status == "fail" and "kernels/extra.cu" in p["git"].reason
        assert p["build provenance"].status == "fail" and "kernels/extra.cu" in p["build provenance"].reason
    finally:
        extra.unlink()


def test_kernel_edited_after_build_names_the_file(repo, tmp_path):
    src = repo / "kernels" / "verify_attn.cu"
    original = src.read_text()
    src.write_text(original + "\n// edited after the build\n")
    try:
        p = by_name(deploy.run_checks(repo, nvml=FakeNvml(), ledger=tmp_path)[0])
        assert p["git"].status == "fail" and "M kernels/verify_attn.cu" in p["git"].reason
        assert p["build provenance"].status == "fail"
        assert "kernel sources changed since the build: kernels/verify_attn.cu" in p["build provenance"].reason
    finally:
        src.write_text(original)


def test_tampered_vector_fails(repo, tmp_path):
    f = repo / "vectors" / "smoke" / "root-only.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    try:
        p = by_name(deploy.run_checks(repo, nvml=FakeNvml(), ledger=tmp_path)[0])
        assert p["vectors"].status == "fail" and "root-only.safetensors" in p["vectors"].reason
    finally:
        f.write_bytes(data)


def test_ahead_of_upstream_warns(repo, tmp_path):
    upstream = tmp_path / "upstream.git"
    git(tmp_path, "clone", "-q", "--bare", str(repo), str(upstream))
    git(repo, "remote", "add", "origin", str(upstream))
    git(repo, "fetch", "-q", "origin")
    git(repo, "branch", "-q", "--set-upstream-to=origin/main")
    (repo / "README.md").write_text("changed\n")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "docs")
    try:
        p = by_name(deploy.run_checks(repo, nvml=FakeNvml(), ledger=ledger_with(tmp_path, repo, "sm_120"))[0])
        assert p["git"].status == "warn" and "1 ahead, 0 behind origin/main" in p["git"].reason
        # built before the docs commit: same kernel sources, so provenance only warns
        assert p["build provenance"].status == "warn" and "same kernel sources" in p["build provenance"].reason
    finally:
        git(repo, "reset", "-q", "--hard", "HEAD~1")
        git(repo, "branch", "-q", "--unset-upstream")
        git(repo, "remote", "remove", "origin")


def test_target_arch_not_in_library(repo, tmp_path):
    p = by_name(deploy.run_checks(repo, target="sm_100", nvml=FakeNvml(), ledger=tmp_path)[0])
    assert p["build provenance"].status == "fail" and "no SASS for sm_100" in p["build provenance"].reason


@pytest.mark.parametrize("fake, status, words", [
    (FakeNvml(ecc=3), "fail", "3 uncorrected ECC"),
    (FakeNvml(free_gib=2.0), "fail", "2.0 GiB free < 8 GiB headroom"),
    (FakeNvml(pending=True), "fail", "retired pages pending"),
    (FakeNvml(reasons=0x40), "warn", "hw-thermal"),
    (FakeNvml(procs=2), "warn", "2 compute process(es)"),
])
def test_gpu_probe_verdicts(fake, status, words):
    (p,) = deploy.probe_gpus(fake, 8.0, require_gpu=False)
    assert p.status == status and words in p.reason


def test_no_nvml_warns_unless_required():
    assert deploy.probe_gpus(None, 8.0, False)[0].status == "warn"
    assert deploy.probe_gpus(None, 8.0, True)[0].status == "fail"
    assert deploy.probe_gpus(FakeNvml(n=0), 8.0, True)[0].status == "fail"


def test_cli_exit_codes(repo, tmp_path, monkeypatch):
    runner = CliRunner()
    monkeypatch.setenv("KDEV_LEDGER", str(tmp_path / "none"))
    r = runner.invoke(app, ["deploy-check", "--repo", str(repo), "--json"])
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert not doc["ok"] and {p["name"]: p["status"] for p in doc["probes"]}["ledger"] == "fail"
    monkeypatch.setenv("KDEV_LEDGER", str(ledger_with(tmp_path, repo, "sm_120")))
    r = runner.invoke(app, ["deploy-check", "--repo", str(repo), "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 0, doc  # no NVML here: the GPU probe warns, which fails only under --strict
    assert runner.invoke(app, ["deploy-check", "--repo", str(repo), "--strict"]).exit_code == 1
    assert runner.invoke(app, ["deploy-check", "--repo", str(repo), "--require-gpu"]).exit_code == 1
    assert runner.invoke(app, ["deploy-check", "--target", "blackwell"]).exit_code == 2


def test_manifest_drift_fails_the_vectors_probe(repo, tmp_path):
    import yaml

    mpath = repo / "vectors" / "smoke" / "manifest.yaml"
    text = mpath.read_text()
    m = yaml.safe_load(text)
    m["cases"][2]["tolerances"]["out"]["rtol"] = 0.9
    mpath.write_text(yaml.safe_dump(m, sort_keys=False))
    try:
        p = by_name(deploy.run_checks(repo, nvml=FakeNvml(), ledger=tmp_path)[0])
        assert p["vectors"].status == "fail" and "manifest tolerances" in p["vectors"].reason
    finally:
        mpath.write_text(text)


def test_a_target_that_is_no_arch_is_one_line_and_exit_2():
    from typer.testing import CliRunner

    from kdev.cli import app

    r = CliRunner().invoke(app, ["deploy-check", "--target", "sm_1"])
    assert r.exit_code == 2 and "--target: 'sm_1' is not an arch" in r.stderr and "Traceback" not in r.output
