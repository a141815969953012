#!/usr/bin/env python3
"""The last lines each serving unit wrote to the journal: what `b70ctl diagnose --start` reads after a start failed.

Standard library only: the vllm_serve role runs it on the serving host, before a rollback restarts the units (their
new lines would follow the failed start's).

    python3 -m b70host.journal [--lines N] < servers.json

servers.json is the role's list of servers, as for serve_wait. Prints one JSON object, {"units": [{"unit": NAME,
"lines": [...], "error": null}]}, in the list's order; a unit journalctl cannot read has no lines and journalctl's
last line of error (the diagnosis quotes it). Exit 0, or 2 on bad arguments or a bad list.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from b70host.serve_wait import read_servers

DEFAULT_LINES = 400


def unit_journal(unit: str, count: int) -> dict[str, object]:
    """The unit's last lines, or none and what journalctl said instead."""
    try:
        shown = subprocess.run(["journalctl", "--unit", unit, "--lines", str(count), "--no-pager", "--output", "cat"],
                               capture_output=True, text=True, errors="replace", check=False)
    except OSError as error:  # no journalctl at all: a host without systemd's journal
        return {"unit": unit, "lines": [], "error": error.strerror or str(error)}
    if shown.returncode != 0:
        said = (shown.stderr.strip().splitlines() or ["exit %d" % shown.returncode])[-1]
        return {"unit": unit, "lines": [], "error": said}
    return {"unit": unit, "lines": shown.stdout.splitlines(), "error": None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=DEFAULT_LINES, help="last lines per unit")
    args = parser.parse_args(argv)
    if args.lines < 1:
        parser.error("--lines must be at least 1")
    try:
        servers = read_servers(sys.stdin.read())
    except ValueError as error:
        parser.error(str(error))
    print(json.dumps({"units": [unit_journal(unit, args.lines) for unit, _ in servers]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
