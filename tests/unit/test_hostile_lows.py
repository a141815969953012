"""Hostile input, third round (#39), two of the lows: a server that sends more than the answer it declares, and a
host's report.json that gives a key twice to the fleet report.

An answer's end is its Content-Length (or its last chunk); h11 keeps whatever comes after it as the start of the
connection's next answer, and the connection is reused: the next request was answered by those bytes, which can be
a whole answer the server forged. Each row runs a real server on loopback that writes its first answer and the
extra bytes in one write, then answers every later request rightly: the answer with extra bytes is refused by a line
that says so, and every answer after it is the server's own answer to its own request.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from b70ctl.checks.client import Endpoint, EndpointError, VllmClient
from fleet_factory import make_report, write_host
from hostile import LoopbackServer, QuietHandler, assert_left_clean, assert_one_line_error, run_b70ctl, snapshot

SECRET = "sk-hostile-lows-41a9"
MODEL = "tiny-qwen3"
MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
FORGED_MODELS = json.dumps({"object": "list", "data": [{"id": "forged-model", "object": "model"}]}).encode()
OVERRUN = r"the server sent \d+ bytes past the end of its answer \(beyond its Content-Length or last chunk\)"


def _answer(body: bytes, content_type: str = "application/json") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: " + content_type.encode()
            + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


FORGED = _answer(FORGED_MODELS)  # a whole answer, for the request after the one it trails


def _chunked(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")


# The first answer to /v1/models, bytes past its end included.
FIRST_ANSWERS = {
    # The declared body, then a forged answer: the next request would get "forged-model".
    "forged-answer-after-content-length": _answer(MODELS) + FORGED,
    # A body longer than its Content-Length: the rest of it would be read as the next answer's status line.
    "body-longer-than-content-length": _answer(MODELS).replace(f"Content-Length: {len(MODELS)}".encode(),
                                                               b"Content-Length: 20"),
    "forged-answer-after-the-last-chunk": _chunked(MODELS) + FORGED,
}


class Overrunning(LoopbackServer):
    """Writes `first(path)` (raw bytes, or None for the right answer) to the first request, each in one write; every
    later request gets the right answer to its path. Records each request's path and client port."""

    def __init__(self, first: Callable[[str], bytes | None]) -> None:
        self.requests: list[tuple[str, int]] = []
        server = self

        class Handler(QuietHandler):
            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?")[0]
                server.requests.append((path, self.client_address[1]))
                raw = first(path) if len(server.requests) == 1 else None
                if raw is None:
                    raw = _answer(MODELS) if path == "/v1/models" else _answer(b'{"detail": "Not Found"}').replace(
                        b"200 OK", b"404 Not Found")
                self.wfile.write(raw)
                self.wfile.flush()

            do_GET = do_POST = _answer  # noqa: N815

        super().__init__(Handler, quiet_errors=True)


@pytest.mark.parametrize("first", list(FIRST_ANSWERS.values()), ids=list(FIRST_ANSWERS))
def test_bytes_past_an_answers_end_refuse_it_and_the_next_answer_is_the_servers_own(first):
    with Overrunning(lambda path: first) as server, VllmClient(Endpoint(server.url)) as client:
        with pytest.raises(EndpointError, match=r"^GET /v1/models: " + OVERRUN) as refused:
            client.models()
        assert refused.value.answered
        assert [client.models(), client.models()] == [[MODEL], [MODEL]]
    paths, ports = zip(*server.requests, strict=True)
    assert paths == ("/v1/models",) * 3
    # The connection holding the extra bytes is closed; the next one is reused as before.
    assert ports[0] != ports[1] == ports[2]


