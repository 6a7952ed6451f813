"""Naive oracle and flash kernel on the GPU: golden vectors, fresh random cases against the float64
reference, the split-KV path, determinism, and bad arguments answered with a status."""


import numpy as np
import pytest
import torch

from kdev import abi, cabi, cases, config, vectors
from kdev.compare import compare

pytestmark = pytest.mark.gpu
KERNELS = ["naive", *abi.FLASH_KERNELS]  # flash-portable: the kernels sm_120 runs, on this GPU


def _check(lib, kernel, tensors, scale, tol, label):
    x = abi.VerifyInputs.from_case(tensors, scale, "cuda")
    out, lse = lib.run(kernel, x)
    assert torch.isfinite(out.float()).all(), f"{label}: non-finite output (unwritten or NaN read)"
    c_out = compare("out", out, tensors["out"], tol.out)
    c_lse = compare("lse", lse, tensors["lse"], tol.lse)
    assert c_out.passed, f"{label} out: {c_out.reason}; worst {c_out.worst[:3]}"
    assert c_lse.passed, f"{label} lse: {c_lse.reason}; worst {c_lse.worst[:3]}"
    return out, lse


def _smoke_case(index: int):
    """(suite, manifest entry, tensors, VerifyInputs on the GPU) of one committed smoke case."""
    suite = vectors.open_suite("smoke")
    entry = suite.cases[index]
    t = suite.load_case(entry)
    return suite, entry, t, abi.VerifyInputs.from_case(t, entry["scale"], "cuda")


@pytest.mark.parametrize("kernel", KERNELS)
def test_smoke_goldens(lib, kernel):
    suite = vectors.open_suite("smoke")
    for entry in suite.cases:
        t = suite.load_case(entry)
        _check(lib, kernel, t, entry["scale"], suite.tolerances(entry), f"{kernel}/{entry['name']}")


def test_shared_memory_is_poisoned_before_each_verify_launch(lib, monkeypatch):
    """run() fills every SM's shared memory with NaN first (ABI 7): a kernel reading shared memory it never wrote then
    fails the finite-output check instead of reading what the kernel before left."""
    assert lib.poisons_shared_memory
    lib.poison_shared_memory()
    torch.cuda.synchronize()
    order = []
    poison, call = lib.poison_shared_memory, lib.call
    monkeypatch.setattr(lib, "poison_shared_memory", lambda *a: (order.append("poison"), poison(*a)))
    monkeypatch.setattr(lib, "call", lambda *a, **k: (order.append("launch"), call(*a, **k)))
    _, entry, t, _ = _smoke_case(0)
    _check(lib, "flash", t, entry["scale"], vectors.open_suite("smoke").tolerances(entry), "flash after poisoning")
    assert order == ["poison", "launch"]


def _random_spec(rng, name, max_prefix=6000, max_nodes=160):
    batch = int(rng.integers(1, 5))
    prefix = [int(v) for v in rng.integers(0, max_prefix, batch)]
    if rng.random() < 0.2:
        prefix[0] = 0
    if rng.random() < 0.5:
        nodes = int(rng.integers(1, max_nodes))
        tree = config.TreeSpec("ddtree", budget=nodes, depth=int(rng.integers(1, 16)), topk=min(nodes, 32000),
                               vocab=32000, sharpness=float(rng.uniform(0.5, 3)), ties=bool(rng.random() < 0.3))
    else:
        tree = config.TreeSpec(str(rng.choice(["random", "chain", "star"])), nodes=int(rng.integers(1, max_nodes)))
    return config.CaseSpec(name=name, prefix_lens=tuple(prefix), tree=tree, heads=int(rng.choice([1, 3, 8, 16, 20, 64])),
                           page_size=int(rng.choice([1, 64])), seed=int(rng.integers(0, 2**31)), model="kimi-k2.6",
                           tolerances=config.DEFAULT_TOLERANCES)


@pytest.mark.parametrize("kernel", KERNELS)
def test_fresh_random_cases_against_float64(lib, kernel, seed):
    rng = np.random.default_rng(seed)
    for i in range(12):
        spec = _random_spec(rng, f"r{i}")
        case = cases.generate_case(spec, device="cuda")
        _check(lib, kernel, case.tensors, case.scale, spec.tolerances, f"{kernel} seed={seed} case {i} {spec}")


