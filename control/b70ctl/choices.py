"""Options that take one word of a fixed set, the set being an Enum: --help and shell completion list its values,
and a word outside it is refused in one line naming them (BadInput, exit 2), as every other bad input is."""

from __future__ import annotations

from enum import Enum
from typing import Any

import typer

from b70ctl.errors import BadInput


def choice_option(choices: type[Enum], name: str, help: str, unknown: str | None = None) -> Any:
    """A typer.Option for NAME whose value is one of CHOICES' values, handed to the command as that str.
    `unknown` names what a wrong word is ("check" -> "--check 'x': unknown check; choose one of ...")."""
    values = [str(member.value) for member in choices]

    def parse(value: str) -> str:
        if value in values:
            return value
        reason = f"unknown {unknown}; " if unknown else ""
        raise BadInput(f"{name} {value!r}: {reason}choose one of {', '.join(values)}")

    return typer.Option(name, parser=parse, metavar=f"[{'|'.join(values)}]", help=help,
                        autocompletion=lambda: values)
