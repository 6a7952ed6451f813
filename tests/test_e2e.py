"""The end-to-end check on the CPU: tree speculative decoding through kdev's float64 reference, its tree ops and the
adapter emits exactly transformers' greedy tokens (2 layers, 8 ragged prompts, 16 rounds, budgets 1/16/64, page
sizes 1 and 64); each planted fault (a mask bit, a node's KV at the wrong position, compaction from the wrong slot)
is caught and named; bad settings are refused in one line."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from typer.testing import CliRunner  # noqa: E402

from kdev.cli import app  # noqa: E402
from kdev.e2e import oracle, run  # noqa: E402
from kdev.errors import BadInput  # noqa: E402

SETTINGS = run.Settings(prompts=8, rounds=16, budgets=(1, 16, 64), page_size=64, depth=8, topk=4, agree=0.7,
                        min_prompt=8, max_prompt=48, seed=3)


@pytest.fixture(scope="module")
def oracle_run():
    model = oracle.build_model()
    prompts = run.prompts_for(SETTINGS, model.config.vocab_size)
    assert len(set(map(len, prompts))) > 1  # ragged
    return model, run.references(model, prompts, SETTINGS)


@pytest.mark.parametrize("page_size", [1, 64])
def test_speculative_decoding_emits_greedys_tokens_in_float64(oracle_run, page_size):
    model, refs = oracle_run
    settings = run.Settings(**{**SETTINGS.__dict__, "page_size": page_size})
    results = run.run(settings, model=model, refs=refs)
    for r in results:
        assert r.passed and not r.differences, [d.to_dict() for d in r.differences]
        # every prompt compared over everything it emitted: 1 prefill token + each round's accepted tokens and bonus
        assert r.tokens == round(settings.prompts * (1 + settings.rounds * r.tokens_per_round))
    by_budget = {r.budget: r for r in results}
    assert by_budget[1].tokens_per_round < by_budget[16].tokens_per_round <= by_budget[64].tokens_per_round
    assert by_budget[1].tokens_per_round <= 2.0  # one drafted node: at most itself and the bonus


def test_prompts_longer_than_a_prefill_chain_are_prefilled_in_chunks(oracle_run):
    """Chunks of 13 tokens (prompts of 8 to 48): every chunk sees the ones before it; prompts of one, two, three or
    four chunks in one batch, and a request already prefilled takes no rows in the later chunks."""
    model, refs = oracle_run
    settings = run.Settings(**{**SETTINGS.__dict__, "budgets": (16,), "rounds": 4, "prefill_chunk": 13})
    (r,) = run.run(settings, model=model, refs=refs)
    assert r.passed and not r.differences, [d.to_dict() for d in r.differences]


@pytest.mark.parametrize("mutant", run.MUTANTS)
def test_each_planted_fault_is_caught_and_named(oracle_run, mutant):
    model, refs = oracle_run
    settings = run.Settings(**{**SETTINGS.__dict__, "budgets": (16,), "mutant": mutant})
    (r,) = run.run(settings, model=model, refs=refs)
    assert not r.passed and r.differences
    d = r.differences[0]
    assert not d.excused and d.got != d.want and 0 <= d.position < len(refs[d.prompt].tokens)
    assert refs[d.prompt].tokens[d.position] == d.want


def test_the_command_reports_budgets_and_refuses_bad_settings(tmp_path):
    cli = CliRunner()
    out = tmp_path / "e2e.json"
    r = cli.invoke(app, ["e2e", "--prompts", "2", "--rounds", "3", "--budget", "1,8", "--page-size", "1", "--json",
                         "--out-json", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["passed"] and [b["budget"] for b in doc["budgets"]] == [1, 8]
    assert json.loads(out.read_text()) == doc
    assert set(doc["budgets"][0]["seconds"]) >= {"draft", "tree build", "verify attention", "rest of forward",
                                                 "accept", "compact"}
    for args, words in ((["--budget", "0"], "--budget 0"), (["--budget", "5000"], "--budget 5000"),
                        (["--topk", "0"], "--topk 0"), (["--page-size", "48"], "page_size 48"),
                        (["--backend", "flash"], "runs on --device cuda"), (["--agree", "1.5"], "--agree 1.5"),
                        (["--rounds", "2000"], "past the model's")):
        r = cli.invoke(app, ["e2e", *args], catch_exceptions=False)
        assert r.exit_code == 2, (args, r.output)
        assert words in r.output and "Traceback" not in r.output
        assert len([x for x in r.output.splitlines() if x.startswith("error")]) == 1


def test_a_model_whose_attention_dims_are_not_the_contracts_is_refused():
    cfg = oracle.tiny_config()
    cfg.kv_lora_rank = 256
    with pytest.raises(BadInput, match="kv_lora_rank is 256, kdev's kernels take 512"):
        oracle.build_model(cfg=cfg)


def test_the_adapter_is_the_stock_attention_in_absorbed_form(oracle_run):
    """One forward of a prompt through the adapter (a chain from position 0) gives the stock model's logits."""
    from kdev.e2e import adapter

    model, _ = oracle_run
    prompt = torch.arange(5, 45) % model.config.vocab_size
    with torch.no_grad():
        want = model(input_ids=prompt[None], use_cache=False).logits[0]
    cache = adapter.PagedLatentCache(len(model.model.layers), 1, 64, 16, torch.float64, "cpu", 0)
    latent = adapter.LatentAttention(cache, "reference", lambda: None)
    latent.step = run._step([40], [0], torch.from_numpy(run._chain_mask(40).view("int64")), 40, 40, None, "cpu")
    stock = adapter.swap_attention(model, latent)
    try:
        got = run._logits(model, prompt, torch.arange(40))
    finally:
        adapter.restore_attention(model, stock)
    assert (got - want).abs().max() < 1e-9, (got - want).abs().max()
    assert type(model.model.layers[0].self_attn).__name__ == "DeepseekV3Attention"  # put back
