"""Errors that end a command with a one-line message.

BadInput (exit 2): the user's input or the endpoint is wrong; the message names the problem and the fix.
CheckFailed (exit 1) is not an exception: checks return results and the CLI maps them to exit codes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from b70host import BadInput as BadInput  # the host package refuses with the same exception

if TYPE_CHECKING:
    from pydantic import ValidationError


def first_problem(error: ValidationError) -> str:
    """The first problem a pydantic ValidationError found, as `dotted.field: what is wrong`: one line that names
    the field, for a BadInput message."""
    first = error.errors()[0]
    location = ".".join(str(part) for part in first["loc"]) or "(top level)"
    return f"{location}: {first['msg'].removeprefix('Value error, ')}"
