"""The torch custom ops on CUDA: the library's kernels, the same bits as a direct call, and inside a captured CUDA graph
(replayed on new inputs of the capture's shapes)."""

import pytest
import torch

from kdev import abi, cases, config, ops  # noqa: F401  (ops: importing it registers torch.ops.kdev)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def case():
    return cases.generate_case(config.load_suite("smoke").cases[3])


@pytest.mark.parametrize("kernel", ["flash-hostplan", "flash-portable-hostplan", "naive"])
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


@pytest.mark.parametrize("kernel", ["flash", "flash-portable"])
def test_one_step_schedule_read_by_several_layers_eagerly_and_in_a_replayed_graph(lib, case, kernel):
    """As an engine makes the call: verify_schedule once (kdev.ops.StepSchedule: by the first layer), then every layer's
    verify_attn with that workspace. Each layer's output has the bits of the call that makes its own schedule; in a
    CUDA graph the schedule kernel is captured with the layers, so a replay after new lengths (a shorter prefix for one
    request, within the capture's bounds) schedules those lengths."""
    x = abi.VerifyInputs.from_case(case.tensors, case.scale, "cuda")
    T = int((x.q_indptr[1:] - x.q_indptr[:-1]).max())
    bounds = dict(max_qlen=T, max_kv_len=int((x.q_indptr[1:] - x.q_indptr[:-1] + x.prefix_lens).max()))
    layers = [torch.randn_like(x.q, dtype=torch.float32).to(x.q.dtype) for _ in range(3)]

    def forward(step, prefix_lens):
        outs = []
        for i, q in enumerate(layers):
            ws = step.workspace(i, prefix_lens, x.q_indptr, q.shape[1], x.kv_cache.shape[1], **bounds)
            outs.append(torch.ops.kdev.verify_attn_with_workspace(q, x.kv_cache, x.page_table, prefix_lens,
                                                                  x.q_indptr, x.tree_mask, x.scale, kernel,
                                                                  bounds["max_qlen"], bounds["max_kv_len"], ws))
        return outs

    def alone(prefix_lens):
        return [lib.run(kernel, abi.VerifyInputs(q, x.kv_cache, x.page_table, prefix_lens, x.q_indptr, x.tree_mask,
                                                 x.scale, **bounds)) for q in layers]

    def same(got, want):
        return all(torch.equal(g[0].view(torch.int16), w[0].view(torch.int16)) and torch.equal(g[1], w[1])
                   for g, w in zip(got, want))

    prefix = x.prefix_lens.clone()
    eager = forward(ops.StepSchedule(kernel), prefix)
    torch.cuda.synchronize()
    assert same(eager, alone(prefix))
    with pytest.raises(abi.AbiArgumentError, match="its schedule was made for"):
        ws = torch.ops.kdev.verify_schedule(prefix, x.q_indptr, layers[0].shape[1], x.kv_cache.shape[1], kernel,
                                            bounds["max_qlen"], bounds["max_kv_len"] + 1)
        torch.ops.kdev.verify_attn_with_workspace(layers[0], x.kv_cache, x.page_table, prefix, x.q_indptr,
                                                  x.tree_mask, x.scale, kernel, bounds["max_qlen"],
                                                  bounds["max_kv_len"], ws)
    graph, step = torch.cuda.CUDAGraph(), ops.StepSchedule(kernel)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        forward(step, prefix)  # warm-up outside the capture
        with torch.cuda.graph(graph):
            captured = forward(step, prefix)
    shorter = prefix.clone()
    shorter[0] = int(prefix[0]) // 3  # the first request's prefix shrinks: other lengths under the same bounds
    assert not torch.equal(shorter, prefix)
    prefix.copy_(shorter)
    for out, lse in captured:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert same(captured, alone(shorter))
