"""kdev's SGLang backend driven through the real SGLang release's modules, on the CPU (tests/sglang_real/conftest.py).

Real here: ForwardBatch (TARGET_VERIFY) with a real EagleVerifyInput or DFlashVerifyInput, RadixAttention of DeepSeek's
attn_mqa shape (models/deepseek_v2.py:2183: heads, 512 + 64, num_kv_heads 1, v_head_dim 512), MLATokenToKVPool,
ReqToTokenPool, ForwardContext, AttentionBackend (the backend is made by `_sglang_class`, a subclass of it, and its
forward() is the base class's dispatch), KVWriteLoc, and SGLang's Triton kernel `extend_attention_fwd` (run under
TRITON_INTERPRET=1, the interpreter tests/conftest.py sets without a GPU).

Stand-ins, each because the real one cannot run here:
- the fallback backend (`TritonVerifyFallback`): SGLang's TritonAttnBackend cannot be constructed outside a launched
  server (its constructor reads the runtime context a server publishes: "config namespace 'exec' not published"). The
  stand-in is a real AttentionBackend subclass whose TARGET_VERIFY forward calls SGLang's own `extend_attention_fwd`
  with the arguments TritonAttnBackend passes it (triton_backend.py:1007 for the metadata, :1888 for the call);
- CUDA graphs: no GPU here, so capture and replay are driven as the graph runner calls the hooks
  (decode_cuda_graph_runner.py:1400 out_graph(in_capture=True) before capture, :638 in_graph inside it, :1812
  out_graph(view) before each replay, with the view built as build_replay_fb_view does at :170) and the "replay" runs
  the captured forward again on the static buffers, after checking that every tensor kdev's kernel reads is the
  captured one (the same storage), refilled in place;
- kdev's kernel: on CPU tensors torch.ops.kdev runs kdev's float64 reference (kdev/ops.py), which is what the backend's
  call reaches here.

Each output is compared with kdev's float64 reference on inputs this file builds itself (its own page table and tree
bits, not the backend's), and with SGLang's extend_attention_fwd on the same batch. Inputs are fresh random per seed;
the pool's unused rows and each output buffer hold NaN, so a row read that should not be, or an output left unwritten,
fails.
"""

import importlib.metadata
import logging

import numpy as np
import pytest
import torch

from kdev import cabi, ddtree, mla
from kdev.integrations import sglang as kdev_sglang
from kdev.integrations.sglang import backend as kb
from kdev.integrations.sglang import convert

from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.verify_mask import VerifyMask
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context, get_token_to_kv_pool
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.eagle_info import EagleVerifyInput
from sglang.srt.speculative.eagle_utils import TreeMaskMode

from test_sglang_convert import sglang_full_mask

HEADS = 8
SCALE = 0.1352


