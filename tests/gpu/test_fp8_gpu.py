"""An e4m3 KV cache on the GPU before its kernels exist: every verify call is refused before any launch (its params
have no kv_dtype yet), the compaction answers KDTREE_ERR_UNSUPPORTED with kdtree_last_error's words, nothing is
written, and kdev verify reports one line per case and kernel. When a kernel reads an e4m3 cache, this file's refusal tests give way to golden checks."""

import pytest
import torch

from kdev import abi, cabi, registry, vectors, verify

pytestmark = pytest.mark.gpu
KERNELS = [registry.ORACLE, *abi.FLASH_KERNELS]


def _case(index: int = 0):
    suite = vectors.open_suite("fp8")
    entry = suite.cases[index]
    t = suite.load_case(entry)
    return entry, t, abi.VerifyInputs.from_case(t, entry["scale"], "cuda")


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_verify_call_refuses_an_e4m3_cache_before_any_launch(lib, kernel):
    """This library's VerifyAttnParams has no kv_dtype (kdtree.h: it comes with the kernels that read e4m3): the call
    is refused in one line before anything is launched."""
    _, _, x = _case()
    out, lse = lib.alloc_outputs(x)
    with pytest.raises(abi.AbiArgumentError, match="an e4m3 cache, which no verify kernel") as e:
        lib.params(x, out, lse)
    assert "\n" not in str(e.value)
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all() and torch.isnan(lse).all()


def test_the_compaction_refuses_an_e4m3_cache(lib):
    _, t, _ = _case()
    tk = abi.TreeKernels(lib)
    on = {k: v.cuda() for k, v in t.items()}
    kv = on["kv_cache"].clone()
    with pytest.raises(abi.KernelError) as e:
        tk.compact_kv(kv, on["page_table"], on["prefix_lens"], on["accept_nodes"], on["accept_len"])
    assert e.value.status == cabi.ERR_UNSUPPORTED
    assert torch.equal(kv.view(torch.uint8), on["kv_cache"].view(torch.uint8))


def test_kdev_verify_reports_the_refusal_one_line_per_case():
    run = verify.run_suite("fp8", [registry.ORACLE, *abi.FLASH_KERNELS, "compact"], write_ledger=False)
    assert not run.passed
    assert len(run.results) == len(vectors.open_suite("fp8").cases) * (len(abi.FLASH_KERNELS) + 2)
    for r in run.results:  # the compaction by the library's refusal (status 4), the verify calls by kdev's own
        assert not r.passed and ("status 4" in r.error or "no verify kernel" in r.error) and "\n" not in r.error, r
