"""One case of a suite, from its CaseSpec: the inputs of the kernel contract, the trees and drafter distributions, the
accept and compaction goldens, and the float64 attention goldens (mla.py's reference). What a case holds is listed in
kdev/vectors.py.

Inputs are drawn from integer-seeded PCG64 streams and shaped with exact arithmetic only, so they reproduce bit for
bit on any machine. Unowned KV slots (spare pages, the tail of each request's last page) hold NaN, and page-table
entries past a request's last page point at a NaN page: a kernel that reads out of range produces NaN instead of a
plausible number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kdev import cabi, ddtree, mla
from kdev.config import QK_DIM, CaseSpec, load_model


def _normalish(rng: np.random.Generator, shape) -> np.ndarray:
    """Approximately N(0, 1) from four exact float32 uniforms (Irwin-Hall): no transcendental functions,
    so identical on every machine."""
    u = rng.random((4,) + tuple(shape), dtype=np.float32)
    return (u.sum(0, dtype=np.float32) - np.float32(2.0)) * np.float32(1.7320508)


def _bf16(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16)


@dataclass
class CaseData:
    spec: CaseSpec
    tensors: dict  # name -> torch tensor (CPU), as stored
    scale: float
    golden64: dict  # out and lse before storage rounding

    @property
    def trees_T(self) -> list[int]:
        ind = self.tensors["q_indptr"]
        return [int(ind[b + 1] - ind[b]) for b in range(len(ind) - 1)]


def make_trees(spec: CaseSpec, rng: np.random.Generator):
    """One tree per request (and its drafter distribution for DDTree cases)."""
    trees, dists = [], []
    t = spec.tree
    for _ in spec.prefix_lens:
        if t.kind == "ddtree":
            budget = int(rng.integers(1, t.budget + 1)) if t.ragged else t.budget  # ragged: each its own size
            root = int(rng.integers(0, t.vocab))
            dist = ddtree.synthetic_drafter(rng, t.depth, t.topk, t.vocab, t.sharpness, t.ties)
            trees.append(ddtree.build_ddtree(dist, budget, root))
            dists.append(dist)
        else:
            nodes = int(rng.integers(1, t.nodes + 1)) if t.ragged else t.nodes
            tokens = rng.integers(0, 32000, nodes)
            if t.kind == "chain":
                trees.append(ddtree.chain_tree(nodes, tokens))
            elif t.kind == "star":
                trees.append(ddtree.star_tree(nodes, tokens))
            else:
                trees.append(ddtree.random_tree(rng, nodes, tokens))
    return trees, dists


def make_paged_kv(rng: np.random.Generator, lengths: list[int], page_size: int):
    """Shuffled physical pages, random bf16 rows where a request owns a slot, NaN everywhere else.
    Returns (kv_cache [P, page_size, 576] bf16, page_table [B, max_pages] int32)."""
    pages_needed = [max(1, -(-n // page_size)) for n in lengths]
    spare = max(2, sum(pages_needed) // 8)
    num_pages = sum(pages_needed) + spare
    perm = rng.permutation(num_pages).astype(np.int32)
    nan_page = int(perm[-1])  # a spare page: never owned, all NaN
    max_pages = max(pages_needed)
    page_table = np.full((len(lengths), max_pages), nan_page, np.int32)
    kv = np.full((num_pages, page_size, QK_DIM), np.nan, np.float32)
    nxt = 0
    for b, n in enumerate(lengths):
        own = perm[nxt:nxt + pages_needed[b]]
        nxt += pages_needed[b]
        page_table[b, :len(own)] = own
        rows = _normalish(rng, (n, QK_DIM))
        pos = np.arange(n)
        kv[cabi.kv_page_offset(own, pos, page_size)] = rows
    return _bf16(kv), torch.from_numpy(page_table)


def generate_case(spec: CaseSpec, device: str = "cpu") -> CaseData:
    """A case's inputs (CPU, bit-identical on every machine) and its float64 goldens computed on `device`."""
    return finish_case(generate_inputs(spec), device)


