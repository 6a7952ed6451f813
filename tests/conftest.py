"""Shared fixtures. GPU tests carry @pytest.mark.gpu: skipped with a reason where no CUDA GPU is visible,
and never skipped where one is."""

import os
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible to torch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def write_yaml(tmp_path):
    def write(name: str, text: str) -> Path:
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
        return p

    return write


TINY_SUITES = """
suites:
  tiny:
    cases:
      - {name: a, prefix_lens: [5, 70], tree: {kind: ddtree, budget: 6, depth: 3, vocab: 50}, heads: 3, page_size: 64, seed: 1}
      - {name: b, prefix_lens: [0], tree: {kind: random, nodes: 9}, heads: 2, page_size: 1, seed: 2}
"""


@pytest.fixture
def tiny_suites(write_yaml):
    return write_yaml("suites.yaml", TINY_SUITES)
