import pytest
import torch

from kdev import config, mla


def _rand(*shape, g):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def test_absorbed_equals_unabsorbed():
    model = config.load_model("kimi-k2.6")
    g = torch.Generator().manual_seed(0)
    N, H, S = 5, 4, 37
    q_nope, q_pe = _rand(N, H, 128, g=g), _rand(N, H, 64, g=g)
    c_kv, k_pe = _rand(S, 512, g=g), _rand(S, 64, g=g)
    w_uk, w_uv = _rand(H, 128, 512, g=g) / 16, _rand(H, 128, 512, g=g) / 16
    q_pos = torch.tensor([30, 31, 31, 32, 33])
    kv_pos = torch.arange(S)
    mask = torch.rand(N, S, generator=g) < 0.7
    mask[:, 0] = True
    o = mla.unabsorbed_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, q_pos, kv_pos, mask, model)
    q, k = mla.absorb(q_nope, q_pe, c_kv, k_pe, w_uk, q_pos, kv_pos, model)
    o_lat, lse = mla.absorbed_attention(q, k, mask, model.softmax_scale)
    o_abs = torch.einsum("hdc,nhc->nhd", w_uv, o_lat)
    rel = (o_abs - o).norm() / o.norm()
    assert rel < 1e-12, rel
    # lse is ln Σ exp(scale·score) over attended keys
    s = torch.einsum("nhd,sd->nhs", q, k) * model.softmax_scale
    want = torch.logsumexp(s.masked_fill(~mask[:, None], float("-inf")), -1)
    assert torch.allclose(lse, want, rtol=0, atol=1e-12)
    # a wrong mask must give a different answer (the test can fail)
    o_bad, _ = mla.absorbed_attention(q, k, torch.ones_like(mask), model.softmax_scale)
    assert (torch.einsum("hdc,nhc->nhd", w_uv, o_bad) - o).norm() / o.norm() > 1e-3


def test_rope_is_a_rotation_and_relative():
    model = config.load_model("kimi-k2.6")
    g = torch.Generator().manual_seed(1)
    x, y = _rand(1, 64, g=g), _rand(1, 64, g=g)
    rx = mla.apply_rope(x, torch.tensor([7]), model)
    assert torch.allclose(rx.norm(), x.norm(), rtol=1e-12)
    # the score depends only on the distance between positions
    a = (mla.apply_rope(x, torch.tensor([10]), model) * mla.apply_rope(y, torch.tensor([3]), model)).sum()
    b = (mla.apply_rope(x, torch.tensor([1010]), model) * mla.apply_rope(y, torch.tensor([1003]), model)).sum()
    assert abs(a - b) < 1e-9


def test_the_interleaved_layout_turns_dims_2i_and_2i_plus_1_together(seed):
    """Written from the definition, not from apply_rope: pair i = (x[2i], x[2i+1]) turns by pos * inv_freq[i], its
    length scaled by YaRN's mscale; the rotate-half layout is the same rotation of the deinterleaved vector."""
    model = config.load_model("deepseek-v3")
    g = torch.Generator().manual_seed(seed)
    x, pos = _rand(5, 3, 64, g=g), torch.tensor([0, 1, 17, 4095, 163839])
    theta = pos.double()[:, None] * mla.yarn_inv_freq(model)[None, :]  # [5, 32]
    c, s_ = theta.cos()[:, None, :], theta.sin()[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    want = torch.stack([a * c - b * s_, a * s_ + b * c], -1).flatten(-2) * mla.yarn_rope_mscale(model)
    got = mla.apply_rope(x, pos, model)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    half = mla.apply_rope(mla.deinterleave(x), pos, model, layout="half")
    assert torch.allclose(mla.interleave(half), want, rtol=0, atol=1e-12)
    assert torch.equal(mla.interleave(mla.deinterleave(x)), x)
    # the layouts are not interchangeable on raw rows: the checkpoints' q_pe / k_pe rotated by halves is another vector
    assert (mla.apply_rope(x, pos, model, layout="half") - want)[1:].abs().max() > 1e-2
    with pytest.raises(ValueError, match="rope layout"):
        mla.apply_rope(x, pos, model, layout="neox")


def test_the_rotation_matches_transformers_deepseek_v3(seed):
    """transformers' own interleaved rotation (where it is installed: the e2e extra), with kdev's YaRN cos/sin."""
    mod = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    model = config.load_model("deepseek-v3")
    g = torch.Generator().manual_seed(seed)
    q, k = _rand(1, 4, 6, 64, g=g), _rand(1, 1, 6, 64, g=g)  # [batch, heads, seq, rope_dim]
    pos = torch.tensor([3, 9, 100, 2047, 4096, 70000])
    theta = pos.double()[:, None] * mla.yarn_inv_freq(model)[None, :]
    emb = torch.cat([theta, theta], -1)[None]
    m = mla.yarn_rope_mscale(model)
    tq, tk = mod.apply_rotary_pos_emb_interleave(q, k, emb.cos() * m, emb.sin() * m)
    # transformers returns the rotated rows in the rotate-half layout (it deinterleaves first)
    assert torch.allclose(tq, mla.deinterleave(mla.apply_rope(q[0].transpose(0, 1), pos, model).transpose(0, 1))[None],
                          atol=1e-12)
    assert torch.allclose(tk[0, 0], mla.deinterleave(mla.apply_rope(k[0, 0], pos, model)), atol=1e-12)


def test_reference_reads_pages_through_the_table(tiny_suites):
    from kdev.cases import generate_case

    spec = config.load_suite("tiny", tiny_suites).cases[0]
    t = generate_case(spec).tensors
    # Rebuild request 1 contiguously and compare with the paged reference.
    b = 1
    L = int(t["prefix_lens"][b])
    r0, r1 = int(t["q_indptr"][b]), int(t["q_indptr"][b + 1])
    k = mla.gather_kv(t["kv_cache"], t["page_table"][b], L + r1 - r0).double()
    assert torch.isfinite(k).all()
    mask = torch.ones(r1 - r0, L + r1 - r0, dtype=torch.bool)
    mask[:, L:] = mla.unpack_tree_mask(t["tree_mask"], slice(r0, r1), r1 - r0)
    out, lse = mla.absorbed_attention(t["q"][r0:r1].double(), k, mask, config.load_model("kimi-k2.6").softmax_scale)
    assert torch.allclose(out.float(), t["out"][r0:r1], rtol=1e-6, atol=1e-6)
    assert torch.allclose(lse, t["lse"][r0:r1], rtol=0, atol=1e-12)
