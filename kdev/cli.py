"""kdev command line: one thin function per command (parsing, output mode, exit code); the work lives in
the stage modules. Exit codes (DESIGN.md §5): 0 success, 1 a check failed, 2 bad usage or input,
3 environment missing. --json prints exactly one JSON document on stdout; progress and logs go to stderr."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import typer

from kdev import __version__, report
from kdev.errors import EXIT_CHECK_FAILED, EnvironmentMissing, KdevError

app = typer.Typer(
    name="kdev",
    help="Develop and validate CUDA kernels for tree speculative decoding on MLA models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

JsonOpt = typer.Option(False, "--json", help="Print one JSON document on stdout (logs go to stderr).")


def command(fn):
    """Turn KdevError into one line on stderr and its exit code; never a traceback for bad input."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KdevError as e:
            report.error(str(e))
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            report.error("interrupted")
            raise typer.Exit(130) from None

    return wrapper


def _version(value: bool):
    if value:
        typer.echo(f"kdev {__version__}")
        raise typer.Exit(0)


@app.callback()
def main_callback(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
):
    """kdev: gen-refs -> build -> verify -> bench -> deploy-check."""


def _check_device(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise typer.BadParameter("must be cpu or cuda", param_hint="--device")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise EnvironmentMissing("--device cuda: no CUDA GPU visible to torch")


# --------------------------------------------------------------------------------------------- gen-refs
@app.command("gen-refs")
@command
def gen_refs(
    suite: str = typer.Option("smoke", "--suite", help="Suite name in the suites file."),
    config: Optional[Path] = typer.Option(None, "--config", help="Suites file (default configs/suites.yaml)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder that holds suite folders (default vectors/)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing suite."),
    check: bool = typer.Option(False, "--check", help="Regenerate in memory and compare with the suite on disk."),
    device: str = typer.Option("cpu", "--device", help="Where the float64 reference runs: cpu or cuda."),
    json_out: bool = JsonOpt,
):
    """Generate golden test vectors from the float64 MLA + DDTree reference (or --check them)."""
    from kdev import config as cfg
    from kdev import vectors

    _check_device(device)
    spec = cfg.load_suite(suite, config)
    root = out or vectors.default_vectors_root()
    if check:
        disk = vectors.open_suite(str(root / suite), allow_stale=True)
        with report.progress(f"check {suite}", len(spec.cases)) as advance:
            problems = vectors.check_suite(spec, disk, device, progress=advance)
        doc = {"suite": suite, "path": str(disk.path), "cases": len(spec.cases), "ok": not problems,
               "stale": disk.stale, "problems": problems}
        if json_out:
            report.emit_json(doc)
        else:
            for p in problems:
                report.error(p)
            verdict = "[green]matches[/]" if not problems else f"[red]{len(problems)} file(s) differ[/]"
            report.show(f"gen-refs --check {suite}: {len(spec.cases)} cases, {verdict} ({disk.path})")
        if problems:
            raise typer.Exit(EXIT_CHECK_FAILED)
        return
    with report.progress(f"gen-refs {suite}", len(spec.cases)) as advance:
        manifest = vectors.write_suite(spec, root, force=force, device=device, progress=advance)
    total = sum(c["bytes"] for c in manifest["cases"])
    doc = {"suite": suite, "path": str(root / suite), "cases": [c["name"] for c in manifest["cases"]],
           "bytes": total, "generator_hash": manifest["generator_hash"]}
    if json_out:
        report.emit_json(doc)
    else:
        rows = [[c["name"], "+".join(map(str, c["tree_sizes"])), c["spec"]["heads"], c["spec"]["page_size"],
                 ",".join(map(str, c["spec"]["prefix_lens"])), f"{c['bytes'] / 1e6:.2f}"] for c in manifest["cases"]]
        report.show(report.table(f"suite {suite} -> {root / suite}", ["case", "T", "H", "page", "prefix", "MB"],
                                 rows, {"left": ("case",)}))
        report.show(f"wrote {len(rows)} cases, {total / 1e6:.1f} MB")


# ------------------------------------------------------------------------------------------------ build
def _split_archs(values: Optional[list[str]]) -> Optional[list[str]]:
    if not values:
        return None
    return [a.strip() for v in values for a in v.split(",") if a.strip()]


@app.command("build")
@command
def build_cmd(
    arch: Optional[list[str]] = typer.Option(None, "--arch", help="Target arch(s), e.g. sm_90 or sm_90,sm_120 "
                                                                 "(default: build.yaml)."),
    config: Optional[Path] = typer.Option(None, "--config", help="Build config (default configs/build.yaml)."),
    force: bool = typer.Option(False, "--force", help="Rebuild even when the cache key matches."),
    json_out: bool = JsonOpt,
):
    """Build kernels/ into one shared library (C ABI) per configuration, gated on the ptxas report."""
    from kdev import build as kbuild
    from kdev import config as cfg

    bc = cfg.load_build(config, _split_archs(arch))
    res = kbuild.build(bc, force=force, log=report.info)
    if json_out:
        report.emit_json({**res.to_dict(), "ok": not res.problems})
    else:
        rows = [[r["kernel"], r["arch"], r["registers"], r["spill_stores"], r["spill_loads"], r["stack_frame"],
                 r["smem"]] for r in res.resources]
        report.show(report.table(f"ptxas resources ({res.folder.name})",
                                 ["kernel", "arch", "regs", "spill st", "spill ld", "stack", "smem"], rows,
                                 {"left": ("kernel", "arch")}))
        emb = res.embedded
        if emb.get("sass") is None:
            report.warn("cuobjdump not found: embedded archs not confirmed (pip install 'kdev[build]')")
        else:
            report.show(f"embedded: SASS {', '.join(emb['sass']) or '-'}; PTX {', '.join(emb['ptx']) or '-'}")
        info = res.build_info
        dirty = " (dirty)" if info.get("git_dirty") else ""
        state = "up to date, nothing compiled" if res.cached else f"built in {res.seconds:.1f} s"
        report.show(f"{res.library}: {state}; sources {info['source_hash'][:12]}, "
                    f"git {str(info.get('git_sha'))[:12]}{dirty}, nvcc {info['nvcc_version']}")
        for p in res.problems:
            report.error(p)
    if res.problems:
        raise typer.Exit(EXIT_CHECK_FAILED)


def main():
    app()
