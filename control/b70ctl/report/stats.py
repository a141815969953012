"""The numbers of the throughput check, as pure functions so tests can feed them exact inputs.

Rates follow docs/facts.md (Measuring): the decode rate of one request is (N-1)/(t_last - t_first), over the engine's
first and last token when the server exposes them (checks/metrics.py), else over arrival times; the peak is the
most tokens arriving in any 1-second window (llama-benchy's definition, counting token ids per chunk, never
chunks). Across requests we report the median with a distribution-free confidence interval from
binomial order statistics, so no normality is assumed for a handful of noisy runs on a shared machine.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Protocol

from b70ctl.report.model import Summary

DEFAULT_CONFIDENCE = 0.95
DEFAULT_TARGET_RELATIVE_HALFWIDTH = 0.02
PEAK_WINDOW_S = 1.0


class TimedChunk(Protocol):
    """What the peak needs of a stream chunk: its arrival time and the token ids it carried."""

    t_s: float
    token_ids: list[int]


def decode_tok_s(token_count: int, t_first_s: float, t_last_s: float) -> float | None:
    """Decode rate of one request: tokens after the first over the time they took to arrive.

    The first token is excluded because its time is prefill (TTFT). None when it is undefined: fewer than two
    tokens, or all tokens in one chunk (zero span)."""
    span_s = t_last_s - t_first_s
    if token_count < 2 or span_s <= 0:
        return None
    return (token_count - 1) / span_s


def peak_tok_s(chunks: Iterable[TimedChunk | tuple[float, int]], window_s: float = PEAK_WINDOW_S) -> float:
    """Most tokens arriving within any `window_s` window, as tokens per second.

    Windows are half-open, [t_i, t_i + window_s), anchored at each chunk's arrival: the count can only change at
    an arrival, so these windows contain the maximum. A chunk counts for all the token ids it carries. Chunks are
    either objects with `t_s` and `token_ids` (the client's Chunk) or (t_s, token_count) pairs. A stream whose
    arrivals span less than the window gives its tokens over that span, as llama-benchy 0.4 does
    (results.py, _calculate_peak_throughput): a window count would read below the stream's own rate."""
    if window_s <= 0:
        raise ValueError("window_s must be positive")
    arrivals: list[tuple[float, int]] = []
    for chunk in chunks:
        if isinstance(chunk, tuple):
            arrivals.append((float(chunk[0]), int(chunk[1])))
        else:
            arrivals.append((float(chunk.t_s), len(chunk.token_ids)))
    arrivals = [(t_s, count) for t_s, count in arrivals if count > 0]
    if not arrivals:
        return 0.0
    arrivals.sort()
    times = [t_s for t_s, _ in arrivals]
    span_s = times[-1] - times[0]
    if 0 < span_s < window_s:
        return sum(count for _, count in arrivals) / span_s
    # Prefix sums make each window's count an O(1) difference: a 512-token stream stays linear.
    prefix = [0]
    for _, count in arrivals:
        prefix.append(prefix[-1] + count)
    best = 0
    for start_index, t_start in enumerate(times):
        end_index = bisect.bisect_left(times, t_start + window_s)
        best = max(best, prefix[end_index] - prefix[start_index])
    return best / window_s


def per_token_gaps_s(chunks: Iterable[TimedChunk | tuple[float, int]]) -> list[float]:
    """Inter-token latency per TOKEN: each chunk's gap since the previous chunk, spread evenly over the tokens it
    carried (with speculation one chunk holds several). vLLM's benchmark takes one gap per chunk instead, which
    reads k+1 times too slow a stream as one token per gap."""
    arrivals = sorted((float(c[0]), int(c[1])) if isinstance(c, tuple) else (float(c.t_s), len(c.token_ids))
                      for c in chunks)
    arrivals = [(t_s, count) for t_s, count in arrivals if count > 0]
    gaps: list[float] = []
    for (previous_s, _), (t_s, count) in itertools.pairwise(arrivals):
        gaps += [(t_s - previous_s) / count] * count
    return gaps


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics, as numpy's default and
    so vLLM's benchmark compute it."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError("q must be within 0..100")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# How far the client's decode rate may stray from the engine's before the delivery is called distorted.
DELIVERY_TOLERANCE = 0.05


def delivery_check(client_decode_tok_s: float | None, engine_decode_tok_s: float | None,
                   tolerance: float = DELIVERY_TOLERANCE) -> tuple[str, str | None]:
    """("ok" | "distorted" | "unchecked", reason). The engine produced the tokens at its rate; a client that saw
    them arrive at another rate saw the network, a proxy or a busy API server (a burst at the end of the stream
    reads as a rate thousands of times the engine's), not the engine."""
    if engine_decode_tok_s is None:
        return "unchecked", None
    if client_decode_tok_s is None:
        return "distorted", ("all tokens arrived in one chunk while the engine decoded for "
                             f"{1 / engine_decode_tok_s * 1000:.1f} ms per token")
    ratio = client_decode_tok_s / engine_decode_tok_s
    if abs(ratio - 1) > tolerance:
        return "distorted", (f"arrivals read {client_decode_tok_s:.4g} tok/s, the engine decoded at "
                             f"{engine_decode_tok_s:.4g} tok/s ({ratio:.3g}x): delivery, not decode, set the pace")
    return "ok", None


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[middle])
    return (ordered[middle - 1] + ordered[middle]) / 2


