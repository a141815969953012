"""Errors that end a command with a one-line message.

BadInput (exit 2): the user's input or the endpoint is wrong; the message names the problem and the fix.
CheckFailed (exit 1) is not an exception: checks return results and the CLI maps them to exit codes.
"""


class BadInput(Exception):
    """Bad input or unreachable service: exit 2 with one line naming the problem and the fix."""

    exit_code = 2