def generate_inputs(spec: CaseSpec) -> "CaseInputs":
    """Everything of a case but the attention goldens: inputs, trees, drafter distributions and the accept
    and compaction goldens. CPU only and picklable, so fuzz runs make these in worker processes."""
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    model = load_model(spec.model)
    trees, dists = make_trees(spec, rng)
    T = [t.size for t in trees]
    q_indptr = np.concatenate([[0], np.cumsum(T)]).astype(np.int32)
    n_q = int(q_indptr[-1])
    q = _bf16(_normalish(rng, (n_q, spec.heads, QK_DIM)))
    kv_cache, page_table = make_paged_kv(rng, [L + t for L, t in zip(spec.prefix_lens, T)], spec.page_size)
    tree_mask = torch.from_numpy(ddtree.batch_tree_mask(trees).view(np.int64))
    tensors = {
        "q": q,
        "kv_cache": kv_cache,
        "page_table": page_table,
        "prefix_lens": torch.tensor(spec.prefix_lens, dtype=torch.int32),
        "q_indptr": torch.from_numpy(q_indptr),
        "tree_mask": tree_mask,
        "tree_tokens": torch.from_numpy(np.concatenate([t.tokens for t in trees])),
        "tree_parents": torch.from_numpy(np.concatenate([t.parents for t in trees])),
        "tree_depths": torch.from_numpy(np.concatenate([t.depths for t in trees])),
        "tree_positions": torch.from_numpy(np.concatenate([t.positions(L) for t, L in zip(trees, spec.prefix_lens)])),
    }
    if dists:
        tensors["drafter_log_probs"] = torch.from_numpy(np.stack([d.log_probs for d in dists]))
        tensors["drafter_token_ids"] = torch.from_numpy(np.stack([d.token_ids for d in dists]))
    # the accept goldens draw from rng after the inputs: the same order as when the goldens came first
    tensors.update(accept_goldens(rng, trees, spec.prefix_lens, kv_cache, page_table))
    return CaseInputs(spec, tensors, model.softmax_scale)


@dataclass
class CaseInputs:
    spec: CaseSpec
    tensors: dict
    scale: float


def finish_case(inputs: CaseInputs, device: str = "cpu") -> CaseData:
    """Add the float64 reference's out and lse (computed on `device`) to a case's inputs."""
    t = inputs.tensors
    out, lse = mla.reference_verify_attn(t["q"], t["kv_cache"], t["page_table"], t["prefix_lens"],
                                         t["q_indptr"].numpy(), t["tree_mask"], inputs.scale, device=device)
    tensors = dict(t)
    tensors["out"], tensors["lse"] = out.cpu().to(torch.float32), lse.cpu()
    return CaseData(inputs.spec, tensors, inputs.scale, {"out": out.cpu(), "lse": lse.cpu()})


def accept_goldens(rng: np.random.Generator, trees: list, prefix_lens, kv_cache: torch.Tensor,
                   page_table: torch.Tensor) -> dict:
    """Golden outputs of the greedy accept walk and the KV compaction for a case. The target's argmax at a
    node is the token of one of its children 3 times in 4 (so walks go deep), else a random token.
    accept_nodes is padded to [B, T_max] with -1; compact_rows holds, request after request, the rows that
    land in slots prefix_len .. prefix_len + accept_len - 1 after compaction."""
    t_max = max(t.size for t in trees)
    targets, nodes, lens, bonus, rows = [], [], [], [], []
    kv_bits = kv_cache.view(torch.int16).numpy()
    for b, tree in enumerate(trees):
        children = [[] for _ in range(tree.size)]
        for i in range(1, tree.size):
            children[int(tree.parents[i])].append(i)
        tgt = np.empty(tree.size, np.int64)
        for i in range(tree.size):
            if children[i] and rng.random() < 0.75:
                tgt[i] = tree.tokens[children[i][int(rng.integers(0, len(children[i])))]]
            else:
                tgt[i] = rng.integers(0, 32000)
        acc = ddtree.accept_greedy(tree, tgt)
        compacted = ddtree.compact_kv(kv_bits, page_table[b].numpy(), int(prefix_lens[b]), acc.nodes)
        page_size = kv_cache.shape[1]
        for i in range(len(acc.nodes)):
            pos = int(prefix_lens[b]) + i
            page, offset = cabi.kv_page_offset(page_table[b], pos, page_size)
            rows.append(compacted[int(page), offset])
        targets.append(tgt)
        nodes.append(np.pad(acc.nodes, (0, t_max - len(acc.nodes)), constant_values=-1))
        lens.append(len(acc.nodes))
        bonus.append(acc.bonus_token)
    return {
        "accept_target": torch.from_numpy(np.concatenate(targets).astype(np.int32)),
        "accept_nodes": torch.from_numpy(np.stack(nodes).astype(np.int32)),
        "accept_len": torch.tensor(lens, dtype=torch.int32),
        "bonus_token": torch.tensor(bonus, dtype=torch.int32),
        "compact_rows": torch.from_numpy(np.stack(rows)).view(torch.bfloat16),
    }


def trees_of(tensors: dict) -> list[ddtree.Tree]:
    """The per-request trees of a case, rebuilt from its stored tensors."""
    ind = tensors["q_indptr"].tolist()
    return [ddtree.Tree(tensors["tree_tokens"][a:b].numpy(), tensors["tree_parents"][a:b].numpy(),
                        tensors["tree_depths"][a:b].numpy()) for a, b in zip(ind[:-1], ind[1:])]
