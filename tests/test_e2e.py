"""The end-to-end check on the CPU: tree speculative decoding through kdev's float64 reference and its bf16 emulation,
the tree ops and the adapter, judged by the command's own verdict (the logits at every accepted and bonus position
against transformers' greedy decoding, within each precision's bound). The unfaulted run passes under both; each
planted fault (softmax scale x 1.001, RoPE by node index, the previous page, a dropped ancestor bit, two rows swapped,
compaction from the wrong slot or a sibling's, the bonus token from the parent) fails under both; kdev's RoPE and
YaRN agree with transformers'; bad settings are refused in one line."""

import json
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from kdev import cabi, mla  # noqa: E402
from kdev.cli import app  # noqa: E402
from kdev.e2e import adapter, oracle, run, verdict  # noqa: E402
from kdev.errors import BadInput  # noqa: E402

# 2 prompts of 130..200 tokens prefilled in chunks of 64 (3 and 4 pages of 64 once the rounds are in), trees of 65
# nodes (two mask words)
SETTINGS = run.Settings(prompts=2, rounds=3, budgets=(64,), page_size=64, min_prompt=130, max_prompt=200, seed=3,
                        prefill_chunk=64)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def oracle_run():
    model = oracle.build_model()
    prompts = run.prompts_for(SETTINGS, model.config.vocab_size)
    assert len(set(map(len, prompts))) > 1  # ragged
    return model, run.references(model, prompts, SETTINGS)


def _run(oracle_run, **kw):
    model, refs = oracle_run
    (r,) = run.run(replace(SETTINGS, **kw), model=model, refs=refs)
    return r


@pytest.mark.parametrize("backend", ["reference", adapter.EMULATED])
def test_the_unfaulted_run_passes_the_verdict_at_every_accepted_and_bonus_position(oracle_run, backend):
    r = _run(oracle_run, backend=backend)
    assert r.passed and not r.differences and not r.failed_positions, [p.to_dict() for p in r.positions]
    # every emitted token's logits compared: one per prompt from the prefill, then each round's accepted + bonus
    assert r.compared == r.tokens == round(SETTINGS.prompts * (1 + SETTINGS.rounds * r.tokens_per_round))
    assert r.max_nodes == 65 and r.max_position >= 3 * 64 and r.prefill_chunks >= 3
    if backend == "reference":
        assert r.worst < 0.01  # float64: errors of ~1e-14 under a bound of ~1e-11
    else:
        assert 0.01 < r.worst < 1.0  # bf16: the rounding shows, within the bound


@pytest.mark.parametrize("backend", ["reference", adapter.EMULATED])
@pytest.mark.parametrize("mutant", run.MUTANTS)
def test_each_planted_fault_fails_the_verdict(oracle_run, mutant, backend):
    r = _run(oracle_run, backend=backend, mutant=mutant)
    assert not r.passed
    assert r.failed_positions or r.differences
    for p in r.failed_positions:
        assert p.ratio > 1.0 and p.error > p.bound and p.status == "fails" and "> bound" in p.why
    if mutant == "bonus-parent":
        assert any(d.what == "bonus token" for d in r.differences)


def test_page_size_1_and_short_prefill_chunks(oracle_run):
    """Pages of one token; chunks of 13 tokens: every chunk sees the ones before it, a request already prefilled takes
    no rows in later chunks."""
    r = _run(oracle_run, page_size=1, prefill_chunk=13, budgets=(16,), rounds=2)
    assert r.passed and r.compared and r.prefill_chunks >= 10, [p.to_dict() for p in r.positions]


def test_budget_one_is_at_most_two_tokens_a_round(oracle_run):
    r = _run(oracle_run, budgets=(1,), rounds=2)
    assert r.passed and r.max_nodes == 2 and 1.0 <= r.tokens_per_round <= 2.0


def test_positions_past_4096_with_kimis_yarn():
    settings = run.Settings(prompts=1, rounds=2, budgets=(16,), min_prompt=130, max_prompt=140, seed=4,
                            position_offset=6000)
    for backend in ("reference", adapter.EMULATED):
        (r,) = run.run(replace(settings, backend=backend))
        assert r.passed and r.max_position > 6000 + 130, [p.to_dict() for p in r.positions]
    (r,) = run.run(replace(settings, mutant="scale"))
    assert not r.passed


def test_the_verdict_excuses_a_near_tie_within_the_bound_and_fails_what_is_not():
    g = torch.Generator().manual_seed(7)
    want = torch.randn(256, generator=g, dtype=torch.float64)
    want[3], want[9] = 5.0, 4.999  # a near-tie: the oracle takes 3
    bound = torch.full_like(want, 0.01)
    got = want.clone()
    got[9] += 0.005  # within the bound, but now 9 wins
    ratio, err, bnd, arg, status = verdict.judge(got, want, bound, 3)
    assert status == "excused" and arg == 9 and ratio == pytest.approx(0.5) and err == pytest.approx(0.005)
    got[100] += 0.02  # beyond
    assert verdict.judge(got, want, bound, 3)[4] == "fails"
    got = want.clone()
    got[17] = float("nan")
    ratio, *_, status = verdict.judge(got, want, bound, 3)
    assert status == "fails" and ratio == float("inf")
    assert verdict.judge(want.clone(), want, bound, 3)[4] == "ok"


