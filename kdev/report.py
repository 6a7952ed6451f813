"""Terminal output: rich tables and progress on stderr, exactly one JSON document on stdout with --json."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text


def _console(to_stderr: bool) -> Console:
    # A pipe or a file (a log through tee, CI) has no width of its own, and rich would then fold every table at 80
    # columns (a bench row over four lines); there, tables take the width they need up to 200 columns. A terminal,
    # or COLUMNS where set, decides as usual.
    stream = sys.stderr if to_stderr else sys.stdout
    wide = not (stream.isatty() or os.environ.get("COLUMNS"))
    return Console(stderr=to_stderr, highlight=False, width=200 if wide else None)


stderr = _console(True)
stdout = _console(False)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):
        return _jsonable(x.item())
    return x


def emit_json(doc: dict) -> None:
    sys.stdout.write(json.dumps(_jsonable(doc), indent=2, allow_nan=False) + "\n")
    sys.stdout.flush()


# Output is plain text but for the pieces made by styled(): what a line quotes (an arch as "[sm_120]", an install hint
# as "kdev[build]", a commit subject as "[skip ci]", a path or an error from elsewhere) is printed as it is. Read as
# rich markup, the first three would vanish and a "[/...]" would raise.
def styled(text: str, style: str) -> Text:
    """A piece of output in a style (a verdict's colour)."""
    return Text(text, style=style)


def line(*parts: str | Text) -> Text:
    """One line from plain strings and styled() pieces."""
    return Text.assemble(*parts)


def info(msg: str | Text) -> None:
    stderr.print(msg, markup=False)


def warn(msg: str) -> None:
    stderr.print(line(styled("warning:", "yellow"), " ", msg))


def error(msg: str) -> None:
    stderr.print(line(styled("error:", "red"), " ", msg), soft_wrap=True)


@contextlib.contextmanager
def progress(label: str, total: int):
    """Yields advance(text) for a bar on stderr; transient so that only the results remain. Without a
    terminal (a log file, CI) a bar draws nothing, so a line is printed at every tenth of the work instead:
    a long run that is killed still says how far it got and at what rate."""
    if not stderr.is_terminal:
        t0, done, step = time.monotonic(), [0], max(1, total // 10)

        def advance_line(item: str = "") -> None:
            done[0] += 1
            if done[0] % step == 0 or done[0] == total:
                stderr.print(f"{label}: {done[0]}/{total} after {time.monotonic() - t0:.0f} s ({item})", markup=False)

        yield advance_line
        return
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[item]}"), TimeElapsedColumn(), console=stderr, transient=True)
    with bar:
        task = bar.add_task(escape(label), total=total, item="")

        def advance(item: str = "") -> None:
            bar.update(task, advance=1, item=escape(item))

        yield advance


def table(title: str, columns: list[str], rows: list[list], styles: dict | None = None) -> Table:
    """Cells are plain text (str() of each value) or styled() pieces."""
    t = Table(title=Text(title), title_justify="left", header_style="bold")
    for c in columns:
        left = c in (styles or {}).get("left", ())
        # names (kernels with their template arguments, paths) fold onto a second line rather than lose their end
        t.add_column(c, justify="left" if left else "right", overflow="fold" if left else "ellipsis")
    for r in rows:
        t.add_row(*[x if isinstance(x, Text) else Text(str(x)) for x in r])
    return t


def _needed_width(t: Table) -> int:
    """The columns a table needs with no figure cut: its widest cell per column (a text column that may fold onto more
    lines, a name or a reason, counts 24), padding and borders."""
    widths = []
    for col in t.columns:
        cells = [Text(str(col.header))] + [c if isinstance(c, Text) else Text(str(c)) for c in col._cells]
        widest = max(len(line) for c in cells for line in c.plain.split("\n"))
        widths.append(min(widest, 24) if col.overflow == "fold" else widest)
    return sum(widths) + 3 * len(widths) + 1


def records(t: Table) -> list:
    """A table too wide for the terminal as one block per row, "column: value" a line: every figure whole, however
    narrow the terminal (rich would cut numbers to "90.…")."""
    title = t.title if isinstance(t.title, Text) else Text(str(t.title or ""))
    out = [title] if title.plain else []
    headers = [str(c.header) for c in t.columns]
    pad = max(map(len, headers), default=0)
    for i in range(t.row_count):
        cells = [c._cells[i] for c in t.columns]
        first, *rest = zip(headers, cells)
        out.append(Text.assemble(Text(""), Text(f"{first[0]}: ", style="bold"), first[1] if isinstance(first[1], Text)
                                 else Text(str(first[1]))))
        for h, c in rest:
            out.append(Text.assemble(Text(f"  {h:<{pad}} "), c if isinstance(c, Text) else Text(str(c))))
    return out


def show(renderable) -> None:
    """Human output goes to stdout when not in --json mode; a string is plain text. A table wider than the terminal is
    shown as records (one block per row) rather than with its figures cut."""
    if isinstance(renderable, Table) and _needed_width(renderable) > stdout.width:
        for line in records(renderable):
            stdout.print(line, markup=False, soft_wrap=True)
        return
    stdout.print(renderable, markup=False)


def fmt_float(x: float, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "nan"
    return f"{x:.{digits}e}" if x != 0 and (abs(x) < 1e-2 or abs(x) >= 1e4) else f"{x:.{digits}f}"
