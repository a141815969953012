"""Helpers of the hostile-input corpus (test_hostile_inputs.py): run b70ctl's real entry point in this process,
and check what a refused or faulted command left behind.

Every case asserts the same four things: the exit code; exactly one `error:` line naming the problem (never a
traceback); no file changed outside the places the case says the command may write; no temporary or
half-written file anywhere under the case's directory.
"""

from __future__ import annotations

import io
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Names the writers use for what is not finished yet: none may outlive a command.
HALF_WRITTEN = re.compile(r"(\.tmp$|\.partial$|\.retired$|\.write-test$|^\.[^/]*\.[0-9a-z_]{8}\.tmp$)")


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]


@dataclass
class Invocation:
    """What a case runs: the arguments, its environment changes, stdin, and where it may write."""

    args: list[str]
    env: dict[str, str | None] = field(default_factory=dict)
    stdin: str | None = None
    may_write: list[Path] = field(default_factory=list)


def snapshot(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every entry under root: kind, size and mtime (directories by name only)."""
    seen: dict[str, tuple[str, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            stat = path.lstat()
            kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file"
            size = 0 if kind == "dir" else stat.st_size
            mtime = 0 if kind == "dir" else stat.st_mtime_ns
            seen[path.relative_to(root).as_posix()] = (kind, size, mtime)
    return seen


def run_b70ctl(args: list[str], env: dict[str, str | None] | None = None, stdin: str | None = None) -> Outcome:
    """b70ctl's own `main()` (the one the console script runs), in this process: exit code, stdout, stderr."""
    from b70ctl.cli import main

    saved_env = {name: os.environ.get(name) for name in (env or {})}
    saved = sys.argv, sys.stdin, sys.stdout, sys.stderr
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["b70ctl", *args]
    sys.stdin = io.StringIO(stdin or "")
    sys.stdout, sys.stderr = out, err
    for name, value in (env or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    code: Any = 0
    try:
        main()
    except SystemExit as exit_:
        code = exit_.code
    finally:
        sys.argv, sys.stdin, sys.stdout, sys.stderr = saved
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return Outcome(code=code if isinstance(code, int) else (0 if code is None else 1), stdout=out.getvalue(),
                   stderr=err.getvalue())


def assert_one_line_error(outcome: Outcome, code: int, pattern: str) -> None:
    assert outcome.code == code, f"exit {outcome.code}, expected {code}\nstderr: {outcome.stderr}"
    assert "Traceback" not in outcome.stderr, outcome.stderr
    if code == 0:
        return
    lines = outcome.error_lines
    assert len(lines) == 1, f"expected one error line, got: {outcome.stderr!r}"
    assert re.search(pattern, lines[0]), f"{pattern!r} not in {lines[0]!r}"


def assert_left_clean(root: Path, before: dict[str, tuple[str, int, int]], may_write: list[Path]) -> None:
    """Nothing changed outside may_write; nothing half-written anywhere under root."""
    after = snapshot(root)
    allowed = [p.resolve().relative_to(root.resolve()).as_posix() for p in may_write]

    def inside(name: str) -> bool:
        return any(name == a or name.startswith(a + "/") for a in allowed)

    changed = sorted(name for name in set(before) | set(after)
                     if before.get(name) != after.get(name) and not inside(name)
                     and not (before.get(name, ("",))[0] == "dir" and after.get(name, ("",))[0] == "dir"))
    assert not changed, f"written outside the target: {changed}"
    half = sorted(name for name in after if HALF_WRITTEN.search(name.rsplit("/", 1)[-1]))
    assert not half, f"half-written files left: {half}"
