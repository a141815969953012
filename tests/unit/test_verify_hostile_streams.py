"""verify against servers that lie or never finish: an impossible engine clock, a stream of `: ping` comments or
a byte every so often, malformed stream events and NaN counters, and an error nothing expected.

Each case runs b70ctl's real entry point against a real HTTP server (scripted_server.py, with the stream or the
counters replaced as the case says) and asserts the exit code, the one line said, and what report.json and
report.md hold. No case depends on timing: the servers that never finish are ended by small explicit deadlines,
and no assertion is on how long anything took.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from b70ctl.recipes.model import Claim
from hostile import assert_one_line_error, run_b70ctl
from scripted_server import Script, ScriptedServer, _Handler, recipe_with, workload

# 33 tokens over 0.64 s of engine time, delivered on time: 50 tok/s on both clocks.
STEADY = Script(ttft_s=0.05, offsets_s=[0.02 * k for k in range(33)], tokens_per_chunk=[1] * 33)
DECODE = Claim(id="decode", description="decode", metric="throughput.short.decode_tok_s.median", op=">=",
               value=1.0, source="test")


class HostileHandler(_Handler):
    """The scripted server's handler, with the stream replaced when the server's `stream_mode` says so."""

    server: HostileServer

    def _stream(self, body: dict[str, Any], script: Script, prompt: Any, prompt_tokens: int, arrival_s: float,
                chat: bool) -> None:
        mode = self.server.stream_mode
        if mode is None:
            super()._stream(body, script, prompt, prompt_tokens, arrival_s, chat)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            if mode in ("ping", "trickle"):
                # vLLM's API server never sends these forever; a proxy's keep-alive or a hung server does.
                while not self.server.stop_event.wait(0.05):
                    self._chunk(": ping\n\n" if mode == "ping" else " ")
                return
            self._chunk(f"data: {self.server.events[mode]}\n\n")
            self._chunk("data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True


    def do_GET(self) -> None:  # noqa: N802 BaseHTTPRequestHandler's name
        if self.path == "/v1/models" and self.server.models_body is not None:
            self._send_text(200, self.server.models_body, "application/json")
            return
        super().do_GET()

    def do_POST(self) -> None:  # noqa: N802 BaseHTTPRequestHandler's name
        if self.path == "/tokenize" and self.server.tokenize_body is not None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._send_text(200, self.server.tokenize_body, "application/json")
            return
        super().do_POST()


class HostileServer(ScriptedServer):
    events: ClassVar[dict[str, str]] = {
        "list": "[1, 2, 3]",
        "choices-string": '{"choices": "none"}',
        "nested": "[" * 100_000 + "]" * 100_000,
        "huge-integer": '{"choices": [{"index": 0, "text": "x", "token_ids": [' + "9" * 5000 + "]}]}",
        "nan-usage": '{"choices": [], "usage": {"prompt_tokens": NaN, "completion_tokens": 3}}',
    }

    def __init__(self) -> None:
        super().__init__()
        self.RequestHandlerClass = HostileHandler
        self.stream_mode: str | None = None
        self.engine_clock_scale = 1.0  # the engine's decode time as /metrics reports it, times this
        self.nan_counter: str | None = None
        self.duplicate_series = False
        self.restart_at_request: int | None = None  # the engine restarts (counters from zero) serving this one
        self.recorded = 0
        self.models_body: str | None = None  # /v1/models answers this instead
        self.tokenize_body: str | None = None  # /tokenize answers this instead

    def record_request(self, script: Script, prompt_tokens: int, completion_tokens: int) -> None:
        scaled = Script(ttft_s=script.ttft_s, offsets_s=[o * self.engine_clock_scale for o in script.offsets_s],
                        tokens_per_chunk=script.tokens_per_chunk)
        self.recorded += 1
        if self.recorded != self.restart_at_request:
            super().record_request(scaled, prompt_tokens, completion_tokens)
            return
        with self.lock:  # restarted while it served this request: every counter and histogram from zero again
            self.counters = dict.fromkeys(self.counters, 0)
            self.histograms = {name: [0.0, 0.0] for name in self.histograms}
            self.accepted_per_position = [0] * len(self.accepted_per_position)

    def metrics_text(self) -> str:
        text = super().metrics_text()
        if self.duplicate_series:  # the whole exposition twice, as a proxy merging two scrapes sends it
            return text + text
        if self.nan_counter is None:
            return text
        # Prometheus' text format spells a NaN sample "NaN" (prometheus/docs exposition_formats.md: "NaN, +Inf,
        # and -Inf are valid values").
        return "\n".join(f"{line.rsplit(' ', 1)[0]} NaN" if line.startswith(self.nan_counter + "{") else line
                         for line in text.splitlines()) + "\n"


@pytest.fixture
def hostile() -> Iterator[HostileServer]:
    with HostileServer() as server:
        server.default_script = STEADY
        yield server


def _verify(server: HostileServer, work: Path, *extra: str, max_tokens: int = 33, requests: int = 2) -> list[str]:
    recipe = recipe_with(workload("short", "go", max_tokens=max_tokens, max_requests=requests,
                                  min_requests=requests)).model_copy(update={"claims": [DECODE]})
    recipe_file = work / "recipe.json"
    recipe_file.write_text(recipe.model_dump_json())
    return ["verify", "--endpoint", server.url, "--recipe", str(recipe_file), "--out", str(work / "out"),
            "--timeout", "5", *extra]


def _report(work: Path) -> tuple[dict[str, Any], str]:
    return json.loads((work / "out" / "report.json").read_text()), (work / "out" / "report.md").read_text()


# -- 1. an impossible engine clock ------------------------------------------------------------------------------
def test_an_engine_clock_the_client_contradicts_makes_the_workload_unmeasurable(hostile, tmp_path):
    # The histograms say each request decoded in 1/100000 of the time its tokens took to arrive.
    hostile.engine_clock_scale = 1e-5
    outcome = run_b70ctl(_verify(hostile, tmp_path, "--check", "throughput"))
    assert_one_line_error(outcome, 1, "")
    report, markdown = _report(tmp_path)
    workload_result = report["throughput"]["workloads"][0]
    assert workload_result["error"].startswith("unmeasurable: the engine's decode rate is more than 10x")
    assert report["throughput"]["passed"] is False
    [verdict] = report["verdicts"]
    assert verdict["verdict"] == "not_measured"
    assert "unmeasurable" in verdict["reason"]
    assert "unmeasurable" in markdown and "PARTIAL" not in markdown


def test_an_honest_engine_clock_still_measures(hostile, tmp_path):
    outcome = run_b70ctl(_verify(hostile, tmp_path, "--check", "throughput"))
    assert_one_line_error(outcome, 0, "")
    report, _ = _report(tmp_path)
    assert report["throughput"]["workloads"][0]["error"] is None
    assert report["verdicts"][0]["verdict"] == "met"


# -- 2. deadlines -----------------------------------------------------------------------------------------------
def test_a_server_that_sends_pings_forever_ends_at_the_run_deadline(hostile, tmp_path):
    hostile.stream_mode = "ping"
    outcome = run_b70ctl(_verify(hostile, tmp_path, "--check", "throughput", "--deadline", "1.5"))
    assert outcome.code == 124, outcome.stderr
    assert "Traceback" not in outcome.stderr
    lines = outcome.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("deadline: the run took longer than --deadline 1.5 s: the report")
    assert lines[0].endswith("is marked partial (deadline)")
    report, markdown = _report(tmp_path)
    assert report["partial"] is True
    assert report["partial_reason"].startswith("deadline: --deadline 1.5 s passed during short: request 1/2")
    assert "PARTIAL — deadline" in markdown and "running" not in markdown


def test_a_trickling_stream_fails_its_request_at_the_request_deadline_and_the_run_goes_on(hostile, tmp_path):
    hostile.stream_mode = "trickle"
    # --timeout 0.5 plus max_tokens 2 at the 1 tok/s floor: the request ends after 2.5 s, the run does not.
    outcome = run_b70ctl(_verify(hostile, tmp_path, "--check", "throughput", "--timeout", "0.5",
                                 max_tokens=2, requests=1))
    assert_one_line_error(outcome, 1, "")
    report, markdown = _report(tmp_path)
    assert report["partial"] is False
    error = report["throughput"]["workloads"][0]["error"]
    assert "took longer than its deadline" in error and "1 tok/s" in error
    assert "PARTIAL" not in markdown


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_deadline_that_is_not_a_positive_number_is_refused(hostile, tmp_path, value):
    outcome = run_b70ctl(_verify(hostile, tmp_path, "--deadline", value))
    assert_one_line_error(outcome, 2, r"--deadline .*give the seconds the whole run may take")
    assert not (tmp_path / "out").exists()


# -- 3. malformed events and counters ---------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "named"), [
    ("list", "a JSON list, not an object"),
    ("choices-string", "choices is a JSON str, not a list"),
    ("nested", "JSON nested deeper than can be read"),
    ("huge-integer", "a value that cannot be read"),
    ("nan-usage", "a NaN where a number belongs"),
])
def test_a_malformed_stream_event_makes_its_request_unusable_and_the_run_goes_on(hostile, tmp_path, mode, named):
    hostile.stream_mode = mode
    outcome = run_b70ctl(_verify(hostile, tmp_path, "--check", "smoke", "--check", "throughput"))
    assert_one_line_error(outcome, 1, "")
    report, markdown = _report(tmp_path)
    assert report["partial"] is False and "running" not in markdown
    stream_check = next(c for c in report["smoke"]["checks"] if c["name"] == "stream_done")
    assert stream_check["passed"] is False and named in stream_check["reason"]
    error = report["throughput"]["workloads"][0]["error"]
    assert error.startswith("request 1: malformed stream event: ") and named in error
    assert report["verdicts"][0]["verdict"] == "not_measured"


@pytest.mark.parametrize("counter", ["vllm:generation_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"])
def test_a_nan_counter_fails_smoke_naming_it(hostile, tmp_path, counter: str):
    hostile.nan_counter = counter
    outcome = run_b70ctl(_verify(hostile, tmp_path, "--check", "smoke"))
    assert_one_line_error(outcome, 1, "")
    report, markdown = _report(tmp_path)
    metrics = next(c for c in report["smoke"]["checks"] if c["name"] == "metrics")
    assert metrics["passed"] is False
    assert f"{counter} as NaN or infinite" in metrics["reason"]
    assert report["smoke"]["passed"] is False and "running" not in markdown


def test_an_unexpected_error_mid_run_leaves_the_report_failed_not_running(hostile, tmp_path, monkeypatch):
    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise ZeroDivisionError("a defect in a check")

    monkeypatch.setattr("b70ctl.verify.pipeline.run_throughput", broken)
    outcome = run_b70ctl(_verify(hostile, tmp_path, "--check", "smoke", "--check", "throughput"))
    assert_one_line_error(outcome, 2, r"b70ctl verify failed unexpectedly \(ZeroDivisionError\)")
    report, markdown = _report(tmp_path)
    assert report["partial"] is True
    assert report["partial_reason"].startswith("failed: ZeroDivisionError")
    assert "PARTIAL — failed: ZeroDivisionError" in markdown and "running" not in markdown
    assert report["smoke"]["passed"] is True  # what was measured before it is kept


# -- 4. numbers that cannot be honoured -------------------------------------------------------------------------
def test_an_answer_limit_beyond_any_memory_is_refused(hostile, tmp_path):
    outcome = run_b70ctl(_verify(hostile, tmp_path, "--max-answer-mb", "1e308"))
    assert_one_line_error(outcome, 2, r"--max-answer-mb 1e\+308: give at most 1048576 MiB")


def _roofline_inputs(work: Path, bytes_per_s: float) -> str:
    """A serving host that reads 1 GB of weights per decode step at `bytes_per_s`: at most bytes_per_s / 1e9
    steps a second, each yielding at most k+1 tokens (every draft accepted plus the bonus token)."""
    path = work / "roofline_inputs.json"
    path.write_text(json.dumps({
        "memory_bandwidth": {"bytes_per_s": bytes_per_s, "method": "copy", "buffer_bytes": 2**20, "repeats": 1},
        "target_shape": {"directory": "/models/target", "weight_files": 1, "weight_bytes": 10**9,
                         "num_hidden_layers": 1, "num_key_value_heads": 1, "head_dim": 64, "dtype": "bfloat16",
                         "full_attention_layers": 1}}))
    return str(path)


def test_an_engine_rate_above_the_hosts_bandwidth_bound_makes_the_workload_unmeasurable(hostile, tmp_path):
    # 1 GB/s over 1 GB a step: one step a second, k+1 tokens each; the engine and the client both say 50 tok/s.
    k = recipe_with().serve.speculative.num_speculative_tokens
    assert 50 > 3 * (k + 1)  # the margin verify states (3x) still leaves 50 tok/s impossible on this host
    outcome = run_b70ctl(_verify(hostile, tmp_path, "--check", "throughput",
                                 "--roofline-inputs", _roofline_inputs(tmp_path, 1e9)))
    assert_one_line_error(outcome, 1, "")
    report, _markdown = _report(tmp_path)
    error = report["throughput"]["workloads"][0]["error"]
    assert error.startswith("unmeasurable: request 1's engine decode rate") and "bandwidth bound" in error
    assert report["verdicts"][0]["verdict"] == "not_measured" and "bandwidth bound" in report["verdicts"][0]["reason"]


def test_an_engine_rate_within_the_hosts_bandwidth_bound_is_measured(hostile, tmp_path):
    outcome = run_b70ctl(_verify(hostile, tmp_path, "--check", "throughput",
                                 "--roofline-inputs", _roofline_inputs(tmp_path, 100e9)))
    assert_one_line_error(outcome, 0, "")
    report, _ = _report(tmp_path)
    assert report["throughput"]["workloads"][0]["error"] is None


# -- 4. what a run says about a restart and about a wrong URL ----------------------------------------------------
def test_a_server_restart_inside_a_workload_makes_it_unmeasurable_and_the_run_fail(hostile, tmp_path):
    hostile.restart_at_request = 2
    outcome = run_b70ctl(_verify(hostile, tmp_path, "--check", "throughput"))
    assert_one_line_error(outcome, 1, "")
    report, markdown = _report(tmp_path)
    error = report["throughput"]["workloads"][0]["error"]
    assert error.startswith("unmeasurable: the server restarted during the workload")
    assert report["passed"] is False and "server restarted" in markdown


def test_duplicate_metric_series_are_named_not_called_other_traffic(hostile, tmp_path):
    hostile.duplicate_series = True
    outcome = run_b70ctl(_verify(hostile, tmp_path, "--check", "smoke"))
    assert_one_line_error(outcome, 1, "")
    report, _ = _report(tmp_path)
    metrics = next(c for c in report["smoke"]["checks"] if c["name"] == "metrics")
    assert "with the same labels twice" in metrics["reason"] and "other traffic" not in metrics["reason"]


def test_an_endpoint_ending_in_v1_is_told_to_drop_it(hostile, tmp_path):
    args = _verify(hostile, tmp_path, "--check", "smoke")
    args[args.index("--endpoint") + 1] = hostile.url + "/v1"
    outcome = run_b70ctl(args)
    assert_one_line_error(outcome, 2, r"/v1: GET /v1/models: HTTP 404: the URL ends in /v1 .*drop the /v1")
    assert not (tmp_path / "out" / "report.json").exists()


def test_unreadable_metrics_on_the_endpoint_are_not_blamed_on_the_baseline(hostile, tmp_path):
    hostile.metrics_mode = "garbage"
    with ScriptedServer() as baseline:
        baseline.speculates = False
        outcome = run_b70ctl(_verify(hostile, tmp_path, "--check", "correctness", "--baseline-endpoint",
                                     baseline.url))
    assert_one_line_error(outcome, 2, r"baseline check: the endpoint's /metrics is unreadable")


# -- 4. answers Python's JSON reader refuses ---------------------------------------------------------------------
def test_a_model_list_nested_deeper_than_python_reads_is_one_line(hostile, tmp_path):
    hostile.models_body = '{"data": ' + "[" * 100_000 + "]" * 100_000 + "}"
    outcome = run_b70ctl(_verify(hostile, tmp_path, "--check", "smoke"))
    assert_one_line_error(outcome, 2, r"GET /v1/models: the answer holds JSON nested deeper than can be read")


def test_a_5000_digit_token_id_from_tokenize_fails_the_workload_not_the_run(hostile, tmp_path):
    # Python refuses to read an integer of more than 4300 digits (docs.python.org/3/library/stdtypes.html,
    # "Integer string conversion length limitation": "the default limit is 4300 digits").
    hostile.tokenize_body = '{"tokens": [' + "9" * 5000 + "], \"count\": 1}"
    outcome = run_b70ctl(_verify(hostile, tmp_path, "--check", "throughput"))
    assert_one_line_error(outcome, 1, "")
    report, _ = _report(tmp_path)
    assert "POST /tokenize: the answer holds a value that cannot be read" in report["throughput"]["workloads"][0][
        "error"]


def test_a_tokenize_answer_without_a_token_list_fails_the_workload_not_the_run(hostile, tmp_path):
    hostile.tokenize_body = '{"tokens": "none"}'
    outcome = run_b70ctl(_verify(hostile, tmp_path, "--check", "throughput"))
    assert_one_line_error(outcome, 1, "")
    report, _ = _report(tmp_path)
    assert "the answer has no tokens list of integers" in report["throughput"]["workloads"][0]["error"]
