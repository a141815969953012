"""b70host/serve_wait.py, the serve gate's wait, run as the role runs it (the system Python, the host package's
module, argv), against real HTTP servers and a `systemctl` on PATH that answers `show` from a state file the test
moves the way systemd moves a unit: active, then dead and waiting for its restart (auto-restart), then restarted
(NRestarts + 1).

The states are systemd's own, not this repo's: src/core/service.c maps SERVICE_AUTO_RESTART to ActiveState
"activating" with SubState "auto-restart" (systemd 254 added "auto-restart-queued"), Result "exit-code" for a main
process that exited non-zero, and counts NRestarts (org.freedesktop.systemd1(5), "NRestarts: how many times this
service was restarted automatically"). The appliance's never-healthy test sees them on a real Debian 12 host."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from host_package import host_module

# `systemctl show --property=... UNIT`: the unit's lines from units.json, as systemd prints them.
FAKE_SYSTEMCTL = """#!/usr/bin/env python3
import json, os, sys
units = json.load(open(os.environ["FAKE_UNITS"]))
with open(os.environ["FAKE_CALLS"], "a") as calls:
    calls.write(sys.argv[-1] + "\\n")
state = units.get(sys.argv[-1], {"NRestarts": "0", "ActiveState": "inactive", "SubState": "dead", "Result": "success"})
print("\\n".join(f"{key}={value}" for key, value in state.items()))
"""


class Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def world(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(FAKE_SYSTEMCTL)
    (bin_dir / "systemctl").chmod(0o755)
    units = tmp_path / "units.json"
    calls = tmp_path / "calls"
    servers = []

    def serve() -> int:
        server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1]

    def set_units(**states: dict[str, str]) -> None:
        temporary = units.with_suffix(".tmp")
        temporary.write_text(json.dumps({unit.replace("_", "-"): state for unit, state in states.items()}))
        temporary.replace(units)

    def run(*args: str, servers: object) -> subprocess.Popen[str]:
        """The watcher with the role's server list on stdin ({"unit", "port", "baseline"} per server)."""
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_UNITS": str(units), "FAKE_CALLS": str(calls)}
        process = subprocess.Popen(host_module("serve_wait", *args), env=env, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert process.stdin is not None
        process.stdin.write(servers if isinstance(servers, str) else json.dumps(servers))
        process.stdin.close()
        return process

    def read_states(count: int) -> None:
        """Until the watcher has asked systemd `count` times: what it read first is its baseline."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if calls.exists() and len(calls.read_text().splitlines()) >= count:
                return
            time.sleep(0.1)
        raise AssertionError(f"the watcher did not ask systemctl {count} times")

    run.read_states = read_states  # type: ignore[attr-defined]
    yield serve, set_units, run
    for server in servers:
        server.shutdown()
        server.server_close()


def active(restarts: int = 0) -> dict[str, str]:
    return {"NRestarts": str(restarts), "ActiveState": "active", "SubState": "running", "Result": "success"}


def finished(process: subprocess.Popen[str]) -> tuple[int, dict]:
    assert process.stdout is not None and process.stderr is not None
    process.wait(timeout=60)
    out, err = process.stdout.read(), process.stderr.read()
    return process.returncode, json.loads(out) if out else {"stderr": err}


def servers(**ports: int) -> list[dict]:
    return [{"unit": unit.replace("_", "-"), "port": port, "baseline": unit.endswith("baseline")}
            for unit, port in ports.items()]


def test_every_server_healthy_is_exit_0(world) -> None:
    serve, set_units, run = world
    set_units(b70_vllm=active(), b70_vllm_baseline=active())
    listed = servers(b70_vllm=serve(), b70_vllm_baseline=serve())
    listed[1]["port"] = str(listed[1]["port"])  # as an inventory that quotes its port gives it
    code, result = finished(run("--timeout", "30", servers=listed))
    assert code == 0 and result["ok"] is True and result["reason"] is None
    assert [server["healthy"] for server in result["servers"]] == [True, True]


def test_a_unit_that_dies_while_starting_ends_the_wait_long_before_the_timeout(world, tmp_path) -> None:
    serve, set_units, run = world
    healthy_port, dead_port = serve(), 1  # nothing answers on port 1
    set_units(b70_vllm=active(restarts=3), b70_vllm_baseline=active())  # restarts from before the wait do not count
    process = run("--timeout", "600", servers=servers(b70_vllm=dead_port, b70_vllm_baseline=healthy_port))
    run.read_states(4)  # the baselines and a first look at each
    assert process.poll() is None  # alive and not answering yet: still waiting
    # vLLM exited: systemd holds the unit in auto-restart for RestartSec.
    set_units(b70_vllm={"NRestarts": "3", "ActiveState": "activating", "SubState": "auto-restart",
                        "Result": "exit-code"}, b70_vllm_baseline=active())
    code, result = finished(process)
    assert code == 1 and result["ok"] is False
    assert result["reason"].startswith("b70-vllm died while starting (1 time(s); systemd: activating/auto-restart, "
                                       f"result exit-code) before /health answered on port {dead_port}, after ")
    assert result["waited_s"] < 600  # stopped by the death, not by its timeout


def test_restarted_units_count_by_nrestarts_and_deaths_sets_how_many_stop_it(world) -> None:
    _serve, set_units, run = world
    set_units(b70_vllm=active(restarts=0))
    process = run("--timeout", "600", "--deaths", "2", servers=servers(b70_vllm=1))
    run.read_states(1)
    set_units(b70_vllm=active(restarts=1))  # died once and was restarted: 1 of the 2 allowed
    run.read_states(4)
    assert process.poll() is None
    set_units(b70_vllm=active(restarts=2))
    code, result = finished(process)
    assert code == 1 and "b70-vllm died while starting (2 time(s)" in result["reason"]


def test_the_timeout_names_every_server_that_did_not_answer(world) -> None:
    serve, set_units, run = world
    Health.status = 503  # up, not ready: vLLM answers /health only once its engine is
    try:
        port = serve()
        set_units(b70_vllm=active(), b70_vllm_baseline=active())
        code, result = finished(run("--timeout", "3", servers=servers(b70_vllm=port, b70_vllm_baseline=serve())))
    finally:
        Health.status = 200
    assert code == 1
    assert result["reason"] == (f"b70-vllm (port {port}), b70-vllm-baseline (port {result['servers'][1]['port']}) "
                                "did not answer /health within 3 s")


def test_a_stopped_unit_is_dead_at_once(world) -> None:
    _, set_units, run = world
    set_units(b70_vllm={"NRestarts": "0", "ActiveState": "failed", "SubState": "failed", "Result": "start-limit-hit"})
    code, result = finished(run("--timeout", "600", servers=servers(b70_vllm=1)))
    assert code == 1 and "failed/failed, result start-limit-hit" in result["reason"]


@pytest.mark.parametrize("listed, problem", [
    ("", "not JSON"), ("[]", "a non-empty JSON list"), ('{"unit": "b70-vllm"}', "a non-empty JSON list"),
    ('[{"unit": "b70-vllm"}]', "give {"), ('[{"unit": "b70 vllm", "port": 8000}]', "give {"),
    ('[{"unit": "b70-vllm", "port": 0}]', "give {"), ('[{"unit": "b70-vllm", "port": "http"}]', "give {"),
    ('[{"unit": "b70-vllm", "port": true}]', "give {"),
])
def test_a_bad_server_list_is_exit_2(world, listed: str, problem: str) -> None:
    _, _, run = world
    code, result = finished(run("--timeout", "5", servers=listed))
    assert code == 2 and problem in result["stderr"], result