def test_flash_split_kv_long_prefix_and_determinism(lib, seed):
    spec = config.CaseSpec(name="long", prefix_lens=(40000,), tree=config.TreeSpec("ddtree", budget=64, depth=15,
                           topk=64, vocab=32000), heads=8, page_size=64, seed=seed,
                           model="kimi-k2.6", tolerances=config.DEFAULT_TOLERANCES)
    case = cases.generate_case(spec, device="cuda")
    x = abi.VerifyInputs.from_case(case.tensors, case.scale, "cuda")
    out0, lse0 = lib.alloc_outputs(x)
    assert lib.flash_splits(lib.params(x, out0, lse0)) > 1  # this shape must take the split-KV + combine path
    first, _ = _check(lib, "flash", case.tensors, case.scale, spec.tolerances, f"flash seed={spec.seed}")
    for _ in range(3):
        again, _ = lib.run("flash", x)
        assert torch.equal(again.view(torch.int16), first.view(torch.int16)), "flash output bits changed between runs"


def _check_flash_twice(lib, spec, kernel, split=True):
    """Generate spec's case, check a flash kernel against float64 (taking the split-KV path iff split) and check that
    a second run gives the same output and lse bits."""
    case = cases.generate_case(spec, device="cuda")
    x = abi.VerifyInputs.from_case(case.tensors, case.scale, "cuda")
    out0, lse0 = lib.alloc_outputs(x)
    assert (lib.flash_splits(lib.params(x, out0, lse0)) > 1) == split
    first, first_lse = _check(lib, kernel, case.tensors, case.scale, spec.tolerances, f"{kernel} {spec}")
    again, again_lse = lib.run(kernel, x)
    assert torch.equal(again.view(torch.int16), first.view(torch.int16)), f"{kernel} output bits changed between runs"
    assert torch.equal(again_lse, first_lse)


@pytest.mark.parametrize("kernel", abi.FLASH_KERNELS)
@pytest.mark.parametrize("nodes,heads", [(17, 8), (97, 16), (65, 64)])
def test_flash_split_kv_combine_at_few_and_many_rows(lib, nodes, heads, kernel, seed):
    """136, 1,552 and 4,160 rows, every one split over the KV range: the combine kernel sums each row's splits
    with 4, 2 or 1 groups of threads depending on how many rows there are to fill the GPU (on an H200 these
    three shapes take one form each). Every form must match float64 and give the same bits on every run."""
    spec = config.CaseSpec(name=f"combine-n{nodes}-h{heads}", prefix_lens=(30000,),
                           tree=config.TreeSpec("random", nodes=nodes), heads=heads, page_size=64, seed=seed,
                           model="kimi-k2.6", tolerances=config.DEFAULT_TOLERANCES)
    _check_flash_twice(lib, spec, kernel)


@pytest.mark.parametrize("nodes,heads,splits", [(17, 8, 75), (65, 64, 14), (5, 8, 128)])
def test_flash_portable_with_the_sm120_split_plan(lib, nodes, heads, splits, seed):
    """The RTX PRO 6000's kernels (flash-portable) with its split plan (188 SMs, params.plan_sm_count): at the N16 target
    75 splits (past the 64 a lane's two weights held; the H200 takes 52), at N4 the combine's cap of 128; at H64 14 splits
    in 910 CTAs (the H200: 2). The same plan as kdev plan reports; float64 agreement and the same bits on every run."""
    from kdev import plan as kplan

    spec = config.CaseSpec(name=f"sm120-plan-n{nodes}-h{heads}", prefix_lens=(32768 + 65 - nodes,),
                           tree=config.TreeSpec("random", nodes=nodes), heads=heads, page_size=64, seed=seed,
                           model="kimi-k2.6", tolerances=config.DEFAULT_TOLERANCES)
    target = kplan.resolve_gpu("rtx-pro-6000")
    planned = kplan.PlanLibrary(lib.path).split_plan(1, nodes, heads, nodes, 32768 + 65, 64, target)["splits"]
    assert planned == splits
    lib.plan_as(target.sms)
    try:
        case = cases.generate_case(spec, device="cuda")
        x = abi.VerifyInputs.from_case(case.tensors, case.scale, "cuda")
        out0, lse0 = lib.alloc_outputs(x)
        assert lib.flash_splits(lib.params(x, out0, lse0)) == splits
        _check_flash_twice(lib, spec, "flash-portable")
    finally:
        lib.plan_as(0)


