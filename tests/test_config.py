import pytest

from kdev import config
from kdev.errors import BadInput


def test_models_load_and_kimi_scale():
    k26 = config.load_model("kimi-k2.6")
    assert k26.num_heads == 64 and k26.kv_lora_rank == 512 and k26.qk_rope_head_dim == 64
    assert round(k26.softmax_scale, 5) == 0.14468
    # K2 uses YaRN factor 32: (0.1 ln 32 + 1)^2 / sqrt(192)
    assert config.load_model("kimi-k2").softmax_scale == pytest.approx((0.1 * 3.4657359 + 1) ** 2 / 192**0.5, rel=1e-7)
    assert config.load_model("deepseek-v3").heads_per_gpu["tp8"] == 16


def test_committed_suites_load():
    suites = config.load_suites()
    assert {"smoke", "full", "stress"} <= set(suites)
    smoke = suites["smoke"]
    assert len(smoke.cases) >= 12
    kinds = {c.tree.kind for c in smoke.cases}
    assert kinds == {"ddtree", "chain", "star", "random"}
    assert {1, 64} == {c.page_size for c in smoke.cases}
    assert any(c.batch == 3 for c in smoke.cases) and any(0 in c.prefix_lens for c in smoke.cases)


@pytest.mark.parametrize(
    "case_yaml, culprit",
    [
        ("{name: a, prefix_lens: [1], tree: {kind: chain, nodes: 2}, heads: 8, seed: 1, colour: red}", "colour: unknown key"),
        ("{name: a, prefix_lens: [1], tree: {kind: chain, nodes: 0}, heads: 8, seed: 1}", "tree.nodes: must be in 1..1025"),
        ("{name: a, prefix_lens: [-4], tree: {kind: chain, nodes: 2}, heads: 8, seed: 1}", "prefix_lens[0]"),
        ("{name: a, prefix_lens: [1], tree: {kind: ddtree, budget: 2048, depth: 3}, heads: 8, seed: 1}", "tree.budget: must be in 1..1024"),
        ("{name: a, prefix_lens: [1], tree: {kind: ddtree, budget: 16, depth: 16}, heads: 8, seed: 1}", "tree.depth: must be in 1..15"),
        ("{name: a, prefix_lens: [1], tree: {kind: tree, nodes: 3}, heads: 8, seed: 1}", "tree.kind: must be one of"),
        ("{name: a, prefix_lens: [1], tree: {kind: chain, nodes: 3}, heads: 8, page_size: 24, seed: 1}", "page_size"),
        ("{name: a, prefix_lens: [1], tree: {kind: chain, nodes: 3}, heads: 0, seed: 1}", "heads: must be in"),
    ],
)
def test_bad_case_names_file_and_key(write_yaml, case_yaml, culprit):
    p = write_yaml("s.yaml", f"suites:\n  x:\n    cases:\n      - {case_yaml}\n")
    with pytest.raises(BadInput) as e:
        config.load_suites(p)
    msg = str(e.value)
    assert str(p) in msg and culprit in msg and "\n" not in msg


def test_malformed_yaml_names_line(write_yaml):
    p = write_yaml("s.yaml", "suites:\n  x: [unclosed\n")
    with pytest.raises(BadInput, match=r"malformed YAML \(line"):
        config.load_suites(p)


def test_missing_suite(tiny_suites):
    with pytest.raises(BadInput, match="no suite named 'nope'"):
        config.load_suite("nope", tiny_suites)


def test_model_unknown_key(write_yaml, tmp_path):
    src = (config.CONFIG_DIR / "models" / "kimi-k2.6.yaml").read_text()
    p = write_yaml("m.yaml", src + "extra_thing: 1\n")
    with pytest.raises(BadInput, match="extra_thing: unknown key"):
        config.load_model(p)


@pytest.mark.parametrize("text, key, line", [
    ("suites:\n  smoke: {cases: []}\nsuites: {}\n", "suites", 3),  # PyYAML alone keeps the second: no suite left
    ("suites:\n  x:\n    cases: []\n    cases: []\n", "cases", 4),
])
def test_a_key_given_twice_is_refused_in_one_line_naming_file_and_key(write_yaml, text, key, line):
    path = write_yaml("dup.yaml", text)
    with pytest.raises(BadInput) as e:
        config.load_yaml(path)
    assert str(e.value).startswith(f"{path}: duplicate key {key!r} (line {line}, ") and "\n" not in str(e.value)


def test_a_merge_key_that_an_explicit_key_overrides_is_no_duplicate(write_yaml):
    path = write_yaml("merge.yaml", "base: &b {heads: 8, seed: 1}\ncase: {<<: *b, seed: 2}\n")
    assert config.load_yaml(path)["case"] == {"heads": 8, "seed": 2}
