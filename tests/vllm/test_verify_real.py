"""b70ctl verify against real vLLM CPU servers: the whole instrument on real speculative decoding."""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from b70ctl.verify.pipeline import VerifyRequest, verify


def trimmed(recipe, max_requests: int = 3):
    """The cpu-tiny recipe with fewer requests per workload: the suite is about behaviour, not precision."""
    workloads = [w.model_copy(update={"min_requests": min(w.min_requests, max_requests),
                                      "max_requests": max_requests}) for w in recipe.workloads]
    return recipe.model_copy(update={"workloads": workloads})


@pytest.fixture(scope="module")
def exact_report(endpoints, cpu_tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("verify-exact")
    request = VerifyRequest(recipe=trimmed(cpu_tiny), out_dir=out, endpoint=endpoints["draft-exact"],
                            baseline_endpoint=endpoints["baseline"])
    return verify(request), out


@pytest.fixture(scope="module")
def perturbed_report(endpoints, cpu_tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("verify-perturbed")
    request = VerifyRequest(recipe=trimmed(cpu_tiny), out_dir=out, endpoint=endpoints["draft-perturbed"],
                            baseline_endpoint=endpoints["baseline"])
    return verify(request), out


def test_exact_draft_passes_every_check(exact_report):
    report, out = exact_report
    assert report.smoke.passed, [c for c in report.smoke.checks if not c.passed]
    assert report.correctness.identical == report.correctness.total == 5
    assert report.throughput.passed
    assert json.loads((out / "report.json").read_text())["partial"] is False


def test_token_counts_equal_usage_and_max_tokens(exact_report):
    report, _ = exact_report
    for workload in report.throughput.workloads:
        assert workload.token_count_mismatches == 0
        for sample in workload.requests:
            assert sample.completion_tokens == sample.usage_completion_tokens == workload.max_tokens


def test_exact_draft_is_accepted_almost_always(exact_report, cpu_tiny):
    report, _ = exact_report
    on_endpoint = {w.name for w in cpu_tiny.workloads if w.server == "endpoint"}
    for workload in report.throughput.workloads:
        if workload.name not in on_endpoint:
            assert workload.spec_decode is None  # the target-only baseline does not draft
            continue
        spec = workload.spec_decode
        assert spec is not None and not spec.polluted, workload.name
        assert spec.acceptance_rate >= 0.95, (workload.name, spec)
        # k=4 fully accepted: each draft step yields 4 accepted + 1 bonus token.
        assert spec.mean_acceptance_length == pytest.approx(1 + spec.num_accepted_tokens / spec.num_drafts)
        assert spec.mean_acceptance_length >= 4.5


def test_perturbed_draft_acceptance_falls_with_position(perturbed_report):
    report, _ = perturbed_report
    natural = {w.name: w for w in report.throughput.workloads}["natural"].spec_decode
    rates = natural.per_position_acceptance
    assert len(rates) == 4
    assert natural.acceptance_rate < 0.95
    assert all(earlier >= later for earlier, later in itertools.pairwise(rates)), rates
    assert rates[0] > rates[-1]
    # Per-position rates are accepted-at-position / drafts: their sum is the accepted tokens per draft.
    assert sum(rates) == pytest.approx(natural.num_accepted_tokens / natural.num_drafts, rel=1e-9)


def test_greedy_with_perturbed_draft_is_identical_to_baseline(perturbed_report):
    report, _ = perturbed_report
    assert report.correctness.identical == report.correctness.total


def test_every_request_is_timed_on_the_engines_clock(perturbed_report):
    report, _out = perturbed_report
    for workload in report.throughput.workloads:
        assert workload.timing_source == "engine", (workload.name, workload.timing_note)
        for sample in workload.requests:
            assert sample.engine.generation_tokens == sample.completion_tokens == workload.max_tokens
            assert sample.decode_tok_s == pytest.approx((sample.completion_tokens - 1) / sample.engine.decode_time_s)
            # Whatever the delivery did, its verdict follows the 5% rule between the two clocks.
            off = (sample.client_decode_tok_s is None
                   or abs(sample.client_decode_tok_s / sample.decode_tok_s - 1) > 0.05)
            assert sample.delivery == ("distorted" if off else "ok")
    long = {w.name: w for w in report.throughput.workloads}["long_prompt"]
    assert long.prompt_tokens_cached == 0  # a new prompt per request: nothing from the prefix cache


class BufferingProxy(ThreadingHTTPServer):
    """A real proxy in front of a real vLLM that holds every streamed answer until it is complete, then sends it
    in one write: what a busy API server or a buffering reverse proxy does to a stream."""

    daemon_threads = True

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _BufferingHandler)
        self.upstream = upstream.rstrip("/")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _BufferingHandler(BaseHTTPRequestHandler):
    server: BufferingProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:
        pass

    def _relay(self, response: httpx.Response) -> None:
        body = response.content
        self.send_response(response.status_code)
        self.send_header("Content-Type", response.headers.get("content-type", "application/json"))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._relay(httpx.get(self.server.upstream + self.path, timeout=120))

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._relay(httpx.post(self.server.upstream + self.path, content=body, timeout=300,
                               headers={"Content-Type": "application/json"}))


def test_a_stream_buffered_into_one_burst_keeps_the_engine_rate(endpoints, vllm_urls, cpu_tiny, tmp_path):
    short = next(w for w in cpu_tiny.workloads if w.name == "short")
    recipe = cpu_tiny.model_copy(update={"workloads": [short.model_copy(update={"min_requests": 3,
                                                                                "max_requests": 3})]})
    proxy = BufferingProxy(vllm_urls["draft-perturbed"])
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        endpoint = dataclasses.replace(endpoints["draft-perturbed"], base_url=proxy.url)
        report = verify(VerifyRequest(recipe=recipe, out_dir=tmp_path, endpoint=endpoint, checks=("throughput",)))
    finally:
        proxy.shutdown()
    result = report.throughput.workloads[0]
    assert result.distorted_requests == len(result.requests) == 3
    for sample in result.requests:
        assert sample.timing_source == "engine" and sample.delivery == "distorted"
        # Every token arrived in one read: the client saw no decode at all, or an absurd rate.
        assert sample.client_decode_tok_s is None or sample.client_decode_tok_s > 5 * sample.decode_tok_s
        assert sample.decode_tok_s == pytest.approx(63 / sample.engine.decode_time_s)
    assert result.peak_tok_s is None and result.itl_ms is None
    # The engine's rate through the proxy is the same server's rate as measured directly, within the noise.
    assert 10 < result.decode_tok_s.median < 10_000