@pytest.mark.parametrize("kernel", abi.FLASH_KERNELS)
@pytest.mark.parametrize("prefix_lens,nodes,page_size,plan", [
    ((30000,), 65, 64, (15, 8)),         # 520 rows: 8 full tiles + 8 rows, both split: two parts of the workspace
    ((20000, 9000, 31000), 17, 64, (17, 9)),  # 136 rows per request, ragged prefixes: the short ones' last narrow
                                         # splits are empty ranges
    ((30000,), 2, 64, (1, 118)),         # 16 rows: the whole request one narrow tile; the combine merges its rows only
    ((5000, 300), 1, 1, (1, 20)),        # 8 rows at page size 1 (cp.async)
    ((300, 280, 120), 65, 64, (2, 1)),   # full tiles split, narrow ones not: the narrow kernel writes its rows itself
    ((200, 90), 2, 64, (1, 1)),          # too short to split: the narrow kernel writes the output itself
])
def test_flash_narrow_row_tiles(lib, prefix_lens, nodes, page_size, plan, kernel, seed):
    """Row tiles of <= 16 rows run in the narrow kernel (four token groups on the same rows, merged at the end), with
    a KV split count of their own: each combination of split and unsplit full and narrow tiles, planned for an H200's
    132 SMs (params.plan_sm_count) whatever GPU runs it. Every form must match float64 in the NaN-poisoned workspace
    and give the same bits on every run."""
    from kdev import plan as kplan

    spec = config.CaseSpec(name=f"narrow-n{nodes}-p{page_size}", prefix_lens=prefix_lens,
                           tree=config.TreeSpec("random", nodes=nodes), heads=8, page_size=page_size, seed=seed,
                           model="kimi-k2.6", tolerances=config.DEFAULT_TOLERANCES)
    h200 = kplan.resolve_gpu("h200")
    B, kv = len(prefix_lens), max(prefix_lens) + nodes
    planned = kplan.PlanLibrary(lib.path).split_plan(B, B * nodes, 8, nodes, kv, page_size, h200)
    assert (planned["splits"], planned["narrow_splits"]) == plan
    lib.plan_as(h200.sms)
    try:
        _check_flash_twice(lib, spec, kernel, split=plan[0] > 1)
    finally:
        lib.plan_as(0)


@pytest.mark.parametrize("kernel", abi.FLASH_KERNELS)
@pytest.mark.parametrize("prefix_lens,nodes", [
    ((8192,) * 16, 33),                  # the B16 target: 128 full-tile CTAs, one wave on an H200, and 160 narrow ones
    ((8000, 40, 7000, 0, 8100, 500, 3000, 64, 8000, 1, 6000, 2500, 8190, 90, 4000, 7500), 33),
    # ragged: the split count is planned for the longest request, so the short ones' later splits are empty (an
    # empty partial) or a single, partial tile
])
def test_flash_many_waves_and_ragged_splits(lib, prefix_lens, nodes, kernel, seed):
    """Batches whose CTAs (row tile x split x request) outnumber the SMs several times over, with requests of very
    different lengths under one split plan. Every row must match float64 and give the same bits on every run."""
    spec = config.CaseSpec(name=f"waves-b{len(prefix_lens)}-n{nodes}", prefix_lens=prefix_lens,
                           tree=config.TreeSpec("random", nodes=nodes), heads=8, page_size=64, seed=seed,
                           model="kimi-k2.6", tolerances=config.DEFAULT_TOLERANCES)
    _check_flash_twice(lib, spec, kernel)


