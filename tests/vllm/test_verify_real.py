"""b70ctl verify against real vLLM CPU servers: the whole instrument on real speculative decoding."""

from __future__ import annotations

import json

import pytest

from b70ctl.verify import VerifyRequest, verify


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


def test_exact_draft_is_accepted_almost_always(exact_report):
    report, _ = exact_report
    for workload in report.throughput.workloads:
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
    assert all(earlier >= later for earlier, later in zip(rates, rates[1:])), rates
    assert rates[0] > rates[-1]
    # Per-position rates are accepted-at-position / drafts: their sum is the accepted tokens per draft.
    assert sum(rates) == pytest.approx(natural.num_accepted_tokens / natural.num_drafts, rel=1e-9)


def test_greedy_with_perturbed_draft_is_identical_to_baseline(perturbed_report):
    report, _ = perturbed_report
    assert report.correctness.identical == report.correctness.total
