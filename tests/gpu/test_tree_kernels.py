"""GPU DDTree build, greedy accept and KV compaction: exact equality with the reference (kdev/ddtree.py)."""


import numpy as np
import pytest
import torch

from kdev import abi, ddtree

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tk(lib):
    return abi.TreeKernels(lib)


def _build_both(tk, rng, batch, depth, topk, budget, ties, vocab=5000):
    dists = [ddtree.synthetic_drafter(rng, depth, topk, vocab, float(rng.uniform(0.3, 3)), ties) for _ in range(batch)]
    roots = rng.integers(0, vocab, batch)
    prefix = rng.integers(0, 100000, batch)
    ref = [ddtree.build_ddtree(d, budget, int(r)) for d, r in zip(dists, roots)]
    dev = "cuda"
    got = tk.build_ddtree(torch.tensor(np.stack([d.log_probs for d in dists]), device=dev),
                          torch.tensor(np.stack([d.token_ids for d in dists]), dtype=torch.int32, device=dev),
                          torch.tensor(roots, dtype=torch.int32, device=dev),
                          torch.tensor(prefix, dtype=torch.int32, device=dev), budget)
    torch.cuda.synchronize()
    return ref, got, prefix


def _assert_same(ref, got, prefix, label):
    W = got["tree_mask"].shape[2]
    for b, tree in enumerate(ref):
        T = tree.size
        assert int(got["node_count"][b]) == T, label
        assert got["node_tokens"][b, :T].cpu().numpy().tolist() == tree.tokens.tolist(), label
        assert got["parents"][b, :T].cpu().numpy().tolist() == tree.parents.tolist(), label
        assert got["depths"][b, :T].cpu().numpy().tolist() == tree.depths.tolist(), label
        assert got["positions"][b, :T].cpu().numpy().tolist() == tree.positions(int(prefix[b])).tolist(), label
        want_mask = ddtree.tree_mask_rows(tree, W).view(np.int64)
        assert np.array_equal(got["tree_mask"][b, :T].cpu().numpy(), want_mask), label
        assert (got["parents"][b, T:] == -1).all(), label


def test_build_matches_reference_on_fuzzed_distributions_with_ties(tk, seed):
    rng = np.random.default_rng(seed)
    for i in range(40):
        depth = int(rng.integers(1, 16))
        budget = int(rng.integers(1, 300))
        topk = int(min(budget, int(rng.integers(1, 64)) if rng.random() < 0.5 else budget, 1024))
        ties = bool(rng.random() < 0.5)
        ref, got, prefix = _build_both(tk, rng, int(rng.integers(1, 5)), depth, topk, budget, ties)
        _assert_same(ref, got, prefix, f"seed {seed} case {i}: depth {depth} topk {topk} budget {budget} ties {ties}")


def test_a_drafter_of_depth_0_gives_the_root_alone(tk, seed):
    """As the reference: no depth to draft from, a tree of one node (the padding rows as always)."""
    rng = np.random.default_rng(seed)
    ref, got, prefix = _build_both(tk, rng, 3, 0, 4, 16, False)
    assert [t.size for t in ref] == [1, 1, 1]
    _assert_same(ref, got, prefix, f"seed {seed}: depth 0")


def test_build_at_budget_and_depth_limits(tk):
    rng = np.random.default_rng(1234)
    for depth, topk, budget, ties in [(15, 1024, 1024, False), (15, 1024, 1024, True), (15, 2, 1024, True),
                                      (1, 1024, 1024, False), (15, 1, 1024, False)]:
        ref, got, prefix = _build_both(tk, rng, 2, depth, topk, budget, ties, vocab=32000)
        assert max(t.depths.max() for t in ref) <= depth
        _assert_same(ref, got, prefix, f"depth {depth} topk {topk} budget {budget}")


