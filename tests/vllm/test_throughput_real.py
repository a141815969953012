"""Smoke and throughput against real vLLM CPU servers (tests/vllm/conftest.py): what the instrument reports must be
what the server did. Token counts are checked against usage, acceptance against the /metrics deltas read here
independently from the raw snapshots the check kept. No timing is asserted (the machine drifts ±10%)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from b70ctl.checks.client import VllmClient
from b70ctl.checks.smoke import run_smoke
from b70ctl.checks.throughput import run_throughput
from b70ctl.recipes.model import Recipe, Workload
from b70ctl.report.measurements import throughput_measurements
from b70ctl.report.model import ThroughputResult, WorkloadResult


def quick(recipe: Recipe, speculative: bool = True, temperature: float | None = None,
          only: tuple[str, ...] | None = None) -> Recipe:
    """The recipe's own workloads, three measured requests each (enough to exercise the loop, short in CI)."""
    workloads: list[Workload] = []
    for workload in recipe.workloads:
        if only is not None and workload.name not in only:
            continue
        if workload.server == "baseline":
            continue  # run_throughput is given one server here; verify runs these on the baseline
        update: dict[str, object] = {"warmup_requests": 1, "min_requests": 3, "max_requests": 3}
        if temperature is not None:
            update["temperature"] = temperature
        workloads.append(workload.model_copy(update=update))
    serve = recipe.serve if speculative else recipe.serve.model_copy(update={"speculative": None})
    return recipe.model_copy(update={"workloads": workloads, "serve": serve})