@pytest.fixture(autouse=True)
def one_rank():
    """What a launched server publishes before any pool write: no decode context parallelism (MLATokenToKVPool's
    set_kv_buffer asks get_parallel().dcp_enabled, set_mla_kv_buffer its attn_dcp_size)."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(dcp_enabled=False, attn_dcp_size=1, attn_dcp_rank=0):
        yield


def test_the_installed_sglang_is_the_pinned_release():
    have = importlib.metadata.version("sglang")
    assert have == kdev_sglang.SGLANG_RELEASE, (
        f"sglang {have} is installed, kdev's backend is written against {kdev_sglang.SGLANG_RELEASE}: re-check "
        "base_attn_backend.py's hooks (init_forward_metadata, *_out_graph, *_in_graph, init_cuda_graph_state, "
        "update_verify_buffers_to_fill_after_draft, the class attributes _sglang_class forwards), "
        "decode_cuda_graph_runner.py's call order, forward_context.get_token_to_kv_pool, MLATokenToKVPool's "
        "set_kv_buffer / set_mla_kv_buffer (KVWriteLoc), EagleVerifyInput / DFlashVerifyInput (draft_token_num, "
        "custom_mask), build_tree_kernel_efficient's FULL_MASK layout, AttentionBackendRegistry in "
        "models/deepseek_common, the sglang.srt.plugins group, and arg_groups/speculative_hook.py's page-size rule; "
        "then set SGLANG_RELEASE")


# ------------------------------------------------------------------------------------------------ the stand-in
class TritonVerifyFallback(AttentionBackend):
    """The fallback (module docstring: why a stand-in): TARGET_VERIFY through SGLang's extend_attention_fwd as
    TritonAttnBackend calls it, every hook call recorded, and state of its own for the wrapper to forward."""

    needs_cpu_seq_lens = False
    data_type = torch.bfloat16
    kv_cache_dtype = torch.bfloat16
    supports_ragged_verify_graph = True  # the wrapper must answer False itself

    def __init__(self, pool, req_to_token, verify_mask=None):
        self.token_to_kv_pool, self.req_to_token = pool, req_to_token
        self.kv_index_translator = object()
        self._verify_mask = verify_mask
        self.calls = []
        self.meta = None
        self.fault = None  # shadow-mode test: a perturbation of kdev's output is planted in the wrapper instead

    @property
    def verify_mask(self):
        return self._verify_mask

    def init_forward_metadata(self, forward_batch):
        self.calls.append("init_forward_metadata")
        self._metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        self.calls.append(f"out_graph(in_capture={in_capture})")
        self._metadata(forward_batch)

    def init_forward_metadata_in_graph(self, forward_batch):
        self.calls.append("in_graph")

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        self.calls.append("init_cuda_graph_state")

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
        self.calls.append("update_verify_buffers_to_fill_after_draft")

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.calls.append("forward_decode")
        return "decode-out"

    def _metadata(self, fb):
        if not fb.forward_mode.is_target_verify():
            return
        spec = fb.spec_info
        T = spec.draft_token_num
        bs = fb.req_pool_indices.shape[0]
        lens = fb.seq_lens.to(torch.int64)
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(lens, 0)
        kv_indices = torch.cat([self.req_to_token[int(r), :int(n)].to(torch.int64)
                                for r, n in zip(fb.req_pool_indices, lens)])
        mask_indptr = torch.zeros(bs + 1, dtype=torch.int64)
        mask_indptr[1:] = torch.cumsum(T * (lens + T), 0)
        self.meta = dict(qo_indptr=torch.arange(0, (bs + 1) * T, T, dtype=torch.int32), kv_indptr=kv_indptr,
                         kv_indices=kv_indices, custom_mask=spec.custom_mask, mask_indptr=mask_indptr, T=T)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if not forward_batch.forward_mode.is_target_verify():
            self.calls.append(f"forward_extend({forward_batch.forward_mode.name})")
            return "extend-out"
        m = self.meta
        if kwargs.get("q_rope") is not None:  # the split call form: q 512 + q_rope 64, k 512 + k_rope 64
            q = torch.cat([q.reshape(-1, layer.tp_q_head_num, 512), kwargs["q_rope"].reshape(-1, layer.tp_q_head_num,
                                                                                           64)], -1)
            k = torch.cat([k.reshape(-1, 1, 512), kwargs["k_rope"].reshape(-1, 1, 64)], -1)
            v = k[..., :512]
        n = q.shape[0] // layer.tp_q_head_num if q.dim() == 2 else q.shape[0]
        # float32 copies: Triton's interpreter reads bf16 tensors as their raw bits (outputs near 1e8), a fault of the
        # interpreter that a GPU run does not have; the values are the bf16 ones, exactly
        f32 = torch.float32
        q = q.reshape(n, layer.tp_q_head_num, 576).to(f32).contiguous()
        o = torch.full((n, layer.tp_q_head_num, 512), float("nan"), dtype=f32)
        pool = self.token_to_kv_pool
        # triton_backend.py:1888: causal is False under a custom mask, True for DFLASH's chain (custom_mask None)
        extend_attention_fwd(q, k.reshape(n, 1, 576).to(f32).contiguous(), v.reshape(n, 1, 512).to(f32).contiguous(),
                             o, pool.get_key_buffer(layer.layer_id).to(f32), pool.get_value_buffer(layer.layer_id).to(f32),
                             m["qo_indptr"], m["kv_indptr"], m["kv_indices"], m["custom_mask"],
                             m["custom_mask"] is None, m["mask_indptr"], m["T"], 1.0, 1.0, layer.scaling)
        return o.to(torch.bfloat16).reshape(n, layer.tp_q_head_num * 512)


# ------------------------------------------------------------------------------------------------ a batch
def chain_tree(T):
    return ddtree.Tree(np.zeros(T, np.int64), np.arange(-1, T - 1, dtype=np.int64), np.arange(T, dtype=np.int64))


class Server:
    """One server's pools (shared by every batch, as a graph's batches share them): the MLA pool of `layers` layers
    (NaN everywhere no test wrote) and req_to_token."""

    def __init__(self, rng, page_size, tokens=4096, layers=2, rows=10, context=600):
        self.rng, self.page_size, self.layers, self.context = rng, page_size, layers, context
        pages = tokens // page_size
        self.pool = MLATokenToKVPool(size=pages * page_size, page_size=page_size, dtype=torch.bfloat16,
                                     kv_lora_rank=512, qk_rope_head_dim=64, layer_num=layers, device="cpu",
                                     enable_memory_saver=False)
        for buf in self.pool.kv_buffer:
            buf.fill_(float("nan"))
        self.req_pool = ReqToTokenPool(rows, context, device="cpu", enable_memory_saver=False)
        self.free_pages = list(rng.permutation(np.arange(1, pages)))  # page 0 never holds a request's row
        self.free_rows = list(rng.permutation(rows))
        self.attn = [RadixAttention(HEADS, 576, SCALE, num_kv_heads=1, layer_id=i, v_head_dim=512)
                     for i in range(layers)]

    def batch(self, bs, T, trees=None, chain=False, max_prefix=200, dflash=False):
        """A TARGET_VERIFY ForwardBatch of bs requests of T nodes with ragged prefixes, the prefix rows written (random
        bf16) and the nodes' slots assigned, as SGLang's prepare_for_verify leaves them."""
        rng, P = self.rng, self.page_size
        if trees is None:
            trees = [chain_tree(T) if chain else ddtree.random_tree(rng, T, rng.integers(0, 1000, T))
                     for _ in range(bs)]
        prefix = [int(rng.integers(0, max_prefix)) for _ in range(bs)]
        rows = [int(self.free_rows.pop()) for _ in range(bs)]
        r2t = self.req_pool.req_to_token
        out_loc, slots_of = [], []
        for L, r in zip(prefix, rows):
            pages = [int(self.free_pages.pop()) for _ in range(-(-(L + T) // P))]
            slots = np.concatenate([p * P + np.arange(P) for p in pages])[: L + T]
            r2t[r, :L + T] = torch.from_numpy(slots.astype(np.int32))
            for buf in self.pool.kv_buffer:
                buf[torch.from_numpy(slots[:L])] = (torch.randn(L, 1, 576) * 0.5).to(torch.bfloat16)
            out_loc.append(slots[L:])
            slots_of.append(slots)
        seq_lens = torch.tensor(prefix, dtype=torch.int64)
        positions = torch.cat([torch.from_numpy(t.positions(L)) for t, L in zip(trees, prefix)])
        mask = None if chain else sglang_full_mask(trees, prefix)[0]
        draft = torch.from_numpy(rng.integers(0, 1000, bs * T))
        if dflash:
            spec = DFlashVerifyInput(draft_token=draft, positions=positions, draft_token_num=T, custom_mask=mask)
        else:
            depth = max(int(t.depths.max()) for t in trees)
            spec = EagleVerifyInput(draft_token=draft, custom_mask=mask, positions=positions,
                                    retrieve_index=torch.arange(bs * T).view(bs, T), retrieve_next_token=None,
                                    retrieve_next_sibling=None, retrieve_cum_len=None, spec_steps=depth,
                                    topk=1 if chain else 4, draft_token_num=T,
                                    capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=sum(prefix),
                                    seq_lens_cpu=seq_lens.clone())
        fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=draft,
                          req_pool_indices=torch.tensor(rows, dtype=torch.int64), seq_lens=seq_lens,
                          out_cache_loc=torch.from_numpy(np.concatenate(out_loc).astype(np.int64)),
                          seq_lens_sum=sum(prefix), seq_lens_cpu=seq_lens.clone(), positions=positions,
                          spec_info=spec)
        fb.kdev_case = dict(trees=trees, prefix=prefix, slots=slots_of, T=T)
        return fb

    def inputs(self, fb, split=False):
        """Fresh q (N, H, 576) and the nodes' latent rows k (N, 1, 576), per layer, in the call form asked for."""
        n = fb.batch_size * fb.kdev_case["T"]
        out = []
        for _ in range(self.layers):
            q = (torch.randn(n, HEADS, 576) * 0.5).to(torch.bfloat16)
            k = (torch.randn(n, 1, 576) * 0.5).to(torch.bfloat16)
            out.append((q, k))
        return out

    def expected(self, fb, layer_id, q):
        """kdev's float64 reference on this file's own inputs (page table from the slots it laid out, tree bits from
        the trees), over the pool as it is now (the nodes' rows written)."""
        c, P = fb.kdev_case, self.page_size
        width = max(len(s) for s in c["slots"])
        table = torch.zeros(len(c["slots"]), -(-width // P), dtype=torch.int32)
        for b, s in enumerate(c["slots"]):
            table[b, :-(-len(s) // P)] = torch.from_numpy((s[::P] // P).astype(np.int32))
        tree_mask = torch.from_numpy(ddtree.batch_tree_mask(c["trees"]).view(np.int64))
        T = c["T"]
        q_indptr = torch.arange(0, (len(c["slots"]) + 1) * T, T, dtype=torch.int32)
        kv = self.pool.get_key_buffer(layer_id).view(-1, P, 576)
        out, _ = mla.reference_verify_attn(q, kv, table, torch.tensor(c["prefix"], dtype=torch.int32), q_indptr,
                                           tree_mask, SCALE)
        return out.reshape(q.shape[0], HEADS * 512)


def make_backend(server, fallback=None, **kw):
    fallback = fallback or TritonVerifyFallback(server.pool, server.req_pool.req_to_token)
    cls = kb._sglang_class()
    return cls(fallback, server.req_pool.req_to_token, server.page_size, server.context, **kw)


def run_layers(server, backend, fb, inputs, split):
    """The model's layers, each calling its RadixAttention as DeepSeek's forward_mla does (forward_mla.py:770 the split
    form with q_rope/k_rope, :792 the concatenated one), inside the ForwardContext the model runner opens
    (model_runner.py:1978)."""
    outs = []
    with forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
        assert get_token_to_kv_pool() is server.pool  # the pool is the backend's, as 0.5.23 reads it
        for attn, (q, k) in zip(server.attn, inputs):
            if split:
                o = attn(q[..., :512], k[..., :512], k[..., :512], fb, q_rope=q[..., 512:], k_rope=k[..., 512:])
            else:
                o = attn(q, k, k[..., :512], fb)
            outs.append(o)
    return outs


def close(got, want, what):
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    err = float((got - want).abs().max())
    assert err <= 2e-2 + 2e-2 * float(want.abs().max()), f"{what}: max |diff| {err}"


def check_against_references(server, backend, fb, inputs, outs):
    for attn, (q, _), o in zip(server.attn, inputs, outs):
        close(o, server.expected(fb, attn.layer_id, q), f"layer {attn.layer_id} vs kdev's float64 reference")
    # SGLang's Triton kernel on the same batch (the KV rows the verify wrote are in the pool)
    backend.fallback._metadata(fb)
    for attn, (q, k), o in zip(server.attn, inputs, outs):
        peer = backend.fallback.forward_extend(q, k, k[..., :512], attn, fb, save_kv_cache=False)
        close(o, peer, f"layer {attn.layer_id} vs SGLang's extend_attention_fwd")


# ------------------------------------------------------------------------------------------------ eager
@pytest.mark.parametrize("kind", ["eagle-tree", "eagle-chain", "dflash-chain"])
@pytest.mark.parametrize("split", [False, True], ids=["concat-576", "split-rope"])
def test_eager_verify_equals_both_references(seed, kind, split):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    server = Server(rng, page_size=1)
    backend = make_backend(server)
    T = int(rng.integers(2, 9))  # small: SGLang's kernel runs in Triton's interpreter (seconds per layer)
    fb = server.batch(int(rng.integers(1, 4)), T, chain=kind != "eagle-tree", dflash=kind == "dflash-chain",
                      max_prefix=120)
    if kind == "dflash-chain":
        assert fb.spec_info.custom_mask is None  # as dflash_worker_v2.py sends it
    inputs = server.inputs(fb)
    # eager_runner.py:328: the model runner's eager extend path calls init_forward_metadata, then the model's forward
    backend.init_forward_metadata(fb)
    assert backend.fallback.calls[-1] == "init_forward_metadata"
    outs = run_layers(server, backend, fb, inputs, split)
    assert backend.stats.verify_layer_calls == server.layers and backend.stats.verify_steps == 1
    check_against_references(server, backend, fb, inputs, outs)


@pytest.mark.parametrize("page_size", [1, 16])
def test_eager_verify_at_larger_pages_and_a_changing_T(seed, page_size):
    """T is each batch's own (spec_info.draft_token_num), not the server's flag: three batches of three sizes on one
    backend; pages of 16 tokens against kdev's reference (SGLang runs trees at page size > 1 only for flashinfer, fa3
    and triton, so with kdev this is a chain's page size)."""
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    server = Server(rng, page_size=page_size)
    backend = make_backend(server)
    for T in (3, 9, 5):
        fb = server.batch(2, T, chain=page_size > 1)
        inputs = server.inputs(fb)
        backend.init_forward_metadata(fb)
        assert backend.batch.max_qlen == T
        outs = run_layers(server, backend, fb, inputs, split=False)
        for attn, (q, _), o in zip(server.attn, inputs, outs):
            close(o, server.expected(fb, attn.layer_id, q), f"T {T}, layer {attn.layer_id}")


# ------------------------------------------------------------------------------------------------ graphs
def replay_view(fb, static, bs):
    """What build_replay_fb_view (decode_cuda_graph_runner.py:170) hands out_graph before a replay: the padded static
    buffers for req_pool_indices / seq_lens (the padding's seq_lens at the fallback's fill value), the live batch's
    spec_info and out_cache_loc."""
    from types import SimpleNamespace

    raw = fb.batch_size
    static["req_pool_indices"][:raw].copy_(fb.req_pool_indices)
    static["req_pool_indices"][raw:bs].fill_(static["pad_row"])
    static["seq_lens"][:raw].copy_(fb.seq_lens)
    static["seq_lens"][raw:bs].fill_(1)
    return SimpleNamespace(batch_size=bs, forward_mode=ForwardMode.TARGET_VERIFY, actual_forward_mode=fb.forward_mode,
                           req_pool_indices=static["req_pool_indices"][:bs], seq_lens=static["seq_lens"][:bs],
                           seq_lens_cpu=static["seq_lens"][:bs].clone(), positions=fb.positions,
                           out_cache_loc=fb.out_cache_loc, spec_info=fb.spec_info)


@pytest.mark.parametrize("split", [False, True], ids=["concat-576", "split-rope"])
def test_capture_then_replay_at_other_batch_sizes_and_lengths(seed, split):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    server = Server(rng, page_size=1, rows=16)
    backend = make_backend(server, max_draft=8)
    T, max_bs = 6, 4
    # model_runner -> graph runner: init_cuda_graph_state once (decode_cuda_graph_runner.py's __init__)
    backend.init_cuda_graph_state(max_bs, max_bs * T)
    static = dict(req_pool_indices=torch.zeros(max_bs, dtype=torch.int64), seq_lens=torch.ones(max_bs, dtype=torch.int64),
                  pad_row=15)
    # capture at bs = max_bs: out_graph(in_capture=True) outside the graph (:1400), then in_graph inside it (:638)
    cap = server.batch(max_bs, T, max_prefix=100)
    view = replay_view(cap, static, max_bs)
    backend.init_forward_metadata_out_graph(view, in_capture=True)
    backend.init_forward_metadata_in_graph(view)
    assert backend.fallback.calls[-2:] == ["out_graph(in_capture=True)", "in_graph"]
    captured = backend.batch
    assert captured.max_kv_len == server.context + 8  # the graph's bound, not this batch's lengths
    run_layers(server, backend, cap, server.inputs(cap), split)
    # replays: other batches (fewer requests, padded to the graph's size; other prefix lengths), out_graph(view) before
    # each (:1812), then the graph's kernels on the same buffers
    for raw in (3, 1, 4):
        fb = server.batch(raw, T, max_prefix=100)
        view = replay_view(fb, static, max_bs)
        backend.init_forward_metadata_out_graph(view)
        assert backend.fallback.calls[-1] == "out_graph(in_capture=False)"
        b = backend.batch
        for name in ("page_table", "prefix_lens", "q_indptr", "tree_mask"):
            assert getattr(b, name).data_ptr() == getattr(captured, name).data_ptr(), f"{name} moved after capture"
        assert b.tree_mask.shape == captured.tree_mask.shape and b.max_kv_len == captured.max_kv_len
        inputs = server.inputs(fb)
        padded = [(torch.cat([q, torch.randn(q.shape[0] // raw * (max_bs - raw) if raw else 0, HEADS,
                                             576).to(q.dtype)]) if raw < max_bs else q,
                   torch.cat([k, torch.zeros(k.shape[0] // raw * (max_bs - raw), 1, 576, dtype=k.dtype)])
                   if raw < max_bs else k) for q, k in inputs]
        # the padded requests' rows are written at slot 0 of the pool (out_cache_loc padded with 0) and discarded
        loc = torch.cat([fb.out_cache_loc, torch.zeros((max_bs - raw) * T, dtype=torch.int64)])
        gfb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=max_bs, input_ids=None,
                           req_pool_indices=view.req_pool_indices, seq_lens=view.seq_lens, out_cache_loc=loc,
                           seq_lens_sum=None, spec_info=fb.spec_info)
        outs = run_layers(server, backend, gfb, padded, split)
        real = [(q[: raw * T], k[: raw * T]) for q, k in padded]
        check_against_references(server, backend, fb, real, [o[: raw * T] for o in outs])


def test_post_draft_update_regathers_the_tree_mask(seed):
    """update_verify_buffers_to_fill_after_draft (eagle_worker_common.py:618): the metadata hook ran on a mask the
    draft had not filled yet; after the draft fills it in place, the update makes kdev's tree bits the filled ones."""
    rng = np.random.default_rng(seed)
    server = Server(rng, page_size=1)
    backend = make_backend(server, max_draft=8)
    backend.init_cuda_graph_state(4, 32)
    fb = server.batch(3, 7)
    filled = fb.spec_info.custom_mask.clone()
    fb.spec_info.custom_mask.fill_(True)  # what the plan stream saw: all True (not a tree)
    backend.init_forward_metadata_out_graph(fb)
    before = backend.batch.tree_mask.clone()
    fb.spec_info.custom_mask.copy_(filled)
    backend.update_verify_buffers_to_fill_after_draft(fb.spec_info, 4)
    want = torch.from_numpy(ddtree.batch_tree_mask(fb.kdev_case["trees"]).view(np.int64))
    assert not torch.equal(before, want)
    assert torch.equal(backend.batch.tree_mask, want)
    assert backend.fallback.calls[-1] == "update_verify_buffers_to_fill_after_draft"


# ------------------------------------------------------------------------------------------------ the wrapper
def test_the_fallbacks_state_reads_through_and_other_modes_are_the_fallbacks(seed):
    rng = np.random.default_rng(seed)
    server = Server(rng, page_size=1)
    mask = VerifyMask(buffer=torch.zeros(64, dtype=torch.bool), mode=TreeMaskMode.FULL_MASK, max_bs=4)
    fallback = TritonVerifyFallback(server.pool, server.req_pool.req_to_token, verify_mask=mask)
    backend = make_backend(server, fallback)
    assert isinstance(backend, AttentionBackend)
    assert backend.verify_mask is mask
    assert backend.needs_cpu_seq_lens is False and backend.kv_index_translator is fallback.kv_index_translator
    assert backend.data_type is torch.bfloat16 and backend.supports_ragged_verify_graph is False
    fallback.forward_metadata = "fallback's"
    assert backend.forward_metadata == "fallback's"
    backend.forward_metadata = None  # eager_runner.py:456 clears it through the backend
    assert fallback.forward_metadata is None
    assert backend.get_cuda_graph_seq_len_fill_value() == 1
    assert "no runner slot" in backend.glue_target_verify_metadata()
    # a QLEN_ONLY mask is not the layout kdev gathers: SGLang then builds FULL_MASK per step
    fallback._verify_mask = VerifyMask(buffer=torch.zeros(8, dtype=torch.bool), mode=TreeMaskMode.QLEN_ONLY, max_bs=4)
    assert backend.verify_mask is None
    # decode and a plain extend reach the fallback through the base class's forward()
    fb = server.batch(1, 3)
    for mode, want in ((ForwardMode.DECODE, "decode-out"), (ForwardMode.EXTEND, "extend-out")):
        fb.forward_mode = mode
        backend.init_forward_metadata(fb)
        assert backend.batch is None
        with forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
            assert server.attn[0](torch.zeros(3, HEADS, 576), torch.zeros(3, 1, 576), torch.zeros(3, 1, 512),
                                  fb) == want
    assert backend.stats.verify_layer_calls == 0


def test_fp8_pool_and_bad_settings_are_refused_in_one_line(seed):
    rng = np.random.default_rng(seed)
    server = Server(rng, page_size=1)
    fp8 = MLATokenToKVPool(size=64, page_size=1, dtype=torch.float8_e4m3fn, kv_lora_rank=512, qk_rope_head_dim=64,
                           layer_num=1, device="cpu", enable_memory_saver=False)
    with pytest.raises(convert.ConversionError, match="bf16 MLA pool.*float8_e4m3fn") as e:
        make_backend(server, TritonVerifyFallback(fp8, server.req_pool.req_to_token))
    assert "\n" not in str(e.value)
    with pytest.raises(convert.ConversionError, match="page_size 3"):
        kb.KdevVerifyBackend(None, server.req_pool.req_to_token, 3, 100)
    with pytest.raises(convert.ConversionError, match="verify kernel 'nope'"):
        make_backend(server, kernel="nope")


def test_the_default_kernel_is_the_device_scheduled_call():
    from kdev import abi

    assert kb.DEFAULT_KERNEL in abi.SCHEDULED_KERNELS
    assert kb.KdevVerifyBackend(None, torch.zeros(1, 8, dtype=torch.int32), 1, 8).kernel == kb.DEFAULT_KERNEL


def test_check_mode_takes_unfilled_prefix_columns_and_refuses_a_non_tree(seed):
    """KDEV_SGLANG_CHECK: a preallocated mask whose prefix columns SGLang never filled (fill_prefix_mask=False,
    eagle_worker_common.py:414) passes; a tree part that is no tree fails, naming the node."""
    rng = np.random.default_rng(seed)
    server = Server(rng, page_size=1)
    backend = make_backend(server, check=True)
    fb = server.batch(2, 6, max_prefix=50)
    c = fb.kdev_case
    m, start = fb.spec_info.custom_mask, 0
    for L, T in zip(c["prefix"], [6, 6]):
        part = m[start:start + T * (L + T)].view(T, L + T)
        part[:, :L] = False  # never filled
        start += T * (L + T)
    backend.init_forward_metadata(fb)
    m[c["prefix"][0] + 1] = True  # the root sees node 1
    with pytest.raises(convert.ConversionError, match="node 0 sees node 1"):
        backend.init_forward_metadata(fb)


# ------------------------------------------------------------------------------------------------ shadow mode
def test_shadow_mode_counts_kdev_calls_and_flags_a_planted_fault(seed, caplog):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    server = Server(rng, page_size=1)
    backend = make_backend(server, shadow=True)
    fb = server.batch(2, 5, max_prefix=60)
    backend.init_forward_metadata(fb)
    with caplog.at_level(logging.INFO, logger="kdev.sglang"):
        run_layers(server, backend, fb, server.inputs(fb), split=False)
    st = backend.stats
    assert st.verify_layer_calls == server.layers and st.shadow_layer_checks == server.layers and st.shadow_flags == 0
    assert set(st.shadow_max_diff) == {0, 1} and max(st.shadow_max_diff.values()) < backend.shadow_tol
    assert sum("kdev shadow: layer" in r.getMessage() for r in caplog.records) == server.layers
    # a fault planted in kdev's output on layer 1: flagged there, and only there
    real = backend.verify_forward

    def faulty(q, k, v, layer, forward_batch, *args, **kwargs):
        out = real(q, k, v, layer, forward_batch, *args, **kwargs)
        if layer.layer_id == 1:
            out = out.clone()
            out[int(rng.integers(0, out.shape[0])), int(rng.integers(0, out.shape[1]))] += 0.5
        return out

    backend.verify_forward = faulty
    fb = server.batch(2, 5, max_prefix=60)
    backend.init_forward_metadata(fb)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kdev.sglang"):
        run_layers(server, backend, fb, server.inputs(fb), split=False)
    assert st.shadow_flags == 1 and st.shadow_max_diff[1] >= 0.4 and st.shadow_max_diff[0] < backend.shadow_tol
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "layer 1" in warned[0] and "over the tolerance" in warned[0]
    assert st.verify_layer_calls == 2 * server.layers


def test_chain_gather_is_the_causal_block():
    req_to_token = torch.arange(40, dtype=torch.int32).view(2, 20)
    b = kb.verify_batch(req_to_token, torch.tensor([1, 0]), torch.tensor([4, 9]), None, 5, 1, 14)
    want = torch.from_numpy(ddtree.batch_tree_mask([chain_tree(5), chain_tree(5)]).view(np.int64))
    assert torch.equal(b.tree_mask, want)
    assert cabi.LATENT_DIM == 512
