"""The budget curve of a real deploy (kdev e2e --acceptance): a projection over declared ranges. The cost model's
arithmetic on fixed numbers (experts touched, weights every GPU holds counted whole, an all-reduce with its payload over
the link, the two topologies), plain decoding and budgets 1..512, the range and what moves it, the acceptance file's
provenance (an assumed one makes the output illustrative), and the command end to end on a stored bench result (bad
files refused in one line)."""

import json
from dataclasses import replace

import pytest
import yaml
from typer.testing import CliRunner

from kdev.cli import app
from kdev.e2e import deploy
from kdev.errors import BadInput

BENCH = "benchmarks/h200-targets-11b9349de707.json"  # H200, B=1, prefix 32K, 8 heads at budgets 16, 64, 128


def costs(**over):
    base = dict(name="t", gpu_name="G", bytes_per_s=1e12, layers=4, dense_layers=1, hidden=64, heads=8,
                q_lora_rank=32, dense_intermediate=128, moe_intermediate=16, routed_experts=384, experts_per_token=8,
                shared_experts=1, vocab=1000, tensor_parallel=2, expert_weight_bytes=0.5, other_weight_bytes=2.0,
                allreduce_us=10.0, allreduces_per_layer=2)
    return deploy.StepCosts(**{**base, **over})


def dep(**over):
    s = deploy.Span
    base = dict(gpus=2, bandwidth_efficiency=s(0.5, 1.0, "a"), link_gbps=s(10.0, 30.0, "b"), latency_us=s(5.0, 15.0, "c"),
                link="pcie", activation_bytes=2.0, router_weight_bytes=2.0, drafter_us=s(100.0, 300.0, "d"),
                other_us=s(50.0, 150.0, "e"))
    return deploy.Deploy(**{**base, **over})


def test_a_tree_of_65_tokens_touches_about_286_of_384_experts():
    assert costs().experts_touched(65) == pytest.approx(286, abs=0.5)
    assert costs().experts_touched(1) == pytest.approx(8)
    assert costs().experts_touched(10**6) == pytest.approx(384)


def test_tp_counts_replicated_weights_whole_and_all_reduces_their_payload():
    c, d = costs(), dep()
    p = deploy.step_parts(c, d, "tp", 17, "mid")
    mlp, n = 3 * 64, 2
    whole = 64 * 32 + 64 * 576  # q_a, kv_a: every GPU holds them whole
    split = 32 * 8 * 192 + 512 * 8 * 256 + 8 * 128 * 64
    other = 4 * (whole + split / n) + (1 * mlp * 128 + 3 * mlp * 16 + 1000 * 64) / n
    experts = 3 * c.experts_touched(17) * mlp * 16 / n
    router = 3 * 64 * 384 * 2.0
    assert p["weight_bytes"] == pytest.approx(other * 2.0 + experts * 0.5 + router)
    assert p["weights_us"] == pytest.approx(p["weight_bytes"] / (1e12 * 0.75) * 1e6)
    payload = 17 * 64 * 2.0
    assert p["comm_us"] == pytest.approx(4 * 2 * (10.0 + 2 * (n - 1) / n * payload / 20e3))
    # the replicated part does not shrink with more GPUs; the split part does
    more = deploy.step_parts(c, dep(gpus=8), "tp", 17, "mid")["weight_bytes"]
    assert more > 4 * whole * 2.0 + router and more < p["weight_bytes"]


def test_the_issues_all_reduce_at_budget_128_carries_1_85_mb():
    c = deploy.load_step_costs(deploy.default_step_costs())
    d = deploy.load_deploy(deploy.default_step_costs())
    payload = 129 * c.hidden * d.activation_bytes
    assert payload == pytest.approx(1.85e6, rel=0.01)
    slow = d.allreduce_us(payload, "high")
    assert slow == pytest.approx(d.latency_us.high + 2 * 7 / 8 * payload / (d.link_gbps.low * 1e3))
    assert 120 * slow > 8000  # 122 of them a step over PCIe: milliseconds, not a flat 30 µs each
    assert d.allreduce_us(payload, "low") < d.allreduce_us(payload, "mid") < slow


