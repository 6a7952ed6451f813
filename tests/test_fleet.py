"""Every GPU of the host without a GPU: a fake device layer (N GPUs whose workers are real processes that pass, fail,
die or hang; one of another model) for the fan-out, the gathering, the ledger rows, deploy-check's per-GPU gate and every
exit code."""

import hashlib
import json
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kdev import deploy, fleet, ledger
from kdev.cli import app
from kdev.errors import BadInput

SRC = "a" * 64
LIB_BYTES = b"the library"
LIB_SHA = hashlib.sha256(LIB_BYTES).hexdigest()


def verify_doc(uuid: str, passed: bool = True, lib_sha: str = LIB_SHA) -> dict:
    return {"schema_version": 1, "timestamp": ledger.now_iso(), "kind": "suite", "source_hash": SRC,
            "library_sha256": lib_sha, "gpu": {"uuid": uuid, "name": "worker's own name"}, "suite": {"name": "smoke"},
            "kernels": {"naive": {"passed": passed, "checks": 12, "failed": 0 if passed else 1},
                        "flash": {"passed": True, "checks": 24, "failed": 0}},
            "passed": passed, "failures": [] if passed else [{"reason": "out: max abs 0.5"}],
            "results": [{"case": f"case-{i}", "note": "x" * 200} for i in range(2000)], "ledger": None}


def bench_doc(us: float) -> dict:
    return {"results": [{"shape": "B1-L32768-N64-H8-p64", "backend": "flash", "timing": {"median_us": us}},
                        {"shape": "B1-L32768-N64-H8-p64", "backend": "naive", "timing": None}]}


class FakeDevices:
    """GPUs by behaviour: pass, fail (a check failed, exit 1 with a document), die (SIGKILL, no document), oom (exit 1,
    CUDA's message, no document), hang (never answers), slow (a bench 20 % slower)."""

    def __init__(self, behaviours, names=None, drivers=None):
        self.behaviours = behaviours
        self.names = names or ["NVIDIA H100 80GB HBM3"] * len(behaviours)
        self.drivers = drivers or ["580.1"] * len(behaviours)
        self.started = []

    def uuids(self):
        return [f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(len(self.behaviours))]

    def state(self, uuid, position):
        return fleet.GpuState(position, uuid, self.names[position], "sm_90", 80.0, self.drivers[position], "on", 0,
                              {"correctable": 0, "uncorrectable": 0, "pending": 0, "failure": 0}, [])

    def start(self, argv, uuid, stdout, stderr):
        import subprocess

        self.started.append((argv, uuid))
        i = self.uuids().index(uuid)
        what = self.behaviours[i]
        doc = bench_doc(120.0 if what == "slow" else 100.0) if argv[0] == "bench" else verify_doc(uuid, what != "fail")
        path = Path(stdout.name).with_suffix(".doc")  # the document is larger than an argument may be
        path.write_text(json.dumps(doc))
        show = f"import sys; sys.stdout.write(open({str(path)!r}).read())"
        code = {
            "pass": show, "slow": show, "fail": show + "; raise SystemExit(1)",
            "die": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
            "oom": "import sys; sys.stderr.write('CUDA error: out of memory\\n'); raise SystemExit(1)",
            "hang": "import time; time.sleep(60)",
        }[what]
        return subprocess.Popen([sys.executable, "-c", code], stdout=stdout, stderr=stderr, start_new_session=True)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setenv("KDEV_LEDGER", str(tmp_path / "ledger"))
    monkeypatch.delenv(fleet.WORKER_ENV, raising=False)

    def use(*behaviours, **kw):
        devices = FakeDevices(list(behaviours), **kw)
        monkeypatch.setattr(fleet, "devices", lambda: devices)
        devices.built = []
        monkeypatch.setattr(fleet, "prebuild", lambda gpus, log=None: devices.built.append(
            sorted({g.arch for g in gpus})))
        return devices

    return use