def test_bytes_past_a_streams_end_never_answer_the_next_request():
    """A streamed answer ends at [DONE]: what trails it is never read, as an answer or as part of one."""
    events = (b'data: {"choices": [{"index": 0, "text": "hi", "token_ids": [7], "finish_reason": "length"}]}\n\n'
              b"data: [DONE]\n\n")
    first = _answer(events, "text/event-stream") + FORGED
    with (Overrunning(lambda path: first if path == "/v1/completions" else None) as server,
          VllmClient(Endpoint(server.url, model=MODEL)) as client):
        result = client.stream("completions", "x", max_tokens=1)
        assert result.error is None or "past the end of its answer" in result.error, result.error
        assert result.token_ids in ([7], [])
        assert client.models() == [MODEL]
    assert [path for path, _ in server.requests] == ["/v1/completions", "/v1/models"]


def test_verify_names_an_answer_longer_than_it_declares(tmp_path):
    work = tmp_path / "case"
    work.mkdir()
    (work / "key").write_text(SECRET + "\n")
    (work / "key").chmod(0o600)
    before = snapshot(tmp_path)
    first = FIRST_ANSWERS["forged-answer-after-content-length"]
    with Overrunning(lambda path: first if path == "/v1/models" else None) as server:
        outcome = run_b70ctl(["verify", "--endpoint", server.url, "--recipe", "cpu-tiny", "--check", "smoke",
                              "--out", str(work / "out"), "--timeout", "5", "--api-key-file", str(work / "key")],
                             {"XDG_CACHE_HOME": str(tmp_path / "xdg-cache")})
    assert_one_line_error(outcome, 2, r"endpoint \S+: GET /v1/models: " + OVERRUN)
    assert_left_clean(tmp_path, before, [work / "out", tmp_path / "xdg-cache"])
    assert "forged-model" not in outcome.stdout + outcome.stderr
    assert SECRET not in outcome.stdout + outcome.stderr


# --- a key given twice in a host's report.json -------------------------------------------------------------------


def _given_twice(text: str, key: str, forged: str) -> str:
    """`text` (a report as verify writes it: compact JSON) with `key`'s first occurrence preceded by the same key
    holding `forged`: Python and pydantic keep the last, other readers the first."""
    needle = f'"{key}":'
    assert needle in text
    return text.replace(needle, f'{needle}{json.dumps(forged)},{needle}', 1)


@pytest.mark.parametrize("key, forged", [("recipe", "pr620-fp8-tp2"), ("kernel", "6.8.0-forged")],
                         ids=["top-level", "nested"])
def test_the_fleet_report_refuses_a_report_that_gives_a_key_twice(key, forged, tmp_path):
    reports = tmp_path / "reports"
    write_host(reports, "good", make_report("cpu-tiny", "good"))
    twice = write_host(reports, "twice") / "report.json"
    twice.write_text(_given_twice(make_report("cpu-tiny", "twice").model_dump_json(), key, forged))
    before = snapshot(tmp_path)
    outcome = run_b70ctl(["fleet", "report", str(reports), "--out", str(tmp_path / "out")])
    assert_one_line_error(outcome, 1, "")
    assert f"corrupt (excluded): {twice}: key '{key}' is given twice in one object: keep one" in outcome.stdout
    assert_left_clean(tmp_path, before, [tmp_path / "out"])
    fleet = json.loads((tmp_path / "out" / "fleet.json").read_text())
    assert {host["host"]: host["status"] for host in fleet["hosts"]} == {"good": "verified", "twice": "bad_report"}
    assert [(problem["kind"], problem["host"]) for problem in fleet["problems"]] == [("corrupt", "twice")]
    assert forged not in (tmp_path / "out" / "fleet.json").read_text()


def test_the_fleet_report_reads_a_report_without_a_key_twice_as_before(tmp_path):
    reports = tmp_path / "reports"
    write_host(reports, "good", make_report("cpu-tiny", "good"))
    outcome = run_b70ctl(["fleet", "report", str(reports), "--out", str(tmp_path / "out")])
    assert_one_line_error(outcome, 0, "")
    assert not json.loads((tmp_path / "out" / "fleet.json").read_text())["problems"]
