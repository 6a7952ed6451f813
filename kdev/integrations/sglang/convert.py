"""SGLang's target-verify inputs -> kdev's contract, as pure torch functions (any device; no SGLang import).

SGLang's verify step describes a batch of draft trees with
- a custom mask (TreeMaskMode.FULL_MASK, built by `build_tree_kernel_efficient` in
  python/sglang/srt/speculative/eagle_utils.py, sgl-project/sglang at 003ddbce039c): bool, flattened, request after
  request; request b's part is T_b rows of L_b + T_b columns (its prefix, then its tree nodes), row i true at every
  prefix column and at tree column j iff node j is node i's ancestor or itself; `mask_indptr` holds where each part
  starts (the cumulative T_b * (L_b + T_b));
- token slots: `req_to_token[req_pool_indices[b], pos]` (or a flattened `kv_indices` with `kv_indptr`) is the KV pool
  row of request b's position pos;
- positions: prefix length + the node's depth.
kdev takes the same trees as one bitmask row per node (bit j: node j is an ancestor-or-self) and the KV pool as pages
of page_size rows with a page table. Each conversion refuses what kdev's contract cannot express, in one line
(ConversionError, exit 2 on the command line): a mask that is not a tree, slots that do not form whole pages.
"""

from __future__ import annotations

import torch

from kdev import cabi
from kdev.errors import BadInput


class ConversionError(BadInput):
    """SGLang's inputs describe something kdev's contract cannot hold (named: request, node or position)."""


def _lengths(indptr: torch.Tensor) -> list[int]:
    ind = [int(x) for x in indptr.tolist()]
    return [b - a for a, b in zip(ind[:-1], ind[1:])]


def pack_rows(bits: torch.Tensor, words: int) -> torch.Tensor:
    """[rows, cols] bool -> [rows, words] int64, column j at bit j % 64 of word j // 64. The bits are summed as
    distinct powers of two (bit 63 as -2^63): the sum is the OR, in one reduction, with no host read (the backend
    packs a CUDA graph's tree bits with it)."""
    rows, cols = bits.shape
    padded = torch.zeros(rows, words * 64, dtype=torch.int64, device=bits.device)
    padded[:, :cols] = bits.to(torch.int64)
    weights = torch.ones(64, dtype=torch.int64, device=bits.device) << torch.arange(64, device=bits.device)
    return (padded.view(rows, words, 64) * weights).sum(-1)


def _unpack_rows(words: torch.Tensor, cols: int) -> torch.Tensor:
    """[rows, words] int64 -> [rows, cols] bool."""
    shifts = torch.arange(64, device=words.device, dtype=torch.int64)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(words.shape[0], -1)[:, :cols].bool()


