"""Filters writing values into a systemd unit so that systemd reads back exactly the value (systemd.syntax(7),
systemd.service(7) "Command lines"): no value can end a line, open a quote or expand a specifier."""

from __future__ import annotations

CONTROL_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def systemd_exec_argument(value: object) -> str:
    """One ExecStart argument, double-quoted: backslash and double quote escaped, control characters as C
    escapes, % (specifiers) and $ (environment expansion) doubled."""
    text = str(value)
    out = []
    for character in text:
        if character == "\\":
            out.append("\\\\")
        elif character == '"':
            out.append('\\"')
        elif character in CONTROL_ESCAPES:
            out.append(CONTROL_ESCAPES[character])
        elif ord(character) < 32 or ord(character) == 127:
            out.append(f"\\x{ord(character):02x}")
        elif character == "%":
            out.append("%%")
        elif character == "$":
            out.append("$$")
        else:
            out.append(character)
    return '"' + "".join(out) + '"'


def systemd_text(value: object) -> str:
    """Free text in a setting's value or a comment (Description=): one line, specifiers taken literally."""
    text = " ".join(str(value).split())
    return "".join(character for character in text if ord(character) >= 32 and ord(character) != 127) \
        .replace("%", "%%")


class FilterModule:
    def filters(self) -> dict[str, object]:
        return {"systemd_exec_argument": systemd_exec_argument, "systemd_text": systemd_text}
