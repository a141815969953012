"""b70ctl: the appliance's command line. This module only dispatches: each command lives in its package's cli.py
(SUBCOMMANDS), parses its arguments, calls one function and renders the result, rich for people and --json for
machines. Here: the top-level group, --version, and the entry point that ends every B70Error with one line and its
exit code. Exit codes: 0 ok, 1 a check failed, 2 bad input or unreachable."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from typer.core import TyperGroup

from b70ctl.errors import B70Error
from b70ctl.escaping import TerminalStream, one_line
from b70ctl.options import console

# Every command lives in its own package, imported only when named: `b70ctl fleet report`, the one b70ctl call of a
# converged site.yml, then starts without the checks, the tuner, docker, httpx and the lock resolver. Each is a Typer
# app (a command group) or a function (one command). Listed in the order `b70ctl --help` shows them.
SUBCOMMANDS = {
    "verify": ("b70ctl.verify.cli", "verify_command"),
    "demo": ("b70ctl.verify.cli", "demo_command"),
    "recipes": ("b70ctl.recipes.cli", "app"),
    "diagnose": ("b70ctl.diagnose.cli", "diagnose_command"),
    "tune": ("b70ctl.tune.cli", "tune_command"),
    "lock": ("b70ctl.lock.cli", "app"),
    "model": ("b70ctl.models.cli", "app"),
    "host": ("b70ctl.host.cli", "app"),
    "fleet": ("b70ctl.fleet.cli", "app"),
    "image": ("b70ctl.image.cli", "app"),
    "serve": ("b70ctl.serve.cli", "app"),
}


class LazyGroup(TyperGroup):
    """b70ctl's top-level group: SUBCOMMANDS, each loaded on first use (help and
    shell completion load them all). Contexts and commands are typed Any: typer's are its vendored click's, which it
    does not export."""

    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx), *(name for name in SUBCOMMANDS if name not in self.commands)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in self.commands and cmd_name in SUBCOMMANDS:
            module, attribute = SUBCOMMANDS[cmd_name]
            loaded = getattr(__import__(module, fromlist=[attribute]), attribute)
            command: Any
            if isinstance(loaded, typer.Typer):
                command = typer.main.get_group(loaded)
                command.name = cmd_name
            else:
                single = typer.Typer(add_completion=False)
                single.command(cmd_name)(loaded)
                command = typer.main.get_command(single)
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] not in self.commands and args[0] not in SUBCOMMANDS:
            for name in SUBCOMMANDS:  # not a command: load them all, so "Did you mean ...?" can name any
                self.get_command(ctx, name)
        return super().resolve_command(ctx, args)


app = typer.Typer(cls=LazyGroup, no_args_is_help=True, help=__doc__,
                  context_settings={"help_option_names": ["-h", "--help"]})


def _print_version(value: bool) -> None:
    if value:
        from b70ctl import __version__

        print(f"b70ctl {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="Print b70ctl's version and exit")] = False,
             ) -> None:
    """Run Qwen3.8-27B with a DSpark drafter on Arc Pro B70 hosts, and verify it against the published claims."""


def main() -> None:
    """The console script. Any exception that still escapes a command is a defect: one line naming the command and
    the file holding the full traceback, exit 2; `--debug` (anywhere on the line) shows the traceback instead."""
    debug = "--debug" in sys.argv[1:]
    if debug:
        sys.argv.remove("--debug")
    # Whatever a command prints from its inputs reaches the terminal as text only: no escape sequence of a
    # server's or a file's (b70ctl.escaping), and no secret of this run.
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = TerminalStream(sys.stdout), TerminalStream(sys.stderr)
    try:
        _run(debug)
    finally:
        sys.stdout, sys.stderr = streams
        from b70ctl.redact import forget_secrets

        forget_secrets()


def _run(debug: bool) -> None:
    try:
        app()
    except B70Error as error:
        # escaped: a message may quote a path or an install hint in brackets ('b70ctl[appliance]')
        # printable: a message may quote what a server sent (an echoed key, an escape sequence)
        line = one_line(error)
        console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
        sys.exit(error.exit_code)
    except Exception as error:
        if debug:
            raise
        command = " ".join(["b70ctl", *[word for word in sys.argv[1:3] if not word.startswith("-")][:2]])
        where = save_traceback()
        console.print(f"[bold red]error:[/] {command} failed unexpectedly ({error.__class__.__name__}); the full "
                      f"traceback is in {where}: run it again with --debug to see it, and report it",
                      highlight=False, soft_wrap=True)
        sys.exit(2)


def save_traceback() -> str:
    """The traceback being handled, in a private file under the user's cache (it may quote local paths)."""
    import time
    import traceback

    from b70ctl.files import write_text_atomically

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = cache / "b70ctl" / "tracebacks" / f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.txt"
    try:
        write_text_atomically(path, traceback.format_exc(), mode=0o600)
    except OSError:
        return "(not saved: the cache is not writable)"
    return str(path)
