"""SGLang's target-verify inputs -> kdev's contract: masks built as SGLang builds them (FULL_MASK:
python/sglang/srt/speculative/eagle_utils.py `build_tree_kernel_efficient`, sgl-project/sglang 003ddbce039c) give the
bits kdev's own tree code gives for the same trees; slot tables give page tables; what kdev cannot hold is refused."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from kdev import ddtree
from kdev.integrations import sglang as sg


def sglang_full_mask(trees: list, prefix_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The FULL_MASK layout, written from SGLang's description and not from kdev's code: the buffer is filled with
    True (the prefix columns), then each request's T x T tree cells are written: row i true at column j iff j is on
    the path from the root to i."""
    parts, indptr = [], [0]
    for tree, L in zip(trees, prefix_lens):
        T = tree.size
        part = np.ones((T, L + T), dtype=bool)
        part[:, L:] = False
        for i in range(T):
            j = i
            while j != -1:
                part[i, L + j] = True
                j = int(tree.parents[j])
        parts.append(part.ravel())
        indptr.append(indptr[-1] + T * (L + T))
    return torch.from_numpy(np.concatenate(parts)), torch.tensor(indptr, dtype=torch.int32)


def random_batch(rng, batch: int):
    trees, prefix = [], []
    for _ in range(batch):
        n = int(rng.integers(1, 140))
        kind = rng.integers(0, 3)
        tokens = rng.integers(0, 1000, n)
        trees.append([ddtree.random_tree(rng, n, tokens), ddtree.chain_tree(n, tokens),
                      ddtree.star_tree(n, tokens)][kind])
        prefix.append(int(rng.integers(0, 300)))
    q_indptr = torch.tensor(np.cumsum([0] + [t.size for t in trees]), dtype=torch.int32)
    return trees, prefix, q_indptr


def test_sglang_masks_give_kdevs_tree_bits_and_back(seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        trees, prefix, q_indptr = random_batch(rng, int(rng.integers(1, 6)))
        mask, indptr = sglang_full_mask(trees, prefix)
        got = sg.custom_mask_to_tree_mask(mask, indptr, torch.tensor(prefix), q_indptr)
        want = torch.from_numpy(ddtree.batch_tree_mask(trees).view(np.int64))
        assert torch.equal(got, want)
        back, back_indptr = sg.tree_mask_to_custom_mask(got, torch.tensor(prefix), q_indptr)
        assert torch.equal(back, mask) and torch.equal(back_indptr, indptr)
        positions = torch.cat([torch.from_numpy(t.positions(L)) for t, L in zip(trees, prefix)])
        sg.check_positions(positions, torch.tensor(prefix), q_indptr, got)
        with pytest.raises(sg.ConversionError, match="position"):
            sg.check_positions(positions + (torch.arange(len(positions)) == len(positions) - 1).long(),
                               torch.tensor(prefix), q_indptr, got)


def test_masks_that_are_not_trees_are_refused():
    tokens = np.arange(5)
    tree = ddtree.Tree(tokens, np.array([-1, 0, 0, 1, 1]), np.array([0, 1, 1, 2, 2]))
    mask, indptr = sglang_full_mask([tree], [3])
    q_indptr, prefix = torch.tensor([0, 5]), torch.tensor([3])
    cases = {(3, 1): "does not see prefix position 1",  # a prefix column cleared
             # node 4 (parent 1) also sees node 2, its parent's sibling: read as a child of 2, node 1 is the stranger
             (4, 3 + 2): r"node 4 sees node [12], which is not its ancestor"}
    for (i, col), message in cases.items():
        bad = mask.clone().view(5, 8)
        bad[i, col] = not bool(bad[i, col])
        with pytest.raises(sg.ConversionError, match=message):
            sg.custom_mask_to_tree_mask(bad.flatten(), indptr, prefix, q_indptr)
    bad = mask.clone().view(5, 8)
    bad[3, 3 + 0] = False  # node 3 sees its parent 1 but not the root, 1's parent
    with pytest.raises(sg.ConversionError, match="node 3 does not see its ancestor 0"):
        sg.custom_mask_to_tree_mask(bad.flatten(), indptr, prefix, q_indptr)
    with pytest.raises(sg.ConversionError, match="mask part of 39 entries, expected 5 x"):
        sg.custom_mask_to_tree_mask(mask[:-1], torch.tensor([0, 39]), prefix, q_indptr)


@pytest.mark.parametrize("page_size", [1, 64])
def test_slot_tables_give_page_tables(seed, page_size):
    rng = np.random.default_rng(seed)
    lens = [int(x) for x in rng.integers(1, 700, 5)]
    pages = [-(-n // page_size) for n in lens]
    perm = rng.permutation(sum(pages) + 3)
    tables, at = [], 0
    for p in pages:
        tables.append(perm[at:at + p])
        at += p
    max_ctx = max(lens) + 5
    req_to_token = torch.full((8, max_ctx), -1, dtype=torch.int64)
    pool_rows = [7, 2, 5, 0, 3]
    flat = []
    for b, (n, table) in enumerate(zip(lens, tables)):
        pos = np.arange(n)
        slots = torch.from_numpy(table[pos // page_size] * page_size + pos % page_size)
        req_to_token[pool_rows[b], :n] = slots
        flat.append(slots)
    got = sg.token_slots_to_page_table(req_to_token, torch.tensor(pool_rows), torch.tensor(lens), page_size)
    for b, table in enumerate(tables):
        assert got[b, :len(table)].tolist() == table.tolist()
    kv_indptr = torch.tensor(np.cumsum([0] + lens))
    assert torch.equal(sg.kv_indices_to_page_table(kv_indptr, torch.cat(flat), page_size), got)
    if page_size > 1:
        broken = req_to_token.clone()
        broken[pool_rows[0], 1] += 1  # position 1 no longer in its page's row 1
        with pytest.raises(sg.ConversionError, match="request 0: position 1 .*do not form whole pages"):
            sg.token_slots_to_page_table(broken, torch.tensor(pool_rows), torch.tensor(lens), page_size)
    with pytest.raises(sg.ConversionError, match="page_size 3 is not a power of two"):
        sg.token_slots_to_page_table(req_to_token, torch.tensor(pool_rows), torch.tensor(lens), 3)


def test_the_integration_imports_without_sglang():
    r = subprocess.run([sys.executable, "-c", "import sys; import kdev.integrations.sglang as s; "
                        "from kdev.integrations.sglang import backend; "
                        "assert 'sglang' not in sys.modules; print(s.custom_mask_to_tree_mask.__name__)"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "custom_mask_to_tree_mask", r.stderr
