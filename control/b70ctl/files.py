"""Whole files or nothing: every document b70ctl writes goes through here.

The text is written to a temporary file beside the target, flushed to disk, and renamed over the target, so
a reader (or a run killed mid-write) sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_text_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    """`mode` defaults to readable by all (reports, locks are meant to be shared); secrets pass 0o600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_json_atomically(path: Path, data: Any, mode: int = 0o644, compact: bool = False,
                          sort_keys: bool = False) -> None:
    """Indented for people by default; `compact` for bulky raw data nobody reads by eye."""
    text = (json.dumps(data, separators=(",", ":"), sort_keys=sort_keys) if compact
            else json.dumps(data, indent=2, sort_keys=sort_keys) + "\n")
    write_text_atomically(path, text, mode)
