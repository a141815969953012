"""Hostile input, third round: answers a server shapes to exhaust or fool verify (a body compressed twice, a
stream line with no end, choices and token ids of the wrong JSON type, redirects and resets), and what stops a
run (a second SIGTERM, SIGINT, the file-size limit).

Each row runs the real b70ctl (in this process, or in its own under resource limits where the old behaviour was
to exhaust one) against a server on loopback, and asserts the exit code, the one `error:` line, what the report
says, that nothing was written outside --out and that the API key is in no file and no stream. Resource limits
are bounds a row must stay within, never measurements: no assertion is on timing.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from functools import cache
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from hostile import LoopbackServer, Outcome, assert_left_clean, assert_one_line_error, run_b70ctl, snapshot

SECRET = "sk-hostile-answers-7c2d"
B70CTL = [sys.executable, "-c", "import sys; from b70ctl.cli import main; sys.argv[0] = 'b70ctl'; sys.exit(main())"]
MODELS = json.dumps({"object": "list", "data": [{"id": "tiny-qwen3", "object": "model"}]}).encode()
TIMEOUT_S = 300  # a guard against a hung run, never an assertion on how long a row takes

# An answer: status, headers, and the body as pieces written one after another (a generator streams).
Answer = tuple[int, dict[str, str], Callable[[], Iterator[bytes]]]


def _body(data: bytes) -> Callable[[], Iterator[bytes]]:
    return lambda: iter([data])


def _json(status: int, value: Any) -> Answer:
    return status, {"Content-Type": "application/json"}, _body(json.dumps(value).encode())


class Answering(LoopbackServer):
    """A server on 127.0.0.1 whose answer to each path (and, for POST, to a streamed or a plain request) is set by
    the row: any status, headers and body, written in pieces as they come. `None` as an answer resets the
    connection (an RST: SO_LINGER 0)."""

    def __init__(self, routes: dict[str, Answer | None]) -> None:
        self.routes = routes
        self.authorizations: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                server.authorizations.append(self.headers.get("Authorization") or "")
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?")[0]
                streamed = b'"stream": true' in body or b'"stream":true' in body
                key = f"{path} stream" if streamed and f"{path} stream" in server.routes else path
                answer = server.routes.get(key, _json(404, {"detail": "Not Found"}))
                if answer is None:  # a tenth of the promised body, then the connection is reset
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: 1000\r\n\r\n" + b"{" * 100)
                    self.wfile.flush()
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.rfile.close()
                    self.wfile.close()
                    self.connection.close()
                    self.close_connection = True
                    return
                status, headers, pieces = answer
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                if not any(name.lower() == "content-length" for name in headers):
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                try:
                    for piece in pieces():
                        self.wfile.write(piece)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

            do_GET = do_POST = _answer  # noqa: N815

        super().__init__(Handler, quiet_errors=True)


def _with_models(**routes: Answer | None) -> dict[str, Answer | None]:
    """vLLM's model list and /health, and `routes` by path with "/" written "_" (`_v1_completions`)."""
    return {"/v1/models": (200, {"Content-Type": "application/json", "Content-Length": str(len(MODELS))},
                           _body(MODELS)),
            "/health": (200, {"Content-Length": "0"}, _body(b"")),
            **{name.replace("_", "/"): answer for name, answer in routes.items()}}


def _key(work: Path) -> Path:
    (work / "key").write_text(SECRET + "\n")
    (work / "key").chmod(0o600)
    return work / "key"


def _everything(root: Path, outcome: Outcome) -> str:
    return outcome.stdout + outcome.stderr + "".join(
        p.read_text(errors="replace") for p in root.rglob("*") if p.is_file() and p.name != "key")


def _run_limited(args: list[str], work: Path, **limits: int) -> Outcome:
    """b70ctl in its own process under resource limits (RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE by name)."""
    def limit() -> None:
        # As from a terminal: a shell starts a background job (`make test &`, nohup, some CI runners) with SIGINT
        # ignored, its children inherit that, and Python then installs no KeyboardInterrupt handler. The sigint
        # case is about what b70ctl does on Ctrl-C, not about how this suite was started.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        for name, value in limits.items():
            resource.setrlimit(getattr(resource, f"RLIMIT_{name.upper()}"), (value, value))

    env = {**os.environ, "XDG_CACHE_HOME": str(work.parent / "xdg-cache"), "COLUMNS": "400"}
    done = subprocess.run([*B70CTL, *args], capture_output=True, timeout=TIMEOUT_S, env=env, cwd=work,
                          preexec_fn=limit, check=False)
    return Outcome(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))


