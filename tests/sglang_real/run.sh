#!/usr/bin/env bash
# The tests of kdev's SGLang backend against the real SGLang release (tests/sglang_real/), in a virtual environment of
# their own: SGLang pins its own torch and transformers, and importing it patches transformers (the main suite's e2e
# tests use transformers). The release is kdev.integrations.sglang.SGLANG_RELEASE, read from there (its one place).
# SGLang is installed without its dependencies: its CUDA kernel packages (flashinfer, sgl-kernel, ...) have no use on
# a CPU; torch and torchvision at SGLang's pins with theirs (torch 2.14.1's CUDA build, which imports and runs on a CPU;
# srt/configs imports torchvision, and one built for another torch breaks every import of ForwardBatch); then the small
# packages its modules import (requirements-nodeps.txt) and kdev, editable.
# Cost: about 5.7 GB on disk (torch's CUDA build and its nvidia libraries), about 6 minutes to install into a new venv
# (measured: 5 to 6 minutes, torch's wheels from the machine's index), and about 2 minutes of tests on 2 cores (SGLang's
# Triton kernel runs in Triton's interpreter).
# KDEV_SGLANG_VENV: where the venv lives (default .sglang-venv, reused when it exists; KDEV_SGLANG_FRESH=1 remakes it).
# Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${KDEV_SGLANG_VENV:-.sglang-venv}"
release=$(sed -n 's/^SGLANG_RELEASE = "\(.*\)"$/\1/p' kdev/integrations/sglang/__init__.py)
if [ -z "$release" ]; then
  echo "tests/sglang_real/run.sh: no SGLANG_RELEASE line in kdev/integrations/sglang/__init__.py" >&2
  exit 2
fi
if [ "${KDEV_SGLANG_FRESH:-0}" = 1 ] || [ ! -x "$venv/bin/python" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q torch==2.14.1 torchvision==0.29.1
"$py" -m pip install -q --no-deps "sglang==$release" -r tests/sglang_real/requirements-nodeps.txt
"$py" -m pip install -q --no-deps --no-build-isolation -e .
# the venv's pytest script, not `python -m pytest`: the latter puts the repository root on sys.path, where a stale
# kdev.egg-info from another install can hide this install's entry points (the plugin's) from importlib.metadata
KDEV_SGLANG_REAL=1 "$venv/bin/pytest" -q -p no:cacheprovider -W ignore::UserWarning tests/sglang_real "$@"
