import os

import pytest
import torch
import yaml

from kdev import cases, config, vectors
from kdev.errors import BadInput


@pytest.fixture
def tiny(tiny_suites, tmp_path):
    spec = config.load_suite("tiny", tiny_suites)
    root = tmp_path / "vec"
    vectors.write_suite(spec, root)
    return spec, root


def test_round_trip_and_layout(tiny):
    spec, root = tiny
    suite = vectors.open_suite(str(root / "tiny"))
    assert [c["name"] for c in suite.cases] == ["a", "b"]
    t = suite.load_case(suite.cases[0])
    assert t["q"].dtype == torch.bfloat16 and t["q"].shape[1:] == (3, 576)
    assert t["kv_cache"].shape[1:] == (64, 576)
    assert t["tree_mask"].dtype == torch.int64
    # NaN in every unowned slot, finite in every owned one
    owned = torch.zeros(t["kv_cache"].shape[:2], dtype=torch.bool)
    ind = t["q_indptr"].tolist()
    for b, L in enumerate(t["prefix_lens"].tolist()):
        for pos in range(L + ind[b + 1] - ind[b]):
            owned[t["page_table"][b, pos // 64], pos % 64] = True
    kv = t["kv_cache"].float()
    assert torch.isfinite(kv[owned]).all() and torch.isnan(kv[~owned]).all()
    assert torch.isfinite(t["out"]).all() and torch.isfinite(t["lse"]).all()
    assert t["drafter_log_probs"].shape == (2, 3, 6)
    assert vectors.check_suite(spec, suite) == []


def test_inputs_reproduce_bit_for_bit(tiny_suites):
    spec = config.load_suite("tiny", tiny_suites).cases[0]
    assert vectors.case_bytes(cases.generate_case(spec)) == vectors.case_bytes(cases.generate_case(spec))


def test_refuses_overwrite_without_force(tiny):
    spec, root = tiny
    with pytest.raises(BadInput, match="already exists"):
        vectors.write_suite(spec, root)
    vectors.write_suite(spec, root, force=True)
    assert sorted(p.name for p in root.iterdir()) == ["tiny"]  # no temp folders left


def _rewrite_case(root, entry, tensors):
    meta = {"kdev": vectors.json.dumps({"case": entry["name"], "schema_version": vectors.SCHEMA_VERSION},
                                       sort_keys=True)}
    data = vectors.st_save(tensors, metadata=meta)
    (root / "tiny" / entry["file"]).write_bytes(data)
    return data


def test_force_over_a_matching_suite_keeps_its_files_and_rewrites_a_wrong_one(tiny):
    """Goldens one ulp apart, as another CPU computes them, are the same case: --force keeps the committed bytes (a
    git checkout stays clean); a wrong input is rewritten."""
    spec, root = tiny
    suite = vectors.open_suite(str(root / "tiny"))
    a, b = suite.cases
    ta, tb = suite.load_case(a), suite.load_case(b)
    ta["lse"] = ta["lse"].clone()
    ta["lse"].view(-1)[0] = torch.nextafter(ta["lse"].view(-1)[0], torch.tensor(float("inf"), dtype=ta["lse"].dtype))
    one_ulp = _rewrite_case(root, a, ta)
    tb["q"][0, 0, 0] += 1.0
    wrong = _rewrite_case(root, b, tb)
    vectors.write_suite(spec, root, force=True)
    assert (root / "tiny" / a["file"]).read_bytes() == one_ulp
    assert (root / "tiny" / b["file"]).read_bytes() != wrong
    suite = vectors.open_suite(str(root / "tiny"))
    suite.check_integrity()  # the manifest names the bytes kept
    assert vectors.check_suite(spec, suite) == []


def test_tampered_and_truncated_refused(tiny):
    _, root = tiny
    suite = vectors.open_suite(str(root / "tiny"))
    f = root / "tiny" / suite.cases[1]["file"]
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(BadInput, match="sha256 does not match"):
        suite.load_case(suite.cases[1])
    f.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(BadInput, match="b.safetensors: sha256"):
        suite.check_integrity()


def test_check_names_the_differing_file(tiny):
    spec, root = tiny
    suite = vectors.open_suite(str(root / "tiny"))
    entry = suite.cases[0]
    t = suite.load_case(entry)
    t["q"][0, 0, 0] += 1.0  # a wrong input, with a manifest that agrees (so only --check can see it)
    data = vectors.st_save(t)
    (root / "tiny" / entry["file"]).write_bytes(data)
    entry["sha256"] = vectors.sha256_bytes(data)
    problems = vectors.check_suite(spec, suite)
    assert len(problems) == 1 and problems[0].startswith("a.safetensors: differs in") and "q" in problems[0]
    t["out"][0, 0, 0] += 1e-3
    t["q"][0, 0, 0] -= 1.0
    data = vectors.st_save(t)
    (root / "tiny" / entry["file"]).write_bytes(data)
    entry["sha256"] = vectors.sha256_bytes(data)
    problems = vectors.check_suite(spec, suite)
    assert len(problems) == 1 and "out (relative error" in problems[0]


def test_stale_suite_refused_unless_allowed(tiny, monkeypatch):
    _, root = tiny
    monkeypatch.setattr(vectors, "generator_hash", lambda: "0" * 64)
    with pytest.raises(BadInput, match="stale vectors"):
        vectors.open_suite(str(root / "tiny"))
    seen = []
    assert vectors.open_suite(str(root / "tiny"), allow_stale=True, warn=seen.append).stale
    assert seen and "stale" in seen[0]


def test_interrupted_write_leaves_no_suite(tiny_suites, tmp_path, monkeypatch):
    spec = config.load_suite("tiny", tiny_suites)
    real = cases.generate_case
    calls = []

    def boom(s, device="cpu"):
        calls.append(s.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(s, device)

    monkeypatch.setattr(vectors, "generate_case", boom)
    with pytest.raises(KeyboardInterrupt):
        vectors.write_suite(spec, tmp_path / "vec")
    assert list((tmp_path / "vec").iterdir()) == []


def test_manifest_contents(tiny):
    _, root = tiny
    m = yaml.safe_load((root / "tiny" / "manifest.yaml").read_text())
    assert m["schema_version"] == 1 and m["generator_hash"] == vectors.generator_hash()
    e = m["cases"][0]
    assert {"sha256", "seed", "shapes", "dtypes", "tolerances", "spec", "scale"} <= set(e)
    assert e["dtypes"]["q"] == "bfloat16" and e["shapes"]["q"][2] == 576


def test_committed_smoke_suite_is_intact_and_current():
    suite = vectors.open_suite("smoke")
    suite.check_integrity()
    total = sum(os.path.getsize(suite.path / c["file"]) for c in suite.cases)
    assert total <= 16 * 1024 * 1024
    assert max(max(c["tree_sizes"]) for c in suite.cases) > 64 and min(min(c["tree_sizes"]) for c in suite.cases) == 1


def test_hand_loosened_tolerance_in_the_manifest_is_caught(tiny):
    spec, root = tiny
    mpath = root / "tiny" / "manifest.yaml"
    m = yaml.safe_load(mpath.read_text())
    assert vectors.open_suite(str(root / "tiny")).config_drift(spec) == []
    m["cases"][0]["tolerances"]["out"]["atol"] = 1.0
    mpath.write_text(yaml.safe_dump(m, sort_keys=False))
    suite = vectors.open_suite(str(root / "tiny"))
    suite.check_integrity()  # the vector files themselves are intact
    drift = suite.config_drift(spec)
    assert len(drift) == 1 and drift[0].startswith("a.safetensors: manifest tolerances")
    assert vectors.check_suite(spec, suite)[0] == drift[0]


@pytest.mark.parametrize("text, problem", [
    ("cases: [a\n  b: 1\n", r"malformed YAML \(line \d+, column \d+\)"),
    ("- just\n- a list\n", "not a schema-1 kdev manifest"),
    ("schema_version: 1\ncases: 3\n", "not a schema-1 kdev manifest"),
])
def test_a_damaged_manifest_is_one_line_for_readers_and_for_appended_fuzz_failures(tiny, text, problem):
    spec, root = tiny
    mpath = root / "tiny" / "manifest.yaml"
    mpath.write_text(text)
    for attempt in (lambda: vectors.open_suite(str(root / "tiny")),
                    lambda: vectors.append_case(root, "tiny", cases.generate_case(spec.cases[0]))):
        with pytest.raises(BadInput, match=problem) as e:
            attempt()
        assert "\n" not in str(e.value)
    assert mpath.read_text() == text  # refused before anything was written
    assert sorted(p.name for p in (root / "tiny").iterdir()) == ["a.safetensors", "b.safetensors", "manifest.yaml"]


def test_a_missing_suite_names_each_place_looked_in_once(tmp_path):
    with pytest.raises(BadInput) as e:
        vectors.resolve_suite_path("nope", tmp_path)
    assert f"no manifest.yaml in nope or {tmp_path / 'nope'});" in str(e.value)
    with pytest.raises(BadInput) as e:
        vectors.resolve_suite_path(str(tmp_path), tmp_path / "vectors")  # a path: the root adds no second place
    assert f"(no manifest.yaml in {tmp_path});" in str(e.value) and "--suite " + tmp_path.name in str(e.value)
