"""The typer/click plumbing of the moebench command line, apart from its
verbs: commands whose help shows plain flags as flags, the consoles (that
outlive a reader who goes away), one red error line with an exit code, the
path parser of path options, the version and a terminal that cannot print
'µs'. Torch- and pandas-free: `moebench --help` reads it at start-up.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

import typer
import typer.core
from rich.console import Console
from rich.markup import escape

#: The exit code of a user error (click's own).
USAGE_ERROR = 2


def flags_as_flags(params: list) -> list:
    """`params` with an empty metavar on every plain flag (a bool option
    that takes no value, --help included) that has none, so that the help
    shows `--warm-l2`, not `--warm-l2 <bool>` (typer's rich help prints a
    flag's type as if it took a value, which `--warm-l2 true` is refused)."""
    for param in params:
        if getattr(param, "is_flag", False) and not getattr(param, "count", False) and param.metavar is None:
            param.metavar = ""
    return params


class Command(typer.core.TyperCommand):
    """A command whose help shows plain flags as flags (flags_as_flags)."""

    def get_params(self, ctx):
        return flags_as_flags(super().get_params(ctx))


#: The exit code of a command stopped by Ctrl-C (128 + SIGINT), as a shell reports it.
INTERRUPTED_EXIT = 130


class Group(typer.core.TyperGroup):
    """The app's group, its help showing plain flags as flags (flags_as_flags);
    a command stopped by Ctrl-C that does not say so itself says it in one
    line and exits 130 (typer alone exits 130 without a word)."""

    def get_params(self, ctx):
        return flags_as_flags(super().get_params(ctx))

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise fail("interrupted (Ctrl-C) before the command finished", INTERRUPTED_EXIT) from None


class ReaderSafeConsole(Console):
    """A rich Console that outlives its reader: when the pipe it prints to
    closes (`moebench sweep | head`), printing stops (the stream goes to
    /dev/null) and the command goes on, so a run is still stored and the exit
    code is the work's, not rich's default SystemExit(1) in mid-run."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        stream = sys.stderr if self.stderr else sys.stdout
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


console = ReaderSafeConsole(highlight=False)
err_console = ReaderSafeConsole(stderr=True, highlight=False)


def natural_width(renderable) -> int:
    """The columns `renderable` (a rich Table) takes when nothing limits it."""
    return Console(file=io.StringIO(), width=10_000).measure(renderable).maximum


def wide_console(width: int, *tables) -> Console:
    """A console for wide tables: at least `width` columns when stdout is not
    a terminal (logs, CI keep every column on one line), the terminal's own
    width when it is one (COLUMNS is honored), and never narrower than any of
    `tables` needs: rich would otherwise crop the cells of a table wider than
    the console (a 120-column terminal showed 9046.3 µs as "904"); a terminal
    narrower than the table wraps its lines instead, and no digit is lost."""
    base = console.width if console.is_terminal else max(console.width, width)
    return ReaderSafeConsole(highlight=False, width=max([base, *(natural_width(t) for t in tables)]))


def fail(message: str, code: int = USAGE_ERROR) -> typer.Exit:
    """Print `message` as one red line on stderr; return the typer.Exit(code) to raise."""
    # Escaped: messages quote shapes like [steps, rows, top_k] that rich would eat.
    err_console.print(f"[red]error: {escape(message)}[/red]", soft_wrap=True)
    return typer.Exit(code)


def package_version() -> str:
    """The installed package's version, else moebench.__version__ (a source tree on PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moebench")
    except PackageNotFoundError:
        import moebench

        return getattr(moebench, "__version__", "unknown")


def print_version(value: bool) -> None:
    """The --version callback: print the version and exit 0."""
    if value:
        console.print(f"moebench {package_version()}")
        raise typer.Exit()


def replace_unprintable() -> None:
    """On an ASCII terminal 'µs' and the box lines print as '?' instead of
    raising UnicodeEncodeError (stdout and stderr)."""
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None) or "utf-8"
        try:
            "µ─".encode(encoding)
        except (UnicodeEncodeError, LookupError):
            with contextlib.suppress(AttributeError, ValueError):
                stream.reconfigure(errors="replace")


def parse_path(text) -> Path:
    """A path option's value (typer `parser`): an empty one is refused, since
    Path("") is the current directory and the user meant something else;
    click then names the option (exit 2)."""
    if isinstance(text, Path):  # a default
        return text
    if not str(text).strip():
        raise typer.BadParameter("the path is empty; give a path ('.' for the current directory)")
    return Path(text)


def check_out(out, option: str = "--out", *, runs: bool = False) -> None:
    """reports.outdir.check_out(...), a refusal as a usage error. Call it
    after the other checks, so that a refused command creates nothing."""
    from moebench.reports import outdir

    try:
        outdir.check_out(out, option, runs=runs)
    except ValueError as error:
        raise fail(str(error)) from None
