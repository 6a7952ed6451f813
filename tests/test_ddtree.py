import itertools

import numpy as np
import pytest

from kdev import ddtree


def _paths_by_brute_force(lp: np.ndarray, budget: int) -> list[tuple]:
    """All rank paths of depth 1..D, ordered by (score desc, path asc), first `budget`."""
    D, K = lp.shape
    lp = lp.astype(np.float64)
    paths = []
    for d in range(1, D + 1):
        for path in itertools.product(range(K), repeat=d):
            s = 0.0
            for i, r in enumerate(path):
                s += lp[i, r]
            paths.append((-s, path))
    paths.sort()
    return [p for _, p in paths[:budget]]


def _rank_paths(tree: ddtree.Tree, dist: ddtree.DrafterDist) -> list[tuple]:
    ranks = {}
    out = []
    for i in range(1, tree.size):
        d = int(tree.depths[i])
        r = int(np.nonzero(dist.token_ids[d - 1] == tree.tokens[i])[0][0])
        path = (ranks[int(tree.parents[i])] if tree.parents[i] > 0 else ()) + (r,)
        ranks[i] = path
        out.append(path)
    return out


@pytest.mark.parametrize("seed,depth,topk,budget,ties", [
    (0, 3, 4, 20, False), (1, 4, 3, 40, False), (2, 3, 5, 30, True), (3, 5, 2, 31, True), (4, 2, 3, 100, False),
])
def test_build_equals_brute_force_top_n(seed, depth, topk, budget, ties):
    rng = np.random.Generator(np.random.PCG64(seed))
    dist = ddtree.synthetic_drafter(rng, depth, topk, vocab=60, sharpness=1.5, ties=ties)
    tree = ddtree.build_ddtree(dist, budget, root_token=7)
    want = _paths_by_brute_force(dist.log_probs, budget)
    assert _rank_paths(tree, dist) == want  # same nodes in the same order
    assert tree.size == 1 + min(budget, sum(topk**d for d in range(1, depth + 1)))
    assert tree.tokens[0] == 7 and tree.parents[0] == -1 and tree.depths[0] == 0
    assert all(tree.parents[i] < i for i in range(1, tree.size))
    assert tree.depths.max() <= depth


def test_ties_exist_and_are_deterministic():
    rng = np.random.Generator(np.random.PCG64(11))
    dist = ddtree.synthetic_drafter(rng, 4, 6, vocab=30, ties=True)
    assert len(np.unique(dist.log_probs)) < dist.log_probs.size  # deliberate equal log-probs
    a = ddtree.build_ddtree(dist, 50)
    b = ddtree.build_ddtree(dist, 50)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.parents, b.parents)


