"""verify on the engine's clock, against scripted servers whose /metrics tell the true engine timing while the
stream reaches the client however the script says (on time, or in one burst at the end).

The expectations are the scripts' own timings, which the server reports through histograms shaped like vLLM's
(tests/fixtures/metrics/ holds the real captures those shapes follow); none comes from b70ctl's code.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

from b70ctl.checks.smoke import run_smoke
from b70ctl.checks.throughput import run_throughput
from b70ctl.errors import BadInput
from b70ctl.recipes.model import Claim
from b70ctl.report.load import read_report
from b70ctl.report.measurements import throughput_measurements
from scripted_server import (
    Script,
    ScriptedServer,
    SpecPerRequest,
    client_for,
    recipe_with,
    short_recipe,
    verify_scripted,
    workload,
)

# 33 tokens from the engine over 0.64 s (first to last token): 32 / 0.64 = 50 tok/s, whatever the delivery.
STEADY = Script(ttft_s=0.1, offsets_s=[0.02 * k for k in range(33)], tokens_per_chunk=[1] * 33)
STEADY_ENGINE_TOK_S = 32 / 0.64
BURST = Script(ttft_s=0.1, offsets_s=STEADY.offsets_s, tokens_per_chunk=STEADY.tokens_per_chunk, delivery="burst")

DECODE_AT_LEAST_40 = Claim(id="decode", description="decode", metric="throughput.short.decode_tok_s.median",
                           op=">=", value=40.0, source="test")
DECODE_AT_MOST_60 = Claim(id="decode-bound", description="decode is no faster than the engine can be",
                          metric="throughput.short.decode_tok_s.median", op="<=", value=60.0, source="test")
PEAK = Claim(id="peak", description="peak", metric="throughput.short.peak_tok_s.max", op=">=", value=1.0,
             source="test")


@pytest.fixture
def servers():
    with ScriptedServer() as served, ScriptedServer() as baseline:
        baseline.speculates = False
        yield served, baseline


def test_a_stream_delivered_in_one_burst_is_judged_on_the_engine_rate(servers, tmp_path):
    served, baseline = servers
    served.scripts["go"] = BURST
    report = verify_scripted(short_recipe(DECODE_AT_LEAST_40, DECODE_AT_MOST_60), served, baseline, tmp_path)

    short = report.throughput.workloads[0]
    assert [r.decode_tok_s for r in short.requests] == pytest.approx([STEADY_ENGINE_TOK_S] * 3, rel=1e-9)
    assert short.timing_source == "engine"
    # What arrived: 33 tokens within a millisecond or so, read as a rate far above anything the engine did.
    assert all(r.client_decode_tok_s is None or r.client_decode_tok_s > 10 * STEADY_ENGINE_TOK_S
               for r in short.requests)
    assert short.distorted_requests == 3 and all(r.delivery == "distorted" for r in short.requests)
    assert short.peak_tok_s is None and short.itl_ms is None  # no figure rests on the burst
    assert {v.claim_id: v.verdict for v in report.verdicts} == {"decode": "met", "decode-bound": "met"}
    markdown = (tmp_path / "report.md").read_text()
    assert "Delivery distorted in 3 of 3 requests" in markdown
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["throughput"]["workloads"][0]["requests"][0]["delivery"] == "distorted"


def test_on_time_delivery_agrees_with_the_engine_and_keeps_the_peak(servers, tmp_path):
    served, baseline = servers
    served.scripts["go"] = STEADY
    report = verify_scripted(short_recipe(DECODE_AT_LEAST_40, PEAK), served, baseline, tmp_path)
    short = report.throughput.workloads[0]
    assert short.decode_tok_s.median == pytest.approx(STEADY_ENGINE_TOK_S, rel=1e-9)
    for sample in short.requests:
        # Delivery is "ok" exactly when the arrivals agree with the engine within 5%, as the issue defines it.
        agrees = abs(sample.client_decode_tok_s / STEADY_ENGINE_TOK_S - 1) <= 0.05
        assert sample.delivery == ("ok" if agrees else "distorted")
    if short.distorted_requests < len(short.requests):
        assert short.peak_tok_s is not None and short.itl_ms is not None
        # A 0.64 s stream: its tokens over its span (llama-benchy 0.4), never below its own decode rate.
        assert short.peak_tok_s.min >= min(r.client_decode_tok_s for r in short.requests if r.delivery == "ok")


def test_without_per_request_timing_the_client_figures_stand_and_say_so(servers, tmp_path):
    served, baseline = servers
    served.scripts["go"] = STEADY
    served.request_histograms = False
    report = verify_scripted(short_recipe(DECODE_AT_LEAST_40), served, baseline, tmp_path)
    short = report.throughput.workloads[0]
    assert short.timing_source == "client"
    assert all(r.delivery == "unchecked" and r.engine is None for r in short.requests)
    assert "no cross-check with the engine was possible" in short.timing_note
    assert short.decode_tok_s.median == short.client_decode_tok_s.median
    assert "no cross-check with the engine was possible" in (tmp_path / "report.md").read_text()


def test_itl_is_per_token_not_per_chunk(server, tmp_path):
    # Chunks of 1, 4, 4 and 2 tokens 100 ms apart: each token of a 4-token chunk waited 25 ms, of the last 50 ms.
    server.scripts["go"] = Script(ttft_s=0.05, offsets_s=[0.0, 0.1, 0.2, 0.3], tokens_per_chunk=[1, 4, 4, 2])
    with client_for(server) as client:
        result = run_throughput(client, recipe_with(workload("short", "go", max_tokens=11)), tmp_path / "raw")
    short = result.workloads[0]
    if short.distorted_requests == 0:
        # Recomputed from the arrival times kept in raw/: each chunk's gap over the tokens it carried, the
        # percentiles as numpy (and vLLM's benchmark) compute them.
        import numpy

        raw = json.loads((tmp_path / short.requests[0].raw_file).read_text())
        chunks = [(chunk["t_s"], len(chunk["token_ids"])) for chunk in raw["chunks"] if chunk["token_ids"]]
        gaps = [(t - t_before) / n for (t_before, _), (t, n) in itertools.pairwise(chunks) for _ in range(n)]
        assert short.itl_ms.n == len(gaps) == 10
        assert short.itl_ms.median_ms == pytest.approx(float(numpy.median(gaps)) * 1000, rel=1e-9)
        assert short.itl_ms.p99_ms == pytest.approx(float(numpy.percentile(gaps, 99)) * 1000, rel=1e-9)
        # ... and, give or take the machine's scheduling, the script's 25 ms and 50 ms.
        assert short.itl_ms.p99_ms > short.itl_ms.median_ms
    # The engine's time per output token: 0.3 s over the 10 tokens after the first.
    assert short.engine_tpot_ms.median_ms == pytest.approx(30.0, rel=1e-9)
    assert short.bench.median_tpot_ms == pytest.approx(30.0, rel=1e-9)
    assert short.bench.median_ttft_ms == pytest.approx(50.0, rel=1e-9)


def test_vllm_bench_keys_are_in_report_json(server, tmp_path):
    server.spec = SpecPerRequest(drafts=10, draft_tokens=40, accepted=30, accepted_per_position=(10, 9, 7, 4))
    with client_for(server) as client:
        result = run_throughput(client, recipe_with(workload("short", "go", max_tokens=11)), tmp_path / "raw")
    bench = result.workloads[0].bench.model_dump()
    # vLLM's benchmarks/serve.py: acceptance rate in percent, length 1 + accepted/drafts, rates per position.
    assert bench["spec_decode_acceptance_rate"] == pytest.approx(75.0)
    assert bench["spec_decode_acceptance_length"] == pytest.approx(4.0)
    assert bench["spec_decode_per_position_acceptance_rates"] == pytest.approx([1.0, 0.9, 0.7, 0.4])
    assert {"median_ttft_ms", "median_itl_ms", "median_tpot_ms"} <= bench.keys()


def test_each_synthesized_prompt_is_new_warmup_included(server, tmp_path):
    load = workload("long", "seed text", prompt_tokens=64, max_tokens=9, warmup_requests=1, min_requests=3,
                    max_requests=3)
    with client_for(server) as client:
        result = run_throughput(client, recipe_with(load), tmp_path / "raw")
    prompts = [sent.prompt for sent in server.sent]
    assert len(prompts) == 4 and all(len(p) == 64 for p in prompts)
    # A prefix cache matches whole blocks from the first token: every prompt must differ within its first block.
    assert len({tuple(p[:16]) for p in prompts}) == 4
    assert result.workloads[0].prompt_tokens_cached == 0
    assert "throughput.long.prefill_tok_s.median" in throughput_measurements(result)


def test_a_prefill_with_cached_prompt_tokens_is_marked_and_not_judged(server, tmp_path):
    server.scripts["ids"] = Script(ttft_s=0.2, offsets_s=[0.0, 0.05], tokens_per_chunk=[1, 4],
                                   cached_prompt_tokens=48)
    load = workload("long", "seed", prompt_tokens=64, max_tokens=5, min_requests=2, max_requests=2)
    with client_for(server) as client:
        result = run_throughput(client, recipe_with(load), tmp_path / "raw")
    assert result.workloads[0].prompt_tokens_cached == 96
    assert "throughput.long.prefill_tok_s.median" not in throughput_measurements(result)


def test_a_one_token_workload_prompt_is_refused_by_the_servers_tokenizer(server, tmp_path):
    with client_for(server) as client:
        result = run_throughput(client, recipe_with(workload("short", "x")), tmp_path / "raw")
    error = result.workloads[0].error
    assert error.startswith("prompt 'x' is 1 token(s) by the server's tokenizer") and "at least 2 tokens" in error
    assert not result.passed and server.sent == []


def test_smoke_names_a_server_that_speculates_with_another_k(server):
    server.spec = SpecPerRequest(accepted_per_position=(10, 8, 5))  # k=3 served, the recipe says k=4
    server.accepted_per_position = [0, 0, 0]
    with client_for(server) as client:
        smoke = run_smoke(client, recipe_with(workload("unused", "go")))
    check = {c.name: c for c in smoke.checks}["speculation"]
    assert not check.passed and check.reason.startswith("the server drafts 3 tokens per step")


def test_smoke_names_a_server_that_does_not_speculate_for_a_speculative_recipe(server):
    server.speculates = False
    with client_for(server) as client:
        smoke = run_smoke(client, recipe_with(workload("unused", "go")))
    check = {c.name: c for c in smoke.checks}["speculation"]
    assert not check.passed and "made no draft" in check.reason


def test_a_baseline_that_is_the_endpoint_itself_is_refused(servers, tmp_path):
    served, _ = servers
    with pytest.raises(BadInput, match="answers with the endpoint's counters"):
        verify_scripted(short_recipe(DECODE_AT_LEAST_40), served, served, tmp_path)
    assert not (tmp_path / "report.json").exists()


def test_a_speculating_baseline_is_refused(servers, tmp_path):
    served, baseline = servers
    baseline.speculates = True
    with pytest.raises(BadInput, match="the baseline must be target-only"):
        verify_scripted(short_recipe(DECODE_AT_LEAST_40), served, baseline, tmp_path)


def test_an_unmeasured_claim_fails_the_run_and_is_named(servers, tmp_path):
    served, baseline = servers
    never = Claim(id="long-decode", description="long", metric="throughput.long_prompt.decode_tok_s.median",
                  op=">=", value=1.0, source="test")
    report = verify_scripted(short_recipe(DECODE_AT_LEAST_40, never, requests=1), served, baseline, tmp_path)
    assert [v.verdict for v in report.verdicts] == ["met", "not_measured"]
    assert report.passed is False
    headline = (tmp_path / "report.md").read_text().splitlines()[2]
    assert "claim long-decode not measured" in headline and "all checks passed" not in headline


def test_verify_cli_exits_1_on_an_unmeasured_claim(servers, tmp_path):
    served, baseline = servers
    recipe_file = tmp_path / "recipe.json"
    never = Claim(id="long-decode", description="long", metric="throughput.long_prompt.decode_tok_s.median",
                  op=">=", value=1.0, source="test")
    recipe_file.write_text(short_recipe(never, requests=1).model_dump_json())
    completed = subprocess.run(
        [sys.executable, "-c", "from b70ctl.cli import main; main()", "verify", "--endpoint", served.url,
         "--baseline-endpoint", baseline.url,
         "--recipe", str(recipe_file), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300)
    assert completed.returncode == 1, completed.stderr[-2000:]
    written = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [v["verdict"] for v in written["verdicts"]] == ["not_measured"]
    assert written["smoke"]["passed"] and written["correctness"]["passed"] and written["throughput"]["passed"]


def test_a_schema_1_report_reads_as_client_timed(tmp_path):
    sample = {"decode_tok_s": 80.0, "peak_tok_s": 90.0, "ttft_s": 0.05, "completion_tokens": 64,
              "usage_completion_tokens": 64, "prompt_tokens": 3, "chunks": 20}
    summary = {"n": 1, "median": 80.0, "min": 80.0, "max": 80.0, "mad": 0.0, "ci_low": 80.0, "ci_high": 80.0}
    old = {"schema_version": 1, "tool_version": "0.1.0", "recipe": "cpu-tiny", "endpoint": "http://h:8000",
           "started_at": "2026-11-01T00:00:00Z",
           "throughput": {"passed": True, "workloads": [{
               "name": "short", "description": "d", "temperature": 0.0, "max_tokens": 64, "requests": [sample],
               "decode_tok_s": summary, "peak_tok_s": None, "ttft_s": None, "converged": False}]},
           "measurements": {"throughput.short.decode_tok_s.median": 80.0}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(old))
    loaded = read_report(path)
    assert loaded.upgraded_from == 1
    workload_result = loaded.report.throughput.workloads[0]
    assert workload_result.timing_source == "client" and "schema 1" in workload_result.timing_note
    assert workload_result.requests[0].client_decode_tok_s == 80.0
    assert workload_result.requests[0].delivery == "unchecked"


def test_a_ratio_claim_compares_the_endpoint_with_the_baseline_measured_in_the_same_run(servers, tmp_path):
    served, baseline = servers
    served.scripts["go"] = STEADY  # 50 tok/s on the engine
    # The target-only baseline decodes the same 33 tokens over 1.28 s: 25 tok/s.
    baseline.scripts["go"] = Script(ttft_s=0.1, offsets_s=[0.04 * k for k in range(33)], tokens_per_chunk=[1] * 33)
    speedup = Claim(id="speedup", description="speculation beats the target alone",
                    metric="throughput.short.decode_tok_s.median",
                    divided_by="throughput.short_baseline.decode_tok_s.median", op=">=", value=1.5, source="test")
    base = short_recipe(speedup)
    on_baseline = workload("short_baseline", "go", max_tokens=33, max_requests=2, min_requests=2, server="baseline")
    report = verify_scripted(base.model_copy(update={"workloads": [*base.workloads, on_baseline]}), served,
                             baseline, tmp_path)
    verdict = report.verdicts[0]
    assert verdict.verdict == "met" and verdict.measured == pytest.approx(2.0, rel=1e-9)
    assert verdict.metric.endswith("/ throughput.short_baseline.decode_tok_s.median")
    # The baseline workload's requests went to the baseline, none of the endpoint's.
    assert len([s for s in baseline.sent if s.prompt == "go"]) == 2


def test_a_baseline_workload_without_a_baseline_server_is_not_measured(server, tmp_path):
    on_baseline = workload("short_baseline", "go", server="baseline")
    with client_for(server) as client:
        result = run_throughput(client, recipe_with(on_baseline), tmp_path / "raw")
    assert result.workloads[0].error.startswith("runs on the target-only baseline: pass --baseline-endpoint")
    assert not result.passed and server.sent == []


def test_a_server_whose_greedy_output_matches_nothing_is_diagnosed_in_report_and_fleet(servers, tmp_path):
    served, baseline = servers
    served.first_token_id = 700  # every greedy output differs from the baseline's from the first token on
    greedy = Claim(id="greedy", description="greedy identical", metric="correctness.identical_fraction", op=">=",
                   value=1.0, source="test")
    report = verify_scripted(short_recipe(greedy, requests=1), served, baseline, tmp_path / "reports" / "host-a")
    assert report.correctness.identical == 0 and not report.passed
    # The catalogue's entry for silent garbage (its source: docs/facts.md, Known failures: "Several image builds
    # silently produce garbage").
    assert [failure.id for failure in report.diagnosis] == ["silent-garbage-output"]
    assert "identical 0/2" in report.diagnosis[0].evidence[0]
    markdown = (tmp_path / "reports" / "host-a" / "report.md").read_text()
    assert "## Diagnosis" in markdown and "**silent-garbage-output**" in markdown

    from b70ctl.fleet.analysis import aggregate
    from b70ctl.fleet.render import render_markdown as render_fleet

    fleet = aggregate(tmp_path / "reports")
    assert [(group.id, group.hosts) for group in fleet.diagnosed] == [("silent-garbage-output", ["host-a"])]
    assert "`silent-garbage-output`" in render_fleet(fleet)


def test_reports_made_by_hand_for_three_endpoints_are_three_hosts(servers, tmp_path):
    served, baseline = servers
    for name in ("box-a", "box-b", "box-c"):
        report = verify_scripted(short_recipe(DECODE_AT_LEAST_40, requests=1), served, baseline,
                                 tmp_path / "reports" / name)
        assert report.environment.hostname is None  # not the machine verify ran on
    named = verify_scripted(short_recipe(DECODE_AT_LEAST_40, requests=1), served, baseline, tmp_path / "named",
                            host="gpu-7")
    assert named.environment.hostname == "gpu-7"

    from b70ctl.fleet.analysis import aggregate

    fleet = aggregate(tmp_path / "reports")
    assert sorted(entry.host for entry in fleet.hosts) == ["box-a", "box-b", "box-c"]
    assert fleet.summary.hosts == 3 and fleet.summary.duplicate == 0 and fleet.summary.verified == 3
