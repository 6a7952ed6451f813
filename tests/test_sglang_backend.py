"""kdev's SGLang backend on the CPU without SGLang installed, with stand-ins for SGLang's objects (the hooks as SGLang
0.5.23 calls them; tests/sglang_real/ drives the same backend through the real 0.5.23 modules, in its own venv): the
verify inputs gathered on the device agree with the
checked conversions; the target-verify forward gives what SGLang's extend attention means (a dense float64 softmax
over each node's prefix and custom-mask columns, written here from that description); a graph's buffers are filled
at capture and refilled in place at replay with other lengths and a padded batch; every other mode goes to the
fallback; register() puts `kdev` in the registry."""

import sys
import types

import numpy as np
import pytest
import torch

from kdev import cabi, ddtree
from kdev.integrations.sglang import backend as kb
from kdev.integrations.sglang import convert

from test_sglang_convert import sglang_full_mask


class Mode:
    def __init__(self, name):
        self.name = name

    def is_target_verify(self):
        return self.name == "target_verify"

    def is_decode(self):
        return self.name == "decode"

    def is_idle(self):
        return False


class Pool:
    """The MLA token pool: one [slots, 1, 576] buffer per layer; SGLang's set_kv_buffer stores cache_k at loc."""

    def __init__(self, slots, layers=1, device="cpu"):
        self.buf = [torch.full((slots, 1, cabi.QK_DIM), float("nan"), dtype=torch.bfloat16, device=device)
                    for _ in range(layers)]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.buf[layer.layer_id][loc.long()] = cache_k.to(torch.bfloat16)

    def set_mla_kv_buffer(self, layer, loc, k_nope, k_rope):
        self.buf[layer.layer_id][loc.long()] = torch.cat([k_nope, k_rope], -1).to(torch.bfloat16)

    def get_key_buffer(self, layer_id):
        return self.buf[layer_id]


class Fallback:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append(name)
            return name
        return record