def _check_tree(tree: torch.Tensor, b: int) -> None:
    """tree[i, j]: node i sees node j. A tree: i sees itself and no later node, and i's row is its parent's (the last
    node before it that it sees) with i added; a node that sees no earlier node is a root."""
    T = tree.shape[0]
    eye = torch.eye(T, dtype=torch.bool, device=tree.device)
    if not bool(tree.diagonal().all()):
        i = int((~tree.diagonal()).nonzero()[0])
        raise ConversionError(f"request {b}: node {i} does not see itself (a tree mask row holds its own node)")
    later = torch.triu(tree, diagonal=1)
    if bool(later.any()):
        i, j = (int(x) for x in later.nonzero()[0])
        raise ConversionError(f"request {b}: node {i} sees node {j}, which comes after it (parents precede children)")
    earlier = tree & ~eye
    has_parent = earlier.any(dim=1)
    parent = torch.where(has_parent, T - 1 - earlier.flip(1).int().argmax(dim=1), torch.zeros_like(has_parent,
                                                                                                   dtype=torch.int64))
    expected = torch.where(has_parent.unsqueeze(1), tree[parent] | eye, eye)
    bad = (expected != tree).any(dim=1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        j = int((expected[i] != tree[i]).nonzero()[0])
        what = "sees node {j}, which is not its ancestor" if bool(tree[i, j]) else "does not see its ancestor {j}"
        raise ConversionError(f"request {b}: node {i} " + what.format(j=j) + " (not a tree mask)")


def custom_mask_to_tree_mask(custom_mask: torch.Tensor, mask_indptr: torch.Tensor, prefix_lens: torch.Tensor,
                             q_indptr: torch.Tensor, mask_words: int | None = None,
                             check_prefix: bool = True) -> torch.Tensor:
    """SGLang's flattened FULL_MASK custom mask -> kdev's tree_mask [N_q, mask_words] int64 (ancestor-or-self bits),
    after checking that every prefix column is set (unless check_prefix is False: SGLang leaves a preallocated mask's
    prefix columns unfilled when its backend does not read them, build_tree_kernel_efficient's fill_prefix_mask) and
    that each request's tree part is a tree."""
    T = _lengths(q_indptr)
    L = [int(x) for x in prefix_lens.tolist()]
    starts = [int(x) for x in mask_indptr.tolist()]
    if len(starts) != len(T) + 1 or len(L) != len(T):
        raise ConversionError(f"mask_indptr has {len(starts)} entries, q_indptr {len(T) + 1}, prefix_lens {len(L)}")
    words = mask_words or (max(T, default=1) + 63) // 64
    out = torch.zeros(sum(T), words, dtype=torch.int64, device=custom_mask.device)
    row = 0
    for b, (t, prefix) in enumerate(zip(T, L)):
        size = starts[b + 1] - starts[b]
        if size != t * (prefix + t):
            raise ConversionError(f"request {b}: mask part of {size} entries, expected {t} x ({prefix} + {t})")
        m = custom_mask[starts[b]:starts[b + 1]].view(t, prefix + t).bool()
        if check_prefix and prefix and not bool(m[:, :prefix].all()):
            i, j = (int(x) for x in (~m[:, :prefix]).nonzero()[0])
            raise ConversionError(f"request {b}: node {i} does not see prefix position {j} (kdev's tree nodes attend "
                                  "to the whole prefix)")
        tree = m[:, prefix:]
        _check_tree(tree, b)
        out[row:row + t] = pack_rows(tree, words)
        row += t
    return out


def tree_mask_to_custom_mask(tree_mask: torch.Tensor, prefix_lens: torch.Tensor,
                             q_indptr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kdev's tree_mask -> SGLang's flattened FULL_MASK custom mask and its mask_indptr (int32)."""
    T = _lengths(q_indptr)
    L = [int(x) for x in prefix_lens.tolist()]
    parts, indptr, row = [], [0], 0
    for t, prefix in zip(T, L):
        tree = _unpack_rows(tree_mask[row:row + t], t)
        part = torch.ones(t, prefix + t, dtype=torch.bool, device=tree_mask.device)
        part[:, prefix:] = tree
        parts.append(part.flatten())
        indptr.append(indptr[-1] + t * (prefix + t))
        row += t
    mask = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool, device=tree_mask.device)
    return mask, torch.tensor(indptr, dtype=torch.int32, device=tree_mask.device)


def _slots_to_pages(slots: torch.Tensor, page_size: int, b: int) -> torch.Tensor:
    """One request's slots (pool row of each position) -> its pages, checking that positions k*P .. k*P + P - 1 are
    rows base .. base + P - 1 of one page (base a multiple of P)."""
    n = slots.shape[0]
    if page_size == 1:
        return slots.to(torch.int32)
    pos = torch.arange(n, device=slots.device)
    base = slots[pos - pos % page_size]
    bad = (base % page_size != 0) | (slots != base + pos % page_size)
    if bool(bad.any()):
        p = int(bad.nonzero()[0])
        raise ConversionError(f"request {b}: position {p} is in slot {int(slots[p])}, not row {p % page_size} of a "
                              f"{page_size}-token page (slots do not form whole pages)")
    return (slots[::page_size] // page_size).to(torch.int32)


def _page_table(rows: list[torch.Tensor], device) -> torch.Tensor:
    width = max((r.shape[0] for r in rows), default=1) or 1
    table = torch.zeros(len(rows), width, dtype=torch.int32, device=device)
    for b, r in enumerate(rows):
        table[b, :r.shape[0]] = r
    return table


def token_slots_to_page_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: torch.Tensor,
                              page_size: int) -> torch.Tensor:
    """SGLang's req_to_token table (the rows req_pool_indices name, the first kv_lens[b] positions: prefix + tree) ->
    kdev's page_table [B, max_pages] int32 for a pool of `page_size`-token pages. Unused entries are 0."""
    problem = cabi.page_size_problem(page_size)
    if problem:
        raise ConversionError(problem)
    rows = [_slots_to_pages(req_to_token[int(r), :int(n)], page_size, b)
            for b, (r, n) in enumerate(zip(req_pool_indices.tolist(), kv_lens.tolist()))]
    return _page_table(rows, req_to_token.device)


def kv_indices_to_page_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """A flattened slot list (kv_indices[kv_indptr[b]:kv_indptr[b + 1]]: request b's slots in position order, as
    SGLang's attention backends build it) -> kdev's page_table, as token_slots_to_page_table."""
    problem = cabi.page_size_problem(page_size)
    if problem:
        raise ConversionError(problem)
    ind = [int(x) for x in kv_indptr.tolist()]
    rows = [_slots_to_pages(kv_indices[a:z], page_size, b) for b, (a, z) in enumerate(zip(ind[:-1], ind[1:]))]
    return _page_table(rows, kv_indices.device)


def check_positions(positions: torch.Tensor, prefix_lens: torch.Tensor, q_indptr: torch.Tensor,
                    tree_mask: torch.Tensor) -> None:
    """SGLang's positions must be prefix length + depth (the node's ancestors, itself excluded): kdev places the tree's
    KV rows and RoPE by that rule. Raises ConversionError naming the first node where they differ."""
    T = _lengths(q_indptr)
    bits = _unpack_rows(tree_mask, tree_mask.shape[1] * 64)
    depth = bits.sum(dim=1) - 1
    prefix = torch.repeat_interleave(prefix_lens.to(depth.device, torch.int64),
                                     torch.tensor(T, device=depth.device))
    bad = positions.to(torch.int64) != prefix + depth
    if bool(bad.any()):
        r = int(bad.nonzero()[0])
        raise ConversionError(f"node row {r}: position {int(positions[r])}, expected prefix {int(prefix[r])} + depth "
                              f"{int(depth[r])}")
