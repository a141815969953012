"""The one boundary per output kind that every string from outside crosses: a server's answers, host facts, a
reference file, an inventory, a recipe's fields, a log line, a directory name.

- `terminal_text`: what a terminal shows (stdout, stderr), and the stream filter `TerminalStream` b70ctl's
  entry point puts in front of both, so a command that forgot a value still cannot move the cursor, retitle the
  window or write the clipboard.
- `markdown_text`, `markdown_code`, `markdown_code_block`: a value in report.md, fleet.md, tune.md. Nothing a
  value holds can end, start or cut a structure there: no line break, no emphasis, link, image, HTML tag, entity,
  table pipe or code span of its own.
- `html_text`: a value in report.html, fleet.html, an SVG.
- `path_part`: a name from an input that becomes one component of a path.

Each first redacts (b70ctl.redact) and drops escape sequences and control characters (`printable`).
"""

from __future__ import annotations

import html
import re
from typing import IO, Any

from b70ctl.errors import BadInput
from b70ctl.redact import printable, redact

# Line breaks a Markdown reader or a browser honours: a value is one line wherever it is put.
_LINE_BREAKS = re.compile(r"\r\n|[\n\r\v\f\x85\u2028\u2029]")
# Characters that mean something inline in CommonMark/GFM: backslash, emphasis (* _ ~), code (`), links and
# images ([ ] !), table cells (|), math on GitHub ($): each is written
# backslash-escaped (CommonMark 2.4: any ASCII punctuation may be). What opens an HTML tag or an autolink (<) and
# an entity (&) is written as an entity, so not even a raw-text reader of the file sees a tag; a ">" alone closes
# nothing (a blockquote needs it first on a line, and no value starts a line).
# An underscore between two letters or digits ("draft_model") cannot open or close emphasis (CommonMark 6.2): it
# stays as it is, so names read as they are.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*~\[\]!|$]|(?<![^\W_])_|_(?![^\W_]))")
_MARKDOWN_ENTITIES = {"&": "&amp;", "<": "&lt;"}
# What opens a block first on a line: a blockquote, a list item ("-", "+", "1." or "1)"), a setext underline, an
# ATX heading.
_LINE_START = re.compile(r"^(\d{1,9}(?=[.)](?:\s|$))|)([.)>+=#-])")


class Markdown(str):
    """Text already in Markdown form (escaped, or written by b70ctl itself): inserted as it is."""


def terminal_text(value: object) -> str:
    """A value for a terminal: redacted, no escape sequence, no control character but line feed and tab."""
    return printable(str(value))


def one_line(value: object) -> str:
    """A value printable and on one line (every kind of line break becomes a space)."""
    return _LINE_BREAKS.sub(" ", printable(str(value)))


def _cut(text: str, length: int | None) -> str:
    return text if length is None or len(text) <= length else text[: max(length - 1, 0)] + "…"


def markdown_text(value: object, length: int | None = None, in_cell: bool = False) -> Markdown:
    """A value as Markdown text on one line (cut to `length` characters first, with "…"): every character that
    could open or close a structure is escaped, so it reads as it was and renders as nothing but text. Spaces
    at either end go: "** x**" would no longer open the emphasis it is put in."""
    escaped = _MARKDOWN_SPECIAL.sub(r"\\\1", _cut(one_line(value).strip(), length))
    # A value may start a line (a workload's description does): what opens a block there is escaped too, but in
    # a table cell (`in_cell`), where no block starts.
    if not in_cell:
        escaped = _LINE_START.sub(r"\1\\\2", escaped, count=1)
    return Markdown(re.sub(r"[&<]", lambda found: _MARKDOWN_ENTITIES[found.group()], escaped))


def markdown_code(value: object, length: int | None = None) -> Markdown:
    """A value as an inline code span on one line: fenced by one backtick more than the longest run in it, so it
    cannot end the span early; a pipe is escaped (GFM ends a table cell at any pipe, even in code)."""
    text = _cut(one_line(value), length).replace("|", "\\|")
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    padded = f" {text} " if text.startswith("`") or text.endswith("`") or not text.strip() else text
    return Markdown(f"{fence}{padded}{fence}")


def markdown_code_block(text: object, info: str = "") -> list[str]:
    """A fenced code block, as lines: the fence is longer than any backtick run the text holds, so no line of it
    can close the block."""
    body = printable(str(text))
    fence = "`" * max(3, max((len(run) for run in re.findall(r"`+", body)), default=0) + 1)
    return [f"{fence}{info}", *_LINE_BREAKS.split(body), fence]


def html_text(value: object) -> str:
    """A value as HTML text or an attribute value (quotes escaped too)."""
    return html.escape(printable(str(value)), quote=True)


# A path component from an input: letters, digits and . _ - (no separator, no "..", not hidden, not empty).
_PATH_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


PATH_PART_RULE = ("not usable as a file name (letters, digits, '.', '_' and '-', starting with a letter or digit, "
                  "no '..', at most 128 characters)")


def path_part_problem(name: object) -> str | None:
    """Why `name` cannot be one component of a path (PATH_PART_RULE), or None."""
    text = name if isinstance(name, str) else ""
    return None if _PATH_PART.fullmatch(text) and ".." not in text else PATH_PART_RULE


def path_part(name: object, what: str, fix: str) -> str:
    """`name` as one component of a path, or BadInput naming `what` and `fix`: a name from an input never
    climbs out of the directory it is put in, nor names an absolute path, a hidden file or a device."""
    problem = path_part_problem(name)
    if problem is not None:
        raise BadInput(f"{what} {one_line(name)[:80]!r}: {problem}: {fix}")
    return str(name)


# What rich writes to a terminal for its own styling and live display: SGR (colours), erase line, cursor up, show
# and hide the cursor. Everything else (OSC, DCS, cursor moves, screen clears) cannot come from b70ctl.
_OWN_SEQUENCE = re.compile(r"\x1b\[[0-9;]*m|\x1b\[[0-9]*[AK]|\x1b\[\?25[lh]|\x1b\[2K|\r")
_NEEDS_FILTER = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


class TerminalStream:
    """A text stream in front of stdout or stderr: what is written is redacted and stripped of escape sequences
    and control characters, except, on a terminal, the ones rich writes for colours and its status line. A value
    a command printed without `terminal_text` still reaches the terminal as text only."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._tty = bool(getattr(stream, "isatty", lambda: False)())

    def write(self, text: str) -> int:
        self._stream.write(self._filtered(text))
        return len(text)

    def _filtered(self, text: str) -> str:
        text = redact(text)
        if not _NEEDS_FILTER.search(text):
            return text
        if not self._tty:
            return printable(text)
        kept: list[str] = []
        position = 0
        for own in _OWN_SEQUENCE.finditer(text):
            kept += [printable(text[position:own.start()]), own.group()]
            position = own.end()
        kept.append(printable(text[position:]))
        return "".join(kept)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