def make_batch(rng, bs, T, page_size, max_prefix=300, pool_pages=None, width=None, pool_rows=None):
    """bs requests of T-node trees with ragged prefixes, their positions in whole pages of a shuffled pool (a graph's
    batches share one pool and one req_to_token shape: pool_pages, width, pool_rows)."""
    trees = [ddtree.random_tree(rng, T, rng.integers(0, 1000, T)) for _ in range(bs)]
    prefix = [int(rng.integers(0, max_prefix)) for _ in range(bs)]
    need = [-(-(L + T) // page_size) for L in prefix]
    pool_pages = pool_pages or sum(need) + 3
    order = rng.permutation(pool_pages)
    width = width or 2 + max(L + T for L in prefix)
    req_to_token = torch.zeros(pool_rows or bs + 2, width, dtype=torch.int32)
    req_pool_indices = torch.tensor(rng.permutation(pool_rows or bs + 2)[:bs], dtype=torch.int64)
    out_loc, k = [], 0
    for b, (L, n) in enumerate(zip(prefix, need)):
        pages = order[k:k + n]
        k += n
        slots = np.concatenate([p * page_size + np.arange(page_size) for p in pages])[: L + T]
        req_to_token[req_pool_indices[b], : L + T] = torch.from_numpy(slots.astype(np.int32))
        out_loc.append(slots[L:])
    mask, _ = sglang_full_mask(trees, prefix)
    return dict(trees=trees, prefix=prefix, req_to_token=req_to_token, req_pool_indices=req_pool_indices,
                seq_lens=torch.tensor(prefix, dtype=torch.int64), custom_mask=mask,
                out_cache_loc=torch.from_numpy(np.concatenate(out_loc).astype(np.int64)),
                positions=torch.cat([torch.from_numpy(t.positions(L)) for t, L in zip(trees, prefix)]),
                slots=pool_pages * page_size)


@pytest.mark.parametrize("page_size", [1, 64])
def test_the_gathered_inputs_are_the_checked_conversions(seed, page_size):
    rng = np.random.default_rng(seed)
    for _ in range(6):
        bs, T = int(rng.integers(1, 6)), int(rng.integers(1, 80))
        x = make_batch(rng, bs, T, page_size)
        bound = int(x["seq_lens"].max()) + T
        got = kb.verify_batch(x["req_to_token"], x["req_pool_indices"], x["seq_lens"], x["custom_mask"], T, page_size,
                              bound)
        want_mask = torch.from_numpy(ddtree.batch_tree_mask(x["trees"]).view(np.int64))
        assert torch.equal(got.tree_mask, want_mask)
        table = convert.token_slots_to_page_table(x["req_to_token"], x["req_pool_indices"], x["seq_lens"] + T, page_size)
        for b, L in enumerate(x["prefix"]):
            used = -(-(L + T) // page_size)
            assert torch.equal(got.page_table[b, :used], table[b, :used])
        assert got.q_indptr.tolist() == list(range(0, (bs + 1) * T, T)) and got.max_qlen == T
        kb.check_verify_batch(got, x["custom_mask"], x["req_to_token"], x["req_pool_indices"], x["positions"],
                              page_size)
        # the root seeing node 1 is no tree: the gather takes it on trust, the check refuses it
        if T > 1:
            bad = x["custom_mask"].clone()
            bad[x["prefix"][0] + 1] = True
            lie = kb.verify_batch(x["req_to_token"], x["req_pool_indices"], x["seq_lens"], bad, T, page_size, bound)
            assert int(lie.tree_mask[0, 0]) == 0b11
            with pytest.raises(convert.ConversionError, match="node 0 sees node 1"):
                kb.check_verify_batch(lie, bad, x["req_to_token"], x["req_pool_indices"], None, page_size)


def sglang_extend_reference(q, pool_buf, x, T, scale):
    """What SGLang's extend attention computes for target-verify, in float64: node i of request b attends to its
    prefix's rows (req_to_token) and to the tree rows the custom mask allows; values are the rows' 512 latent dims."""
    outs, start = [], 0
    for b, L in enumerate(x["prefix"]):
        r = int(x["req_pool_indices"][b])
        slots = x["req_to_token"][r, : L + T].long()
        keys = pool_buf[slots, 0].double()
        allowed = x["custom_mask"][start: start + T * (L + T)].view(T, L + T)
        start += T * (L + T)
        qs = q[b * T:(b + 1) * T].double()  # [T, H, 576]
        s = torch.einsum("thd,kd->thk", qs, keys) * scale
        s = s.masked_fill(~allowed[:, None, :], float("-inf"))
        outs.append(torch.einsum("thk,kd->thd", torch.softmax(s, -1), keys[:, : cabi.LATENT_DIM]))
    return torch.cat(outs)


def run_verify(backend, x, T, heads, layer, rng, split_rope=False):
    pool = Pool(x["slots"])
    n = len(x["prefix"])
    # the prefix rows were written by earlier forwards
    for b in range(n):
        r, L = int(x["req_pool_indices"][b]), x["prefix"][b]
        pool.buf[0][x["req_to_token"][r, :L].long()] = torch.randn(L, 1, cabi.QK_DIM).to(torch.bfloat16)
    q = torch.randn(n * T, heads, cabi.QK_DIM).to(torch.bfloat16)
    k = torch.randn(n * T, 1, cabi.QK_DIM).to(torch.bfloat16)
    fb = types.SimpleNamespace(forward_mode=Mode("target_verify"), req_pool_indices=x["req_pool_indices"],
                               seq_lens=x["seq_lens"], seq_lens_cpu=x["seq_lens"], positions=x["positions"],
                               spec_info=types.SimpleNamespace(custom_mask=x["custom_mask"], draft_token_num=T),
                               out_cache_loc=x["out_cache_loc"])
    backend.kv_pool = pool  # the server's MLA pool (0.5.23: the backend's, not the batch's)
    if split_rope:
        kwargs = dict(q_rope=q[..., cabi.LATENT_DIM:], k_rope=k[..., cabi.LATENT_DIM:])
        q_in, k_in = q[..., : cabi.LATENT_DIM].reshape(n * T, -1), k[..., : cabi.LATENT_DIM]
    else:
        kwargs, q_in, k_in = {}, q.reshape(n * T, -1), k
    return backend.forward_extend(q_in, k_in, k_in[..., : cabi.LATENT_DIM], layer, fb, **kwargs), q, pool, fb


def test_the_backend_serves_target_verify_and_delegates_every_other_mode(seed):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    heads, T, page_size = 4, 12, 64
    x = make_batch(rng, 3, T, page_size, max_prefix=8)
    layer = types.SimpleNamespace(layer_id=0, tp_q_head_num=heads, scaling=0.1, qk_head_dim=cabi.QK_DIM)
    fallback = Fallback()
    backend = kb.KdevVerifyBackend(fallback, x["req_to_token"], page_size, 4096, T, check=True)
    fb = types.SimpleNamespace(forward_mode=Mode("target_verify"), req_pool_indices=x["req_pool_indices"],
                               seq_lens=x["seq_lens"], seq_lens_cpu=x["seq_lens"], positions=x["positions"],
                               spec_info=types.SimpleNamespace(custom_mask=x["custom_mask"], draft_token_num=T))
    backend.init_forward_metadata(fb)
    assert fallback.calls == ["init_forward_metadata"]  # the fallback keeps its own metadata current
    for split in (False, True):
        out, q, pool, fb = run_verify(backend, x, T, heads, layer, rng, split_rope=split)
        assert out.shape == (3 * T, heads * cabi.LATENT_DIM) and out.dtype == torch.bfloat16
        assert not bool(torch.isnan(pool.buf[0][x["out_cache_loc"]].float()).any())  # the nodes' rows were written
        want = sglang_extend_reference(q, pool.buf[0], x, T, layer.scaling)
        torch.testing.assert_close(out.view(3 * T, heads, -1).double(), want, atol=2e-2, rtol=2e-2)
    # a mutant: the root of request 0 also sees node 1, which is not its ancestor; the root's rows leave SGLang's
    # meaning (the near-uniform attention of a small scale gives node 1 a weight of about 1 / (prefix + 2))
    backend.batch.tree_mask[0, 0] ^= 1 << 1
    flat = types.SimpleNamespace(**{**vars(layer), "scaling": 0.01})
    out_bad, q, pool, _ = run_verify(backend, x, T, heads, flat, rng)
    want = sglang_extend_reference(q, pool.buf[0], x, T, flat.scaling)
    diff = (out_bad.view(3 * T, heads, -1).double() - want).abs().amax(dim=(1, 2))
    assert diff[0] > 5e-2 and diff[1:].max() < 2e-2
    # every other mode is the fallback's
    decode = types.SimpleNamespace(forward_mode=Mode("decode"))
    assert backend.forward_extend(None, None, None, layer, decode) == "forward_extend"
    assert backend.forward_decode(None, None, None, layer, decode) == "forward_decode"
    assert backend.get_cuda_graph_seq_len_fill_value() == "get_cuda_graph_seq_len_fill_value"


def test_a_scheduled_kernel_is_scheduled_once_per_forward_by_its_first_layer(monkeypatch, seed):
    from kdev import ops

    made = []
    real = ops._schedule_bytes
    monkeypatch.setattr(ops, "_schedule_bytes", lambda *a: made.append(a[4]) or real(*a))
    rng = np.random.default_rng(seed)
    heads, T, page_size = 4, 9, 64
    x = make_batch(rng, 2, T, page_size, max_prefix=40)
    backend = kb.KdevVerifyBackend(Fallback(), x["req_to_token"], page_size, 4096, T, kv_pool=Pool(x["slots"], layers=3))
    assert backend.kernel == kb.DEFAULT_KERNEL  # the device-scheduled call
    fb = types.SimpleNamespace(forward_mode=Mode("target_verify"), req_pool_indices=x["req_pool_indices"],
                               seq_lens=x["seq_lens"], seq_lens_cpu=x["seq_lens"], positions=x["positions"],
                               spec_info=types.SimpleNamespace(custom_mask=x["custom_mask"], draft_token_num=T),
                               out_cache_loc=x["out_cache_loc"])
    for forward in range(2):
        backend.init_forward_metadata(fb)
        for layer_id in range(3):
            layer = types.SimpleNamespace(layer_id=layer_id, tp_q_head_num=heads, scaling=0.1)
            q = torch.randn(2 * T, heads * cabi.QK_DIM).to(torch.bfloat16)
            k = torch.randn(2 * T, 1, cabi.QK_DIM).to(torch.bfloat16)
            out = backend.forward_extend(q, k, k[..., : cabi.LATENT_DIM], layer, fb)
            assert out.shape == (2 * T, heads * cabi.LATENT_DIM)
        assert made == [kb.DEFAULT_KERNEL] * (forward + 1)  # layer 0 made it; layers 1 and 2 read it


def test_a_graphs_buffers_are_filled_at_capture_and_refilled_in_place_at_replay(seed):
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    heads, T, page_size, max_bs = 2, 9, 1, 4
    context = 512
    layer = types.SimpleNamespace(layer_id=0, tp_q_head_num=heads, scaling=0.07, qk_head_dim=cabi.QK_DIM)
    cap = make_batch(rng, max_bs, T, page_size, max_prefix=200, pool_pages=4000)
    backend = kb.KdevVerifyBackend(Fallback(), cap["req_to_token"], page_size, context, T)
    backend.init_cuda_graph_state(max_bs, max_bs * T)
    verify = Mode("target_verify")
    backend.init_forward_metadata_out_graph(types.SimpleNamespace(
        forward_mode=verify, req_pool_indices=cap["req_pool_indices"], seq_lens=cap["seq_lens"],
        spec_info=types.SimpleNamespace(custom_mask=cap["custom_mask"], draft_token_num=T)), in_capture=True)
    captured = {k: getattr(backend.batch, k).data_ptr() for k in ("page_table", "prefix_lens", "q_indptr", "tree_mask")}
    assert backend.batch.max_kv_len == context + T  # planned for the longest request, not this one
    for raw_bs in (max_bs, 2):  # other lengths and trees; then a batch padded to the graph's size
        x = make_batch(rng, raw_bs, T, page_size, max_prefix=400, pool_pages=4000)
        backend.req_to_token = x["req_to_token"]  # (the server's table is one tensor; here each batch brings its own)
        pad = max_bs - raw_bs
        idx = torch.cat([x["req_pool_indices"], torch.zeros(pad, dtype=torch.int64)])
        lens = torch.cat([x["seq_lens"], torch.ones(pad, dtype=torch.int64)])
        backend.init_forward_metadata_out_graph(types.SimpleNamespace(
            forward_mode=verify, req_pool_indices=idx, seq_lens=lens,
            spec_info=types.SimpleNamespace(custom_mask=x["custom_mask"], draft_token_num=T)))
        assert {k: getattr(backend.batch, k).data_ptr() for k in captured} == captured  # in place
        out, q, pool, _ = run_verify_padded(backend, x, T, heads, layer, pad)
        want = sglang_extend_reference(q[: raw_bs * T], pool.buf[0], x, T, layer.scaling)
        torch.testing.assert_close(out[: raw_bs * T].view(raw_bs * T, heads, -1).double(), want, atol=2e-2, rtol=2e-2)


def run_verify_padded(backend, x, T, heads, layer, pad):
    """The graph's batch: the real requests then `pad` padded ones (request-pool row 0, length 1, discarded rows)."""
    pool = Pool(x["slots"] + 1)  # the last slot: the padded rows' (no request owns it)
    n = len(x["prefix"])
    pool.buf[0][:] = torch.randn(pool.buf[0].shape).to(torch.bfloat16)  # every slot holds some row (padding reads)
    q = torch.randn((n + pad) * T, heads, cabi.QK_DIM).to(torch.bfloat16)
    k = torch.randn((n + pad) * T, 1, cabi.QK_DIM).to(torch.bfloat16)
    loc = torch.cat([x["out_cache_loc"], torch.full((pad * T,), x["slots"], dtype=torch.int64)])
    fb = types.SimpleNamespace(forward_mode=Mode("target_verify"), out_cache_loc=loc)
    backend.kv_pool = pool
    return backend.forward_extend(q.reshape(-1, heads * cabi.QK_DIM), k, None, layer, fb), q, pool, fb


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(convert.ConversionError, match="power of two"):
        kb.KdevVerifyBackend(Fallback(), torch.zeros(1, 1, dtype=torch.int32), 3, 4096, 8)
    with pytest.raises(convert.ConversionError, match="draft tokens"):
        kb.KdevVerifyBackend(Fallback(), torch.zeros(1, 1, dtype=torch.int32), 64, 4096, 0)
    b = kb.KdevVerifyBackend(Fallback(), torch.zeros(1, 1, dtype=torch.int32), 64, 4096, 4)
    with pytest.raises(convert.ConversionError, match="carries no draft_token_num"):
        b.init_forward_metadata(types.SimpleNamespace(forward_mode=Mode("target_verify"),
                                                      spec_info=types.SimpleNamespace()))


def test_register_puts_kdev_in_sglangs_registry(monkeypatch, seed):
    """Stand-ins for SGLang's registry (ATTENTION_BACKENDS, register_attention_backend) and base class (forward()
    dispatching on the mode), so that this runs without SGLang (tests/sglang_real/ registers into the real ones)."""
    registry = types.ModuleType(kb._REGISTRY_MODULE)
    registry.ATTENTION_BACKENDS = {}

    def register_attention_backend(name):
        def decorator(fn):
            registry.ATTENTION_BACKENDS[name] = fn
            return fn
        return decorator

    registry.register_attention_backend = register_attention_backend
    base = types.ModuleType(kb._BASE_MODULE)

    class AttentionBackend:
        def init_forward_metadata(self, forward_batch):
            raise NotImplementedError()

        def get_cuda_graph_seq_len_fill_value(self):
            raise NotImplementedError()

        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            if forward_batch.forward_mode.is_decode():
                return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
            return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

        def forward_decode(self, *args, **kwargs):
            raise NotImplementedError()

    base.AttentionBackend = AttentionBackend
    server_args = types.ModuleType(kb._SERVER_ARGS_MODULE)
    server_args.ATTENTION_BACKEND_CHOICES = ["triton", "flashinfer"]
    server_args.add_attention_backend_choices = server_args.ATTENTION_BACKEND_CHOICES.extend
    monkeypatch.setitem(sys.modules, kb._REGISTRY_MODULE, registry)
    monkeypatch.setitem(sys.modules, kb._BASE_MODULE, base)
    monkeypatch.setitem(sys.modules, kb._SERVER_ARGS_MODULE, server_args)
    made = Fallback()
    registry.ATTENTION_BACKENDS["triton"] = lambda runner: made
    assert kb.register("triton") == "kdev" and "kdev" in server_args.ATTENTION_BACKEND_CHOICES
    rng = np.random.default_rng(seed)
    T = 5
    x = make_batch(rng, 2, T, 1)
    runner = types.SimpleNamespace(use_mla_backend=True, page_size=1,
                                   req_to_token_pool=types.SimpleNamespace(req_to_token=x["req_to_token"]),
                                   model_config=types.SimpleNamespace(context_len=2048),
                                   server_args=types.SimpleNamespace(speculative_num_draft_tokens=T))
    backend = registry.ATTENTION_BACKENDS["kdev"](runner)
    assert isinstance(backend, AttentionBackend) and backend.fallback is made
    assert backend.get_cuda_graph_seq_len_fill_value() == "get_cuda_graph_seq_len_fill_value"
    decode = types.SimpleNamespace(forward_mode=Mode("decode"))
    assert backend.forward(None, None, None, None, decode) == "forward_decode"  # base.forward -> the fallback's
    layer = types.SimpleNamespace(layer_id=0, tp_q_head_num=2, scaling=0.1, qk_head_dim=cabi.QK_DIM)
    fb = types.SimpleNamespace(forward_mode=Mode("target_verify"), req_pool_indices=x["req_pool_indices"],
                               seq_lens=x["seq_lens"], seq_lens_cpu=x["seq_lens"], positions=x["positions"],
                               spec_info=types.SimpleNamespace(custom_mask=x["custom_mask"], draft_token_num=T))
    backend.init_forward_metadata(fb)
    out, q, pool, fb = run_verify(backend, x, T, 2, layer, rng)
    torch.testing.assert_close(out.view(2 * T, 2, -1).double(),
                               sglang_extend_reference(q, pool.buf[0], x, T, layer.scaling), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="not a registered backend"):
        kb.create(runner, "no-such-backend")
    with pytest.raises(ValueError, match="MLA models only"):
        kb.create(types.SimpleNamespace(use_mla_backend=False), "triton")
