"""Options several b70ctl commands share, declared once: the same flag means the same thing in every command."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer


def json_option(help: str = "Print JSON") -> Any:
    """--json: the command prints its result as one JSON document on stdout (what the roles read), and nothing else
    there; progress and errors go to stderr."""
    return typer.Option("--json", help=help)


JsonOption = Annotated[bool, json_option()]


def print_json(data: object) -> None:
    """What --json prints: the document, indented, as the one thing on stdout."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
