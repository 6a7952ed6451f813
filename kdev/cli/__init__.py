"""kdev command line: one thin function per command (parsing, output mode, exit code); the work lives in the stage
modules, what a person sees in kdev/cli/views.py. The commands of the loop are in kdev/cli/loop.py (gen-refs, build,
verify, bench, ab), the rest in kdev/cli/tools.py (plan, sass, field-report, e2e, clean, deploy-check, all, help).
Exit codes (docs/architecture.md §5): 0 success, 1 a check failed, 2 bad usage or input, 3 environment missing. --json
prints exactly one JSON document on stdout, an error too; progress and logs go to stderr."""

from __future__ import annotations

import functools
import inspect
import signal
import sys
from pathlib import Path
from typing import Optional

import typer
import typer.core
from typer.core import TyperGroup

from kdev import __version__, fsutil, report
from kdev.errors import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EnvironmentMissing, KdevError, Terminated

# the exceptions of the click that typer runs on: its own copy in newer typers (typer._click), the click package before
_click = getattr(typer.core, "_click", None) or typer.core.click
_errors = _click.exceptions
_NO_ARGS_IS_HELP = getattr(_errors, "NoArgsIsHelpError", ())  # `kdev` alone: the help, as it is
ParameterSource = _click.core.ParameterSource  # whether an option was given or left at its default


def usage_error_line(e) -> str:
    """An error of the option parser (or a command's own typer.BadParameter) in kdev's one-line form: the command, the
    option, what is wrong, where help is (`kdev verify: --repeat: ... (see kdev verify -h)`), not click's usage block."""
    if isinstance(e, _errors.BadParameter) and not isinstance(e, _errors.MissingParameter):
        hint = e.param_hint if e.param_hint is not None else (max(e.param.opts, key=len) if e.param else None)
        hint = "/".join(hint) if isinstance(hint, (list, tuple)) else hint
        what = f"{hint}: {e.message}" if hint else e.message
    else:
        what = e.format_message()
    ctx = e.ctx or _click.globals.get_current_context(silent=True)
    path = ctx.command_path if ctx is not None else "kdev"
    return f"{path}: {what} (see {path} -h)"


class _OneLineUsageError(_errors.ClickException):
    """A usage error shown as kdev shows every error: `error: ...` in one line on stderr, and with --json also
    {"error": ..., "exit_code": 2} on stdout (docs/architecture.md §5)."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, json_out: bool):
        super().__init__(message)
        self.json_out = json_out

    def show(self, file=None) -> None:
        report.error(self.message)
        if self.json_out:
            report.emit_json({"error": self.message, "exit_code": self.exit_code})


class KdevGroup(TyperGroup):
    """kdev's command group: the option parser's errors (an unknown option, a value out of range, a missing
    argument, an unknown command) become one line in kdev's style, and a JSON document where --json was given."""

    _json_out = False

    def main(self, args=None, *a, **kw):
        args = sys.argv[1:] if args is None else list(args)
        self._json_out = "--json" in args[: args.index("--")] if "--" in args else "--json" in args
        return super().main(args, *a, **kw)

    def _one_line(self, thunk):
        try:
            return thunk()
        except _NO_ARGS_IS_HELP:
            raise
        except _errors.UsageError as e:
            raise _OneLineUsageError(usage_error_line(e), self._json_out) from None

    def make_context(self, *a, **kw):  # kdev's own options: kdev --bogus
        return self._one_line(lambda: super(KdevGroup, self).make_context(*a, **kw))

    def invoke(self, ctx):  # the command's name and options, and its run
        return self._one_line(lambda: super(KdevGroup, self).invoke(ctx))


app = typer.Typer(
    name="kdev",
    cls=KdevGroup,
    help="Develop and validate CUDA kernels for tree speculative decoding on MLA models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # plain help (click's layout): a flag shows no placeholder there, -h among them
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 1000},
)

JsonOpt = typer.Option(False, "--json", help="Print one JSON document on stdout (logs go to stderr).")
# the shapes of kdev bench and kdev plan: a named sweep (their own --sweep default), or these
ShapeOpt = typer.Option(None, "--shape", help="One shape, e.g. B=1,L=32768,N=64,H=8 (repeatable).")
AxisOpt = typer.Option(None, "-a", "--axis", help="Override an axis: AXIS=V1,V2 (repeatable).")
# verify and bench: another GPU's split plan, run on this one
PlanGpuOpt = typer.Option(
    None, "--plan-gpu", metavar="GPU", help="Plan the flash calls as for a GPU of configs/gpus.yaml (e.g. "
    "rtx-pro-6000 with flash-portable: the target's kernels and split plan) or for a number of SMs: its split counts "
    "and workspace, run here.")

# verify, bench and deploy-check: the GPUs of the host (kdev/fleet.py)
GpusOpt = typer.Option(
    None, "--gpus", help="all, or positions (0,2,5: torch's cuda:N, CUDA_VISIBLE_DEVICES applied) or UUIDs of the GPUs "
    "to run on, one worker process each, at once (default: every GPU this process sees; one GPU runs here).")
WorkerTimeoutOpt = typer.Option(3600.0, "--worker-timeout", min=1.0,
                                help="With several GPUs: a worker still running after this many seconds fails.")


def worker_argv(ctx: typer.Context, drop: tuple = ("gpus", "worker_timeout", "json_out", "out_json")) -> list[str]:
    """The running command's options as a worker takes them: every option given another value than its default, but
    those the parent keeps (the GPUs, the timeout, the output)."""
    argv = []
    for p in ctx.command.params:
        if getattr(p, "param_type_name", None) != "option" or p.name in drop:
            continue
        value = ctx.params.get(p.name)
        if value is None or value == p.default or (p.is_flag and not value):
            continue
        flag = max(p.opts, key=len)
        if p.is_flag:
            argv.append(flag)
        else:
            argv += [x for v in (value if p.multiple else [value]) for x in (flag, str(v))]
    return argv


