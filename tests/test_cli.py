import json

from typer.testing import CliRunner

from kdev.cli import app

runner = CliRunner()


def test_version():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.startswith("kdev ")


def test_gen_refs_check_committed_smoke_json():
    r = runner.invoke(app, ["gen-refs", "--suite", "smoke", "--check", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] is True and doc["cases"] >= 12


def test_gen_refs_write_force_and_check_failure(tiny_suites, tmp_path):
    args = ["gen-refs", "--suite", "tiny", "--config", str(tiny_suites), "--out", str(tmp_path)]
    assert runner.invoke(app, args + ["--json"]).exit_code == 0
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and "already exists" in r.stderr and "Traceback" not in r.output
    assert runner.invoke(app, args + ["--force"]).exit_code == 0
    assert runner.invoke(app, args + ["--check"]).exit_code == 0
    # change the suite definition: the files on disk no longer match -> exit 1, naming the file
    tiny_suites.write_text(tiny_suites.read_text().replace("seed: 2", "seed: 3"))
    r = runner.invoke(app, args + ["--check"])
    assert r.exit_code == 1 and "b.safetensors: differs" in r.stderr


def test_bad_input_is_one_line_exit_2(write_yaml):
    p = write_yaml("bad.yaml", "suites:\n  x:\n    cases:\n      - {name: a, prefix_lens: [1], tree: {kind: chain, nodes: 2}, heads: 8, seed: 1, oops: 1}\n")
    r = runner.invoke(app, ["gen-refs", "--suite", "x", "--config", str(p)])
    assert r.exit_code == 2 and "oops: unknown key" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    r = runner.invoke(app, ["gen-refs", "--suite", "nope"])
    assert r.exit_code == 2 and "no suite named 'nope'" in r.stderr


def test_messages_print_what_they_quote_as_it_is(monkeypatch, capsys):
    """An arch in brackets, an install hint with an extra and a path from an error are text, not rich markup: rich
    would drop the first two and raise on the third. Styled pieces keep their text beside plain ones."""
    from rich.console import Console

    from kdev import report

    monkeypatch.setattr(report, "stderr", Console(stderr=True, force_terminal=False, highlight=False, width=200))
    report.error("verify_attn_flash_kernel<true> [sm_120]: 91136 B dynamic shared memory per block > 50000 B limit")
    report.warn("cuobjdump not found: embedded archs not confirmed (pip install 'kdev[build]')")
    report.info("cannot read [/tmp/x]/y")
    report.info(report.line(report.styled("== build", "bold"), ": kdev build [/x]"))
    with report.progress("fuzz", 1) as advance:
        advance("[/case]")
    assert capsys.readouterr().err.splitlines() == [
        "error: verify_attn_flash_kernel<true> [sm_120]: 91136 B dynamic shared memory per block > 50000 B limit",
        "warning: cuobjdump not found: embedded archs not confirmed (pip install 'kdev[build]')",
        "cannot read [/tmp/x]/y", "== build: kdev build [/x]", "fuzz: 1/1 after 0 s ([/case])"]
    monkeypatch.setattr(report, "stdout", Console(force_terminal=False, highlight=False, width=200))
    report.show(report.table("deploy-check [/repo]", ["probe", "reason"],
                             [["git", "last commit: [skip ci] a fix"], ["ledger", report.styled("FAIL", "red")]]))
    report.show("ledger [/tmp/l.jsonl]")
    out = capsys.readouterr().out
    assert "deploy-check [/repo]" in out and "last commit: [skip ci] a fix" in out and "FAIL" in out
    assert out.rstrip().endswith("ledger [/tmp/l.jsonl]")


def test_progress_without_a_terminal_prints_a_line_per_tenth(monkeypatch, capsys):
    from rich.console import Console

    from kdev import report

    monkeypatch.setattr(report, "stderr", Console(stderr=True, force_terminal=False, highlight=False))
    with report.progress("fuzz", 20) as advance:
        for i in range(20):
            advance(f"case-{i}")
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("fuzz:")]
    assert len(lines) == 10
    assert lines[0].startswith("fuzz: 2/20 after") and lines[-1].startswith("fuzz: 20/20 after")
    assert "(case-19)" in lines[-1]


def test_the_command_list_shows_each_commands_first_paragraph_as_one_flowing_text():
    r = CliRunner().invoke(app, ["--help"], terminal_width=400)
    assert r.exit_code == 0
    # one row per command at this width: the docstrings' line breaks are not carried into the list
    assert "the machine code that changed, both on the golden vectors (and where they give the same bits)" in r.output
    for name in ("gen-refs", "build", "verify", "bench", "ab", "plan", "sass", "clean", "deploy-check", "all"):
        assert sum(line.split()[:1] == [name] for line in r.output.split("Commands:")[1].splitlines()) == 1


def test_help_speaks_in_words_and_takes_h():
    """No Python type as a placeholder (`--force <bool>`, `<list[str]>`), -h as --help, and bench's help names its
    backends and sweeps and no option it lacks."""
    from kdev.cli import app

    for cmd in ["gen-refs", "build", "sass", "verify", "bench", "ab", "plan", "clean", "deploy-check", "all"]:
        r = CliRunner().invoke(app, [cmd, "-h"], env={"COLUMNS": "200"})
        assert r.exit_code == 0, (cmd, r.output)
        assert "<bool>" not in r.output and "<list" not in r.output and "<str>" not in r.output, (cmd, r.output)
    out = CliRunner().invoke(app, ["bench", "-h"], env={"COLUMNS": "200"}).output
    assert "torch-sdpa" in out and "tree-kernels" in out and "--kernel " not in out
