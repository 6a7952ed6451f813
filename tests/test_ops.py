"""The torch custom ops on CPU tensors (the reference path CI runs; the CUDA path is tests/gpu): their outputs, their
fake implementations under torch.compile (one node, no graph break), and the CLI's argument checks."""

import numpy as np
import pytest
import torch

from kdev import abi, cases, config, ddtree, mla, ops  # noqa: F401  (ops: importing it registers torch.ops.kdev)


@pytest.fixture(scope="module")
def case():
    return cases.generate_case(config.load_suite("smoke").cases[3])


def _args(case):
    t = case.tensors
    return (t["q"], t["kv_cache"], t["page_table"], t["prefix_lens"], t["q_indptr"], t["tree_mask"], case.scale)


def test_verify_attn_on_cpu_gives_the_golden_outputs(case):
    """Against the case's stored goldens (float64 rounded to float32), not the function the op calls: within the bf16
    rounding of out and the float32 rounding of lse."""
    out, lse = torch.ops.kdev.verify_attn(*_args(case))
    golden_out, golden_lse = case.tensors["out"].double(), case.tensors["lse"].double()
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert ((out.double() - golden_out).abs() <= 2.0**-8 * golden_out.abs() + 1e-30).all()
    assert ((lse.double() - golden_lse).abs() <= 2.0**-23 * golden_lse.abs()).all()
    assert torch.isfinite(out.float()).all() and not torch.equal(out, torch.zeros_like(out))


def test_the_ops_pass_torchs_own_checks(case):
    torch.library.opcheck(torch.ops.kdev.verify_attn.default, _args(case),
                          test_utils=("test_schema", "test_faketensor"))


def test_no_op_gives_an_argument_it_writes_a_default():
    """Torch releases before the pinned one strip a call's trailing default arguments (None among them) and then
    index the written argument past the call's end (IndexError in every call that leaves it out): an argument an op
    writes is one every call passes."""
    names = [n for n in dir(torch.ops.kdev) if not n.startswith("_")]
    written = []
    for name in names:
        packet = getattr(torch.ops.kdev, name)
        if not hasattr(packet, "default"):
            continue
        for arg in packet.default._schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write:
                written.append((name, arg.name))
                assert not arg.has_default_value(), f"{name}: written argument {arg.name} has a default"
    assert ("verify_attn_with_workspace", "workspace") in written and ("compact_kv", "kv_cache") in written


def test_verify_attn_compiles_as_one_node(case):
    def step(q, kv, pt, pl, qi, tm):
        out, lse = torch.ops.kdev.verify_attn(q, kv, pt, pl, qi, tm, case.scale)
        return out.float().sum(-1) + lse

    eager = step(*_args(case)[:-1])
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(*_args(case)[:-1])
    assert torch.equal(eager, compiled)


def test_bad_arguments_are_the_clis_one_line(case):
    args = list(_args(case))
    args[0] = args[0][:, :, :512].contiguous()
    with pytest.raises(abi.AbiArgumentError, match="q: rows are 512 wide, expected 576"):
        torch.ops.kdev.verify_attn(*args)


