"""The wgmma primitives on an sm_90 GPU (kernels/wgmma.cu, kernels/include/kdev/wgmma.cuh), from a library built for
sm_90a: the operand layouts (Q and K K-major for S = Q K^T, V read MN-major from the same tile, P from the S
accumulators in registers) against matmuls of the same bf16 inputs, and the ceilings rung. The default library (sm_90)
says it has no wgmma."""

import ctypes

import pytest
import torch

from kdev import abi, cabi, config
from kdev import build as kbuild
from kdev.bench import ceilings as kceilings

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def lib90a():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90 GPUs (H100, H200) only")
    res = kbuild.build(config.load_build(None, ["sm_90a"]))
    assert not res.problems, res.problems
    return abi.Library(res.library)


def _check(lib, q, kv):
    s = torch.full((64, 64), float("nan"), device="cuda")
    o = torch.full((64, 512), float("nan"), device="cuda")
    st = lib.lib.kdtree_bench_wgmma_check(ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(kv.data_ptr()),
                                          ctypes.c_void_p(s.data_ptr()), ctypes.c_void_p(o.data_ptr()),
                                          ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()
    return st, s, o


def test_the_operand_layouts_give_the_matmuls_products(lib90a, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(64, 576, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(64, 576, device="cuda", generator=g).to(torch.bfloat16)
    st, s, o = _check(lib90a, q, kv)
    assert st == cabi.OK, cabi.status_text(st)
    want_s = q.float() @ kv.float().T  # fp32 sums of exact bf16 products, in another order
    torch.testing.assert_close(s, want_s, rtol=1e-5, atol=1e-3)
    p = s.to(torch.bfloat16).float()  # P as the kernel packs it (round to nearest even)
    torch.testing.assert_close(o, p @ kv[:, :512].float(), rtol=1e-5, atol=1e-2)
    # a layout off by a swizzle phase or a box would not pass: the products of a K with its rows or dims permuted differ
    assert not torch.allclose(s, q.float() @ kv.roll(1, 0).float().T, rtol=1e-2, atol=1.0)
    assert not torch.allclose(o, p @ kv[:, :512].roll(8, 1).float(), rtol=1e-2, atol=1.0)


@pytest.fixture(scope="module")
def plain_lib():
    """A library built for this GPU's plain arch (sm_90, not sm_90a): no wgmma code, whatever library KDEV_LIB names
    for the other tests."""
    major, minor = torch.cuda.get_device_capability()
    res = kbuild.build(config.load_build(None, [f"sm_{major}{minor}"]))
    assert not res.problems, res.problems
    return abi.Library(res.library)


def test_the_rung_runs_where_there_is_wgmma_and_a_plain_library_says_it_has_none(lib90a, plain_lib):
    assert kceilings.measure_wgmma_peak(lib90a, torch.device("cuda")) > 0
    assert kceilings.measure_wgmma_peak(plain_lib, torch.device("cuda")) is None  # sm_90 code: no wgmma
    q = torch.zeros(64, 576, device="cuda", dtype=torch.bfloat16)
    assert _check(plain_lib, q, q)[0] == cabi.ERR_UNSUPPORTED


def test_flash_wgmma_passes_the_smoke_suite_and_a_fuzz_run(lib90a):
    """The flash call with its full tiles by wgmma (kdtree_verify_attn_flash_wgmma), checked as every verify kernel is:
    against the float64 goldens and fresh random cases, NaN-poisoned outputs, the same bits on a repeat."""
    from typer.testing import CliRunner

    from kdev.cli import app

    for args in (["--suite", "smoke", "--repeat", "2"], ["--fuzz", "100"]):
        r = CliRunner().invoke(app, ["verify", *args, "--kernel", "naive,flash,flash-wgmma", "--library",
                                     str(lib90a.path)])
        assert r.exit_code == 0, r.output


def test_flash_wgmma_in_a_library_without_it_says_unsupported(plain_lib):
    from kdev import cases

    case = cases.generate_case(config.load_suite("smoke").cases[3])
    x = abi.VerifyInputs.from_case(case.tensors, case.scale, "cuda")
    with pytest.raises(abi.KernelError) as e:
        plain_lib.run("flash-wgmma", x)
    assert e.value.status == cabi.ERR_UNSUPPORTED and "sm_90a" in e.value.message


@pytest.mark.parametrize("case_index", [4, 8])  # ddtree-n64-2k; ragged-ddtree (pages of 64: tensor copies)
def test_flash_of_an_sm90a_library_is_the_wgmma_call_even_first_in_a_graph(lib90a, tmp_path, case_index):
    """In a library built for sm_90a the flash call runs its full tiles by wgmma: the bits of flash-wgmma. It asks the
    loaded function's attributes which code it has, which a captured call may do: a second load of the library (a copy
    of the file) makes its very first flash call inside a graph capture."""
    import shutil

    from kdev import cases

    case = cases.generate_case(config.load_suite("smoke").cases[case_index])
    x = abi.VerifyInputs.from_case(case.tensors, case.scale, "cuda")
    want_out, want_lse = lib90a.run("flash-wgmma", x)
    copy = tmp_path / "libkdtree.so"
    shutil.copy(lib90a.path, copy)
    fresh = abi.Library(copy)
    out, lse = fresh.alloc_outputs(x)
    p = fresh.params(x, out, lse)
    ws = fresh.alloc_workspace("flash", p, "cuda")  # noqa: F841  (kept alive for the replay)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            fresh.call("flash", p)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)) and torch.equal(lse, want_lse)