def test_workers_run_at_once_and_a_dead_or_hung_one_is_a_failed_row(fake):
    devices = fake("pass", "die", "hang", "oom", "pass")
    gpus = fleet.select(devices, "all")
    seen = []
    t0 = time.monotonic()
    rows = fleet.fan_out(devices, gpus, ["verify", "--json"], timeout_s=3.0, on_update=lambda g, s: seen.append(s))
    assert time.monotonic() - t0 < 20  # the hang costs its timeout once, not per GPU
    assert [r.gpu.position for r in rows] == [0, 1, 2, 3, 4]
    assert [r.passed for r in rows] == [True, False, False, False, True]
    assert rows[1].reason == "killed by signal 9 (out of memory?)"
    assert rows[2].rc is None and rows[2].reason == "no answer in 3 s: killed"
    assert rows[3].reason == "exit 1 without a result: CUDA error: out of memory"
    assert seen.count("running") == 5 and seen.count("passed") == 2
    assert {uuid for _, uuid in devices.started} == set(devices.uuids())  # each worker on its own GPU, by UUID


def test_gpus_names_positions_or_uuids_and_refuses_the_rest(fake):
    devices = fake("pass", "pass", "pass")
    assert [g.position for g in fleet.select(devices, "2,0")] == [2, 0]
    uuid = devices.uuids()[1]
    assert [g.position for g in fleet.select(devices, uuid.lower().removeprefix("gpu-"))] == [1]
    for bad, why in (("3", "neither a position"), ("0,0", "named twice"), ("GPU-nope", "neither a position")):
        with pytest.raises(BadInput, match=why):
            fleet.select(devices, bad)


def test_one_gpu_runs_here_as_it_always_did(fake, monkeypatch):
    devices = fake("pass")
    listed = []
    monkeypatch.setattr(devices, "uuids", lambda: listed.append(1) or FakeDevices(["pass"]).uuids())
    assert fleet.plan("all") is None and fleet.plan("0") is None
    assert len(listed) == 2  # the GPUs listed once per call (a process each)
    monkeypatch.setenv(fleet.WORKER_ENV, "1")
    assert fleet.plan(None) is None  # a worker never fans out again
    with pytest.raises(BadInput, match="a worker runs on the one GPU"):
        fleet.plan("all")


def test_verify_on_every_gpu_writes_one_ledger_row_per_uuid(fake, tmp_path):
    devices = fake("pass", "fail", "die", "pass")
    r = CliRunner().invoke(app, ["verify", "--gpus", "all", "--kernel", "naive,flash", "--repeat", "2",
                                 "--worker-timeout", "30", "--json"])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert [g["passed"] for g in doc["gpus"]] == [True, False, False, True] and not doc["passed"]
    assert devices.built == [["sm_90"]]  # the library built once, before the workers
    argv = devices.started[0][0]
    assert argv[0] == "verify" and argv.count("--json") == 1 and "--gpus" not in argv and "--worker-timeout" not in argv
    assert argv[argv.index("--kernel") + 1] == "naive,flash" and argv[argv.index("--repeat") + 1] == "2"
    rows = ledger.read_records(tmp_path / "ledger")
    assert sorted(r["gpu"]["uuid"] for r in rows) == sorted(devices.uuids())  # the parent's UUIDs, one row each
    by = {r["gpu"]["uuid"]: r for r in rows}
    dead = by[devices.uuids()[2]]
    assert dead["kind"] == "worker" and not dead["passed"] and "signal 9" in dead["failures"][0]["reason"]
    assert by[devices.uuids()[1]]["kernels"]["naive"]["failed"] == 1
    assert all("results" not in r for r in rows)


def test_verify_on_every_gpu_says_each_cards_result(fake):
    fake("pass", "oom")
    r = CliRunner().invoke(app, ["verify", "--gpus", "0,1"])
    assert r.exit_code == 1
    assert "kdev verify on 2 GPUs" in r.output and "CUDA error: out of memory" in r.output
    r = CliRunner().invoke(app, ["verify", "--gpus", "7"])
    assert r.exit_code == 2 and "neither a position" in r.output and len(r.output.strip().splitlines()) == 1