def fan_out_progress():
    """One line per GPU on stderr, updated as its worker runs and ends."""
    from rich.live import Live
    from rich.text import Text

    lines: dict = {}

    def render():
        return Text("\n".join(f"{label}: {state}" for label, state in lines.values()))

    live = Live(render(), console=report.stderr, refresh_per_second=4, transient=False)

    def update(gpu, state: str):
        lines[gpu.uuid] = (gpu.label, state)
        live.update(render())

    return live, update


def run_on_gpus(ctx: typer.Context, stage: str, gpus: list, library, worker_timeout: float, out_json, json_out: bool):
    """verify or bench on several GPUs (kdev/fleet.py): the library built once per arch, a worker per GPU with this
    command's options, a progress line each, the gathered document written and shown; exit 1 where a GPU failed."""
    from kdev import fleet
    from kdev.cli import views

    if library is None:
        fleet.prebuild(gpus, report.info)
    live, update = fan_out_progress()
    with live:
        doc = getattr(fleet, stage)(gpus, worker_argv(ctx), worker_timeout, update)
    write_json_file(out_json, doc)
    report.emit_json(doc) if json_out else views.show_fleet(doc, stage)
    if not doc["passed"]:
        raise typer.Exit(EXIT_CHECK_FAILED)


def command(fn):
    """Turn KdevError into one line on stderr and its exit code; never a traceback for bad input. With --json, an error
    is still exactly one JSON document on stdout: {"error": ..., "exit_code": ...}."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        json_out = bool(kwargs.get("json_out"))

        def fail(message: str, code: int):
            report.error(message)
            if json_out:
                report.emit_json({"error": message, "exit_code": code})
            raise typer.Exit(code) from None

        try:
            if kwargs.get("repo") is None:  # every command works on the checkout around the current directory
                from kdev import project

                project.require_root()
            result = fn(*args, **kwargs)
            fsutil.raise_if_stopped()  # a stop that library code swallowed never ends in a success
            return result
        except KdevError as e:
            fail(str(e), e.exit_code)
        except OSError as e:  # a path the user gave that cannot be read or written: bad input, said in one line
            where = f"{e.filename}: " if e.filename else ""
            fail(f"{where}{e.strerror or e}", EXIT_BAD_INPUT)
        except typer.BadParameter as e:  # raised by a command's own checks
            fail(usage_error_line(e), EXIT_BAD_INPUT)
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except Terminated as e:
            fail(f"terminated ({e.signal_name})", 128 + e.signum)

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


def check_device(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise typer.BadParameter("must be cpu or cuda", param_hint="--device")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise EnvironmentMissing("--device cuda: no CUDA GPU visible to torch")


def split_archs(values: Optional[list[str]]) -> Optional[list[str]]:
    if not values:
        return None
    return [a.strip() for v in values for a in v.split(",") if a.strip()]


def kernel_list(value: str, allowed, refs: bool = False) -> list[str]:
    """--kernel's comma-separated names, each once; refs: KERNEL@REF names too (abi.kernel_ref checks them)."""
    from kdev import abi

    names = [k.strip() for k in value.split(",") if k.strip()]
    bad = [k for k in names if k not in allowed and not (refs and abi.kernel_ref(k) is not None)]
    if bad or not names:
        raise typer.BadParameter(f"unknown kernel {bad[0] if bad else value!r} (have {', '.join(allowed)})",
                                 param_hint="--kernel")
    return list(dict.fromkeys(names))


def write_json_file(path: Optional[Path], doc: dict) -> None:
    if path:
        import json

        from kdev.fsutil import atomic_write_bytes

        atomic_write_bytes(path, json.dumps(report._jsonable(doc), indent=2, allow_nan=False).encode())


from kdev.cli import loop, tools  # noqa: E402,F401  (registers the commands, in the order help lists them)

# The command list shows each command's first paragraph; Typer's rich help would keep the docstring's line breaks
# there (it joins them only in a command's own --help), so the list gets them joined.
for _info in app.registered_commands:
    if _info.short_help is None and _info.callback.__doc__:
        _info.short_help = " ".join(inspect.cleandoc(_info.callback.__doc__).split("\n\n")[0].split())


def _placeholders() -> None:
    """Help shows what an option takes in words, not Python types: a flag takes nothing (`--force`, never
    `--force <bool>`), a number N or X, a path PATH, anything else its option's name (`--arch ARCH`); a repeatable or
    comma-separated option says so."""
    import typing

    for info in app.registered_commands:
        fn = inspect.unwrap(info.callback)
        hints = typing.get_type_hints(fn)
        for name, param in inspect.signature(fn).parameters.items():
            opt = param.default
            if not isinstance(opt, typer.models.OptionInfo) or opt.metavar is not None:
                continue
            kind = hints.get(name)
            args = [a for a in typing.get_args(kind) if a is not type(None)]
            base = args[0] if args else kind
            many = typing.get_origin(base) is list
            base = typing.get_args(base)[0] if many else base
            long = next((d for d in [opt.default, *(opt.param_decls or ())] if isinstance(d, str) and
                         d.startswith("--")), f"--{name}")
            word = {bool: "", int: "N", float: "X", Path: "PATH"}.get(base, long[2:].upper().replace("-", "_"))
            opt.metavar = f"{word}..." if many and word else word


_placeholders()


def main():
    from kdev.fsutil import DEFERRED_SIGNALS, stop_on_signal

    for sig in DEFERRED_SIGNALS:
        signal.signal(sig, stop_on_signal)
    app(prog_name="kdev")  # `python -m kdev` too: its usage and errors name the command as a user types it