def _accept_inputs(rng, trees, t_max):
    tokens = np.full((len(trees), t_max), -1, np.int32)
    parents = np.full((len(trees), t_max), -1, np.int32)
    target = np.full((len(trees), t_max), -1, np.int32)
    for b, tree in enumerate(trees):
        T = tree.size
        tokens[b, :T], parents[b, :T] = tree.tokens, tree.parents
        children = [[] for _ in range(T)]
        for i in range(1, T):
            children[tree.parents[i]].append(i)
        for i in range(T):
            target[b, i] = (tree.tokens[children[i][rng.integers(len(children[i]))]]
                            if children[i] and rng.random() < 0.9 else rng.integers(0, 50))
    return tokens, parents, target


def test_accept_matches_reference(tk, seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        B, T = int(rng.integers(1, 9)), int(rng.integers(1, 1026))
        trees = [ddtree.random_tree(rng, T, rng.integers(0, 50, T)) if rng.random() < 0.5
                 else ddtree.chain_tree(T, rng.integers(0, 50, T)) for _ in range(B)]
        tokens, parents, target = _accept_inputs(rng, trees, T)
        dev = "cuda"
        acc, length, bonus = tk.accept_greedy(*(torch.tensor(x, device=dev) for x in (tokens, parents)),
                                              torch.full((B,), T, dtype=torch.int32, device=dev),
                                              torch.tensor(target, device=dev))
        for b, tree in enumerate(trees):
            want = ddtree.accept_greedy(tree, target[b])
            n = len(want.nodes)
            assert int(length[b]) == n and int(bonus[b]) == want.bonus_token
            assert acc[b, :n].tolist() == want.nodes.tolist() and (acc[b, n:] == -1).all()


def test_compaction_with_overlap_hazard_and_long_chains(tk):
    """Accepted [0, 2, 3, ...]: slot L+2 is both entry 1's source and entry 2's destination, so a parallel
    copy that writes before every read is done corrupts it; walks longer than the 32-row chunk exercise
    the chunked path."""
    rng = np.random.default_rng(7)
    dev = "cuda"
    for page_size, accepted_lists in [(1, [[0, 2, 3, 5], [0, 1, 2]]), (64, [[0, 3, 4, 9, 10, 11], [0]]),
                                      (64, [list(range(0, 300, 3)), list(range(0, 1025, 2))[:400]])]:
        B = len(accepted_lists)
        L = rng.integers(0, 200, B)
        span = [int(L[b]) + max(a) + 1 for b, a in enumerate(accepted_lists)]
        pages = [-(-s // page_size) for s in span]
        num_pages = sum(pages) + 3
        perm = rng.permutation(num_pages).astype(np.int32)
        table = np.zeros((B, max(pages)), np.int32)
        o = 0
        for b, n in enumerate(pages):
            table[b, :n] = perm[o:o + n]
            o += n
        kv = torch.randn(num_pages, page_size, 576, device=dev).to(torch.bfloat16)
        t_max = max(len(a) for a in accepted_lists)
        acc = np.full((B, t_max), -1, np.int32)
        for b, a in enumerate(accepted_lists):
            acc[b, :len(a)] = a
        want = kv.view(torch.int16).cpu().numpy()
        for b, a in enumerate(accepted_lists):
            want = ddtree.compact_kv(want, table[b], int(L[b]), np.array(a))
        got = kv.clone()
        tk.compact_kv(got, torch.tensor(table, device=dev), torch.tensor(L, dtype=torch.int32, device=dev),
                      torch.tensor(acc, device=dev), torch.tensor([len(a) for a in accepted_lists], dtype=torch.int32,
                                                                 device=dev))
        torch.cuda.synchronize()
        assert np.array_equal(got.view(torch.int16).cpu().numpy(), want)


def test_bad_arguments_return_status(tk):
    dev = "cuda"
    lp = torch.zeros(1, 16, 4, device=dev)  # depth 16 > 15
    ids = torch.zeros(1, 16, 4, dtype=torch.int32, device=dev)
    one = torch.zeros(1, dtype=torch.int32, device=dev)
    with pytest.raises(abi.KernelError, match="depth 16 outside"):
        tk.build_ddtree(lp, ids, one, one, 4)
    with pytest.raises(abi.KernelError, match="budget 2000 outside"):
        tk.build_ddtree(lp[:, :3].contiguous(), ids[:, :3].contiguous(), one, one, 2000)