def test_bench_on_every_gpu_reports_each_card_and_the_slow_one(fake):
    fake("pass", "slow", "pass")
    r = CliRunner().invoke(app, ["bench", "--gpus", "all", "--sweep", "targets", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    (row,) = doc["spread"]
    assert row["shape"] == "B1-L32768-N64-H8-p64" and row["backend"] == "flash"
    assert row["spread"] == pytest.approx(0.2) and row["slow"] == [f"GPU 1 NVIDIA H100 80GB HBM3 ({fleet_uuid(1)[:12]})"]
    r = CliRunner().invoke(app, ["bench", "--gpus", "all", "--baseline", "h200"])
    assert r.exit_code == 2 and "one GPU" in r.output


def fleet_uuid(i):
    return FakeDevices(["pass"] * 3).uuids()[i]


# ------------------------------------------------------------------------------------------ deploy-check
@pytest.fixture
def gate(monkeypatch, tmp_path):
    """deploy.probe_fleet over a ledger in tmp_path, this build's sources SRC and library bytes hashing to LIB_SHA."""
    lib = tmp_path / "libkdtree.so"
    lib.write_bytes(LIB_BYTES)
    monkeypatch.setattr(deploy, "library_info", lambda repo: (lib, {"source_hash": SRC}, ""))
    monkeypatch.setattr("kdev.build.source_hash", lambda kdir=None: SRC)
    cfg = deploy.DeployConfig("sm_90", ("smoke",), ("naive", "flash"), ("flash-portable",), 8.0, 14.0)
    folder = tmp_path / "ledger"

    def run(gpus, rows, allow_mixed=False):
        for row in rows:
            ledger.append_record(row, folder)
        return deploy.probe_fleet(tmp_path, cfg, gpus, allow_mixed, folder)

    return run


def test_deploy_check_fails_a_card_without_a_passing_row_for_this_build(gate):
    devices = FakeDevices(["pass"] * 4)
    gpus = [devices.state(u, i) for i, u in enumerate(devices.uuids())]
    u = devices.uuids()
    rows = [verify_doc(u[0]), verify_doc(u[1], lib_sha="c" * 64), verify_doc(u[3], passed=False)]
    rows[0]["gpu"]["uuid"] = u[0].removeprefix("GPU-")  # torch's form of the same UUID
    probes = gate(gpus, rows)
    alike, *per = probes
    assert alike.status == deploy.PASS and "4 x NVIDIA H100" in alike.reason
    assert [p.status for p in per] == [deploy.PASS, deploy.FAIL, deploy.FAIL, deploy.FAIL]
    assert f"ran library cccccccccccc, this build's is {LIB_SHA[:12]}" in per[1].reason and u[1][:12] in per[1].reason
    assert "no passing verify of this build on it ('kdev verify --gpus 2')" in per[2].reason
    assert "its last verify of this build failed: out: max abs 0.5" in per[3].reason
    assert "ECC on" in per[0].reason


def test_deploy_check_fails_mixed_cards_and_faults_unless_told(gate):
    devices = FakeDevices(["pass"] * 3, names=["NVIDIA H100 80GB HBM3"] * 2 + ["NVIDIA H200"],
                          drivers=["580.1", "580.1", "575.2"])
    gpus = [devices.state(u, i) for i, u in enumerate(devices.uuids())]
    rows = [verify_doc(u) for u in devices.uuids()]
    gpus[0].ecc_mode, gpus[0].ecc_uncorrected = "off", None
    gpus[1].remapped_rows["pending"] = 1
    gpus[2].clock_events = ["HwThermalSlowdown"]
    alike, a, b, c = gate(gpus, rows)
    assert alike.status == deploy.FAIL and "names differ" in alike.reason and "drivers differ" in alike.reason
    assert "NVIDIA H200 (2)" in alike.reason and "--allow-mixed" in alike.reason
    assert a.status == deploy.PASS and "ECC off" in a.reason  # said, not failed
    assert b.status == deploy.FAIL and "row remapping pending" in b.reason
    assert c.status == deploy.FAIL and "HwThermalSlowdown" in c.reason
    alike, *_ = gate(gpus, [], allow_mixed=True)
    assert alike.status == deploy.WARN


def test_nvml_state_reads_ecc_remaps_and_only_the_harmful_clock_events():
    class Nvml:
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 1, 0

        def __init__(self, ecc):
            self.ecc = ecc

        def nvmlDeviceGetHandleByUUID(self, uuid):
            return "h"

        def nvmlDeviceGetName(self, h):
            return b"NVIDIA H100 80GB HBM3"

        def nvmlDeviceGetCudaComputeCapability(self, h):
            return (9, 0)

        def nvmlDeviceGetMemoryInfo(self, h):
            return type("M", (), {"total": 80 * 2**30})()

        def nvmlSystemGetDriverVersion(self):
            return "580.1"

        def nvmlDeviceGetEccMode(self, h):
            if self.ecc is None:
                raise RuntimeError("not supported")
            return (self.ecc, self.ecc)

        def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
            return 3

        def nvmlDeviceGetRemappedRows(self, h):
            return (2, 0, 0, 0)

        def nvmlDeviceGetCurrentClocksEventReasons(self, h):
            return 0x4 | 0x1 | 0x40  # the power cap and idle are not faults; hardware thermal slowdown is

    st = fleet.nvml_state(Nvml(1), "GPU-1", 0)
    assert (st.name, st.arch, st.ecc_mode, st.ecc_uncorrected) == ("NVIDIA H100 80GB HBM3", "sm_90", "on", 3)
    assert st.remapped_rows == {"correctable": 2, "uncorrectable": 0, "pending": 0, "failure": 0}
    assert st.clock_events == ["HwThermalSlowdown"]
    assert fleet.nvml_state(Nvml(0), "GPU-1", 0).ecc_mode == "off"
    off = fleet.nvml_state(Nvml(None), "GPU-1", 0)
    assert off.ecc_mode is None and off.ecc_uncorrected is None


def test_the_real_layer_lists_no_gpu_here_as_one_line(monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the layer lists it (tests/gpu/test_fleet_gpu.py)")
    monkeypatch.delenv(fleet.WORKER_ENV, raising=False)
    r = CliRunner().invoke(app, ["verify", "--gpus", "all"])
    assert r.exit_code == 3 and "no CUDA GPU visible" in r.output


def test_the_fleet_docs_say_how_a_cluster_gathers_hosts():
    from kdev.config import REPO_ROOT

    doc = (REPO_ROOT / "docs" / "fleet.md").read_text()
    assert "deploy-check --gpus all --json" in doc and "Slurm" in doc and "Ray" in doc


def test_a_worker_keeps_its_failing_fuzz_cases_apart(monkeypatch):
    monkeypatch.delenv(fleet.WORKER_ENV, raising=False)
    assert fleet.failures_root() is None
    monkeypatch.setenv(fleet.WORKER_ENV, "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234")
    assert fleet.failures_root().parts[-2:] == ("fleet", "GPU-1234")


def test_prebuild_builds_each_arch_once(monkeypatch):
    calls = []
    monkeypatch.setattr("kdev.build.build", lambda cfg, log=None: calls.append(cfg.archs) or
                        type("R", (), {"problems": [], "library": "x"})())
    states = [fleet.GpuState(i, f"GPU-{i}", arch=a) for i, a in enumerate(["sm_90", "sm_120", "sm_90", "?"])]
    fleet.prebuild(states)
    assert calls == [("sm_120",), ("sm_90",)]


def test_bench_on_every_gpu_shows_each_card_and_the_spread(fake):
    fake("pass", "slow")
    r = CliRunner().invoke(app, ["bench", "--gpus", "all"])
    assert r.exit_code == 0, r.output
    assert "kdev bench on 2 GPUs" in r.output and "median µs per card" in r.output and "20.0%" in r.output