# --- bodies that expand or never end: bounded memory, linear time ----------------------------------------------


@cache
def _gzip_twice(decoded_bytes: int) -> bytes:
    """`decoded_bytes` zero bytes, gzip-compressed, and the result compressed again: a few kB on the wire."""
    def gzip(pieces: Iterator[bytes]) -> bytes:
        packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        return b"".join([packer.compress(piece) for piece in pieces] + [packer.flush()])

    once = gzip(iter([bytes(2**20)] * (decoded_bytes // 2**20)))
    return gzip(iter([once]))


# What the verify process may map: its imports and a 1 MiB answer fit, the 2 GiB the body expands to do not.
ADDRESS_SPACE_LIMIT = 1536 * 2**20


@pytest.mark.parametrize("encoding, body, message", [
    ("gzip, gzip", lambda: _gzip_twice(2 * 2**30), r"the answer is larger than 1 MiB"),
    ("gzip, gzip, gzip", lambda: _gzip_twice(2**20),
     r"the answer is compressed 3 times \(Content-Encoding: gzip, gzip, gzip\)"),
    ("br", lambda: b"\x0b\x02\x80hello\x03", r"the answer is compressed as 'br', which b70ctl does not read"),
    ("gzip", lambda: b"not gzip at all", r"the answer is not valid gzip"),
], ids=["gzip-twice-2GiB", "gzip-three-times", "brotli", "not-gzip"])
def test_a_compressed_body_is_decoded_within_the_answer_limit(encoding, body, message, tmp_path):
    data = body()
    models = (200, {"Content-Type": "application/json", "Content-Encoding": encoding,
                    "Content-Length": str(len(data))}, _body(data))
    work = tmp_path / "case"
    work.mkdir()
    key = _key(work)
    before = snapshot(tmp_path)
    with Answering({**_with_models(), "/v1/models": models}) as server:
        outcome = _run_limited(["verify", "--endpoint", server.url, "--recipe", "cpu-tiny", "--check", "smoke",
                                "--out", str(work / "out"), "--timeout", "30", "--max-answer-mb", "1",
                                "--api-key-file", str(key)], work, **{"as": ADDRESS_SPACE_LIMIT})
    assert_one_line_error(outcome, 2, r"endpoint \S+: GET /v1/models: " + message)
    assert_left_clean(tmp_path, before, [work / "out", tmp_path / "xdg-cache"])
    assert not (work / "out" / "report.json").exists()
    assert SECRET not in _everything(tmp_path, outcome)


def _endless_line(total_bytes: int) -> Callable[[], Iterator[bytes]]:
    def pieces() -> Iterator[bytes]:
        yield b"data: "
        for _ in range(total_bytes // 2**20):
            yield b"x" * 2**20
    return pieces


# What verify may spend in CPU: its imports and reading 128 MiB take a few seconds; looking at each byte of an
# unfinished line again with every new piece took 21 s at 64 MiB, four times that at 128.
CPU_LIMIT_S = 40


def test_a_stream_line_without_an_end_is_read_in_linear_time(tmp_path):
    """Every streamed answer one line of 160 MiB with no line end: cut at the answer limit, within the CPU bound."""
    stream = (200, {"Content-Type": "text/event-stream"}, _endless_line(160 * 2**20))
    routes = _with_models(**{"_v1_completions stream": stream,
                             "_v1_completions": _json(500, {"error": {"message": "no plain answers here"}}),
                             "_v1_chat_completions": _json(500, {"error": {"message": "no chat here"}})})
    work = tmp_path / "case"
    work.mkdir()
    with Answering(routes) as server:
        outcome = _run_limited(["verify", "--endpoint", server.url, "--recipe", "cpu-tiny", "--check", "smoke",
                                "--out", str(work / "out"), "--timeout", "30", "--max-answer-mb", "128",
                                "--api-key-file", str(_key(work)), "--json"], work, cpu=CPU_LIMIT_S)
    assert_one_line_error(outcome, 1, "")
    smoke = {check["name"]: check for check in json.loads(outcome.stdout)["smoke"]["checks"]}
    assert smoke["stream_done"]["reason"].startswith("stream cut: the answer is larger than 128 MiB"), smoke
    assert SECRET not in _everything(tmp_path, outcome)


# --- completions of the wrong shape: refused, never a crash, never judged a match -------------------------------


def _completion(token_ids: Any, choices: Any = None) -> Answer:
    answer = {"id": "cmpl-1", "object": "text_completion", "model": "tiny-qwen3",
              "choices": choices if choices is not None else [
                  {"index": 0, "text": " a b c", "token_ids": token_ids, "finish_reason": "length"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
    return _json(200, answer)


GOOD_IDS = [11, 12, 13]
SHAPES = {
    "choices-string": (_completion(None, "not a list"), r"choices as a JSON str, not a list"),
    "choices-integers": (_completion(None, [1, 2]), r"the first choice is a JSON int, not an object"),
    "choices-object": (_completion(None, {"0": {"token_ids": GOOD_IDS}}), r"choices as a JSON dict, not a list"),
    "float-token-ids": (_completion([11.5, 12.25, 13.75]), r"token_ids is not a list of integers"),
    "bool-token-ids": (_completion([True, 12, 13]), r"token_ids is not a list of integers"),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_record_reference_refuses_a_completion_of_the_wrong_shape(shape, tmp_path):
    answer, problem = SHAPES[shape]
    work = tmp_path / "case"
    work.mkdir()
    key = _key(work)
    before = snapshot(tmp_path)
    with Answering(_with_models(_v1_completions=answer)) as server:
        outcome = run_b70ctl(["verify", "--endpoint", server.url, "--recipe", "cpu-tiny", "--record-reference",
                              str(work / "ref.json"), "--timeout", "5", "--api-key-file", str(key)],
                             {"XDG_CACHE_HOME": str(tmp_path / "xdg-cache")})
    assert_one_line_error(outcome, 2, r"cannot record reference \S*ref\.json: \S+ failed on prompt 0: "
                                      r"POST /v1/completions: .*" + problem)
    assert_left_clean(tmp_path, before, [tmp_path / "xdg-cache"])
    assert SECRET not in _everything(tmp_path, outcome)


@pytest.mark.parametrize("shape", SHAPES)
def test_correctness_fails_on_a_completion_of_the_wrong_shape(shape, tmp_path):
    """The reference is recorded from the same server answering token ids 11 12 13; then it answers in the wrong
    shape (float ids that round down to the same: once judged identical). Correctness fails, naming why."""
    answer, problem = SHAPES[shape]
    work = tmp_path / "case"
    work.mkdir()
    key = _key(work)
    routes = _with_models(_v1_completions=_completion(GOOD_IDS))
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg-cache")}
    with Answering(routes) as server:
        recorded = run_b70ctl(["verify", "--endpoint", server.url, "--recipe", "cpu-tiny", "--record-reference",
                               str(work / "ref.json"), "--timeout", "5", "--api-key-file", str(key)], env)
        assert recorded.code == 0, recorded.stderr
        routes["/v1/completions"] = answer
        before = snapshot(tmp_path)
        outcome = run_b70ctl(["verify", "--endpoint", server.url, "--recipe", "cpu-tiny", "--check", "correctness",
                              "--reference", str(work / "ref.json"), "--out", str(work / "out"), "--timeout", "5",
                              "--api-key-file", str(key)], env)
    assert_one_line_error(outcome, 1, "")
    report = json.loads((work / "out" / "report.json").read_text())
    assert report["correctness"]["passed"] is False and report["correctness"]["identical"] == 0
    assert re.search(r"served endpoint failed on prompt 0: POST /v1/completions: .*" + problem,
                     report["correctness"]["reason"]), report["correctness"]["reason"]
    assert_left_clean(tmp_path, before, [work / "out", tmp_path / "xdg-cache"])
    assert SECRET not in _everything(tmp_path, outcome)


# --- redirects and resets: the line says what happened ------------------------------------------------------------


@pytest.mark.parametrize("answer, message", [
    ((302, {"Content-Length": "0"}, _body(b"")),
     r"endpoint \S+: GET /v1/models: HTTP 302: a redirect without a Location header: not a vLLM server's answer"),
    ((301, {"Content-Length": "0", "Location": "https://elsewhere.example/v1/models"}, _body(b"")),
     r"GET /v1/models: HTTP 301: redirects to https://elsewhere\.example/v1/models: give the server's own URL"),
    (None, r"endpoint \S+ unreachable: GET /v1/models: the connection was reset or closed mid-answer \(ReadError\)"),
], ids=["302-without-location", "301-with-location", "connection-reset"])
def test_a_redirect_or_a_reset_is_named_as_such(answer, message, tmp_path):
    work = tmp_path / "case"
    work.mkdir()
    key = _key(work)
    before = snapshot(tmp_path)
    with Answering({**_with_models(), "/v1/models": answer}) as server:
        outcome = run_b70ctl(["verify", "--endpoint", server.url, "--recipe", "cpu-tiny", "--check", "smoke",
                              "--out", str(work / "out"), "--timeout", "5", "--api-key-file", str(key)],
                             {"XDG_CACHE_HOME": str(tmp_path / "xdg-cache")})
    assert_one_line_error(outcome, 2, message)
    assert_left_clean(tmp_path, before, [work / "out", tmp_path / "xdg-cache"])
    assert not (work / "out" / "report.json").exists()
    assert SECRET not in _everything(tmp_path, outcome)


# --- what stops a run: the report says what stopped it, never an unexpected error ---------------------------------


SLOW_STREAM = 40  # tokens, one every 0.1 s: a throughput request lasts seconds, so a signal lands mid-run


def _slow_recipe(work: Path, max_tokens: int = SLOW_STREAM) -> Path:
    from scripted_server import short_recipe

    slow = short_recipe(requests=6)
    slow = slow.model_copy(update={"workloads": [w.model_copy(update={"max_tokens": max_tokens})
                                                 for w in slow.workloads]})
    path = work / "recipe.json"
    path.write_text(slow.model_dump_json())
    return path


def _start(served: Any, baseline: Any, work: Path, recipe_file: Path, **limits: int) -> subprocess.Popen[str]:
    def limit() -> None:
        # As from a terminal: a shell starts a background job (`make test &`, nohup, some CI runners) with SIGINT
        # ignored, its children inherit that, and Python then installs no KeyboardInterrupt handler. The sigint
        # case is about what b70ctl does on Ctrl-C, not about how this suite was started.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        for name, value in limits.items():
            resource.setrlimit(getattr(resource, f"RLIMIT_{name.upper()}"), (value, value))

    env = {**os.environ, "XDG_CACHE_HOME": str(work.parent / "xdg-cache"), "COLUMNS": "400",
           "B70CTL_API_KEY": SECRET}
    return subprocess.Popen([*B70CTL, "verify", "--endpoint", served.url, "--baseline-endpoint", baseline.url,
                             "--recipe", str(recipe_file), "--out", str(work / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=work,
                            preexec_fn=limit)


@pytest.fixture
def slow_servers() -> Iterator[tuple[Any, Any]]:
    from scripted_server import Script, ScriptedServer

    with ScriptedServer() as served, ScriptedServer() as baseline:
        baseline.speculates = False
        served.scripts["go"] = Script(ttft_s=0.05, offsets_s=[0.1 * k for k in range(SLOW_STREAM)],
                                      tokens_per_chunk=[1] * SLOW_STREAM)
        yield served, baseline


def _wait_for_throughput(process: subprocess.Popen[str], out: Path) -> None:
    """Until the throughput check is under way (its first raw request file exists); a guard, not a measurement."""
    deadline = time.monotonic() + TIMEOUT_S
    while not (out / "raw" / "throughput" / "short" / "001.json").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)


@pytest.mark.parametrize("signals, code, word", [
    ([signal.SIGTERM] * 20, 143, "terminated"),
    ([signal.SIGINT], 130, "interrupted"),
], ids=["sigterm-twenty-times", "sigint"])
def test_a_stop_leaves_a_partial_report_that_says_so(slow_servers, signals, code, word, tmp_path):
    """SIGTERM again and again while the report is being closed (systemd, then a user, then Ansible), or SIGINT:
    the report says what stopped it, the line on stdout says where the partial report is, and nothing claims an
    unexpected error or a traceback."""
    served, baseline = slow_servers
    work = tmp_path / "case"
    work.mkdir()
    process = _start(served, baseline, work, _slow_recipe(work))
    try:
        _wait_for_throughput(process, work / "out")
        for each in signals:
            process.send_signal(each)
            time.sleep(0.005)
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == code, stderr
    assert "Traceback" not in stderr and "unexpected" not in stdout + stderr
    assert f"{word}: the report in {work / 'out'} is marked partial ({word})" in stdout + stderr
    report = json.loads((work / "out" / "report.json").read_text())
    assert report["partial"] is True and report["partial_reason"] == word
    assert f"PARTIAL — {word}" in (work / "out" / "report.md").read_text()
    assert not list((tmp_path / "xdg-cache").rglob("tracebacks/*"))
    assert SECRET not in stdout + stderr + "".join(
        p.read_text(errors="replace") for p in work.rglob("*") if p.is_file())


def test_the_file_size_limit_ends_the_run_with_one_line_and_a_report_that_says_so(slow_servers, tmp_path):
    """ulimit -f: Python ignores SIGXFSZ, so a write past the limit fails with EFBIG; the run ends like a full
    disk, with the report marked partial (or removed, when not even it fits) and no traceback."""
    from scripted_server import Script

    served, baseline = slow_servers
    served.scripts["go"] = Script(ttft_s=0.0, offsets_s=[0.0] * 2000, tokens_per_chunk=[1] * 2000)
    work = tmp_path / "case"
    work.mkdir()
    process = _start(served, baseline, work, _slow_recipe(work, max_tokens=2000), fsize=48 * 2**10)
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
    outcome = Outcome(process.returncode, stdout, stderr)
    assert_one_line_error(outcome, 2, r"--out \S+: file-size limit reached(; the report is marked partial "
                                      r"\(file-size limit reached\)|, and the partial report could not be written)"
                                      r".*: raise the file-size limit \(ulimit -f\) and run again")
    if (work / "out" / "report.json").exists():
        report = json.loads((work / "out" / "report.json").read_text())
        assert report["partial"] is True and report["partial_reason"] == "file-size limit reached"
    assert not [p.name for p in (work / "out").rglob(".*.tmp")]
    assert not list((tmp_path / "xdg-cache").rglob("tracebacks/*"))


# --- counters that are no count: the baseline check cannot be made, the run goes on -------------------------------


METRICS = Path(__file__).resolve().parents[1] / "fixtures" / "metrics"


def _capture(name: str, spoil: Callable[[str], str] = lambda text: text) -> Answer:
    """A real vLLM 0.32.0 /metrics capture (tests/fixtures/metrics/README.md), spoiled as the row says."""
    text = spoil((METRICS / name / "metrics_before.txt").read_text()).encode()
    return 200, {"Content-Type": "text/plain; version=0.0.4", "Content-Length": str(len(text))}, _body(text)


def _nan_generation_tokens(text: str) -> str:
    return re.sub(r"^(vllm:generation_tokens_total\{[^}]*\}) \S+$", r"\1 NaN", text, flags=re.MULTILINE)


def _series_twice(text: str) -> str:
    line = next(line for line in text.splitlines() if line.startswith("vllm:generation_tokens_total{"))
    return text + "# TYPE vllm:generation_tokens_total counter\n" + line + "\n"


@pytest.mark.parametrize("endpoint_metrics, baseline_metrics, reason", [
    (_capture("0.32.0-cpu-draft-k4", _nan_generation_tokens), _capture("0.32.0-cpu-baseline"),
     r"not compared: the endpoint's /metrics gives vllm:generation_tokens_total as NaN or infinite"),
    (_capture("0.32.0-cpu-draft-k4"),
     _capture("0.32.0-cpu-baseline", _series_twice),
     r"not compared: /metrics gives the series vllm:generation_tokens_total with the same labels twice"),
], ids=["endpoint-generation-nan", "baseline-series-twice"])
def test_counters_that_are_no_count_leave_correctness_unjudged_and_the_run_reported(
        endpoint_metrics, baseline_metrics, reason, tmp_path):
    """With --baseline-endpoint, a NaN counter or a series given twice: exit 1 with a report whose correctness is
    not compared and says why; once it was exit 2 and no report."""
    work = tmp_path / "case"
    work.mkdir()
    key = _key(work)
    with Answering(_with_models(_metrics=endpoint_metrics)) as endpoint, \
            Answering(_with_models(_metrics=baseline_metrics)) as baseline:
        before = snapshot(tmp_path)
        outcome = run_b70ctl(["verify", "--endpoint", endpoint.url, "--baseline-endpoint", baseline.url,
                              "--recipe", "cpu-tiny", "--check", "correctness", "--out", str(work / "out"),
                              "--timeout", "5", "--api-key-file", str(key)],
                             {"XDG_CACHE_HOME": str(tmp_path / "xdg-cache")})
    assert_one_line_error(outcome, 1, "")
    report = json.loads((work / "out" / "report.json").read_text())
    assert report["partial"] is False and report["correctness"]["passed"] is False
    assert re.search(reason, report["correctness"]["reason"]), report["correctness"]["reason"]
    assert report["correctness"]["comparisons"] == [] and report["correctness"]["total"] == 0
    assert re.search(reason.replace("not compared: ", ""), (work / "out" / "report.md").read_text().replace("\\", ""))
    assert_left_clean(tmp_path, before, [work / "out", tmp_path / "xdg-cache"])
    assert SECRET not in _everything(tmp_path, outcome)