def test_dp_ep_holds_the_attention_whole_and_a_share_of_the_experts():
    c, d = costs(), dep(gpus=4)
    p = deploy.step_parts(c, d, "dp-ep", 17, "mid", local_tokens=17)
    t = deploy.step_parts(c, d, "tp", 17, "mid")
    assert p["weight_bytes"] > t["weight_bytes"]  # every GPU reads the whole attention for its requests
    payload = 17 * 8 * 64 * 2.0
    assert p["comm_us"] == pytest.approx(3 * 2 * (10.0 + 3 / 4 * payload / 20e3))
    with pytest.raises(BadInput, match="--topology 'ep': one of tp, dp-ep"):
        deploy.step_parts(c, d, "ep", 17, "mid")


def test_the_projection_has_plain_decoding_a_range_and_one_best_budget():
    c, d = costs(), dep()
    attention = {16: 100.0, 64: 300.0}
    acceptance = {1: 1.5, 16: 3.0, 64: 4.0}
    rows = deploy.projection(c, d, "tp", attention, acceptance, [0, 1, 16, 32, 64], batch=2)
    plain, one, _, r32, _ = rows
    assert plain["tokens_per_round"] == 1.0 and plain["drafter_us"] == 0.0 and one["drafter_us"] == 200.0
    assert one["attention_upper_bound"] and not r32["attention_upper_bound"]
    assert one["verify_attention_us"] == 4 * 100.0  # below the bench: its smallest budget's time
    assert r32["verify_attention_us"] == pytest.approx(4 * (100 + (32 - 16) / 48 * 200))  # linear in the budget
    assert r32["tokens_per_round"] == pytest.approx(3.5)  # linear in log2(budget)
    assert r32["step_us"] == pytest.approx(r32["verify_attention_us"] + r32["weights_us"] + r32["comm_us"]
                                           + r32["drafter_us"] + r32["other_us"])
    assert r32["tokens_per_s"] == pytest.approx(2 * r32["tokens_per_round"] / r32["step_us"] * 1e6)
    for r in rows:
        assert r["tokens_per_s_low"] > r["tokens_per_s_mid"] > r["tokens_per_s_high"] > 0
    assert [r["best"] for r in rows].count(True) == 1 and max(rows, key=lambda r: r["tokens_per_s"])["best"]
    with pytest.raises(BadInput, match="budget 128 outside the budgets of the attention timings, 16..64"):
        deploy.projection(c, d, "tp", attention, {16: 3.0, 256: 5.0}, [128], batch=1)
    moves = deploy.sensitivity(c, d, "tp", attention, acceptance, [0, 1, 16, 64], 2)
    assert [m["swing"] for m in moves] == sorted((m["swing"] for m in moves), reverse=True)
    assert all(m["source"] for m in moves) and {m["input"] for m in moves} >= {"link_gbps", "drafter_us"}


def test_every_range_of_the_shipped_cost_model_has_its_source_and_bad_ones_are_refused(tmp_path):
    d = deploy.load_deploy(deploy.default_step_costs())
    for name in ("bandwidth_efficiency", "link_gbps", "latency_us", "drafter_us", "other_us"):
        span = getattr(d, name)
        assert 0 < span.low <= span.high and len(span.source) > 20, name
    assert "PCIe" in d.link and "NVLink" in d.link and d.gpus == 8
    doc = yaml.safe_load(open(deploy.default_step_costs()))
    for broken, words in ((("link_gbps", {"low": 50.0, "high": 20.0, "source": "x"}), "0 <= low <= high"),
                          (("drafter_us", {"low": 1.0, "high": 2.0}), "drafter_us.source: missing"),
                          (("bandwidth_efficiency", {"low": 0.5, "high": 1.5, "source": "x"}), "a share")):
        bad = json.loads(json.dumps(doc))
        bad["deploy"][broken[0]] = broken[1]
        path = tmp_path / "steps.yaml"
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(BadInput, match=words.replace(".", r"\.")):
            deploy.load_deploy(path)
    assert replace(d, gpus=4).gpus == 4