def test_an_excused_near_tie_is_reported_teacher_forced_and_the_comparison_goes_on(oracle_run, monkeypatch):
    """A position whose argmax is not the oracle's but whose logits are within the bound: listed with why, the
    oracle's token taken (the walk and the emitted tokens stay the oracle's), and every later position compared."""
    real = verdict.judge
    calls = []

    def judge(got, want, bound, want_token):
        calls.append(1)
        ratio, err, bnd, arg, status = real(got, want, bound, want_token)
        if len(calls) == 3:  # as if this position's top-2 had swapped within the bound
            return ratio, err, bnd, (want_token + 1) % 256, "excused"
        return ratio, err, bnd, arg, status

    monkeypatch.setattr(verdict, "judge", judge)
    r = _run(oracle_run, backend=adapter.EMULATED)
    assert r.passed and not r.differences and r.compared == r.tokens == len(calls)
    (p,) = r.excused
    assert p.status == "excused" and p.got != p.want and "near-tie" in p.why and "oracle's token taken" in p.why
    d = r.to_dict()
    assert d["excused"] == 1 and d["positions"][0]["why"] == p.why


def test_the_bf16_bound_is_zero_nowhere_and_grows_with_the_output():
    model = oracle.build_model()
    b = verdict.Bounds(model, bf16=True)
    g = torch.Generator().manual_seed(8)
    want = torch.randn(3, 256, generator=g, dtype=torch.float64)
    outs = [torch.randn(3, 8, cabi.LATENT_DIM, generator=g, dtype=torch.float64) for _ in model.model.layers]
    small = b.of(want, outs, torch.ones(3, dtype=torch.float64))
    big = b.of(want, [2 * o for o in outs], torch.ones(3, dtype=torch.float64))
    assert (small > verdict.Bounds(model, bf16=False).of(want, [], None)).all()
    assert torch.allclose(big - small, small - verdict.F64_REL * (1 + want.abs().amax(-1, keepdim=True)))


def test_the_bf16_bound_adds_the_heads_shared_rounding_before_squaring():
    """The latent rows' rounding is one error read by every head (MLA's one KV head): its share of sigma is summed
    over heads before it is squared; the rest is independent per head and element."""
    model = oracle.build_model()
    b = verdict.Bounds(model, bf16=True)
    g = torch.Generator().manual_seed(10)
    want = torch.randn(1, 256, generator=g, dtype=torch.float64)
    outs = [torch.randn(1, 8, cabi.LATENT_DIM, generator=g, dtype=torch.float64) for _ in model.model.layers]
    inv_rms = torch.tensor([0.7], dtype=torch.float64)
    var = torch.zeros(256, dtype=torch.float64)
    for o, m in zip(outs, b.m):
        s = o[0].abs() + o[0].square().mean(-1, keepdim=True).sqrt()  # [H, 512]
        var += ((m * verdict.BF16_REL * s).square()).sum((1, 2))
        var += ((m * verdict.SHARED_REL * s).sum(1)).square().sum(-1)
    floor = verdict.F64_REL * (1 + want.abs().max())
    want_bound = floor + verdict.SIGMAS * verdict.PROPAGATION * var.sqrt() * 0.7
    assert torch.allclose(b.of(want, outs, inv_rms)[0], want_bound, rtol=1e-12)


def test_the_emulated_kernel_is_the_reference_to_bf16_and_reads_only_what_it_may():
    g = torch.Generator().manual_seed(9)
    T, L, page = 70, 100, 16  # two mask words
    cache = adapter.PagedLatentCache(1, 1, L + T, page, torch.float64, "cpu", 1)
    rows = torch.randn(L + T, cabi.QK_DIM, generator=g, dtype=torch.float64)
    pg, rw = cache.slots(torch.zeros(L + T, dtype=torch.long), torch.arange(L + T))
    cache.pools[0][pg, rw] = rows  # rows past L + T stay NaN
    q = torch.randn(T, 8, cabi.QK_DIM, generator=g, dtype=torch.float64)
    mask = torch.from_numpy(run._chain_mask(T).view("int64"))
    args = (cache.page_table, torch.tensor([L]), torch.tensor([0, T]), mask, 0.13)
    want, _ = mla.reference_verify_attn(q, cache.pools[0], *args)
    got = adapter.emulated_verify_attn(q, cache.pools[0], *args)
    assert torch.isfinite(got).all()
    err = (got - want).abs().max() / want.abs().max()
    assert 1e-5 < err < 2.0**-6, err  # bf16's rounding, not float64's, and no more


