"""Exact arithmetic of the throughput statistics."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from b70ctl.report.stats import (
    converged,
    decode_tok_s,
    mad,
    median,
    median_ci,
    median_ci_ranks,
    peak_tok_s,
    per_token_gaps_s,
    percentile,
    summarize,
)


@dataclass
class FakeChunk:
    t_s: float
    token_ids: list[int]


# -- decode rate ---------------------------------------------------------------------------------------------
def test_decode_rate_excludes_the_first_token():
    # 101 tokens, the first at 0.5 s (prefill), the last at 2.5 s: 100 tokens in 2 s.
    assert decode_tok_s(101, 0.5, 2.5) == pytest.approx(50.0, rel=1e-12)


def test_decode_rate_is_undefined_without_a_span():
    assert decode_tok_s(1, 0.5, 0.5) is None
    assert decode_tok_s(0, 0.0, 0.0) is None
    assert decode_tok_s(5, 1.0, 1.0) is None  # every token in one chunk
    assert decode_tok_s(5, 2.0, 1.0) is None  # clock went backwards: refuse, don't report a negative rate


# -- peak ------------------------------------------------------------------------------------------------------
def test_peak_counts_token_ids_not_chunks():
    # Speculation: 3 chunks of 5 tokens inside one second. Counting chunks would say 3.
    chunks = [FakeChunk(0.1, [1] * 5), FakeChunk(0.4, [1] * 5), FakeChunk(0.7, [1] * 5), FakeChunk(3.0, [1])]
    assert peak_tok_s(chunks) == 15.0


def test_peak_window_is_half_open():
    # A chunk exactly one second after the window's start belongs to the next window.
    assert peak_tok_s([(0.0, 4), (1.0, 4)]) == 4.0
    assert peak_tok_s([(0.0, 4), (1.0, 4), (1.5, 1)]) == 5.0


def test_peak_of_a_stream_shorter_than_the_window_is_its_tokens_over_its_duration():
    # llama-benchy 0.4 (results.py, _calculate_peak_throughput): "If total duration is less than the window, use
    # actual duration ... where Peak would otherwise be < Mean": len(token timestamps) / (last - first).
    assert peak_tok_s([(0.0, 4), (0.999, 4)]) == pytest.approx(8 / 0.999)
    # 64 tokens in 0.5 s decode at (64-1)/0.5 = 126 tok/s: a 1 s window would have said 64.
    steady = [(i * 0.5 / 63, 1) for i in range(64)]
    assert peak_tok_s(steady) == pytest.approx(128.0)
    assert peak_tok_s(steady) >= decode_tok_s(64, 0.0, 0.5)


def test_peak_finds_the_densest_window_anywhere():
    chunks = [(0.0, 1), (0.5, 1), (1.2, 6), (1.3, 6), (2.1, 6), (2.25, 1), (5.0, 9)]
    # [1.2, 2.2) holds 6+6+6 = 18; [1.3, 2.3) holds 6+6+1 = 13; the last chunk alone 9.
    assert peak_tok_s(chunks) == 18.0


def test_peak_ignores_empty_chunks_and_order():
    chunks = [(2.0, 3), (0.0, 0), (1.5, 3), (0.2, 0), (4.0, 1)]
    assert peak_tok_s(chunks) == 6.0
    assert peak_tok_s([]) == 0.0
    assert peak_tok_s([(0.0, 0)]) == 0.0


def test_peak_with_another_window_is_per_second():
    assert peak_tok_s([(0.0, 3), (0.4, 3), (0.6, 3)], window_s=0.5) == 12.0  # 6 tokens in 0.5 s
    with pytest.raises(ValueError):
        peak_tok_s([(0.0, 1)], window_s=0.0)


# -- median, MAD, CI -----------------------------------------------------------------------------------------
def test_median_and_mad():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    # deviations from 2.5: 1.5 0.5 0.5 1.5 -> median 1.0
    assert mad([4.0, 1.0, 3.0, 2.0]) == 1.0
    # one outlier moves neither
    assert median([10.0, 10.0, 11.0, 12.0, 1000.0]) == 11.0
    assert mad([10.0, 10.0, 11.0, 12.0, 1000.0]) == 1.0
    with pytest.raises(ValueError):
        median([])


@pytest.mark.parametrize(
    ("n", "ranks", "coverage"),
    [
        (5, (1, 5), 1 - 2 / 32),  # too few for 95%: [min, max] at 93.75%
        (6, (1, 6), 1 - 2 / 64),
        (8, (1, 8), 1 - 2 / 256),  # l=2 would give 1 - 2*9/256 = 0.9297
        (9, (2, 8), 1 - 2 * 10 / 512),
        (10, (2, 9), 1 - 2 * 11 / 1024),
        (20, (6, 15), 1 - 2 * 21700 / 2**20),  # the textbook table value 0.9586
    ],
)
def test_median_ci_ranks_are_the_binomial_order_statistics(n, ranks, coverage):
    low, high, achieved = median_ci_ranks(n, 0.95)
    assert (low, high) == ranks
    assert achieved == pytest.approx(coverage, abs=1e-12)


def test_median_ci_picks_those_order_statistics():
    values = [float(v) for v in (17, 3, 9, 11, 5, 13, 1, 19, 7, 15)]  # sorted: 1 3 5 ... 19
    low, high, coverage = median_ci(values)
    assert (low, high) == (3.0, 17.0)  # ranks 2 and 9
    assert coverage == pytest.approx(0.978515625)


def test_median_ci_covers_the_true_median_as_often_as_it_says():
    # Exponential samples (skewed): the interval is distribution-free, so coverage holds anyway.
    rng = random.Random(20261130)
    true_median = 0.6931471805599453  # ln 2 for rate 1
    trials, hits = 4000, 0
    for _ in range(trials):
        low, high, _ = median_ci([rng.expovariate(1.0) for _ in range(10)])
        hits += low <= true_median <= high
    assert hits / trials == pytest.approx(0.978515625, abs=0.01)


def test_summarize_reports_the_achieved_coverage():
    summary = summarize([10.0, 12.0, 11.0])
    assert (summary.n, summary.median, summary.min, summary.max, summary.mad) == (3, 11.0, 10.0, 12.0, 1.0)
    assert (summary.ci_low, summary.ci_high) == (10.0, 12.0)
    assert summary.confidence == pytest.approx(0.75)  # 1 - 2/8: three values cannot give 95%
    with pytest.raises(ValueError):
        summarize([])


# -- stopping rule ---------------------------------------------------------------------------------------------
def test_converged_needs_enough_values_for_the_confidence():
    # Identical values but only five: [min, max] covers 93.75% < 95%, so keep sampling.
    assert not converged([100.0] * 5)
    assert converged([100.0] * 6)


def test_converged_checks_both_ends_against_the_target():
    within = [98.5, 99.0, 99.5, 100.0, 100.5, 101.0, 101.5, 100.2, 99.8, 100.1]
    # ranks 2 and 9 of the sorted values: 99.0 and 101.0, median 100.05: both ends within 2%.
    assert converged(within, 0.02)
    assert not converged(within, 0.005)
    skewed = [100.0] * 8 + [103.0, 103.0]  # upper end (rank 9) 3% above the median
    assert not converged(skewed, 0.02)
    assert converged(skewed, 0.031)
    assert not converged([0.0] * 10)


# -- per-token latency --------------------------------------------------------------------------------------
def test_percentile_interpolates_as_numpy_does():
    # vLLM's benchmark reports np.percentile (linear interpolation): the same numbers, here from numpy itself.
    import numpy  # installed with vLLM, which the suite's environment always has
    values = [random.Random(7).uniform(0, 50) for _ in range(37)]
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)), rel=1e-12)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_each_token_of_a_chunk_waited_the_chunks_gap_over_its_size():
    # Chunks at 0, 0.1, 0.3 s carrying 1, 4, 2 tokens: 4 tokens that waited 25 ms each, 2 that waited 100 ms.
    gaps = per_token_gaps_s([(0.0, 1), (0.1, 4), (0.3, 2)])
    assert gaps == pytest.approx([0.025] * 4 + [0.1] * 2)
    assert per_token_gaps_s([(0.0, 3)]) == []
