"""The torch custom ops on CUDA: the library's kernels, the same bits as a direct call, and inside a captured CUDA graph
(replayed on new inputs of the capture's shapes)."""

import pytest
import torch

from kdev import abi, cases, config, ops  # noqa: F401  (ops: importing it registers torch.ops.kdev)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def case():
    return cases.generate_case(config.load_suite("smoke").cases[3])


@pytest.mark.parametrize("kernel", ["flash", "flash-portable", "naive"])
def test_the_op_gives_the_direct_calls_bits_and_replays_in_a_graph(lib, case, kernel):
    x = abi.VerifyInputs.from_case(case.tensors, case.scale, "cuda")
    want_out, want_lse = lib.run(kernel, x)
    bounds = dict(max_qlen=int((x.q_indptr[1:] - x.q_indptr[:-1]).max()),
                  max_kv_len=int((x.q_indptr[1:] - x.q_indptr[:-1] + x.prefix_lens).max()))
    args = (x.q, x.kv_cache, x.page_table, x.prefix_lens, x.q_indptr, x.tree_mask, x.scale, kernel)
    out, lse = torch.ops.kdev.verify_attn(*args, **bounds)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), want_out.view(torch.int16)) and torch.equal(lse, want_lse)
    q = x.q.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.ops.kdev.verify_attn(q, *args[1:], **bounds)  # warm-up outside the capture
        with torch.cuda.graph(graph):
            g_out, g_lse = torch.ops.kdev.verify_attn(q, *args[1:], **bounds)
    g_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out.view(torch.int16), want_out.view(torch.int16)) and torch.equal(g_lse, want_lse)
    q.copy_(torch.randn_like(q, dtype=torch.float32).to(q.dtype))  # new inputs, the same shapes: the graph reads them
    graph.replay()
    x2 = abi.VerifyInputs(q, *args[1:7])
    ref_out, _ = lib.run(kernel, x2)
    torch.cuda.synchronize()
    assert torch.equal(g_out.view(torch.int16), ref_out.view(torch.int16))
