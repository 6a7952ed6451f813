"""The device schedule on the GPU (kernels/flash/schedule.cuh): skewed batches with trees of different sizes, run by the
plain call (the host plan) and by the scheduled calls (kdtree_flash_schedule, then the kernels on its table), at the
batch's own bounds and at larger ones (what a CUDA graph captured for the largest batch replays), each checked against
the naive oracle in NaN-poisoned outputs, and the same bits on a second run."""

import dataclasses

import pytest
import torch

from kdev import abi
from kdev.bench.runners import make_inputs
from kdev.bench.sweeps import Shape
from kdev.compare import compare
from kdev.config import DEFAULT_TOLERANCES
from kdev.verify import pairwise_tolerances

pytestmark = pytest.mark.gpu

SHAPES = [
    # one long request beside short ones, trees of 17, 65 and 129 nodes dealt in turn
    Shape(batch=8, prefix=40000, budget=128, heads=8, page_size=64, tree="ddtree", requests="1x40000+7x1500",
          budgets="16/64/128"),
    # page size 1 (the gathered rows), two long and several short, trees of 65, 2 and 17 nodes
    Shape(batch=6, prefix=20000, budget=64, heads=8, page_size=1, tree="ddtree", requests="2x20000+4x700",
          budgets="64/1/16"),
]


# kernel against the naive kernel (both bf16 outputs, each within the golden tolerance): kdev verify's pairwise rule
PAIRWISE = pairwise_tolerances(DEFAULT_TOLERANCES)


def _close(out, ref_out, lse, ref_lse, name):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"{name}: an output was not written"
    for what, got, want, tol in (("out", out, ref_out, PAIRWISE.out), ("lse", lse, ref_lse, PAIRWISE.lse)):
        c = compare(f"{name} {what}", got, want, tol)
        assert c.passed, f"{c.name}: {c.reason}; worst {c.worst[:2]}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("bounds", ["own", "larger"])
def test_skewed_batches_match_the_oracle_on_every_flash_call(lib, shape, bounds, seed):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch")
    if bounds == "larger":  # a graph captured at a larger batch's bounds replays the call with them
        shape = dataclasses.replace(shape, capture=f"{shape.prefix + 5000}/{shape.budget + 64}")
    x, sizes, prefix = make_inputs(shape, seed, torch.device("cuda"))
    assert (x.max_kv_len > max(L + t for L, t in zip(prefix, sizes))) == (bounds == "larger")
    ref_out, ref_lse = lib.run("naive", x)
    for kernel in abi.FLASH_KERNELS:
        out, lse = lib.run(kernel, x)
        _close(out, ref_out, lse, ref_lse, f"{kernel} {shape.name} bounds {bounds}")
        again, again_lse = lib.run(kernel, x)
        assert torch.equal(out, again) and torch.equal(lse, again_lse), f"{kernel}: not the same bits twice"


def test_a_scheduled_call_on_a_workspace_never_scheduled_writes_nothing(lib, seed):
    """The scheduled kernels read their work only from a schedule stamped for this call's shapes: on a NaN workspace
    they find none, so the NaN-poisoned outputs stay NaN (and nothing is written from garbage), and the call succeeds."""
    import ctypes

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch")
    x, sizes, _ = make_inputs(SHAPES[0], seed, torch.device("cuda"))
    out, lse = lib.alloc_outputs(x)
    p = lib.params(x, out, lse)
    ws = lib.alloc_workspace("flash", p, x.q.device)  # NaN-filled
    fn = abi.VERIFY_KERNELS["flash"]  # the call alone, without kdtree_flash_schedule before it
    lib._status(fn, getattr(lib.lib, fn)(ctypes.byref(p), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)))
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all() and torch.isnan(lse).all()
    del ws
