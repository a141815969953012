"""Secrets and terminal control out of everything b70ctl prints or stores.

A server (or a proxy in front of it) may echo the request's Authorization header in an error body, and a server's
model name or log line may hold terminal escape sequences. Every secret in play in this process (the API key, the
password of http://user:pw@host, a Hugging Face token in the environment) is registered here once, and every text
that leaves the process (report files, raw/, the error line) goes through `redact`; text shown on a terminal or in
report.md also through `printable`.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
from functools import lru_cache
from urllib.parse import quote, quote_plus

REDACTED = "[redacted]"
# Variables a Hugging Face token is read from (huggingface_hub's constants.py: HF_TOKEN, and the older name).
HF_TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
# Shorter values are not redacted as substrings: a 1-3 character password would blank every word holding it.
MIN_SECRET_CHARS = 4
# A secret cut short (an error body truncated at 200 characters, a line cut at a column) still gives most of it
# away: a prefix or suffix of any of its forms is redacted once it holds this many characters, or half the form,
# whichever is more. Shorter secrets are only redacted whole.
MIN_CUT_CHARS = 8

_secrets: set[str] = set()

# Credentials of any request, whoever's they are: what a proxy echoes of the headers, and a URL's user:password.
_CREDENTIAL_PATTERNS = (
    re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{4,}|\b(Basic\s+)(?=[A-Za-z+/]*[0-9+/=])[A-Za-z0-9+/]{8,}={0,2}"),
    re.compile(r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?)(?!\[redacted\])[^\s\"',}]+(\s+[^\s\"',}]+)?"),
    re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^/\s:@]+:)[^/\s@]+(@)"),
)
# Escape sequences in one value, whole, so no parameter bytes stay behind: CSI; the string sequences (OSC, DCS, SOS,
# PM, APC), which end at BEL or ST, and here also at the end of the line or the next ESC, so an unterminated one
# takes at most the rest of its own line of its own value; any other ESC with the byte after it, and a lone ESC.
_ESCAPE_SEQUENCE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[\]PX^_][^\x07\x1b\n]*(?:\x07|\x1b\\)?|\x1b[ -~]?")
# Control characters but line feed and tab; C1 (8-bit CSI, OSC...); the bidirectional overrides and isolates,
# which reorder what a terminal or a browser shows (a "Trojan Source" line reads other than it is).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def keep_secret(value: str | None) -> None:
    """`value` is a secret of this run: it never appears in anything printed or stored from now on."""
    if value and len(value) >= MIN_SECRET_CHARS:
        _secrets.add(value)


def forget_secrets() -> None:
    """The end of a command: the next one (b70ctl called again in the same process, as the tests do) starts with
    no secret of this one's."""
    _secrets.clear()


def credentials_in_use() -> bool:
    """Whether this run sends a credential (an API key, a URL's password): what a server answers may then quote
    it in a form redaction cannot know, so whatever holds a server's text is written for this user only."""
    return bool(_secrets)


def secrets_in_play() -> set[str]:
    """The registered secrets and a Hugging Face token in the environment (read each time: it may be set late)."""
    found = set(_secrets)
    for name in HF_TOKEN_VARIABLES:
        token = os.environ.get(name, "").strip()
        if len(token) >= MIN_SECRET_CHARS:
            found.add(token)
    return found


def keep_basic_credentials(user: str, password: str) -> None:
    """A URL's user:password, sent as basic auth: the password is a secret, and so is the header's base64 of
    "user:password" (what a server echoing the Authorization header sends back)."""
    keep_secret(password)
    if password and len(password) >= MIN_SECRET_CHARS:
        keep_secret(base64.b64encode(f"{user}:{password}".encode()).decode())


def _base64_forms(secret: str) -> set[str]:
    """The secret base64-encoded (standard and URL-safe alphabets, without padding: padding is where it ends)."""
    raw = secret.encode()
    return {base64.b64encode(raw).decode().rstrip("="), base64.urlsafe_b64encode(raw).decode().rstrip("=")}


@lru_cache(maxsize=64)
def _forms(secret: str) -> tuple[str, ...]:
    """The secret as a server or a writer can quote it: plain; in a JSON string, a Python repr, HTML, a URL
    (each also inside a JSON string or HTML, as a report stores what it was given); base64. Longest first."""
    once = {secret, json.dumps(secret)[1:-1], repr(secret)[1:-1], html.escape(secret), quote(secret, safe=""),
            quote_plus(secret, safe="")}
    forms = once | {json.dumps(form)[1:-1] for form in once} | {html.escape(form) for form in once}
    forms |= _base64_forms(secret)
    return tuple(sorted(forms, key=len, reverse=True))


