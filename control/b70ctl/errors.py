"""Errors that end a command with a one-line message: the hierarchy b70host defines (B70Error and its families,
each with its exit code), for b70ctl to import from one place.

B70Error's families: BadInput (the user's input), Unreachable (an endpoint, a registry, an API, a host), Refused (a
domain refusal), HostFailed (a command on a host), CheckAborted (a check stopped before its end). A failed check
is not an exception: checks return results and the CLI maps them to exit codes (1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# The host package refuses with the same exceptions.
from b70host import B70Error as B70Error
from b70host import BadInput as BadInput
from b70host import CheckAborted as CheckAborted
from b70host import HostFailed as HostFailed
from b70host import Refused as Refused
from b70host import Unreachable as Unreachable

if TYPE_CHECKING:
    from pydantic import ValidationError


def first_problem(error: ValidationError) -> str:
    """The first problem a pydantic ValidationError found, as `dotted.field: what is wrong`: one line that names
    the field, for a BadInput message."""
    first = error.errors()[0]
    location = ".".join(str(part) for part in first["loc"]) or "(top level)"
    return f"{location}: {first['msg'].removeprefix('Value error, ')}"