def counter_total(text: str, name: str) -> float:
    """Sum of every sample of a counter, by plain text matching (not the code under test)."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.MULTILINE)
    return sum(float(match.group(2)) for match in pattern.finditer(text))


def per_position_totals(text: str) -> dict[int, float]:
    pattern = re.compile(r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"[^}]*\} (\S+)$',
                         re.MULTILINE)
    totals: dict[int, float] = {}
    for match in pattern.finditer(text):
        totals[int(match.group(1))] = totals.get(int(match.group(1)), 0.0) + float(match.group(2))
    return totals


def assert_counts_match_usage(result: ThroughputResult, recipe: Recipe) -> None:
    for workload in result.workloads:
        assert workload.error is None, (workload.name, workload.error)
        assert workload.token_count_mismatches == 0
        assert len(workload.requests) == 3
        for sample in workload.requests:
            # ignore_eos: every request generates exactly max_tokens, counted from token ids per chunk.
            assert sample.completion_tokens == sample.usage_completion_tokens == workload.max_tokens
            assert sample.decode_tok_s is not None and sample.decode_tok_s > 0
        if workload.prompt_tokens is not None:
            assert all(sample.prompt_tokens == workload.prompt_tokens for sample in workload.requests)
            assert workload.prefill_tok_s is not None
    assert result.passed


def assert_engine_timed(result: ThroughputResult) -> None:
    """Every request timed by the server's own per-request histograms, the client's arrivals judged against them."""
    for workload in result.workloads:
        assert workload.timing_source == "engine", (workload.name, workload.timing_note)
        for sample in workload.requests:
            assert sample.engine.generation_tokens == sample.completion_tokens
            off = (sample.client_decode_tok_s is None
                   or abs(sample.client_decode_tok_s / sample.decode_tok_s - 1) > 0.05)
            assert sample.delivery == ("distorted" if off else "ok")


def assert_acceptance_matches_metrics(workload: WorkloadResult, raw_dir: Path) -> None:
    before = (raw_dir / "throughput" / workload.name / "metrics_before.txt").read_text()
    after = (raw_dir / "throughput" / workload.name / "metrics_after.txt").read_text()

    def grown(name: str) -> float:
        return counter_total(after, f"vllm:{name}") - counter_total(before, f"vllm:{name}")

    spec = workload.spec_decode
    assert spec is not None and not spec.polluted, spec
    drafts, draft_tokens, accepted = (grown("spec_decode_num_drafts_total"),
                                      grown("spec_decode_num_draft_tokens_total"),
                                      grown("spec_decode_num_accepted_tokens_total"))
    assert grown("generation_tokens_total") == sum(s.usage_completion_tokens for s in workload.requests)
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (drafts, draft_tokens, accepted)
    assert drafts > 0
    assert spec.acceptance_rate == pytest.approx(accepted / draft_tokens)
    assert spec.mean_acceptance_length == pytest.approx(1 + accepted / drafts)
    positions_before, positions_after = per_position_totals(before), per_position_totals(after)
    expected = [(positions_after[p] - positions_before.get(p, 0.0)) / drafts for p in sorted(positions_after)]
    assert spec.per_position_acceptance == pytest.approx(expected)
    # A draft token is accepted only if every one before it was: the rates never rise with position.
    rates = spec.per_position_acceptance
    assert all(later <= earlier + 1e-12 for earlier, later in itertools.pairwise(rates))


def test_baseline_serves_and_counts_tokens_exactly(endpoints, cpu_tiny, tmp_path):
    recipe = quick(cpu_tiny, speculative=False)
    with VllmClient(endpoints["baseline"]) as client:
        smoke = run_smoke(client, recipe)
        assert smoke.passed, [(c.name, c.reason) for c in smoke.checks if not c.passed]
        result = run_throughput(client, recipe, tmp_path / "raw")
    assert_counts_match_usage(result, recipe)
    assert_engine_timed(result)
    for workload in result.workloads:
        assert workload.spec_decode is None or workload.spec_decode.num_drafts == 0
    figures = throughput_measurements(result)
    assert "throughput.short.acceptance_rate" not in figures
    assert figures["throughput.long_prompt.prefill_tok_s.median"] > 0


def test_exact_draft_is_accepted_almost_always(endpoints, cpu_tiny, tmp_path):
    recipe = quick(cpu_tiny)
    with VllmClient(endpoints["draft-exact"]) as client:
        smoke = run_smoke(client, recipe)
        assert smoke.passed, [(c.name, c.reason) for c in smoke.checks if not c.passed]
        result = run_throughput(client, recipe, tmp_path / "raw")
    assert_counts_match_usage(result, recipe)
    for workload in result.workloads:
        assert_acceptance_matches_metrics(workload, tmp_path / "raw")
        # Same weights, greedy: only a floating-point tie could reject a draft token.
        assert workload.spec_decode.acceptance_rate >= 0.95
        assert workload.spec_decode.mean_acceptance_length >= 1 + 0.95 * 4
    figures = throughput_measurements(result)
    assert figures["throughput.acceptance_friendly.acceptance_rate"] >= 0.95
    assert len(figures["throughput.acceptance_friendly.per_position_acceptance"]) == 4


def test_perturbed_draft_acceptance_falls_with_position(endpoints, cpu_tiny, tmp_path):
    # Greedy, the recipe's own setting: the draft's 60% weight noise flips enough argmaxes that acceptance
    # falls with the position (a rejected position ends the draft). At temperature > 0, vLLM 0.32 CPU accepts
    # nothing past position 0 with draft_model, which would hide the fall.
    recipe = quick(cpu_tiny, only=("natural", "acceptance_friendly"))
    with VllmClient(endpoints["draft-perturbed"]) as client:
        result = run_throughput(client, recipe, tmp_path / "raw")
    assert_counts_match_usage(result, recipe)
    for workload in result.workloads:
        assert_acceptance_matches_metrics(workload, tmp_path / "raw")
        rates = workload.spec_decode.per_position_acceptance
        assert rates[0] > rates[-1], (workload.name, rates)
    natural = {w.name: w for w in result.workloads}["natural"].spec_decode
    assert natural.acceptance_rate < 0.9


def test_ngram_acceptance_matches_its_counters(endpoints, cpu_tiny, tmp_path):
    recipe = quick(cpu_tiny, only=("acceptance_friendly", "long_prompt"))
    with VllmClient(endpoints["ngram"]) as client:
        result = run_throughput(client, recipe, tmp_path / "raw")
    assert_counts_match_usage(result, recipe)
    assert_engine_timed(result)
    for workload in result.workloads:
        assert_acceptance_matches_metrics(workload, tmp_path / "raw")
