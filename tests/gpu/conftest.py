import os

import pytest
import torch

from kdev import abi
from kdev import build as kbuild
from kdev import config


@pytest.fixture(scope="session")
def lib():
    """The library for this GPU's arch (a cache hit when `kdev build` already built it), or the one KDEV_LIB names
    (e.g. an sm_90a build on an sm_90 GPU: every GPU test then runs its flash call by wgmma)."""
    if os.environ.get("KDEV_LIB"):
        named = abi.Library(os.environ["KDEV_LIB"])
        assert not named.stale, f"KDEV_LIB={named.path} was built from other sources"
        return named
    major, minor = torch.cuda.get_device_capability()
    cfg = config.load_build(None, [f"sm_{major}{minor}"])
    res = kbuild.build(cfg)
    assert not res.problems, res.problems
    return abi.Library(res.library)
