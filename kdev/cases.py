"""One case of a suite, from its CaseSpec: the inputs of the kernel contract, the trees and drafter distributions, the
accept and compaction goldens, and the float64 attention goldens (mla.py's reference). What a case holds is listed in
kdev/vectors.py.

Inputs are drawn from integer-seeded PCG64 streams and shaped with exact arithmetic only, so they reproduce bit for
bit on any machine. An e4m3 case (CaseSpec.kv_dtype) draws the same rows as its bf16 twin and stores them as SGLang's
fp8 pool does, row / kv_scale rounded to float8 e4m3fn (float32 division, then the cast: both exact IEEE operations),
with kv_scale (float32, [1]) beside the inputs; its goldens are the float64 reference on that dequantized cache. Unowned KV slots (spare pages, the tail of each request's last page) hold NaN, and page-table
entries past a request's last page point at a NaN page: a kernel that reads out of range produces NaN instead of a
plausible number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kdev import cabi, ddtree, mla
from kdev.config import DEFAULT_TOLERANCES, QK_DIM, CaseSpec, Tolerance, Tolerances, load_model


def _normalish(rng: np.random.Generator, shape) -> np.ndarray:
    """Approximately N(0, 1) from four exact float32 uniforms (Irwin-Hall): no transcendental functions,
    so identical on every machine."""
    u = rng.random((4,) + tuple(shape), dtype=np.float32)
    return (u.sum(0, dtype=np.float32) - np.float32(2.0)) * np.float32(1.7320508)


def _bf16(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16)


# The largest |value| _normalish gives (4 uniforms below 1, centred and scaled), and the smallest e4m3 cache scale that
# stores it without saturating at e4m3's largest finite value (448): an e4m3 case's kv_scale is at least this.
NORMALISH_MAX = float(np.float32(2.0) * np.float32(1.7320508))
E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
E4M3_MIN_SCALE = NORMALISH_MAX / E4M3_MAX


# Tolerances of an e4m3 case, derived from the dequantizing kernel's arithmetic (mla.emulate_dequantizing_kernel), not
# tuned. Its dequantization rounds nothing (an e4m3 value is a bf16 value), so against the float64 reference on the
# dequantized cache it rounds where the bf16 kernel does: P to bf16 before P.V (each term off by at most BF16_UNIT of
# p_j |v_j|, so O by at most BF16_UNIT x max |v|, the p_j summing to 1) and O to bf16 (BF16_UNIT of |O| <= max |v|);
# the fp32 product scale x kv_scale and the fp32 multiply of O by kv_scale add 2^-24 each. Per element then
# |out - golden| <= 2 x BF16_UNIT x E4M3_V_MAX, with E4M3_V_MAX the largest |value| the generator's rows take once stored
# (NORMALISH_MAX, rounded up by at most half an e4m3 ulp: 2^-4 relative): out's atol, and no relative bound beside it
# (rtol 0). The cosine bound and lse's bounds are the bf16 kernels' own (DEFAULT_TOLERANCES): the same arithmetic on
# the same kind of values. tests/test_fp8.py holds the emulation to them on every fp8 case and fresh fuzz cases, and
# checks that configs/suites.yaml's fp8 suite states these numbers.
BF16_UNIT = 2.0**-8  # round to nearest: at most half of bf16's 2^-7 ulp, relative
E4M3_V_MAX = NORMALISH_MAX * (1 + 2.0**-4)
E4M3_TOLERANCES = Tolerances(out=Tolerance(atol=2 * BF16_UNIT * E4M3_V_MAX, rtol=0.0,
                                           cos_diff=DEFAULT_TOLERANCES.out.cos_diff),
                             lse=DEFAULT_TOLERANCES.lse)


def _e4m3(x: np.ndarray, kv_scale: float) -> torch.Tensor:
    """float32 values stored as an e4m3 cache with this scale: x / scale in float32, rounded to nearest even (NaN stays
    NaN)."""
    scaled = np.ascontiguousarray(x, dtype=np.float32) / np.float32(kv_scale)
    return torch.from_numpy(scaled).to(torch.float8_e4m3fn)


def cache_bits(kv_cache: torch.Tensor) -> torch.Tensor:
    """A cache's elements as integers of their width (bf16: int16, e4m3: uint8): compared bit for bit, NaN slots too."""
    return kv_cache.view(torch.int16 if kv_cache.element_size() == 2 else torch.uint8)


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


def make_paged_kv(rng: np.random.Generator, lengths: list[int], page_size: int, kv_dtype: str = "bf16",
                  kv_scale: float = 0.0):
    """Shuffled physical pages, random rows where a request owns a slot, NaN everywhere else, stored as kv_dtype (e4m3:
    value / kv_scale). Returns (kv_cache [P, page_size, 576] bf16 or float8_e4m3fn, page_table [B, max_pages] int32)."""
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
    cache = _e4m3(kv, kv_scale) if kv_dtype == "e4m3" else _bf16(kv)
    return cache, torch.from_numpy(page_table)


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
    kv_cache, page_table = make_paged_kv(rng, [L + t for L, t in zip(spec.prefix_lens, T)], spec.page_size,
                                         spec.kv_dtype, spec.kv_scale)
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
    if spec.kv_dtype == "e4m3":
        tensors["kv_scale"] = torch.tensor([spec.kv_scale], dtype=torch.float32)
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
                                         t["q_indptr"].numpy(), t["tree_mask"], inputs.scale, device=device,
                                         kv_scale=kv_scale_of(t))
    tensors = dict(t)
    tensors["out"], tensors["lse"] = out.cpu().to(torch.float32), lse.cpu()
    return CaseData(inputs.spec, tensors, inputs.scale, {"out": out.cpu(), "lse": lse.cpu()})


def kv_scale_of(tensors: dict) -> float | None:
    """An e4m3 case's cache scale, as the kernels take it (float32); None for a bf16 case."""
    return float(tensors["kv_scale"].reshape(-1)[0]) if "kv_scale" in tensors else None


def accept_goldens(rng: np.random.Generator, trees: list, prefix_lens, kv_cache: torch.Tensor,
                   page_table: torch.Tensor) -> dict:
    """Golden outputs of the greedy accept walk and the KV compaction for a case. The target's argmax at a
    node is the token of one of its children 3 times in 4 (so walks go deep), else a random token.
    accept_nodes is padded to [B, T_max] with -1; compact_rows holds, request after request, the rows that
    land in slots prefix_len .. prefix_len + accept_len - 1 after compaction."""
    t_max = max(t.size for t in trees)
    targets, nodes, lens, bonus, rows = [], [], [], [], []
    kv_bits = cache_bits(kv_cache).numpy()
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
        "compact_rows": torch.from_numpy(np.stack(rows)).view(kv_cache.dtype),
    }


def trees_of(tensors: dict) -> list[ddtree.Tree]:
    """The per-request trees of a case, rebuilt from its stored tensors."""
    ind = tensors["q_indptr"].tolist()
    return [ddtree.Tree(tensors["tree_tokens"][a:b].numpy(), tensors["tree_parents"][a:b].numpy(),
                        tensors["tree_depths"][a:b].numpy()) for a, b in zip(ind[:-1], ind[1:])]
