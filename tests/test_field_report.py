"""kdev field-report without a GPU: a fake NVML and a fake step runner stand for the machine; the report's steps, its
NVML summary, a failing step, the write rules, and the round trip through `kdev plan --project --calibrate`."""

import json
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kdev import field_report as fr
from kdev.cli import app
from kdev.errors import BadInput, EnvironmentMissing


def bench_doc():
    return {"provenance": {"gpu": {"name": "NVIDIA RTX PRO 6000 Blackwell"}}, "results": [{"shape": "s"}]}


def fake_runner(fail=()):
    seen = []

    def run(step):
        seen.append(step)
        rc = 1 if step.name in fail else 0
        doc = bench_doc() if step.name == "bench" else {"step": step.name}
        return {"name": step.name, "command": " ".join(step.argv), "rc": rc, "seconds": 1.0, "doc": doc,
                "tail": ["FAIL: a case"] if rc else []}

    return run, seen


def test_a_report_holds_every_step_and_the_clocks_during_them(tmp_path, monkeypatch, fake_nvml):
    monkeypatch.setattr(fr.shutil, "which", lambda tool: "/usr/bin/compute-sanitizer")
    run, seen = fake_runner()
    out = tmp_path / "r.json"
    doc = fr.collect(out, fuzz=50, nvml=fake_nvml(), runner=run)
    assert json.loads(out.read_text()) == doc
    assert doc["kind"] == fr.KIND and doc["gpu"]["arch"] == "sm_120" and doc["gpu"]["power_limit_w"] == 600
    names = [s.name for s in seen]
    assert names == ["build", "verify", "ceilings", "bench", "fuzz", "sanitizer-memcheck", "sanitizer-racecheck",
                     "sanitizer-synccheck"]
    assert seen[0].argv[:3] == ("build", "--arch", "sm_120") and "50" in seen[4].argv
    assert seen[5].wrapper[0] == "/usr/bin/compute-sanitizer" and "racecheck" in seen[6].wrapper
    for step in seen[5:]:  # the sanitizers on their few cases, not the whole suite (racecheck over it takes minutes)
        assert [step.argv[i + 1] for i, a in enumerate(step.argv) if a == "--case"] == list(fr.SANITIZER_CASES)
    assert "page_size=1,64" in seen[3].argv and doc["bench"] == bench_doc() and doc["complete"]
    assert doc["nvml"]["samples"] >= 1 and doc["nvml"]["sm_clock_mhz"]["median"] == 2400
    assert doc["nvml"]["power_w"]["max"] == 450 and doc["nvml"]["clock_events"] == ["SwPowerCap"]
    assert not fr.failed_steps(doc)


def test_a_failing_step_is_recorded_and_the_rest_run(tmp_path, monkeypatch, fake_nvml):
    monkeypatch.setattr(fr.shutil, "which", lambda tool: None)
    run, seen = fake_runner(fail={"fuzz"})
    doc = fr.collect(tmp_path / "r.json", nvml=fake_nvml(), runner=run)
    assert {s["name"] for s in fr.failed_steps(doc)} == {"fuzz", "sanitizer"}  # no compute-sanitizer: said so
    assert seen[-1].name == "fuzz" and doc["bench"] == bench_doc()  # the steps before and after it ran


def test_a_report_cut_short_keeps_the_steps_it_ran(tmp_path, fake_nvml):
    out = tmp_path / "r.json"
    run, _ = fake_runner()

    def dies_at_fuzz(step):
        if step.name == "fuzz":
            raise KeyboardInterrupt
        return run(step)

    with pytest.raises(KeyboardInterrupt):
        fr.collect(out, nvml=fake_nvml(), runner=dies_at_fuzz)
    doc = json.loads(out.read_text())
    assert not doc["complete"] and [s["name"] for s in doc["steps"]][-1] == "bench" and doc["bench"] == bench_doc()


def test_no_gpu_an_existing_report_and_no_fuzz_are_one_line_each(tmp_path, fake_nvml):
    with pytest.raises(EnvironmentMissing, match="NVML"):
        fr.identify(None)
    (tmp_path / "old.json").write_text("{}")
    with pytest.raises(BadInput, match="--force"):
        fr.collect(tmp_path / "old.json", nvml=fake_nvml(), runner=fake_runner()[0])
    with pytest.raises(BadInput, match="fuzz"):
        fr.collect(tmp_path / "new.json", fuzz=0, nvml=fake_nvml(), runner=fake_runner()[0])
    assert (tmp_path / "old.json").read_text() == "{}"


def test_the_command_writes_the_report_and_exits_1_on_a_failed_step(tmp_path, monkeypatch, fake_nvml):
    run, _ = fake_runner(fail={"verify"})
    monkeypatch.setattr(fr, "run_step", run)
    monkeypatch.setattr(fr.kgpu, "load_nvml", fake_nvml)
    monkeypatch.setattr(fr.shutil, "which", lambda tool: "/x/compute-sanitizer")
    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["field-report", "--out", str(out), "--fuzz", "5"])
    assert r.exit_code == 1, r.output
    assert "verify" in r.output and "r.json" in r.output and out.is_file()
    r = CliRunner().invoke(app, ["field-report", "--out", str(out)])
    assert r.exit_code == 2 and "--force" in r.output


def test_a_step_keeps_the_document_without_its_case_list_and_the_sanitizers_lines(monkeypatch):
    out = "========= COMPUTE-SANITIZER\n" + json.dumps({"passed": True, "results": [1] * 10}) + \
        "\n========= ERROR SUMMARY: 0 errors\n"
    monkeypatch.setattr(fr.subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=0, stdout=out, stderr=""))
    step = fr.Step("sanitizer-memcheck", ("verify", "--json"), 10, ("compute-sanitizer", "--tool", "memcheck"),
                   case_list=True)
    r = fr.run_step(step)
    assert r["doc"] == {"passed": True} and r["sanitizer"] == ["COMPUTE-SANITIZER", "ERROR SUMMARY: 0 errors"]
    assert r["command"].startswith("compute-sanitizer --tool memcheck ") and r["rc"] == 0


def test_the_bench_step_keeps_its_rows_for_the_calibration(monkeypatch):
    out = json.dumps(bench_doc())
    monkeypatch.setattr(fr.subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=0, stdout=out, stderr=""))
    by_name = {s.name: s for s in fr.steps("sm_120", 5, "smoke", "compute-sanitizer")}
    assert fr.run_step(by_name["bench"])["doc"] == bench_doc()
    assert "results" not in fr.run_step(by_name["fuzz"])["doc"]


def test_the_sanitizer_cases_are_smoke_cases():
    import yaml

    manifest = yaml.safe_load((Path(__file__).resolve().parents[1] / "vectors" / "smoke" / "manifest.yaml").read_text())
    names = {case["name"] for case in manifest["cases"]}
    assert set(fr.SANITIZER_CASES) <= names, set(fr.SANITIZER_CASES) - names
