"""scripts/gpu-round.sh: bad options are refused (exit 2, one line) before any GPU work starts."""

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu-round.sh"


def run(tmp_path, *args):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")}, timeout=30)


@pytest.mark.parametrize("value", ["0", "-5", "1.5", "ten", ""])
def test_step_timeout_must_be_whole_seconds(tmp_path, value):
    r = run(tmp_path, "--step-timeout", value)
    assert r.returncode == 2
    assert r.stderr.strip() == f"--step-timeout takes a whole number of seconds > 0, not '{value}'"
    assert not (tmp_path / "out" / "round.log").exists()  # refused before the round began


def test_unknown_option_is_refused(tmp_path):
    r = run(tmp_path, "--fuz", "10")
    assert r.returncode == 2 and r.stderr.strip() == "unknown option --fuz"
