"""kdev field-report on the GPU: every step runs here (a short fuzz, the smoke sweep for the bench), the NVML samples
are this GPU's, and the file is a calibration point for kdev plan --project."""

import json

import pytest
from typer.testing import CliRunner

from kdev import build as kbuild
from kdev import config
from kdev.cli import app

pytestmark = pytest.mark.gpu


def test_the_field_report_runs_here_and_calibrates_the_projection(lib, tmp_path):
    out = tmp_path / "field.json"
    r = CliRunner().invoke(app, ["field-report", "--out", str(out), "--fuzz", "5", "--sweep", "smoke"])
    doc = json.loads(out.read_text())
    failed = {s["name"]: s["tail"][-3:] for s in doc["steps"] if s["rc"] != 0}
    assert set(failed) <= {"sanitizer"}, failed  # compute-sanitizer may be absent: said so, not failed silently
    assert r.exit_code == (1 if failed else 0), r.output
    assert doc["verify"]["passed"] and doc["fuzz"]["passed"]
    assert doc["nvml"]["samples"] > 10 and doc["nvml"]["sm_clock_mhz"]["max"] > 0
    timed = [x for x in doc["bench"]["results"] if x.get("timing")]
    assert {x["axes"]["page_size"] for x in timed} == {1, 64}
    # the projection reads the SASS of every arch it projects: a library of build.yaml's archs, not this GPU's alone
    res = kbuild.build(config.load_build(None))
    assert not res.problems, res.problems
    r = CliRunner().invoke(app, ["plan", "--project", "--calibrate", str(out), "--json"])
    assert r.exit_code == 0, r.output
    (cal,) = json.loads(r.stdout)["calibrations"]
    assert cal["before"] and all(b["measured_us"] > 0 for b in cal["before"])
