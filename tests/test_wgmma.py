"""The wgmma primitives compiled without a GPU: an sm_90a build holds the rung's and the layout check's HGMMA
instructions (the shapes, the register-A form and the transposed B the header asks for); an sm_90 build holds none
(its kernels answer that they have no wgmma). Whether they compute the right products is tests/gpu/test_wgmma_gpu.py."""

import pytest

from kdev import sass

pytestmark = pytest.mark.nvcc


@pytest.fixture(scope="session")
def sm90a_build(default_build):
    """The build `kdev build` makes (sm_90a and sm_120: one for the whole run) holds the sm_90a code."""
    cfg, res = default_build
    assert "sm_90a" in cfg.archs and not res.problems, res.problems
    return res


@pytest.fixture(scope="module")
def sm90a_functions(sm90a_build):
    functions = [f for f in sass.parse(sass.dump(sm90a_build.library)) if f.arch == "sm_90a"]
    names = sass.demangle(sorted({f.name for f in functions}))
    return {names[f.name]: f for f in functions}


def _hgmma(fn):
    return [i.text for i in fn.instrs if i.op.startswith("HGMMA")]


def test_an_sm90a_build_holds_the_wgmma_instructions(sm90a_functions):
    check = next(f for name, f in sm90a_functions.items() if "wgmma_check_kernel" in name)
    peak = next(f for name, f in sm90a_functions.items() if "wgmma_peak_kernel" in name)
    ops = _hgmma(check)
    # S: 36 k16 steps of 64 x 64 from two descriptors; O: 4 k16 steps of 64 x 256, A from registers, B transposed
    # (the loop over the two column halves is kept: one copy of its four)
    assert sum("64x64x16.F32.BF16" in t for t in ops) == 36
    rs = [t for t in ops if "64x256x16.F32.BF16" in t]
    assert len(rs) == 4 and all(".tnspB" in t and ", R" in t.split("gdesc")[0] for t in rs)
    assert _hgmma(peak) and all("64x256x16.F32.BF16" in t and "tnsp" not in t for t in _hgmma(peak))


def test_the_wgmma_verify_kernel_issues_its_tiles_products_by_hgmma(sm90a_functions):
    """flash-wgmma's full-tile kernel (kernels/flash/wgmma.cuh): per 64-token tile, each warpgroup's S as 36 HGMMA
    64x32x16 from two descriptors and its half of O as 4 HGMMA 64x256x16 with V transposed (MN-major), no mma.sync."""
    kernel = next(f for name, f in sm90a_functions.items() if "verify_attn_flash_wgmma_kernel" in name)
    ops = _hgmma(kernel)
    assert sum("64x32x16.F32.BF16" in t for t in ops) == 36
    pv = [t for t in ops if "64x256x16.F32.BF16" in t]
    assert len(pv) == 4 and all(".tnspB" in t and "gdesc" in t.split(",")[1] for t in pv)
    assert not any(i.op == "HMMA" for i in kernel.instrs)


def test_the_flash_call_can_tell_where_the_wgmma_body_is_compiled(sm90a_build, both_archs):
    """kdtree_verify_attn_flash runs the wgmma kernel where the loaded code has its body, which it reads from the
    kernel's register count (kernels/verify_attn_flash.cu, kWgmmaBodyMinRegisters = 129: O's 128 fp32 accumulators
    a thread need more): more than 128 in the sm_90a build, a few in every other arch's."""
    def registers(resources):
        return {r["arch"]: r["registers"] for r in resources if r["kernel"] == "verify_attn_flash_wgmma_kernel"}

    assert registers(sm90a_build.resources)["sm_90a"] >= 129
    others = registers(both_archs[1].resources)
    assert set(others) == {"sm_90", "sm_120"} and max(others.values()) <= 128
