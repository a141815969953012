"""What several b70ctl commands share, declared once: the same flag means the same thing in every command, and an
error or a value from an input reaches the terminal the same way."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from b70ctl.escaping import one_line

# Progress, warnings and errors: stderr, so stdout holds only a command's result (--json's document, a table).
console = Console(stderr=True)


def json_option(help: str = "Print JSON") -> Any:
    """--json: the command prints its result as one JSON document on stdout (what the roles read), and nothing else
    there; progress and errors go to stderr."""
    return typer.Option("--json", help=help)


JsonOption = Annotated[bool, json_option()]


def print_json(data: object) -> None:
    """What --json prints: the document, indented, as the one thing on stdout."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr and the exit code; never a traceback for a user's mistake."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def shown(value: object) -> str:
    """A value from an input (a server, a recipe file, a report) for a rich console: one line of text, no escape
    sequence, and no markup of rich's."""
    return escape(one_line(value))
