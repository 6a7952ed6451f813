"""kdev's SGLang backend on CUDA: the target-verify forward of a synthetic batch (DeepSeek-V3's 16 heads per GPU at
TP 8, 64-token pages, ragged prefixes up to 8K) against SGLang's extend-attention meaning in float64, eagerly and as
a captured CUDA graph replayed on two other batches (other lengths and trees, one padded to the graph's size)."""

import types

import numpy as np
import pytest
import torch

from kdev import cabi
from kdev.integrations.sglang import backend as kb

from test_sglang_backend import Fallback, Mode, Pool, make_batch, sglang_extend_reference

pytestmark = pytest.mark.gpu

HEADS, T, PAGE, MAX_BS, CONTEXT, POOL_PAGES, ROWS = 16, 16, 64, 4, 8192, 700, 8


def batch_on_cuda(rng, bs):
    x = make_batch(rng, bs, T, PAGE, max_prefix=8000, pool_pages=POOL_PAGES, width=CONTEXT + T, pool_rows=ROWS)
    return x, {k: v.cuda() for k, v in x.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("kernel", kb.abi.SCHEDULED_KERNELS)
def test_the_backend_verify_forward_eager_and_in_a_replayed_graph(seed, kernel):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    layer = types.SimpleNamespace(layer_id=0, tp_q_head_num=HEADS, scaling=0.1352, qk_head_dim=cabi.QK_DIM)
    req_to_token = torch.zeros(ROWS, CONTEXT + T, dtype=torch.int32, device="cuda")  # the server's one table
    pool = Pool((POOL_PAGES + 1) * PAGE, device="cuda")  # a page past the batches': padded rows' writes
    pool.buf[0].copy_(torch.randn_like(pool.buf[0], dtype=torch.float32).to(torch.bfloat16))
    backend = kb.KdevVerifyBackend(Fallback(), req_to_token, PAGE, CONTEXT, T, kernel=kernel, kv_pool=pool)
    verify = Mode("target_verify")
    n_rows = MAX_BS * T
    q = torch.empty(n_rows, HEADS * cabi.QK_DIM, dtype=torch.bfloat16, device="cuda")
    k = torch.empty(n_rows, 1, cabi.QK_DIM, dtype=torch.bfloat16, device="cuda")
    loc = torch.empty(n_rows, dtype=torch.int64, device="cuda")
    fb = types.SimpleNamespace(forward_mode=verify, out_cache_loc=loc)

    def load(raw_bs):
        """A new batch into the static tensors: its table rows, q, the nodes' rows and slots (padding after it)."""
        x, xc = batch_on_cuda(rng, raw_bs)
        req_to_token.copy_(xc["req_to_token"])
        pad = MAX_BS - raw_bs
        q.copy_(torch.randn(n_rows, HEADS * cabi.QK_DIM, device="cuda").to(torch.bfloat16))
        k.copy_(torch.randn(n_rows, 1, cabi.QK_DIM, device="cuda").to(torch.bfloat16))
        loc.copy_(torch.cat([xc["out_cache_loc"], torch.full((pad * T,), POOL_PAGES * PAGE, device="cuda")]))
        idx = torch.cat([xc["req_pool_indices"], torch.zeros(pad, dtype=torch.int64, device="cuda")])
        lens = torch.cat([xc["seq_lens"], torch.ones(pad, dtype=torch.int64, device="cuda")])
        return x, xc, idx, lens

    def check(out, x, raw_bs):
        want = sglang_extend_reference(q[: raw_bs * T].view(-1, HEADS, cabi.QK_DIM).cpu(), pool.buf[0].cpu(), x, T,
                                       layer.scaling)
        got = out[: raw_bs * T].view(-1, HEADS, cabi.LATENT_DIM).double().cpu()
        assert not bool(torch.isnan(got).any())
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)

    # eager: the metadata hook, then the forward
    x, xc, idx, lens = load(MAX_BS)
    backend.init_forward_metadata(types.SimpleNamespace(
        forward_mode=verify, req_pool_indices=idx, seq_lens=lens, seq_lens_cpu=lens.cpu(), positions=xc["positions"],
        spec_info=types.SimpleNamespace(custom_mask=xc["custom_mask"], draft_token_num=T)))
    check(backend.forward_extend(q, k, None, layer, fb), x, MAX_BS)
    # a graph: captured on this batch, replayed on two others
    backend.init_cuda_graph_state(MAX_BS, n_rows)
    # SGLang 0.5.23's order: out_graph(in_capture=True) outside the capture, in_graph inside it (the fallback's)
    backend.init_forward_metadata_out_graph(types.SimpleNamespace(
        forward_mode=verify, req_pool_indices=idx, seq_lens=lens,
        spec_info=types.SimpleNamespace(custom_mask=xc["custom_mask"], draft_token_num=T)), in_capture=True)
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        backend.forward_extend(q, k, None, layer, fb)  # warm-up outside the capture
        with torch.cuda.graph(graph):
            out = backend.forward_extend(q, k, None, layer, fb)
    for raw_bs in (MAX_BS, 2):
        x, xc, idx, lens = load(raw_bs)
        backend.init_forward_metadata_out_graph(types.SimpleNamespace(  # before every replay, outside the graph
            forward_mode=verify, req_pool_indices=idx, seq_lens=lens,
            spec_info=types.SimpleNamespace(custom_mask=xc["custom_mask"], draft_token_num=T)))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, x, raw_bs)
