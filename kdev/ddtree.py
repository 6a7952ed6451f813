"""DDTree reference: tree build (best-first heap), masks and positions, greedy accept, KV compaction.

A drafter gives, for each depth d = 1..D, the top-K log-probs lp[d-1, :] (sorted, best first) and their
token ids. A tree node is a path of ranks (r_1, ..., r_d); its score is Σ lp[i-1, r_i]. The build pops
the best entry of a heap seeded with (depth 1, rank 0), emits it as the next node (so a parent's index
is always below its children's), then pushes its next sibling (same parent, rank + 1) and its first
child (depth + 1, rank 0); it stops after N (the budget) nodes. Ties break on the rank path
(lexicographically smaller first), then on the parent index. Node 0 is the root (last round's bonus
token), so a tree has T = 1 + N rows.

Scores are float64 sums of float32 log-probs in path order, which is exactly what a GPU build must do
to break ties the same way.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from kdev import cabi
from kdev.config import MAX_DEPTH


@dataclass(frozen=True)
class DrafterDist:
    """Per-depth top-K log-probs [D, K] float32 (descending per row) and token ids [D, K] int64."""

    log_probs: np.ndarray
    token_ids: np.ndarray

    @property
    def depth(self) -> int:
        return self.log_probs.shape[0]

    @property
    def topk(self) -> int:
        return self.log_probs.shape[1]


@dataclass(frozen=True)
class Tree:
    """One request's draft tree; index 0 is the root. parents[0] = -1, depths[0] = 0."""

    tokens: np.ndarray  # [T] int64
    parents: np.ndarray  # [T] int64
    depths: np.ndarray  # [T] int64

    @property
    def size(self) -> int:
        return len(self.tokens)

    def positions(self, prefix_len: int) -> np.ndarray:
        """Position ids: siblings share one; the root sits right after the prefix."""
        return prefix_len + self.depths

    def ancestors(self, i: int) -> list[int]:
        """Ancestor-or-self set of node i, root first."""
        path = []
        while i >= 0:
            path.append(i)
            i = int(self.parents[i])
        return path[::-1]


# ------------------------------------------------------------------------------ synthetic drafter
def synthetic_drafter(rng: np.random.Generator, depth: int, topk: int, vocab: int, sharpness: float = 1.0,
                      ties: bool = False) -> DrafterDist:
    """Per-depth log-softmax over a vocabulary of random logits (std = sharpness: larger is more peaked),
    top-K kept. Log-probs are snapped to a grid of 2^-12 (2^-3 with ties=True, which makes many exactly
    equal scores) so that they are exact in float32, sums of them are exact in float64, and the values
    reproduce bit for bit on any machine."""
    if not 0 <= depth <= MAX_DEPTH:  # 0: a drafter that proposes nothing (the tree is its root)
        raise ValueError(f"depth {depth} outside 0..{MAX_DEPTH}")
    topk = min(topk, vocab)
    grid = 8.0 if ties else 4096.0
    lps, ids = [], []
    for _ in range(depth):
        logits = rng.standard_normal(vocab) * sharpness
        logz = np.log(np.exp(logits - logits.max()).sum()) + logits.max()
        order = np.argsort(-logits, kind="stable")[:topk]
        lp = np.round((logits[order] - logz) * grid) / grid
        lp = np.minimum(lp, 0.0)
        # Rounding may reorder nothing (monotone), but make the descending order explicit and stable.
        o2 = np.argsort(-lp, kind="stable")
        lps.append(lp[o2])
        ids.append(order[o2])
    if not depth:
        return DrafterDist(np.zeros((0, topk), np.float32), np.zeros((0, topk), np.int64))
    return DrafterDist(np.stack(lps).astype(np.float32), np.stack(ids).astype(np.int64))


# ------------------------------------------------------------------------------------------ building
def build_ddtree(dist: DrafterDist, budget: int, root_token: int = 0) -> Tree:
    """Best-first DDTree build under a node budget (see the module docstring)."""
    lp = dist.log_probs.astype(np.float64)
    D, K = lp.shape
    tokens, parents, depths = [root_token], [-1], [0]
    node_scores = [0.0]
    # heap entry: (-score, rank path, parent index)
    heap = [(-lp[0, 0], (0,), 0)] if D and K else []  # no drafter depth: the root alone
    while heap and len(tokens) - 1 < budget:
        neg, path, parent = heapq.heappop(heap)
        idx = len(tokens)
        d, r = len(path), path[-1]
        tokens.append(int(dist.token_ids[d - 1, r]))
        parents.append(parent)
        depths.append(d)
        node_scores.append(-neg)
        if r + 1 < K:
            heapq.heappush(heap, (-(node_scores[parent] + lp[d - 1, r + 1]), path[:-1] + (r + 1,), parent))
        if d < D:
            heapq.heappush(heap, (-(node_scores[idx] + lp[d, 0]), path + (0,), idx))
    return Tree(np.array(tokens, np.int64), np.array(parents, np.int64), np.array(depths, np.int64))


