"""Shared fixtures. GPU tests carry @pytest.mark.gpu: skipped with a reason where no CUDA GPU is visible,
and never skipped where one is."""

import os
import textwrap
import types
import zlib
from pathlib import Path

import pytest
import torch

from kdev import build as kbuild
from kdev import config as kconfig
from kdev.errors import EnvironmentMissing

REPO = Path(__file__).resolve().parent.parent

# Without a GPU the triton peer's tests run its kernels in Triton's interpreter, which Triton fixes when it is
# imported (nothing has imported it yet); with a GPU they run compiled, on it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _have_nvcc() -> bool:
    try:
        kbuild.find_nvcc()
        return True
    except EnvironmentMissing:
        return False


HAVE_NVCC = _have_nvcc()


def pytest_configure(config):
    # one fresh base seed per run (or KDEV_TEST_SEED's): every test that takes `seed` gets its own from it and its id
    config.kdev_seed = int(os.environ.get("KDEV_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))


def pytest_report_header(config):
    return f"kdev test seed {config.kdev_seed} (replay a run: KDEV_TEST_SEED={config.kdev_seed} python -m pytest ...)"


@pytest.fixture
def seed(request) -> int:
    """A fresh seed for this test: the run's base seed and the test's id, printed (a failing test shows it), so
    `KDEV_TEST_SEED=<base> python -m pytest <test id>` gives the failing inputs again."""
    value = zlib.crc32(f"{request.config.kdev_seed}:{request.node.nodeid}".encode())
    print(f"seed {value} (KDEV_TEST_SEED={request.config.kdev_seed} python -m pytest '{request.node.nodeid}')")
    return value


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="no CUDA GPU visible to torch")
    no_nvcc = pytest.mark.skip(reason="nvcc not found")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "nvcc" in item.keywords and not HAVE_NVCC:
            item.add_marker(no_nvcc)


@pytest.fixture
def build_config():
    """build_config(out_dir, archs) -> a BuildConfig from configs/build.yaml writing into out_dir."""

    def make(out_dir, archs):
        c = kconfig.load_build(None, archs)
        return kconfig.BuildConfig(c.archs, c.flags, out_dir, False, c.smem_limit_bytes, c.path)

    return make


@pytest.fixture(scope="session")
def sm90_library(both_archs):
    """A library with sm_90 code from the current sources (both_archs': one build for the whole run; needs nvcc)."""
    return both_archs[1].library


@pytest.fixture(scope="session")
def both_archs(tmp_path_factory):
    """(BuildConfig, BuildResult) of a build of configs/build.yaml's flags for sm_90 and sm_120 from the current
    sources into a temporary folder (needs nvcc)."""
    if not HAVE_NVCC:
        pytest.skip("nvcc not found")
    c = kconfig.load_build(None, ["sm_90", "sm_120"])
    cfg = kconfig.BuildConfig(c.archs, c.flags, tmp_path_factory.mktemp("b") / "build", False, c.smem_limit_bytes,
                              c.path)
    return cfg, kbuild.build(cfg)


@pytest.fixture(scope="session")
def default_build(tmp_path_factory):
    """(BuildConfig, BuildResult) of the build `kdev build` makes (configs/build.yaml: its archs and flags, sm_90a and
    sm_120) from the current sources into a temporary folder (needs nvcc)."""
    if not HAVE_NVCC:
        pytest.skip("nvcc not found")
    c = kconfig.load_build(None, None)
    cfg = kconfig.BuildConfig(c.archs, c.flags, tmp_path_factory.mktemp("b") / "build", False, c.smem_limit_bytes,
                              c.path)
    return cfg, kbuild.build(cfg)


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


@pytest.fixture
def fake_nvml():
    """A factory of fake NVML modules: one RTX PRO 6000 at the clock, power and clock-event reasons given."""
    def make(clock=2400, power_mw=450_000, limit_mw=600_000, events=0x4):
        h = object()
        return types.SimpleNamespace(
            NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0,
            nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: h,
            nvmlDeviceGetCudaComputeCapability=lambda h: (12, 0),
            nvmlDeviceGetName=lambda h: b"NVIDIA RTX PRO 6000 Blackwell", nvmlDeviceGetUUID=lambda h: "GPU-1234",
            nvmlSystemGetDriverVersion=lambda: "580.1", nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=96 << 30),
            nvmlDeviceGetClockInfo=lambda h, k: clock, nvmlDeviceGetMaxClockInfo=lambda h, k: 2617,
            nvmlDeviceGetPowerUsage=lambda h: power_mw, nvmlDeviceGetEnforcedPowerLimit=lambda h: limit_mw,
            nvmlDeviceGetTemperature=lambda h, k: 71, nvmlDeviceGetCurrentClocksEventReasons=lambda h: events)

    return make