def test_mask_rows_are_ancestor_sets_and_positions():
    rng = np.random.Generator(np.random.PCG64(5))
    tree = ddtree.random_tree(rng, 150, rng.integers(0, 100, 150))
    W = ddtree.mask_words(tree.size)
    assert W == 3
    rows = ddtree.tree_mask_rows(tree, W)
    assert rows.dtype == np.uint64 and rows.shape == (150, 3)
    for i in range(tree.size):
        got = {j for j in range(150) if (int(rows[i, j // 64]) >> (j % 64)) & 1}
        assert got == set(tree.ancestors(i))
    pos = tree.positions(1000)
    assert pos[0] == 1000 and all(pos[i] == pos[tree.parents[i]] + 1 for i in range(1, 150))


def test_accept_greedy_walk_and_bonus():
    # root -> 1 (tok 5) -> 3 (tok 9); root -> 2 (tok 6)
    tree = ddtree.Tree(np.array([0, 5, 6, 9]), np.array([-1, 0, 0, 1]), np.array([0, 1, 1, 2]))
    acc = ddtree.accept_greedy(tree, np.array([5, 9, 0, 42]))
    assert acc.nodes.tolist() == [0, 1, 3] and acc.bonus_token == 42
    acc = ddtree.accept_greedy(tree, np.array([6, 9, 77, 42]))
    assert acc.nodes.tolist() == [0, 2] and acc.bonus_token == 77
    acc = ddtree.accept_greedy(tree, np.array([8, 9, 77, 42]))
    assert acc.nodes.tolist() == [0] and acc.bonus_token == 8


def test_compact_kv_reads_before_writing():
    page_size, L = 4, 3
    kv = np.arange(4 * page_size * 2, dtype=np.float32).reshape(4, page_size, 2)
    page_table = np.array([2, 0, 3, 1])
    # accepted nodes 0, 2, 1: slot L+1 <- node 2's row while node 2's own slot L+2 <- node 1's row (overlap)
    acc = np.array([0, 2, 1])
    out = ddtree.compact_kv(kv, page_table, L, acc)

    def row(c, pos):
        return c[page_table[pos // page_size], pos % page_size]

    for i, a in enumerate(acc):
        assert np.array_equal(row(out, L + i), row(kv, L + a))
    assert np.array_equal(row(out, 0), row(kv, 0))
    # a write-as-you-go copy would have corrupted slot L+2
    naive = kv.copy()
    for i, a in enumerate(acc):
        naive[page_table[(L + i) // page_size], (L + i) % page_size] = row(naive, L + a)
    assert not np.array_equal(row(naive, L + 2), row(kv, L + 1))


def _build_by_next_child(dist: ddtree.DrafterDist, budget: int, root: int) -> ddtree.Tree:
    """The formulation kernels/ddtree.cu runs: the frontier is one candidate per emitted node (its next
    child by rank, since each depth's log-probs are sorted); the best candidate is the highest score, ties
    by the candidate's rank path (a prefix first), then by the parent index."""
    lp = dist.log_probs.astype(np.float64)
    D, K = lp.shape
    score, parent, depth, rank, nxt, tokens = [0.0], [-1], [0], [0], [0], [root]
    cand = [lp[0, 0]]

    def path(n):
        p = [nxt[n]]
        while n > 0:
            p.insert(0, rank[n])
            n = parent[n]
        return p

    def order(n):
        return (-cand[n], path(n), n)

    while len(score) - 1 < budget:
        open_nodes = [n for n in range(len(score)) if cand[n] is not None]
        if not open_nodes:
            break
        P = min(open_nodes, key=order)
        d, r = depth[P] + 1, nxt[P]
        s = score[P] + lp[d - 1, r]
        score.append(s), parent.append(P), depth.append(d), rank.append(r), nxt.append(0)
        tokens.append(int(dist.token_ids[d - 1, r]))
        cand.append(s + lp[d, 0] if d < D else None)
        nxt[P] = r + 1
        cand[P] = score[P] + lp[d - 1, r + 1] if r + 1 < K else None
    return ddtree.Tree(np.array(tokens), np.array(parent), np.array(depth))


@pytest.mark.parametrize("seed", range(6))
def test_next_child_frontier_makes_the_heaps_pops(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        D, K, budget = int(rng.integers(1, 7)), int(rng.integers(1, 10)), int(rng.integers(1, 50))
        dist = ddtree.synthetic_drafter(rng, D, K, 40, float(rng.uniform(0.3, 3.0)), bool(rng.random() < 0.5))
        want = ddtree.build_ddtree(dist, budget, 5)
        got = _build_by_next_child(dist, budget, 5)
        assert got.parents.tolist() == want.parents.tolist()
        assert got.tokens.tolist() == want.tokens.tolist() and got.depths.tolist() == want.depths.tolist()


def test_a_drafter_of_depth_0_gives_the_root_alone():
    dist = ddtree.synthetic_drafter(np.random.default_rng(3), 0, 8, 100)
    tree = ddtree.build_ddtree(dist, budget=16, root_token=42)
    assert tree.tokens.tolist() == [42] and tree.parents.tolist() == [-1] and tree.depths.tolist() == [0]
