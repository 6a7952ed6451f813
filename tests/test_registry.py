"""One table of verify calls (kdev/registry.py): every list of kernels derives from it, no module names a call in a
string of its own, a call added to the table reaches every list, and the defaults are the device-scheduled calls."""

import ast
import json
import subprocess
import sys
from pathlib import Path

from kdev import abi, registry

REPO = Path(__file__).resolve().parent.parent


def _literals(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_no_module_names_a_verify_call_but_the_registry():
    """A call's name in a string literal anywhere in the package (a whole string, or one item of a comma-separated
    list) is a second list of kernels: it must come from kdev/registry.py instead."""
    names = set(registry.VERIFY_KERNELS) | set(registry.LAYER_BACKENDS)
    offenders = []
    for path in sorted((REPO / "kdev").rglob("*.py")):
        if path.name == "registry.py":
            continue
        for line, text in _literals(path):
            if {t.strip() for t in text.split(",")} & names:
                offenders.append(f"{path.relative_to(REPO)}:{line}: {text!r}")
    assert offenders == []


def test_the_defaults_are_the_scheduled_calls():
    assert registry.DEFAULT == registry.HOPPER == "flash" and registry.PORTABLE == "flash-portable"
    for name in (registry.HOPPER, registry.PORTABLE):
        assert registry.BY_NAME[name].scheduled and registry.BY_NAME[name].engine
        assert abi.VERIFY_KERNELS[name].endswith("_scheduled")
    # the host plans stay, as the schedule's reference, under names that say so, and no engine is handed them
    assert registry.HOST_PLAN_OF == {"flash": "flash-hostplan", "flash-portable": "flash-portable-hostplan"}
    assert not any(registry.BY_NAME[h].engine for h in registry.HOST_PLAN_OF.values())
    import torch

    import kdev.ops  # noqa: F401  (registers the ops)

    assert f'str kernel="{registry.DEFAULT}"' in str(torch.ops.kdev.verify_attn.default._schema)
    from kdev.bench.sweeps import load_bench

    assert load_bench().backends[0] == registry.DEFAULT


def test_every_entry_point_is_one_the_header_declares():
    from kdev import cabi

    for call in registry.CALLS:
        assert call.entry in cabi.CONTRACT.functions, call.name


DUMMY = """
import json, sys, types
import kdev
src = open(sys.argv[1]).read().replace(
    "CALLS = (", "CALLS = (VerifyCall('flash-dummy', 'kdtree_dummy', 'hopper', True, True, False, True, 'a dummy'),", 1)
m = types.ModuleType("kdev.registry")
m.__file__ = sys.argv[1]
sys.modules["kdev.registry"] = m
exec(compile(src, sys.argv[1], "exec"), m.__dict__)
kdev.registry = m
from typer.testing import CliRunner
from kdev import abi
from kdev.bench import runners, sweeps
from kdev.cli import app
from kdev.e2e import adapter
helps = {c: CliRunner().invoke(app, [c, "--help"], terminal_width=400).output for c in ("verify", "bench", "e2e")}
print(json.dumps({"abi": list(abi.VERIFY_KERNELS), "scheduled": list(abi.SCHEDULED_KERNELS),
                  "bench": list(sweeps.ATTENTION_BACKENDS), "layer": list(runners.LAYER_BACKENDS),
                  "e2e": list(adapter.BACKENDS), "verify_default": "flash-dummy" in helps["verify"].split("--kernel")[1],
                  "helps": {c: "flash-dummy" in h for c, h in helps.items()}}))
"""


def test_a_call_added_to_the_table_reaches_every_list(tmp_path):
    r = subprocess.run([sys.executable, "-c", DUMMY, str(REPO / "kdev" / "registry.py")], capture_output=True,
                       text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    for where in ("abi", "scheduled", "bench", "e2e"):
        assert "flash-dummy" in doc[where], where
    assert "flash-dummy-layer" in doc["layer"] and "flash-dummy-layer" in doc["bench"]
    assert all(doc["helps"].values()), doc["helps"]
