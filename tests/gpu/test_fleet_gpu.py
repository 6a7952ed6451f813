"""--gpus on a machine with one GPU: everything runs here, exactly as without the option (one GPU, no worker)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from kdev import fleet
from kdev.cli import app

pytestmark = pytest.mark.gpu


def test_the_real_layer_names_this_gpu_by_its_uuid():
    uuids = fleet.Devices().uuids()
    assert len(uuids) == torch.cuda.device_count() and all(u.startswith("GPU-") for u in uuids)
    state = fleet.select(fleet.Devices(), "0")[0]
    assert state.name == torch.cuda.get_device_name(0) and state.arch == "sm_%d%d" % torch.cuda.get_device_capability(0)


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="a one-GPU machine's behaviour")
def test_gpus_all_with_one_gpu_is_todays_run(lib, tmp_path, monkeypatch):
    monkeypatch.setenv("KDEV_LEDGER", str(tmp_path / "ledger"))
    plain = CliRunner().invoke(app, ["verify", "--kernel", "naive,flash", "--json"])
    fanned = CliRunner().invoke(app, ["verify", "--gpus", "all", "--kernel", "naive,flash", "--json"])
    assert plain.exit_code == fanned.exit_code == 0, fanned.output
    a, b = json.loads(plain.stdout), json.loads(fanned.stdout)
    assert set(a) == set(b) and "gpus" not in b and a["kernels"].keys() == b["kernels"].keys()
    assert a["gpu"]["uuid"] == b["gpu"]["uuid"] and b["ledger"]
    plain = CliRunner().invoke(app, ["deploy-check", "--json"])
    fanned = CliRunner().invoke(app, ["deploy-check", "--gpus", "all", "--json"])
    assert [p["name"] for p in json.loads(plain.stdout)["probes"]] == \
        [p["name"] for p in json.loads(fanned.stdout)["probes"]]
