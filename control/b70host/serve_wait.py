#!/usr/bin/env python3
"""Wait until every vLLM server of a host answers /health, or stop as soon as one of them has died.

Standard library only: the vllm_serve role runs this file on the serving host with the system Python, right after
it started (or restarted) the units.

    python3 serve_wait.py --timeout SECONDS [--deaths N] < servers.json

servers.json is the role's list of servers, [{"unit": "b70-vllm", "port": 8000, ...}, ...] (other keys ignored).

All servers are watched at once, so the wait is as long as the slowest start, not the sum of the starts. A unit
that died while starting is restarted by systemd (Restart=on-failure) and would only die again: an XPU start that
crashes at its first collective would otherwise hold the play for the whole health timeout (900 s by default)
before the rollback. A unit has died when systemd's count of its automatic restarts (NRestarts) has grown since
the wait began, and while it waits for that restart (SubState auto-restart, for RestartSec) or is not active at
all (failed, or stopped). --deaths (default 1) is how many deaths stop the wait.

Prints one JSON object: {"ok": bool, "reason": str | null, "waited_s": float, "servers": [{"unit", "port",
"healthy", "deaths", "active_state", "result"}]}. Exit 0 when every server answered /health with 200, 1 when one
died --deaths times or the timeout passed (reason names which and how), 2 on bad arguments or a bad list.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

UNIT_NAME = re.compile(r"^[A-Za-z0-9@._-]+$")
POLL_INTERVAL_S = 2.0
HEALTH_REQUEST_TIMEOUT_S = 5.0


def unit_state(unit: str) -> dict[str, str]:
    """systemd's view of the unit: NRestarts, ActiveState, SubState, Result."""
    shown = subprocess.run(["systemctl", "show", "--property=NRestarts,ActiveState,SubState,Result", unit],
                           capture_output=True, text=True, check=False)
    return dict(line.split("=", 1) for line in shown.stdout.splitlines() if "=" in line)


def restarts(state: dict[str, str]) -> int:
    try:
        return int(state.get("NRestarts", "0"))
    except ValueError:
        return 0


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=HEALTH_REQUEST_TIMEOUT_S) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def read_servers(text: str) -> list[tuple[str, int]]:
    """[(unit, port)] from the role's JSON list; ValueError naming the first entry that is not one."""
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"the server list on stdin is not JSON ({error.msg})") from error
    if not isinstance(entries, list) or not entries:
        raise ValueError("the server list on stdin must be a non-empty JSON list")
    servers = []
    for entry in entries:
        unit = entry.get("unit") if isinstance(entry, dict) else None
        port = entry.get("port") if isinstance(entry, dict) else None
        if isinstance(port, str) and port.isdigit():  # an inventory may give the port as a string
            port = int(port)
        if not isinstance(unit, str) or not UNIT_NAME.match(unit) or type(port) is not int or not 0 < port < 65536:
            raise ValueError(f"server {json.dumps(entry)}: give {{\"unit\": NAME, \"port\": 1-65535}}")
        servers.append((unit, port))
    return servers


@dataclass
class Watched:
    unit: str
    port: int
    restarts_before: int
    healthy: bool = False
    deaths: int = 0
    active_state: str = ""
    result: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"unit": self.unit, "port": self.port, "healthy": self.healthy, "deaths": self.deaths,
                "active_state": self.active_state, "result": self.result}


def wait(servers: list[tuple[str, int]], timeout_s: float, deaths_allowed: int) -> dict[str, Any]:
    started = time.monotonic()
    watched = [Watched(unit, port, restarts(unit_state(unit))) for unit, port in servers]
    reason: str | None = None
    while reason is None:
        for server in (server for server in watched if not server.healthy):
            state = unit_state(server.unit)
            server.active_state, server.result = state.get("ActiveState", ""), state.get("Result", "")
            server.deaths = restarts(state) - server.restarts_before
            if (server.active_state in ("failed", "inactive")
                    or state.get("SubState", "").startswith("auto-restart")):
                server.deaths += 1  # dead now: waiting for systemd's restart (RestartSec), or not to be restarted
            if server.deaths >= deaths_allowed:
                reason = (f"{server.unit} died while starting ({server.deaths} time(s); systemd: "
                          f"{server.active_state}/{state.get('SubState', '')}, result {server.result or '-'}) "
                          f"before /health answered on port {server.port}, after "
                          f"{time.monotonic() - started:.0f} s")
                break
            server.healthy = healthy(server.port)
        waited = time.monotonic() - started
        if reason is not None or all(server.healthy for server in watched):
            break
        if waited >= timeout_s:
            late = [f"{server.unit} (port {server.port})" for server in watched if not server.healthy]
            reason = f"{', '.join(late)} did not answer /health within {timeout_s:.0f} s"
            break
        time.sleep(min(POLL_INTERVAL_S, max(0.0, timeout_s - waited)))
    return {"ok": reason is None, "reason": reason, "waited_s": round(time.monotonic() - started, 1),
            "servers": [server.as_json() for server in watched]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, required=True, help="seconds to wait for every server")
    parser.add_argument("--deaths", type=int, default=1, help="deaths of one unit that stop the wait")
    args = parser.parse_args(argv)
    if not args.timeout > 0 or args.deaths < 1:
        parser.error("--timeout must be above 0 and --deaths at least 1")
    try:
        servers = read_servers(sys.stdin.read())
    except ValueError as error:
        parser.error(str(error))
    result = wait(servers, args.timeout, args.deaths)
    print(json.dumps(result, sort_keys=True))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
