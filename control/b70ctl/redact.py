"""Secrets and terminal control out of everything b70ctl prints or stores.

A server (or a proxy in front of it) may echo the request's Authorization header in an error body, and a server's
model name or log line may hold terminal escape sequences. Every secret in play in this process (the API key, the
password of http://user:pw@host, a Hugging Face token in the environment) is registered here once, and every text
that leaves the process (report files, raw/, the error line) goes through `redact`; text shown on a terminal or in
report.md also through `printable`.
"""

from __future__ import annotations

import html
import json
import os
import re
from urllib.parse import quote

REDACTED = "[redacted]"
# Variables a Hugging Face token is read from (huggingface_hub's constants.py: HF_TOKEN, and the older name).
HF_TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
# Shorter values are not redacted as substrings: a 1-3 character password would blank every word holding it.
MIN_SECRET_CHARS = 4

_secrets: set[str] = set()

# Credentials of any request, whoever's they are: what a proxy echoes of the headers, and a URL's user:password.
_CREDENTIAL_PATTERNS = (
    re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{4,}|\b(Basic\s+)(?=[A-Za-z+/]*[0-9+/=])[A-Za-z0-9+/]{8,}={0,2}"),
    re.compile(r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?)(?!\[redacted\])[^\s\"',}]+(\s+[^\s\"',}]+)?"),
    re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^/\s:@]+:)[^/\s@]+(@)"),
)
# CSI and OSC escape sequences whole (so no parameter bytes stay behind), then any other control character.
_ESCAPE_SEQUENCE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)?|\x1b[@-_]?")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def keep_secret(value: str | None) -> None:
    """`value` is a secret of this run: it never appears in anything printed or stored from now on."""
    if value and len(value) >= MIN_SECRET_CHARS:
        _secrets.add(value)


def secrets_in_play() -> set[str]:
    """The registered secrets and a Hugging Face token in the environment (read each time: it may be set late)."""
    found = set(_secrets)
    for name in HF_TOKEN_VARIABLES:
        token = os.environ.get(name, "").strip()
        if len(token) >= MIN_SECRET_CHARS:
            found.add(token)
    return found


def _forms(secret: str) -> set[str]:
    """The secret as it reads in plain text, in a JSON string, in HTML and in a URL."""
    return {secret, json.dumps(secret)[1:-1], html.escape(secret), quote(secret, safe="")}


def redact(text: str) -> str:
    """`text` with every secret in play replaced by [redacted]. Exact values only: a model's output that happens
    to read "bearer bonds" stays as it was (a recorded reference must compare equal later)."""
    for secret in sorted(secrets_in_play(), key=len, reverse=True):
        for form in sorted(_forms(secret), key=len, reverse=True):
            text = text.replace(form, REDACTED)
    return text


def redact_credentials(text: str) -> str:
    """`text` redacted, and any credential a header or URL carries in it too, whoever's it is: for text whose
    secrets this process cannot know (a report written elsewhere, copied into the fleet report), and for the error
    line."""
    text = _CREDENTIAL_PATTERNS[0].sub(lambda m: f"{m.group(1) or m.group(2)}{REDACTED}", redact(text))
    text = _CREDENTIAL_PATTERNS[1].sub(lambda m: f"{m.group(1)}{REDACTED}", text)
    return _CREDENTIAL_PATTERNS[2].sub(lambda m: f"{m.group(1)}{REDACTED}{m.group(2)}", text)


def printable(text: str) -> str:
    """`text` redacted, without escape sequences or control characters (line breaks and tabs stay): what a server
    sent can neither hide a line on a terminal, nor retitle it, nor ring it."""
    return _CONTROL.sub("", _ESCAPE_SEQUENCE.sub("", redact_credentials(text)))
