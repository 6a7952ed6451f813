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
