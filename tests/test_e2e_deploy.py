"""The budget curve of a real deploy (kdev e2e --acceptance): the cost model's arithmetic on fixed numbers, the
issue's figure for a 384-expert model, interpolation that refuses to extrapolate, and the command end to end on a
stored bench result (bad files refused in one line)."""

import json

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


def test_a_tree_of_65_tokens_touches_about_286_of_384_experts():
    assert costs().experts_touched(65) == pytest.approx(286, abs=0.5)
    assert costs().experts_touched(1) == pytest.approx(8)
    assert costs().experts_touched(10**6) == pytest.approx(384)


def test_the_step_is_attention_plus_weights_at_bandwidth_plus_all_reduces():
    c = costs()
    rest = c.rest_of_step(17)
    mlp = 3 * 64
    other = 4 * c.attention_params() + 1 * mlp * 128 + 3 * 1 * mlp * 16 + 1000 * 64
    experts = 3 * c.experts_touched(17) * mlp * 16
    assert rest["weight_bytes"] == pytest.approx((other * 2.0 + experts * 0.5) / 2)
    assert rest["weights_us"] == pytest.approx(rest["weight_bytes"] / 1e12 * 1e6)
    assert rest["allreduce_us"] == 4 * 2 * 10.0
    rows = deploy.budget_curve(c, {16: 100.0, 64: 300.0}, {16: 3.0, 64: 4.0}, [16, 32, 64], batch=2)
    r32 = rows[1]
    assert r32["verify_attention_us"] == pytest.approx(4 * (100 + (32 - 16) / 48 * 200))  # linear in the budget
    assert r32["tokens_per_round"] == pytest.approx(3.5)  # linear in log2(budget)
    assert r32["step_us"] == pytest.approx(r32["verify_attention_us"] + r32["weights_us"] + r32["allreduce_us"])
    assert r32["tokens_per_s"] == pytest.approx(2 * 3.5 / r32["step_us"] * 1e6)
    assert [r["best"] for r in rows].count(True) == 1
    assert max(rows, key=lambda r: r["tokens_per_s"])["best"]
    with pytest.raises(BadInput, match="budget 128 outside the budgets of the attention timings, 16..64"):
        deploy.budget_curve(c, {16: 100.0, 64: 300.0}, {16: 3.0, 256: 5.0}, [128], batch=1)


def test_the_command_gives_the_curve_and_refuses_bad_files(tmp_path):
    acc = tmp_path / "acceptance.yaml"
    acc.write_text(yaml.safe_dump({"source": "synthetic (a test)", "tokens_per_round": {16: 3.0, 64: 3.8, 128: 4.1}}))
    cli = CliRunner()
    r = cli.invoke(app, ["e2e", "--acceptance", str(acc), "--attention", BENCH, "--budget", "16,64,128", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [b["budget"] for b in doc["budgets"]] == [16, 64, 128] and doc["attention"]["gpu"] == "NVIDIA H200"
    assert "timed on NVIDIA H200" in r.stderr  # not the deploy's GPU: said
    stored = json.loads(open(BENCH).read())
    t64 = next(x["timing"]["median_us"] for x in stored["results"] if x["backend"] == "flash" and
               x["axes"] == {**x["axes"], "batch": 1, "prefix": 32768, "budget": 64, "heads": 8})
    assert doc["budgets"][1]["verify_attention_us"] == pytest.approx(61 * t64)
    bad = tmp_path / "bad.yaml"
    bad.write_text("tokens_per_round: {16: 0.5}\n")
    for args, words in ((["--acceptance", str(acc)], "needs --attention"),
                        (["--acceptance", str(bad), "--attention", BENCH], "at least 1 token per round"),
                        (["--acceptance", str(acc), "--attention", BENCH, "--batch", "3"], "no flash timing at batch 3"),
                        (["--acceptance", str(acc), "--attention", BENCH, "--budget", "256"], "budget 256 outside"),
                        (["--acceptance", str(acc), "--attention", str(acc)], "not a kdev bench result")):
        r = cli.invoke(app, ["e2e", *args])
        assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output, (args, r.output)


def test_the_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    acc = tmp_path / "acceptance.yaml"
    acc.write_text(yaml.safe_dump({"tokens_per_round": {16: 3.0, 128: 4.1}}))
    png = tmp_path / "curve.png"
    r = CliRunner().invoke(app, ["e2e", "--acceptance", str(acc), "--attention", BENCH, "--budget", "16,64,128",
                                 "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
