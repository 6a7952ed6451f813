"""verify without a GPU: token-exact logic (ties, a wrong output that must fail), ledger atomicity under
concurrent writers, and suites refused before anything runs."""

import dataclasses
import threading

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kdev import cases, ddtree, ledger, tokens, vectors, verify
from kdev.cli import app


def _setup(seed=0, heads=4, T=12):
    rng = np.random.default_rng(seed)
    vocab = 300
    tree = ddtree.random_tree(rng, T, rng.integers(0, vocab, T))
    proj = tokens.TokenProjector(heads, vocab, "cpu", seed=5)
    g = torch.Generator().manual_seed(seed)
    o_ref = torch.randn(T, heads, 512, generator=g, dtype=torch.float64)
    return proj, [tree], o_ref


def test_identical_output_is_token_exact():
    proj, trees, o_ref = _setup()
    r = tokens.token_exact(proj, trees, o_ref.clone(), o_ref)
    assert r.passed and r.node_mismatches == 0 and r.walk_mismatches == 0 and r.nodes == 12


def test_wrong_output_fails_token_exact():
    proj, trees, o_ref = _setup()
    o_bad = o_ref.clone()
    o_bad[3] = torch.randn(o_ref.shape[1:], generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    r = tokens.token_exact(proj, trees, o_bad, o_ref)
    assert not r.passed and r.node_mismatches >= 1
    assert "FAIL" in r.label()


def test_ties_are_reported_not_failed(monkeypatch):
    proj, trees, o_ref = _setup()
    o_bad = o_ref.clone()
    o_bad[3] *= -1  # flips node 3's logits: a different argmax
    assert not tokens.token_exact(proj, trees, o_bad, o_ref).passed
    monkeypatch.setattr(tokens, "TIE_REL_NOISE", 10.0)  # noise larger than any margin: every node is a tie
    r = tokens.token_exact(proj, trees, o_bad, o_ref)
    assert r.passed and r.ties == r.nodes and "ties" in r.label()


def test_accept_walk_uses_the_tree():
    proj, trees, o_ref = _setup(T=30)
    lr = proj.logits(o_ref)
    # make the target follow node 0 -> its first child by re-tokenising the tree with the argmax tokens
    tree = trees[0]
    ids = tree.tokens.copy()
    arg = lr.argmax(-1).numpy()
    for i in range(1, tree.size):
        ids[i] = arg[tree.parents[i]]
    t2 = ddtree.Tree(ids, tree.parents, tree.depths)
    r = tokens.token_exact(proj, [t2], o_ref.clone(), o_ref)
    assert r.passed and r.accepted[0][0] > 1  # the walk went past the root


def test_ledger_concurrent_appends_are_all_kept(tmp_path):
    folder = tmp_path / "ledger"

    def write(i):
        ledger.append_record({"timestamp": "2026-12-02T10:00:00+00:00", "i": i, "passed": True}, folder)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    recs = ledger.read_records(folder)
    assert sorted(r["i"] for r in recs) == list(range(40))
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temp files left behind
    (folder / "broken.json").write_text("{not json")
    assert len(ledger.read_records(folder)) == 40  # an unreadable file is skipped, never fatal


def test_cli_refuses_tampered_and_stale_suites_before_anything(tiny_suites, tmp_path, monkeypatch):
    from kdev import config

    spec = config.load_suite("tiny", tiny_suites)
    vectors.write_suite(spec, tmp_path)
    runner = CliRunner()
    f = tmp_path / "tiny" / "a.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:100])
    r = runner.invoke(app, ["verify", "--suite", str(tmp_path / "tiny")])
    assert r.exit_code == 2 and "a.safetensors: sha256 does not match" in r.stderr
    f.write_bytes(data)
    monkeypatch.setattr(vectors, "generator_hash", lambda: "1" * 64)
    r = runner.invoke(app, ["verify", "--suite", str(tmp_path / "tiny")])
    assert r.exit_code == 2 and "stale vectors" in r.stderr
    r = runner.invoke(app, ["verify", "--suite", str(tmp_path / "tiny"), "--allow-stale"])
    if not torch.cuda.is_available():
        assert r.exit_code == 3 and "no CUDA GPU" in r.stderr


def test_unknown_kernel_is_usage_error():
    r = CliRunner().invoke(app, ["verify", "--kernel", "naive,fastest"])
    assert r.exit_code == 2 and "fastest" in r.output


def test_unknown_plan_gpu_is_usage_error_before_any_gpu_is_asked_for():
    r = CliRunner().invoke(app, ["verify", "--kernel", "flash-portable", "--plan-gpu", "a100", "--fuzz", "3"])
    assert r.exit_code == 2 and "--plan-gpu 'a100': not in configs/gpus.yaml" in r.output


class FakeLibrary:
    """Stands in for the CUDA library: returns the golden outputs rounded as a kernel would store them,
    optionally with one element of one kernel's output moved."""

    def __init__(self, tensors, perturb=None):
        self.t, self.perturb = tensors, perturb

    def run(self, kernel, x, sync=True):
        out = self.t["out"].to(torch.bfloat16).clone()
        lse = self.t["lse"].to(torch.float32).clone()
        if self.perturb and kernel == self.perturb[0]:
            out[self.perturb[1]] += 0.5
        return out, lse


def test_check_case_passes_golden_like_outputs_and_catches_a_perturbed_one():
    suite = vectors.open_suite("smoke")
    entry = suite.cases[3]
    t = suite.load_case(entry)
    tol = suite.tolerances(entry)
    res = verify.check_case(FakeLibrary(t), entry["name"], t, entry["scale"], tol, ["naive", "flash"], 2, {}, "cpu")
    assert [(r.kernel, r.against, r.passed) for r in res] == [("naive", "golden", True), ("flash", "golden", True),
                                                              ("flash", "naive", True)]
    assert res[0].repeat_identical is True and res[0].token.nodes == t["q"].shape[0]
    res = verify.check_case(FakeLibrary(t, ("flash", (4, 2, 9))), entry["name"], t, entry["scale"], tol,
                            ["naive", "flash"], 1, {}, "cpu")
    bad = [r for r in res if not r.passed]
    assert [(r.kernel, r.against) for r in bad] == [("flash", "golden"), ("flash", "naive")]
    assert bad[0].out.worst[0][0] == (4, 2, 9)  # the moved element is named first


def test_a_kernel_of_another_build_is_checked_beside_this_one_and_same_bits_are_noted():
    """--kernel flash@main,flash: main's kernel (another library) against the golden, then this build's against it,
    with the comparison noting where both gave the same bits."""
    suite = vectors.open_suite("smoke")
    entry = suite.cases[3]
    t = suite.load_case(entry)
    tol = suite.tolerances(entry)
    kernels = ["flash@main", "flash"]
    res = verify.check_case(FakeLibrary(t), entry["name"], t, entry["scale"], tol, kernels, 1, {}, "cpu",
                            {"flash@main": (FakeLibrary(t), "flash")})
    assert [(r.kernel, r.against, r.passed, r.note) for r in res] == [
        ("flash@main", "golden", True, ""), ("flash", "golden", True, ""), ("flash", "flash@main", True, "bit-identical")]
    assert verify.summarize(res, kernels)["flash"]["bit_identical_to_first"] == 1
    moved = FakeLibrary(t, ("flash", (0, 0, 0)))  # this build's kernel moves one element: no longer the same bits
    res = verify.check_case(moved, entry["name"], t, entry["scale"], tol, kernels, 1, {}, "cpu",
                            {"flash@main": (FakeLibrary(t), "flash")})
    assert res[-1].against == "flash@main" and res[-1].note == ""


def test_verify_refuses_a_kernel_ref_that_names_nothing_before_any_gpu_is_asked_for():
    for name, problem in [("flash@no-such-branch-here", "no library, build folder, copy of kernels/, git revision or"),
                          ("accept@HEAD", "KERNEL@REF takes one of naive, flash, flash-portable")]:
        r = CliRunner().invoke(app, ["verify", "--kernel", f"naive,{name}"])
        assert r.exit_code == 2 and problem in r.stderr and "Traceback" not in r.output, r.output


def test_verify_refuses_a_manifest_that_drifted_from_the_config(tiny_suites, tmp_path, monkeypatch):
    import yaml

    from kdev import config

    spec = config.load_suite("tiny", tiny_suites)
    vectors.write_suite(spec, tmp_path)
    monkeypatch.setattr(vectors, "default_vectors_root", lambda: tmp_path)
    monkeypatch.setattr(config, "load_suites", lambda *a: {"tiny": spec})
    assert verify.open_checked_suite("tiny").name == "tiny"
    mpath = tmp_path / "tiny" / "manifest.yaml"
    m = yaml.safe_load(mpath.read_text())
    m["cases"][1]["tolerances"]["lse"]["rtol"] = 0.5
    mpath.write_text(yaml.safe_dump(m, sort_keys=False))
    r = CliRunner().invoke(app, ["verify", "--suite", "tiny"])
    assert r.exit_code == 2 and "manifest disagrees with configs/suites.yaml" in r.stderr and "b.safetensors" in r.stderr


def test_fuzz_inputs_come_from_worker_processes_in_order_and_equal_direct_generation():
    rng = np.random.default_rng(11)
    specs = [verify.fuzz_spec(rng, f"f{i}", 300, 20) for i in range(5)]
    got = [(spec.name, fut.result()) for spec, fut in verify._prefetched_inputs(specs)]
    assert [name for name, _ in got] == [s.name for s in specs]
    for spec, (_, inputs) in zip(specs, got):
        direct = cases.generate_inputs(spec)
        assert inputs.tensors.keys() == direct.tensors.keys()
        for k, v in direct.tensors.items():
            assert torch.equal(inputs.tensors[k].view(torch.uint8) if v.dtype == torch.bfloat16 else inputs.tensors[k],
                               v.view(torch.uint8) if v.dtype == torch.bfloat16 else v), k


def test_fuzz_summary_keeps_the_worst_of_every_metric():
    from kdev.cli.views import worst_rows as _worst_rows
    from kdev.compare import compare
    from kdev.config import Tolerance

    tol = Tolerance(atol=1e-2, rtol=1e-2, cos_diff=1e-3)
    want = torch.linspace(1, 2, 64)
    small = compare("out", want + 1e-4, want, tol)
    large = compare("out", want + 5e-3, want, tol)
    tok = tokens.TokenResult(True, 4, 0, 1, 0, 0)
    res = [verify.CaseResult("a", "flash", "golden", True, small, small, tok),
           verify.CaseResult("b", "flash", "golden", True, large, small, tok),
           verify.CaseResult("b", "compact", "golden", False, error="1 KV row(s) differ")]
    rows = {r[0]: r for r in _worst_rows(res)}
    from kdev import report

    assert rows["flash"][1] == report.fmt_float(large.max_abs) != report.fmt_float(small.max_abs)
    assert "2 checks, 2 ties" in rows["flash"][4] and "pass" in rows["flash"][5]
    assert "FAIL 1" in rows["compact"][5]


def test_the_record_names_the_plan_the_flash_calls_took(monkeypatch):
    from kdev import abi
    from kdev.errors import BadInput
    from kdev.plan import plan_target

    class Lib:
        build_info, path, planned = {"source_hash": "abc"}, "lib.so", None
        poisons_shared_memory = True

        def plan_as(self, n):
            self.planned = n

    monkeypatch.setattr(abi, "load_library", lambda *a: Lib())
    target = plan_target("rtx-pro-6000")
    lib = verify.load_planned_library(None, None, target)
    assert lib.planned == 188 and target.label == "NVIDIA RTX PRO 6000 Blackwell (188 SMs)"
    assert verify.load_planned_library(None, None, None).planned is None  # this GPU's own plan: nothing set
    rec = verify.make_record("fuzz", [], ["flash-portable"], lib, {"arch": "sm_90"}, {"name": "fuzz:1"}, target)
    assert rec["plan"] == {"gpu": "rtx-pro-6000", "name": "NVIDIA RTX PRO 6000 Blackwell", "arch": "sm_120", "sms": 188}
    assert rec["shared_memory_poisoned"] is True
    assert verify.make_record("fuzz", [], ["flash"], lib, {"arch": "sm_90"}, {"name": "fuzz:1"})["plan"] is None
    # a bare SM count: no GPU and no arch (deploy-check does not count it as the target's plan)
    assert plan_target("96").to_dict() == {"gpu": None, "name": None, "arch": None, "sms": 96}
    assert plan_target("96").label == "96 SMs"
    with pytest.raises(BadInput, match="--plan-gpu 0: an SM count must be >= 1"):
        plan_target("0")


def test_fuzz_batches_hold_trees_of_different_sizes():
    """Half the fuzz batches of more than one request give each request its own tree size, as an engine's batch holds
    (a plain call's grid spans the largest tree: a smaller request's row tiles past its rows, and its narrow tail where
    the largest has none, must be skipped, which batches of one tree size never test)."""
    from kdev.config import TreeSpec

    rng = np.random.default_rng(11)
    specs = [verify.fuzz_spec(rng, f"f{i}", 4000, 300) for i in range(60)]
    ragged = [s for s in specs if s.tree.ragged]
    assert ragged and all(s.batch > 1 for s in ragged) and len(ragged) < len(specs)
    spec = dataclasses.replace(ragged[0], tree=TreeSpec("random", nodes=70, ragged=True), heads=3,
                               prefix_lens=(300, 40, 1000, 7))
    case = cases.generate_case(spec)
    sizes = np.diff(case.tensors["q_indptr"].numpy())
    assert len(set(sizes.tolist())) > 1 and sizes.max() <= 70
    assert case.tensors["tree_mask"].shape[0] == sizes.sum() and spec.tree.to_dict()["ragged"] is True
    assert "ragged" not in TreeSpec("random", nodes=70).to_dict()  # the specs written before it read the same