def test_the_schedule_op_on_cpu_and_a_call_that_reads_it(case):
    """On CPU the reference needs no schedule: verify_schedule gives an empty workspace, and verify_attn with it (a
    scheduled kernel, schedule=False) gives what it gives without one. Its argument checks are the ones a GPU run
    meets first."""
    t = case.tensors
    T = int((t["q_indptr"][1:] - t["q_indptr"][:-1]).max())
    L = int((t["prefix_lens"] + t["q_indptr"][1:] - t["q_indptr"][:-1]).max())
    heads = t["q"].shape[1]
    ws = torch.ops.kdev.verify_schedule(t["prefix_lens"], t["q_indptr"], heads, t["kv_cache"].shape[1],
                                        "flash", T, L)
    assert ws.dtype == torch.uint8 and ws.numel() == 0
    out, lse = torch.ops.kdev.verify_attn_with_workspace(*_args(case), "flash", T, L, ws)
    want_out, want_lse = torch.ops.kdev.verify_attn(*_args(case))
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    torch.library.opcheck(torch.ops.kdev.verify_schedule.default,
                          (t["prefix_lens"], t["q_indptr"], heads, 64, "flash", T, L),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(abi.AbiArgumentError, match="a schedule is made for flash or flash-portable$"):
        torch.ops.kdev.verify_schedule(t["prefix_lens"], t["q_indptr"], heads, 64, "flash-hostplan", T, L)
    with pytest.raises(abi.AbiArgumentError, match="bounds 0 / 70: a schedule needs the call's bounds"):
        torch.ops.kdev.verify_schedule(t["prefix_lens"], t["q_indptr"], heads, 64, "flash", 0, 70)


def test_a_step_schedule_is_made_by_the_first_layer_of_each_forward(monkeypatch, case):
    made = []
    real = ops._schedule_bytes
    monkeypatch.setattr(ops, "_schedule_bytes", lambda *a: made.append(a[2]) or real(*a))
    t = case.tensors
    lens = (t["prefix_lens"], t["q_indptr"])
    step = ops.StepSchedule("flash-portable")
    for forward in range(3):
        for layer in range(4):
            assert step.workspace(layer, *lens, 8, 64, 17, 400) is not None
        assert len(made) == forward + 1  # layer 0 made it, layers 1-3 read it
    step.workspace(1, *lens, 16, 64, 17, 400)  # other heads: a schedule of their own
    assert made == [8, 8, 8, 16] and step.made[0] == 0
    plain = ops.StepSchedule("flash-hostplan")
    assert plain.workspace(0, *lens, 8, 64, 17, 400) is None and len(made) == 4


def test_tree_ops_on_cpu_are_the_reference(seed):
    rng = np.random.default_rng(seed)
    B, depth, topk, budget = 3, 5, 6, 20
    dists = [ddtree.synthetic_drafter(rng, depth, topk, 500) for _ in range(B)]
    roots = torch.tensor(rng.integers(0, 500, B), dtype=torch.int32)
    prefix = torch.tensor(rng.integers(0, 1000, B), dtype=torch.int32)
    lp = torch.from_numpy(np.stack([d.log_probs for d in dists]))
    ids = torch.from_numpy(np.stack([d.token_ids for d in dists])).to(torch.int32)
    tokens, parents, depths, positions, mask, count = torch.ops.kdev.build_ddtree(lp, ids, roots, prefix, budget)
    for b, d in enumerate(dists):
        tree = ddtree.build_ddtree(d, budget, int(roots[b]))
        n = tree.size
        assert int(count[b]) == n and tokens[b, :n].tolist() == tree.tokens.tolist()
        assert parents[b, :n].tolist() == tree.parents.tolist() and (parents[b, n:] == -1).all()
        assert positions[b, :n].tolist() == tree.positions(int(prefix[b])).tolist()
        assert np.array_equal(mask[b, :n].numpy(), ddtree.tree_mask_rows(tree, mask.shape[2]).view(np.int64))
    target = tokens.clone()  # the target agrees with the drafter along each first-child chain
    accepted, length, bonus = torch.ops.kdev.accept_greedy(tokens, parents, count, target)
    for b in range(B):
        n = int(count[b])
        tree = ddtree.Tree(tokens[b, :n].numpy().astype(np.int64), parents[b, :n].numpy().astype(np.int64),
                           depths[b, :n].numpy().astype(np.int64))
        acc = ddtree.accept_greedy(tree, target[b, :n].numpy())
        assert accepted[b, :int(length[b])].tolist() == list(acc.nodes) and int(bonus[b]) == acc.bonus_token


def test_compact_kv_on_cpu_moves_the_accepted_rows(case):
    t = case.tensors
    kv = t["kv_cache"].clone()
    torch.ops.kdev.compact_kv(kv, t["page_table"], t["prefix_lens"], t["accept_nodes"], t["accept_len"])
    ind = t["q_indptr"].tolist()
    for b in range(len(ind) - 1):
        L = int(t["prefix_lens"][b])
        for i in range(int(t["accept_len"][b])):
            dst = mla.gather_kv(kv, t["page_table"][b], L + i + 1)[-1]
            src = mla.gather_kv(t["kv_cache"], t["page_table"][b], L + int(t["accept_nodes"][b, i]) + 1)[-1]
            assert torch.equal(dst.view(torch.int16), src.view(torch.int16))