# MAD / 0.6745 (x 1.4826) estimates a normal distribution's sigma, 0.6745 being the normal's third quartile in
# sigmas: the tune's robust score and the fleet's modified z-scores (Iglewicz & Hoaglin) both scale by it.
SIGMA_PER_MAD = 1 / 0.6745


def mad(values: Sequence[float]) -> float:
    """Median absolute deviation from the median, unscaled (multiply by SIGMA_PER_MAD for a normal sigma)."""
    center = median(values)
    return median([abs(value - center) for value in values])


def _binomial_half_cdf(n: int, k: int) -> float:
    """P(B <= k) for B ~ Binomial(n, 1/2), exact (integers until the one division)."""
    if k < 0:
        return 0.0
    return sum(math.comb(n, i) for i in range(min(k, n) + 1)) / (1 << n)


def median_ci_ranks(n: int, confidence: float = DEFAULT_CONFIDENCE) -> tuple[int, int, float]:
    """1-based ranks (low, high) of the order statistics bounding the median, and the coverage they achieve.

    P(x_(l) <= true median <= x_(n+1-l)) = 1 - 2 P(B <= l-1) with B ~ Binomial(n, 1/2), whatever the
    distribution (continuous). We take the largest l (narrowest interval) whose coverage is at least
    `confidence`. Below that many samples (n < 6 at 95%) even [min, max] falls short: then the ranks are (1, n)
    and the returned coverage says how much less it is."""
    if n < 1:
        raise ValueError("no values")
    if not 0 < confidence < 1:
        raise ValueError("confidence must be in (0, 1)")
    low_rank = 1
    for candidate in range(1, n // 2 + 1):
        coverage = 1 - 2 * _binomial_half_cdf(n, candidate - 1)
        if coverage >= confidence:
            low_rank = candidate
        else:
            break
    coverage = 1 - 2 * _binomial_half_cdf(n, low_rank - 1)
    return low_rank, n + 1 - low_rank, coverage


def median_ci(values: Sequence[float], confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float, float]:
    """(low, high, achieved coverage) of the distribution-free confidence interval for the median."""
    ordered = sorted(values)
    low_rank, high_rank, coverage = median_ci_ranks(len(ordered), confidence)
    return float(ordered[low_rank - 1]), float(ordered[high_rank - 1]), coverage


def summarize(values: Sequence[float], confidence: float = DEFAULT_CONFIDENCE) -> Summary:
    """Median, range, MAD and the median's CI. `confidence` in the result is the coverage actually achieved,
    which is below the one asked for when there are too few values (see median_ci_ranks)."""
    if not values:
        raise ValueError("summarize needs at least one value")
    ci_low, ci_high, coverage = median_ci(values, confidence)
    return Summary(
        n=len(values),
        median=median(values),
        min=float(min(values)),
        max=float(max(values)),
        mad=mad(values),
        ci_low=ci_low,
        ci_high=ci_high,
        confidence=coverage,
    )


def converged(values: Sequence[float], target_relative_halfwidth: float = DEFAULT_TARGET_RELATIVE_HALFWIDTH,
              confidence: float = DEFAULT_CONFIDENCE) -> bool:
    """Stopping rule: the median's CI reaches the asked confidence and lies within ±target of the median.

    Both ends are checked (the interval from order statistics is not symmetric). With too few values for the
    asked confidence the rule never fires, so a run of three identical-looking requests does not stop early."""
    if len(values) < 2:
        return False
    center = median(values)
    if center == 0:
        return False
    ci_low, ci_high, coverage = median_ci(values, confidence)
    if coverage < confidence:
        return False
    widest = max(center - ci_low, ci_high - center)
    return widest <= target_relative_halfwidth * abs(center)