def test_kdevs_rope_and_yarn_are_transformers_and_a_different_yarn_is_refused():
    model = oracle.build_model()
    agree = oracle.rope_agreement(model)
    assert agree["inv_freq_rel"] < 2.0**-20
    assert agree["mscale"][0] == pytest.approx(agree["mscale"][1], abs=1e-12)
    assert all(s == pytest.approx(agree["softmax_scale"][0], rel=1e-12) for s in agree["softmax_scale"][1])
    rope = getattr(model.config, "rope_parameters", None) or model.config.rope_scaling
    rope["beta_fast"] = 32.0  # DeepSeek-V3's ramp, not the table transformers built for Kimi K2's
    with pytest.raises(BadInput, match="kdev's YaRN is not transformers'"):
        oracle.use_float64_rope(model)


@pytest.mark.parametrize("offset", [0, 5000])
def test_the_adapter_with_kdevs_rope_is_the_stock_attention_in_absorbed_form(oracle_run, offset):
    """One forward of a prompt through the adapter (a chain at RoPE positions offset..) gives the stock model's
    logits to float64 rounding."""
    model, _ = oracle_run
    prompt = (torch.arange(5, 45) * 7) % model.config.vocab_size
    pos = offset + torch.arange(40)
    with torch.no_grad():
        want = model(input_ids=prompt[None], position_ids=pos[None], use_cache=False).logits[0]
    cache = adapter.PagedLatentCache(len(model.model.layers), 1, 64, 16, torch.float64, "cpu", 0)
    latent = adapter.LatentAttention(cache, "reference", lambda: None, oracle.kdev_config(model.config))
    latent.step = run._step([40], [0], torch.from_numpy(run._chain_mask(40).view("int64")), 40, 40, None, "cpu",
                            offset=offset)
    stock = adapter.swap_attention(model, latent)
    try:
        got = run._logits(model, prompt, pos, latent)
    finally:
        adapter.restore_attention(model, stock)
    assert (got - want).abs().max() < 1e-11 * want.abs().max(), (got - want).abs().max()
    assert type(model.model.layers[0].self_attn).__name__ == "DeepseekV3Attention"  # put back


def test_the_default_matrix_covers_what_docs_e2e_says():
    cases = run.matrix(("reference", adapter.EMULATED))
    assert {c.backend for c in cases} == {"reference", adapter.EMULATED}
    assert any(c.page_size == 64 and c.min_prompt > 2 * 64 for c in cases)  # >= 3 pages of 64
    assert any(c.page_size == 1 for c in cases)
    assert any(max(c.budgets) >= 64 for c in cases) and min(min(c.budgets) for c in cases) <= 16
    assert max(max(c.budgets) for c in cases) >= 256
    assert all(c.prefill_chunk < c.min_prompt and c.heads == 8 for c in cases)
    assert any(c.position_offset > 4096 for c in cases)
    full = run.matrix(("reference",), full=True)
    assert any(c.heads == 64 for c in full) and any(c.max_prompt > 4096 for c in full)
    assert {1, 512} <= {b for c in full for b in c.budgets}


def test_a_model_whose_attention_dims_are_not_the_contracts_is_refused():
    cfg = oracle.tiny_config()
    cfg.kv_lora_rank = 256
    with pytest.raises(BadInput, match="kv_lora_rank is 256, kdev's kernels take 512"):
        oracle.build_model(cfg=cfg)


def test_the_command_reports_its_verdict_and_refuses_bad_settings(tmp_path):
    cli = CliRunner()
    out = tmp_path / "e2e.json"
    r = cli.invoke(app, ["e2e", "--prompts", "1", "--rounds", "2", "--budget", "1,8", "--page-size", "1",
                         "--position-offset", "0", "--json", "--out-json", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["passed"] and json.loads(out.read_text()) == doc
    assert {(b["budget"], b["backend"]) for b in doc["budgets"]} == {
        (n, be) for n in (1, 8) for be in ("reference", adapter.EMULATED)}
    assert len(doc["budgets"]) == 2 * 2 * len(run.DEFAULT_CASES)
    for b in doc["budgets"]:
        assert b["passed"] and b["compared"] > 0 and b["failed"] == 0 and b["worst"] < 1.0
        assert set(b["seconds"]) >= {"draft", "tree build", "verify attention", "rest of forward", "accept", "compact"}
    assert doc["bounds"]["sigmas"] == verdict.SIGMAS and doc["rope_vs_transformers"]["inv_freq_rel"] < 2.0**-20
    for args, words in ((["--budget", "0"], "--budget 0"), (["--budget", "5000"], "--budget 5000"),
                        (["--topk", "0"], "--topk 0"), (["--page-size", "48"], "page_size 48"),
                        (["--backend", "flash"], "runs on --device cuda"), (["--agree", "1.5"], "--agree 1.5"),
                        (["--rounds", "20000"], "past the model's"), (["--backend", "reference,bogus"], "'bogus'"),
                        (["--graph"], "--graph: CUDA graphs")):
        r = cli.invoke(app, ["e2e", *args], catch_exceptions=False)
        assert r.exit_code == 2, (args, r.output)
        assert words in r.output and "Traceback" not in r.output
        assert len([x for x in r.output.splitlines() if x.startswith("error")]) == 1
