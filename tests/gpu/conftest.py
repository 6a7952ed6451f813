import pytest
import torch

from kdev import abi
from kdev import build as kbuild
from kdev import config


@pytest.fixture(scope="session")
def lib():
    """The library for this GPU's arch (a cache hit when `kdev build` already built it)."""
    major, minor = torch.cuda.get_device_capability()
    cfg = config.load_build(None, [f"sm_{major}{minor}"])
    res = kbuild.build(cfg)
    assert not res.problems, res.problems
    return abi.Library(res.library)
