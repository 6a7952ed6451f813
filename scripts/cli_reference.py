"""Write docs/cli.md: every kdev command and option, as the CLI's own help prints them (tests/test_docs.py fails when
the file and the CLI differ: rerun this after changing an option).

usage: python3 scripts/cli_reference.py [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from kdev.cli import app

OUT = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
WIDTH = 100


def render() -> str:
    group = typer.main.get_command(app)
    parts = ["# kdev command-line reference", "",
             "Generated from the CLI by `python3 scripts/cli_reference.py`; what each command is for, with examples, is in",
             "[commands.md](commands.md).", ""]
    settings = {**group.context_settings, "terminal_width": WIDTH, "max_content_width": WIDTH}
    ctx = typer.Context(group, info_name="kdev", **settings)
    parts += ["```", group.get_help(ctx), "```", ""]
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        sub = typer.Context(cmd, info_name=name, parent=ctx, **settings)  # its path: kdev NAME
        parts += [f"## kdev {name}", "", "```", cmd.get_help(sub), "```", ""]
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    text = render()
    if argv[1:] == ["--check"]:
        if OUT.read_text() != text:
            print(f"{OUT} differs from the CLI: run python3 scripts/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