def test_the_command_gives_the_projection_and_refuses_bad_files(tmp_path):
    acc = tmp_path / "acceptance.yaml"
    acc.write_text(yaml.safe_dump({"source": "synthetic (a test)", "tokens_per_round": {1: 1.8, 16: 3.0, 64: 3.8,
                                                                                        128: 4.1}}))
    cli = CliRunner()
    r = cli.invoke(app, ["e2e", "--acceptance", str(acc), "--attention", BENCH, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["projection"] and doc["illustrative"] and "ASSUMED" in doc["acceptance"]["source"]
    assert [b["budget"] for b in doc["budgets"]] == [0, 1, 2, 4, 8, 16, 32, 64, 128]
    assert doc["attention"]["gpu"] == "NVIDIA H200" and "timed on NVIDIA H200" in r.stderr  # not the deploy's GPU
    stored = json.loads(open(BENCH).read())
    t64 = next(x["timing"]["median_us"] for x in stored["results"] if x["backend"] == "flash" and
               x["axes"] == {**x["axes"], "batch": 1, "prefix": 32768, "budget": 64, "heads": 8})
    assert doc["budgets"][7]["verify_attention_us"] == pytest.approx(61 * t64)
    r = cli.invoke(app, ["e2e", "--acceptance", str(acc), "--attention", BENCH])
    assert r.exit_code == 0 and "ILLUSTRATIVE PROJECTION" in r.output and "best budget" in r.output
    acc.write_text(yaml.safe_dump({"source": "production, 2026-11", "measured": True,
                                   "tokens_per_round": {16: 3.0, 128: 4.1}}))
    r = cli.invoke(app, ["e2e", "--acceptance", str(acc), "--attention", BENCH, "--budget", "16,64"])
    assert r.exit_code == 0 and "ILLUSTRATIVE" not in r.output and "production, 2026-11" in r.output, r.output
    r = cli.invoke(app, ["e2e", "--acceptance", str(acc), "--attention", BENCH, "--budget", "16,64", "--topology",
                         "dp-ep", "--json"])
    dp = json.loads(r.stdout)
    assert dp["attention"]["heads"] == 64 and dp["topology"] == "dp-ep"  # one GPU attends with every head
    assert dp["budgets"][0]["weight_bytes"] > json.loads(cli.invoke(app, [
        "e2e", "--acceptance", str(acc), "--attention", BENCH, "--budget", "16,64", "--json"]).stdout)["budgets"][0][
        "weight_bytes"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("tokens_per_round: {16: 0.5}\n")
    for args, words in ((["--acceptance", str(bad), "--attention", BENCH], "at least 1 token per round"),
                        (["--acceptance", str(acc), "--attention", BENCH, "--batch", "3"], "no flash timing at batch 3"),
                        (["--acceptance", str(acc), "--attention", BENCH, "--budget", "256"], "budget 256 outside"),
                        (["--acceptance", str(acc), "--attention", BENCH, "--topology", "ep"], "--topology 'ep'"),
                        (["--acceptance", str(acc), "--attention", str(acc)], "not a kdev bench result"),
                        (["--topology", "dp-ep"], "only with --acceptance")):
        r = cli.invoke(app, ["e2e", *args])
        assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output, (args, r.output)


def test_without_a_bench_file_the_attention_is_kdev_plans_projection_at_page_size_1(tmp_path):
    from kdev import build

    acc = tmp_path / "acceptance.yaml"
    acc.write_text(yaml.safe_dump({"source": "synthetic (a test)", "tokens_per_round": {1: 1.8, 16: 3.0, 64: 3.8}}))
    r = CliRunner().invoke(app, ["e2e", "--acceptance", str(acc), "--budget", "0,4,16,64", "--json"])
    if build.latest_library() is None:  # the projection reads a built library's plan and SASS
        assert r.exit_code != 0 and "kdev build" in r.output and "Traceback" not in r.output, r.output
        return
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    att = doc["attention"]
    assert att["file"] is None and "kdev plan --project" in att["source"] and att["gpu"].startswith("NVIDIA RTX PRO")
    assert any("page size 1" in n for n in att["notes"])  # the projection's known page-1 miss, said
    for row in doc["budgets"]:
        assert 0 < row["verify_attention_us_low"] <= row["verify_attention_us"] <= row["verify_attention_us_high"]
    assert any(m["input"] == "verify_attention_us" for m in doc["sensitivity"])


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    acc = tmp_path / "acceptance.yaml"
    acc.write_text(yaml.safe_dump({"tokens_per_round": {16: 3.0, 128: 4.1}}))
    png = tmp_path / "curve.png"
    r = CliRunner().invoke(app, ["e2e", "--acceptance", str(acc), "--attention", BENCH, "--budget", "0,16,64,128",
                                 "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
