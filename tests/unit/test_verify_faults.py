"""verify under faults: SIGTERM (what systemd and Ansible send), a full disk under --out, two runs into one --out,
and raw data left by an earlier run. Each leaves the last consistent report marked partial with the reason, or
exits 2 with nothing half-written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from b70ctl.checks.client import Endpoint, EndpointError, VllmClient
from b70ctl.errors import BadInput
from b70ctl.verify.run_dir import RunDirectory
from scripted_server import Script, ScriptedServer, short_recipe, verify_scripted

SLOW = Script(ttft_s=0.05, offsets_s=[0.1 * k for k in range(33)], tokens_per_chunk=[1] * 33)  # 3.2 s a request


@pytest.fixture
def servers():
    with ScriptedServer() as served, ScriptedServer() as baseline:
        baseline.speculates = False
        yield served, baseline


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*") if p.name.startswith(".") and p.name != RunDirectory.LOCK_NAME)


def test_a_second_run_into_the_same_out_is_refused(servers, tmp_path):
    served, baseline = servers
    with RunDirectory(tmp_path):  # a run that is still writing there
        with pytest.raises(BadInput, match="another b70ctl verify is writing there"):
            verify_scripted(short_recipe(), served, baseline, tmp_path)
    assert not (tmp_path / "report.json").exists()
    verify_scripted(short_recipe(), served, baseline, tmp_path)  # once it ended, the directory is free again
    assert json.loads((tmp_path / "report.json").read_text())["partial"] is False


def test_raw_data_of_an_earlier_run_is_cleared(servers, tmp_path):
    served, baseline = servers
    verify_scripted(short_recipe(), served, baseline, tmp_path)  # the earlier run: raw/ carries verify's marker
    stale = tmp_path / "raw" / "throughput" / "gone" / "001.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    verify_scripted(short_recipe(), served, baseline, tmp_path)
    assert not stale.exists() and (tmp_path / "raw" / "throughput" / "short" / "001.json").exists()
    assert leftovers(tmp_path) == []


def test_sigterm_leaves_the_report_marked_terminated(servers, tmp_path):
    served, baseline = servers
    served.scripts["go"] = SLOW
    recipe_file = tmp_path / "recipe.json"
    recipe_file.write_text(short_recipe(requests=6).model_dump_json())
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-c", "from b70ctl.cli import main; main()", "verify", "--endpoint", served.url,
         "--baseline-endpoint", baseline.url, "--recipe", str(recipe_file), "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        # Wait until the throughput check is under way: its first raw request file exists.
        while not (out / "raw" / "throughput" / "short" / "001.json").exists():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, stderr
    report = json.loads((out / "report.json").read_text())
    assert report["partial"] is True and report["partial_reason"] == "terminated"
    assert report["smoke"]["passed"] and report["correctness"] is not None
    assert "PARTIAL — terminated" in (out / "report.md").read_text()
    assert leftovers(out) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs: room for the first report, not for the raw data of a throughput check."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a small tmpfs here (the fault tests run as root, as CI does): {mounted.stderr}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_disk_ends_with_one_line_and_no_report_that_lies(servers, small_disk):
    served, baseline = servers
    # Large raw records: every request writes its chunks; a 2000-token answer fills 256 KiB within a few requests.
    served.scripts["go"] = Script(ttft_s=0.0, offsets_s=[0.0] * 2000, tokens_per_chunk=[1] * 2000)
    big = short_recipe(requests=12)
    big = big.model_copy(update={"workloads": [w.model_copy(update={"max_tokens": 2000}) for w in big.workloads]})
    with pytest.raises(BadInput) as raised:
        verify_scripted(big, served, baseline, small_disk)
    message = str(raised.value)
    assert "disk full" in message and "\n" not in message
    report_path = small_disk / "report.json"
    if report_path.exists():  # what is left says why it stopped, never "running"
        report = json.loads(report_path.read_text())
        assert report["partial"] is True and report["partial_reason"] == "disk full"
    else:
        assert "no report was left" in message
    assert leftovers(small_disk) == []


class _Huge(BaseHTTPRequestHandler):
    """Answers every request with 8 MiB: a JSON model list, or an endless stream line."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:
        pass

    def _send(self, content_type: str, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_GET(self) -> None:
        models = {"object": "list", "data": [{"id": "m" * 64, "object": "model"}] * 60_000}
        self._send("application/json", json.dumps(models).encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send("text/event-stream", b"data: " + b"x" * (8 * 2**20) + b"\n\n")


@pytest.fixture
def huge_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Huge)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_answer_over_the_limit_is_not_read_and_says_so(huge_server):
    endpoint = Endpoint(huge_server, model="m", timeout_s=10, max_answer_bytes=2**20)
    with VllmClient(endpoint) as client:
        with pytest.raises(EndpointError, match=r"GET /v1/models: the answer is larger than 1 MiB: read no further"):
            client.models()
        stream = client.stream("completions", "go", 8)
    assert stream.error.startswith("stream cut: the answer is larger than 1 MiB") and not stream.chunks


@pytest.mark.parametrize("option, value, message", [
    ("--max-answer-mb", "0", "--max-answer-mb 0: give the MiB one answer may hold, a number above 0"),
    ("--max-requests", "0", "--max-requests 0: give how many requests each workload may take, 1 or more"),
])
def test_verify_cli_refuses_a_limit_that_is_no_number(tmp_path, option, value, message):
    completed = subprocess.run(
        [sys.executable, "-c", "from b70ctl.cli import main; main()", "verify", "--endpoint", "http://127.0.0.1:9",
         "--recipe", "cpu-tiny", "--out", str(tmp_path / "out"), option, value],
        capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2
    assert [line for line in completed.stderr.splitlines() if line.strip()] == [f"error: {message}"]
    assert not (tmp_path / "out").exists()


# -- small inputs that must be one line and exit 2 ------------------------------------------------------------
def b70ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from b70ctl.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("path", "message"), [
    ("/dev/zero", "recipe file /dev/zero: a character device, not a regular file"),
    ("fifo", "not a regular file"),
    ("big.yaml", "2 MiB, over the 1 MiB cap: give the path of a recipe YAML file"),
    ("latin1.yaml", "not UTF-8 text"),
])
def test_recipe_files_that_are_not_recipes(tmp_path, path, message):
    if path == "fifo":
        path = str(tmp_path / "recipe.fifo")
        os.mkfifo(path)
    elif path == "big.yaml":
        path = str(tmp_path / "big.yaml")
        Path(path).write_text("# " + "x" * (2 * 2**20) + "\n")
    elif path == "latin1.yaml":
        path = str(tmp_path / "latin1.yaml")
        Path(path).write_bytes("name: caf\xe9\n".encode("latin-1"))
    completed = b70ctl("recipes", "show", path)
    assert completed.returncode == 2
    lines = [line for line in completed.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], completed.stderr


@pytest.mark.parametrize(("pair", "message"), [
    ("BAD NAME=1", "not an environment variable name"),
    ("1ST=1", "not an environment variable name"),
    ("NAME=line\nbreak", "the value holds a line break"),
])
def test_serve_render_refuses_env_that_cannot_be_an_environment(pair, message):
    completed = b70ctl("serve", "render", "--recipe", "cpu-tiny", "--env", pair)
    assert completed.returncode == 2
    lines = [line for line in completed.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], completed.stderr


def test_a_nan_figure_is_not_measured_not_judged():
    from b70ctl.recipes.model import Claim
    from b70ctl.report.verdict import judge

    claim = Claim(id="c", description="d", metric="m", op=">=", value=1.0, source="test")
    verdict = judge(claim, {"m": float("nan")})
    assert verdict.verdict == "not_measured" and "not a finite number" in verdict.reason