def test_limits_t1025_h64_and_a_256k_prefix(lib):
    for spec in [
        config.CaseSpec("t1025", (3000,), config.TreeSpec("random", nodes=1025), 8, 1, 77, "kimi-k2.6",
                        config.DEFAULT_TOLERANCES),
        # the contract's longest prefix beside a short one: 8,192 KV tiles, on 132 SMs 31 splits in four waves
        config.CaseSpec("l256k", (config.MAX_PREFIX, 100), config.TreeSpec("ddtree", budget=64, depth=15, topk=64,
                        vocab=32000), 8, 64, 79, "kimi-k2.6", config.DEFAULT_TOLERANCES),
        config.CaseSpec("h64", (5000, 17), config.TreeSpec("ddtree", budget=128, depth=15, topk=128, vocab=32000),
                        64, 64, 78, "kimi-k2.6", config.DEFAULT_TOLERANCES),
    ]:
        case = cases.generate_case(spec, device="cuda")
        for kernel in KERNELS:
            _check(lib, kernel, case.tensors, case.scale, spec.tolerances, f"{kernel}/{spec.name}")


@pytest.mark.parametrize("page_size", [1, 64])
def test_pages_past_4_gib_of_pool_give_the_same_bits(lib, page_size, seed):
    """A server's KV pool holds tens of GB. A request's pages at the pool's far end put its rows past 2^31 elements and
    4 GiB of bytes from the pool's start: the offsets of the gather, of the naive kernel and of the tensor map's
    coordinates (page size 64). The same case with its pages moved there gives every kernel the same bits as in a pool
    of its own size; the rest of the big pool is NaN, so a wrong offset cannot pass."""
    spec = config.CaseSpec("far-pages", (3000, 700), config.TreeSpec("ddtree", budget=64, depth=15, topk=64,
                           vocab=32000), 8, page_size, seed, "kimi-k2.6",
                           config.DEFAULT_TOLERANCES)
    case = cases.generate_case(spec, device="cuda")
    x = abi.VerifyInputs.from_case(case.tensors, case.scale, "cuda")
    far = -(-(2**32 // (2 * config.QK_DIM) + 1) // page_size)  # the first page whose rows start past 4 GiB
    pool = torch.full((far + x.kv_cache.shape[0], page_size, config.QK_DIM), float("nan"), dtype=torch.bfloat16,
                      device="cuda")
    pool[far:] = x.kv_cache
    moved = abi.VerifyInputs(x.q, pool, (x.page_table + far).contiguous(), x.prefix_lens, x.q_indptr, x.tree_mask,
                             x.scale)
    for kernel in KERNELS:
        near, near_lse = _check(lib, kernel, case.tensors, case.scale, spec.tolerances, f"{kernel} {spec}")
        out, lse = lib.run(kernel, moved)
        assert torch.equal(out.view(torch.int16), near.view(torch.int16)), f"{kernel}: other output bits, pages moved"
        assert torch.equal(lse, near_lse), f"{kernel}: other lse bits with the pages moved past 4 GiB"
    del pool


def test_perturbed_output_is_caught(lib):
    suite, entry, t, x = _smoke_case(3)
    for kernel in KERNELS:
        out, _ = lib.run(kernel, x)
        out[5, 3, 100] += 0.25
        c = compare("out", out, t["out"], suite.tolerances(entry).out)
        assert not c.passed and c.worst[0][0] == (5, 3, 100)


def test_bad_arguments_return_status_and_launch_nothing(lib):
    suite, entry, t, x = _smoke_case(4)
    out, lse = lib.alloc_outputs(x)
    for field, value, message in [("num_heads", 0, "num_heads 0"), ("mask_words", 0, "mask_words 0"),
                                  ("page_size", 48, "page_size 48"), ("max_qlen", 2000, "max_qlen 2000"),
                                  ("struct_size", 8, "struct_size"), ("scale", float("nan"), "scale")]:
        for kernel in KERNELS:
            p = lib.params(x, out, lse)
            # the workspace a good call has (a scheduled call always needs one: its schedule), so the refusal is the
            # bad field's, not a missing workspace's
            ws = lib.alloc_workspace(kernel, p, "cuda")  # noqa: F841  (kept alive for the call)
            setattr(p, field, value)
            with pytest.raises(abi.KernelError, match=message) as e:
                lib.call(kernel, p)
            assert e.value.status == 1
    host = torch.zeros(x.q.shape[0] * x.q.shape[1] * 512, dtype=torch.bfloat16)  # pageable host memory
    p = lib.params(x, out, lse)
    p.out = host.data_ptr()
    with pytest.raises(abi.KernelError, match="out is not device memory"):
        lib.call("naive", p)
    # flash on a long prefix needs a workspace: without one it refuses with status 3
    spec = config.CaseSpec("ws", (30000,), config.TreeSpec("chain", nodes=8), 8, 64, 5, "kimi-k2.6",
                           config.DEFAULT_TOLERANCES)
    case = cases.generate_case(spec, device="cuda")
    xw = abi.VerifyInputs.from_case(case.tensors, case.scale, "cuda")
    ow, lw = lib.alloc_outputs(xw)
    p = lib.params(xw, ow, lw)
    assert lib.workspace_size(p) > 0
    with pytest.raises(abi.KernelError) as e:
        lib.call("flash", p)
    assert e.value.status == 3 and "workspace" in e.value.message
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all() and torch.isnan(ow.float()).all()  # nothing was launched


def test_verify_catches_an_output_perturbed_after_the_kernel(lib, monkeypatch):
    from kdev import verify

    real_run = abi.Library.run

    def tampered(self, kernel, x, sync=True):
        out, lse = real_run(self, kernel, x, sync=True)
        if kernel == "flash":
            out[1, 2, 300] = out[1, 2, 300] + 0.5
        return out, lse

    monkeypatch.setattr(abi.Library, "run", tampered)
    run = verify.run_suite("smoke", ["naive", "flash"], cases=["ddtree-n16"], lib_path=lib.path, write_ledger=False)
    assert not run.passed
    bad = [r for r in run.results if not r.passed]
    assert bad and all(r.kernel == "flash" for r in bad)
    assert any(r.out is not None and r.out.worst[0][0] == (1, 2, 300) for r in bad)


def test_verify_smoke_and_fuzz_200_pass(lib, tmp_path, seed):
    from kdev import verify

    kernels = ["naive", "flash", "ddtree", "accept", "compact"]
    run = verify.run_suite("smoke", kernels, repeat=2, lib_path=lib.path, write_ledger=False)
    assert run.passed, run.record["failures"]
    run = verify.run_fuzz(200, seed, kernels, max_prefix=16384, lib_path=lib.path, failures_root=tmp_path,
                          write_ledger=False)
    assert run.passed, (seed, run.record["failures"][:3])


def test_a_copy_of_the_library_gives_the_same_bits_in_one_verify_run(lib, tmp_path):
    """--kernel flash,flash@COPY: the same kernels from a second library instance (as an A/B base is loaded) pass the
    goldens and give bit for bit the same outputs (the kernels are deterministic)."""
    import shutil

    from kdev import verify

    copy = tmp_path / "copy" / lib.path.name
    copy.parent.mkdir()
    shutil.copy2(lib.path, copy)
    shutil.copy2(lib.path.parent / cabi.HEADER_BESIDE, copy.parent)  # a library travels with the header it binds by
    kernels = ["flash", f"flash@{copy}", f"flash-portable@{copy.parent}"]
    run = verify.run_suite("smoke", kernels, lib_path=lib.path, write_ledger=False)
    assert run.passed, run.record["failures"]
    pairs = [r for r in run.results if r.against == "flash"]
    assert pairs and all(r.note == "bit-identical" for r in pairs if r.kernel == f"flash@{copy}")
    assert run.record["libraries"][f"flash@{copy}"]["library"] == str(copy)


def test_verify_kernels_replay_from_a_cuda_graph(lib):
    """The ABI allocates nothing and never syncs, so a call can be captured once and replayed (how SGLang
    runs decode). Bounds are computed before the capture: params() reads q_indptr on the host. The flash call
    splits the KV range here, so the graph holds the combine kernel's programmatic launch too."""
    suite, entry, t, x = _smoke_case(4)
    for kernel in KERNELS:
        direct, _ = lib.run(kernel, x)
        out, lse = lib.alloc_outputs(x)
        p = lib.params(x, out, lse)
        if kernel in abi.FLASH_KERNELS:
            assert lib.flash_splits(p) > 1
        ws = lib.alloc_workspace(kernel, p, x.q.device)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            lib.call(kernel, p)
        for _ in range(2):
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out.view(torch.int16), direct.view(torch.int16)), kernel
            assert compare("lse", lse, t["lse"], suite.tolerances(entry).lse).passed
        del ws