def _cut_length(form: str) -> int:
    return max(MIN_CUT_CHARS, (len(form) + 1) // 2)


_TRUNCATION_MARKS = ("…", "...")


def _is_cut_end(text: str, end: int, form: str, kept: int) -> bool:
    """Whether text[:end], holding form[:kept], is the form cut short there rather than a word that happens to
    begin like it: the text ends, or a truncation mark follows, or the form goes on inside a word (a letter or
    digit) where the text does not. "rehearsal" in "serve/rehearsal.yaml" is not the key "rehearsal-key-3e9a" cut
    short: the key goes on with "-" there, so the word is whole."""
    if end == len(text) or text.startswith(_TRUNCATION_MARKS, end):
        return True
    return form[kept].isalnum() and not text[end].isalnum()


def _is_cut_start(text: str, start: int, form: str, dropped: int) -> bool:
    """The same at the front: text[start:] begins with form[dropped:]."""
    if start == 0 or text.endswith(_TRUNCATION_MARKS, 0, start):
        return True
    return form[dropped - 1].isalnum() and not text[start - 1].isalnum()


def _redact_form(text: str, form: str) -> str:
    """Every whole occurrence of `form`, then every cut one: a prefix of `form` of at least _cut_length characters
    that ends where the form was cut (_is_cut_end), and a suffix that starts where it was cut."""
    text = text.replace(form, REDACTED)
    cut = _cut_length(form)
    if len(form) < MIN_CUT_CHARS or len(form) <= cut:
        return text
    head, tail = form[:cut], form[-cut:]
    if head not in text and tail not in text:
        return text
    pieces: list[str] = []
    position = 0
    search = 0
    while True:
        found = text.find(head, search)
        if found < 0:
            break
        end = found + cut
        while end < len(text) and end - found < len(form) and text[end] == form[end - found]:
            end += 1
        if end - found < len(form) and not _is_cut_end(text, end, form, end - found):
            search = found + 1
            continue
        pieces += [text[position:found], REDACTED]
        position = search = end
    text = "".join(pieces) + text[position:]
    pieces, position, search = [], 0, 0
    while True:
        found = text.find(tail, search)
        if found < 0:
            break
        start, dropped = found, len(form) - cut  # extend backwards while the text reads as the form's end
        while start > position and dropped > 0 and text[start - 1] == form[dropped - 1]:
            start, dropped = start - 1, dropped - 1
        if dropped > 0 and not _is_cut_start(text, start, form, dropped):
            search = found + 1
            continue
        pieces += [text[position:start], REDACTED]
        position = search = found + cut
    return "".join(pieces) + text[position:]


def redact(text: str) -> str:
    """`text` with every secret in play replaced by [redacted], in each of the forms it can be quoted in, and cut
    short to any length worth having (MIN_CUT_CHARS, half the form). A model's output that happens to read
    "bearer bonds" stays as it was (a recorded reference must compare equal later)."""
    for secret in sorted(secrets_in_play(), key=len, reverse=True):
        for form in _forms(secret):
            text = _redact_form(text, form)
    return text


def redact_credentials(text: str) -> str:
    """`text` redacted, and any credential a header or URL carries in it too, whoever's it is: for text whose
    secrets this process cannot know (a report written elsewhere, copied into the fleet report), and for the error
    line."""
    text = _CREDENTIAL_PATTERNS[0].sub(lambda m: f"{m.group(1) or m.group(2)}{REDACTED}", redact(text))
    text = _CREDENTIAL_PATTERNS[1].sub(lambda m: f"{m.group(1)}{REDACTED}", text)
    return _CREDENTIAL_PATTERNS[2].sub(lambda m: f"{m.group(1)}{REDACTED}{m.group(2)}", text)


def printable(text: str) -> str:
    """One value from outside (a server's answer, a log line, a file's field) redacted, without escape sequences
    or control characters (line breaks and tabs stay): it can neither hide a line on a terminal, nor retitle it,
    nor write its clipboard, nor ring it. For a value, not a document: an unterminated sequence takes the rest of
    its line with it (b70ctl.escaping.terminal_text is the terminal's boundary)."""
    return _CONTROL.sub("", _ESCAPE_SEQUENCE.sub("", redact_credentials(text)))


def without_controls(document: str) -> str:
    """A whole rendered document (report.md, report.html) redacted and without control characters: the last line
    of defence, after each value was made printable where it was inserted. Only control characters go, one at a
    time, never a run of text: a stray ESC here cannot take the markup after it along."""
    return _CONTROL.sub("", redact_credentials(document))