def chain_tree(nodes: int, tokens: np.ndarray) -> Tree:
    return Tree(tokens.astype(np.int64), np.arange(-1, nodes - 1, dtype=np.int64), np.arange(nodes, dtype=np.int64))


def star_tree(nodes: int, tokens: np.ndarray) -> Tree:
    parents = np.zeros(nodes, np.int64)
    parents[0] = -1
    depths = np.ones(nodes, np.int64)
    depths[0] = 0
    return Tree(tokens.astype(np.int64), parents, depths)


def random_tree(rng: np.random.Generator, nodes: int, tokens: np.ndarray) -> Tree:
    parents = np.full(nodes, -1, np.int64)
    depths = np.zeros(nodes, np.int64)
    for i in range(1, nodes):
        parents[i] = rng.integers(0, i)
        depths[i] = depths[parents[i]] + 1
    return Tree(tokens.astype(np.int64), parents, depths)


# -------------------------------------------------------------------------------------- mask layout
def mask_words(t_max: int) -> int:
    return max(1, (t_max + 63) // 64)


def tree_mask_rows(tree: Tree, words: int) -> np.ndarray:
    """Ancestor-or-self bitmask, [T, words] uint64: bit j of row i set iff node j is on i's root path."""
    T = tree.size
    bits = np.zeros((T, words * 64), dtype=bool)
    for i in range(T):
        p = int(tree.parents[i])
        if p >= 0:
            bits[i] = bits[p]  # parents precede children, so the parent's row is complete
        bits[i, i] = True
    weights = np.uint64(1) << np.arange(64, dtype=np.uint64)
    return (bits.reshape(T, words, 64).astype(np.uint64) * weights).sum(-1, dtype=np.uint64)


def batch_tree_mask(trees: list[Tree]) -> np.ndarray:
    """[N_q, W] uint64 for a batch, W = ceil(T_max / 64), rows in q_indptr order."""
    W = mask_words(max(t.size for t in trees))
    return np.concatenate([tree_mask_rows(t, W) for t in trees], 0)


# ---------------------------------------------------------------------------------- accept, compact
@dataclass(frozen=True)
class Acceptance:
    nodes: np.ndarray  # accepted node indices, root first
    bonus_token: int


def accept_greedy(tree: Tree, target_argmax: np.ndarray) -> Acceptance:
    """From the root, follow the child whose token equals the target's argmax at the current node; the
    first miss ends the walk and the target's argmax there is the bonus token. Children are tried in node
    order (the siblings of one parent carry distinct tokens in a DDTree, so the order matters only for
    trees that repeat tokens)."""
    children: dict[int, list[int]] = {}
    for i in range(1, tree.size):
        children.setdefault(int(tree.parents[i]), []).append(i)
    cur, path = 0, [0]
    while True:
        want = int(target_argmax[cur])
        nxt = next((c for c in children.get(cur, []) if int(tree.tokens[c]) == want), None)
        if nxt is None:
            return Acceptance(np.array(path, np.int64), want)
        path.append(nxt)
        cur = nxt


def compact_kv(kv_cache: np.ndarray, page_table_row: np.ndarray, prefix_len: int, accepted: np.ndarray) -> np.ndarray:
    """Copy accepted node i's row (logical prefix_len + accepted[i]) to logical slot prefix_len + i.
    Sources and destinations overlap, so every source is read before any destination is written.
    Returns a new cache; the input is not modified."""
    out = kv_cache.copy()
    page_size = kv_cache.shape[1]

    def loc(pos):
        page, offset = cabi.kv_page_offset(page_table_row, pos, page_size)
        return int(page), offset

    rows = [kv_cache[loc(prefix_len + int(a))].copy() for a in accepted]
    for i, row in enumerate(rows):
        out[loc(prefix_len + i)] = row
    return out
