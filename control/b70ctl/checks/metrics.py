"""vLLM's Prometheus counters: snapshots, deltas, and the speculative-decoding figures derived from them.

The counters (docs/facts.md, Measuring) are cumulative and server-wide, so a figure is only ours if it is a delta
around our own requests and nothing else ran in between. What vLLM counts, as read from its source (0.32) and
checked against a real CPU server:
- vllm:generation_tokens_total grows by the output tokens of every request, after truncation at max_tokens or a
  stop: for our requests the delta equals the sum of usage.completion_tokens, exactly. More than that means other
  traffic (pollution); less means the counters went backwards (a restarted server).
- The spec-decode counters count drafts as verified, BEFORE truncation: the last draft of a request may be
  accepted beyond max_tokens. So they cannot be matched token for token with the output; only the generation
  tokens can tell pollution.
- The counters are recorded in the same event-loop step that hands the output to the request, before the request
  sees it, so a snapshot taken after our last [DONE] includes it. The throughput check still re-reads briefly
  when a request's decode histogram has not moved yet, in case a future vLLM records later.
Label sets (engine per data-parallel rank, model_name) are summed, keeping the served model's when given.

Per-request timing comes from the histograms vLLM observes once per FINISHED request, on the engine core's clock
(v1/metrics/stats.py update_from_finished_request, v1/metrics/loggers.py record(); same names in 0.21 and 0.32,
real captures of both in tests/fixtures/metrics/): decode time = last token - first token, prefill time = first
token - scheduled, plus TTFT (from arrival), queue time and generated / prompt token counts. Read right before and
right after one request at concurrency 1, the deltas of their _sum and _count are that request's own figures,
whatever the network did to the stream in between. vllm:inter_token_latency_seconds is observed once per engine
STEP (a step can emit several tokens under speculation), so it counts steps, not tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from b70ctl.checks.client import EndpointError, VllmClient
from b70ctl.report.model import EngineTiming, SpecDecodeStats

NUM_DRAFTS = "vllm:spec_decode_num_drafts_total"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS_CACHED = "vllm:prompt_tokens_cached_total"  # prompt tokens not computed (0.21 and 0.32)
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"  # prefix-cache hits, in tokens
_SUMMED = (NUM_DRAFTS, NUM_DRAFT_TOKENS, NUM_ACCEPTED_TOKENS, GENERATION_TOKENS, PROMPT_TOKENS_CACHED,
           PREFIX_CACHE_HITS)

REQUEST_DECODE_TIME = "vllm:request_decode_time_seconds"
REQUEST_PREFILL_TIME = "vllm:request_prefill_time_seconds"
REQUEST_QUEUE_TIME = "vllm:request_queue_time_seconds"
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
_HISTOGRAMS = (REQUEST_DECODE_TIME, REQUEST_PREFILL_TIME, REQUEST_QUEUE_TIME, TIME_TO_FIRST_TOKEN,
               REQUEST_GENERATION_TOKENS, REQUEST_PROMPT_TOKENS, INTER_TOKEN_LATENCY)


class MetricsUnavailable(Exception):
    """/metrics could not be read or parsed. `reason` is one line for the report."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class CountersUnusable(MetricsUnavailable):
    """/metrics answered, but its counters are no count: a series given twice, a NaN or infinite generation count.
    What needs them cannot be judged; the run goes on."""


@dataclass(frozen=True)
class MetricsSnapshot:
    """The counters we use, summed over label sets. None: the server does not export that counter (a server
    without speculation has no spec_decode_* counters)."""

    num_drafts: float | None
    num_draft_tokens: float | None
    num_accepted_tokens: float | None
    generation_tokens: float | None
    accepted_per_position: dict[int, float] = field(default_factory=dict)
    text: str = field(default="", repr=False)  # the exposition as read, kept for raw/
    # Histogram name -> (sum, count), summed over label sets; absent when the server does not export it.
    histograms: dict[str, tuple[float, float]] = field(default_factory=dict)
    prompt_tokens_cached: float | None = None
    prefix_cache_hits: float | None = None
    # Series we use whose value was NaN or infinite: left out as unusable (None), named here.
    non_finite: tuple[str, ...] = ()

    @property
    def has_request_timing(self) -> bool:
        return REQUEST_DECODE_TIME in self.histograms and REQUEST_GENERATION_TOKENS in self.histograms

    @property
    def speculative_positions(self) -> int:
        """k as the server exports it: one per-position acceptance series per draft position (vLLM creates the
        position labels 0..k-1 when it starts, before any draft)."""
        return len(self.accepted_per_position)

    @property
    def has_spec_decode(self) -> bool:
        return self.num_drafts is not None and self.num_draft_tokens is not None \
            and self.num_accepted_tokens is not None


@dataclass(frozen=True)
class MetricsDelta:
    num_drafts: float | None
    num_draft_tokens: float | None
    num_accepted_tokens: float | None
    generation_tokens: float | None
    accepted_per_position: dict[int, float]


def parse_metrics(text: str, model_name: str | None = None) -> MetricsSnapshot:
    """Parse a Prometheus text exposition. Samples labelled with another model_name are left out when
    `model_name` is given and the server labels by model at all."""
    try:
        samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    except (ValueError, TypeError, IndexError) as error:
        raise MetricsUnavailable(f"/metrics is not a Prometheus text exposition: {error}") from error
    histogram_samples = {f"{name}{suffix}": (name, suffix) for name in _HISTOGRAMS for suffix in ("_sum", "_count")}
    wanted = set(_SUMMED) | {ACCEPTED_PER_POSITION} | set(histogram_samples)
    ours = [s for s in samples if s.name in wanted]
    if model_name is not None and any(s.labels.get("model_name") == model_name for s in ours):
        ours = [s for s in ours if s.labels.get("model_name") in (model_name, None)]
    # One series twice (two exporters merged by a proxy, a family repeated) would be summed into twice the count
    # and read as other traffic: it is no count at all.
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for sample in ours:
        series = (sample.name, tuple(sorted(sample.labels.items())))
        if series in seen:
            raise CountersUnusable(f"/metrics gives the series {sample.name} with the same labels twice: the "
                                     "exposition is not one server's (a proxy merging two?); read it from the server")
        seen.add(series)
    # A NaN or infinite counter is no count: the counter is unusable (None), not a figure to subtract and judge.
    non_finite = tuple(dict.fromkeys(s.name for s in ours if not math.isfinite(s.value)))
    unusable = set(non_finite)
    ours = [s for s in ours if s.name not in unusable]
    totals: dict[str, float] = {}
    per_position: dict[int, float] = {}
    histograms: dict[str, list[float]] = {}
    for sample in ours:
        if sample.name in histogram_samples:
            name, suffix = histogram_samples[sample.name]
            pair = histograms.setdefault(name, [0.0, 0.0])
            pair[0 if suffix == "_sum" else 1] += sample.value
        elif sample.name == ACCEPTED_PER_POSITION:
            try:
                position = int(sample.labels["position"])
            except (KeyError, ValueError) as error:
                raise MetricsUnavailable(f"{ACCEPTED_PER_POSITION} without a numeric position label") from error
            per_position[position] = per_position.get(position, 0.0) + sample.value
        else:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return MetricsSnapshot(
        num_drafts=totals.get(NUM_DRAFTS),
        num_draft_tokens=totals.get(NUM_DRAFT_TOKENS),
        num_accepted_tokens=totals.get(NUM_ACCEPTED_TOKENS),
        generation_tokens=totals.get(GENERATION_TOKENS),
        accepted_per_position=dict(sorted(per_position.items())),
        text=text,
        histograms={name: (pair[0], pair[1]) for name, pair in histograms.items()},
        prompt_tokens_cached=totals.get(PROMPT_TOKENS_CACHED),
        prefix_cache_hits=totals.get(PREFIX_CACHE_HITS),
        non_finite=non_finite,
    )


def missing_generation_tokens(result: MetricsSnapshot) -> str:
    if GENERATION_TOKENS in result.non_finite:
        return f"/metrics gives {GENERATION_TOKENS} as NaN or infinite: the counter is unusable"
    return f"/metrics has no {GENERATION_TOKENS}: not a vLLM server, or its stats are off"


def snapshot(client: VllmClient, model_name: str | None = None) -> MetricsSnapshot:
    """Read and parse the server's /metrics. Raises MetricsUnavailable with the reason."""
    try:
        text = client.metrics_text()
    except EndpointError as error:
        raise MetricsUnavailable(error.reason) from error
    result = parse_metrics(text, model_name)
    if result.generation_tokens is None:
        unusable = GENERATION_TOKENS in result.non_finite
        raise (CountersUnusable if unusable else MetricsUnavailable)(missing_generation_tokens(result))
    return result


def _minus(after: float | None, before: float | None) -> float | None:
    if after is None or before is None:
        return None
    return after - before


def delta(before: MetricsSnapshot, after: MetricsSnapshot) -> MetricsDelta:
    positions = sorted(set(before.accepted_per_position) | set(after.accepted_per_position))
    return MetricsDelta(
        num_drafts=_minus(after.num_drafts, before.num_drafts),
        num_draft_tokens=_minus(after.num_draft_tokens, before.num_draft_tokens),
        num_accepted_tokens=_minus(after.num_accepted_tokens, before.num_accepted_tokens),
        generation_tokens=_minus(after.generation_tokens, before.generation_tokens),
        accepted_per_position={
            p: after.accepted_per_position.get(p, 0.0) - before.accepted_per_position.get(p, 0.0) for p in positions
        },
    )


def spec_decode_stats(before: MetricsSnapshot, after: MetricsSnapshot,
                      expected_generation_tokens: float) -> SpecDecodeStats | None:
    """Acceptance figures from the counter deltas around our requests; None when the server does not speculate.

    `expected_generation_tokens` is what our own requests generated (sum of usage.completion_tokens); the
    generation-token delta is compared with it to tell whether other traffic ran meanwhile."""
    if not (before.has_spec_decode and after.has_spec_decode):
        return None
    change = delta(before, after)
    drafts = change.num_drafts or 0.0
    draft_tokens = change.num_draft_tokens or 0.0
    accepted = change.num_accepted_tokens or 0.0
    polluted, reason = _pollution(change, expected_generation_tokens)
    return SpecDecodeStats(
        num_drafts=drafts,
        num_draft_tokens=draft_tokens,
        num_accepted_tokens=accepted,
        acceptance_rate=accepted / draft_tokens if draft_tokens > 0 else None,
        mean_acceptance_length=1 + accepted / drafts if drafts > 0 else None,
        per_position_acceptance=[value / drafts for value in change.accepted_per_position.values()]
        if drafts > 0 else [],
        generation_tokens=change.generation_tokens,
        polluted=polluted,
        pollution_reason=reason,
    )


def _pollution(change: MetricsDelta, expected_generation_tokens: float) -> tuple[bool, str | None]:
    counters = (change.num_drafts, change.num_draft_tokens, change.num_accepted_tokens, change.generation_tokens,
                *change.accepted_per_position.values())
    if any(value is not None and value < 0 for value in counters):
        return True, "counters went backwards between the snapshots: the server restarted during the run"
    generated = change.generation_tokens
    if generated is None:
        return True, f"/metrics has no {GENERATION_TOKENS}: cannot tell our tokens from other traffic"
    if generated > expected_generation_tokens:
        return True, (
            f"the server generated {generated:g} tokens during the run but our requests received "
            f"{expected_generation_tokens:g}: other traffic shared the server, the counters are not ours alone"
        )
    if generated < expected_generation_tokens:
        return True, (
            f"the server counted {generated:g} generated tokens but our requests received "
            f"{expected_generation_tokens:g}: its counters are not the ones that served us (restart or a proxy?)"
        )
    return False, None


def _histogram_delta(before: MetricsSnapshot, after: MetricsSnapshot, name: str) -> tuple[float, float] | None:
    if name not in before.histograms or name not in after.histograms:
        return None
    (sum_before, count_before), (sum_after, count_after) = before.histograms[name], after.histograms[name]
    return sum_after - sum_before, count_after - count_before


def request_timing(before: MetricsSnapshot, after: MetricsSnapshot) -> EngineTiming | str:
    """One request's figures on the engine's clock, from the histogram deltas around it, or the reason they cannot
    be (then the client's figures stand alone). Exactly one finished request must lie between the snapshots."""
    if not (before.has_request_timing and after.has_request_timing):
        return (f"/metrics has no {REQUEST_DECODE_TIME} / {REQUEST_GENERATION_TOKENS}: the server exposes no "
                "per-request timing, no cross-check with the engine was possible")
    decode = _histogram_delta(before, after, REQUEST_DECODE_TIME)
    generated = _histogram_delta(before, after, REQUEST_GENERATION_TOKENS)
    assert decode is not None and generated is not None
    if decode[1] < 0 or generated[1] < 0:
        return "the engine's counters went backwards around the request: the server restarted"
    if decode[1] != 1 or generated[1] != 1:
        return (f"{decode[1]:g} requests finished on the engine around this one (other traffic, or the request was "
                "not yet recorded): its own timing cannot be told apart")

    def one(name: str) -> float | None:
        change = _histogram_delta(before, after, name)
        return change[0] if change is not None and change[1] == 1 else None

    steps = _histogram_delta(before, after, INTER_TOKEN_LATENCY)
    cached = _minus(after.prompt_tokens_cached, before.prompt_tokens_cached)
    prompt_tokens = one(REQUEST_PROMPT_TOKENS)
    return EngineTiming(
        decode_time_s=max(decode[0], 0.0),
        generation_tokens=round(generated[0]),
        prefill_time_s=one(REQUEST_PREFILL_TIME),
        ttft_s=one(TIME_TO_FIRST_TOKEN),
        queue_time_s=one(REQUEST_QUEUE_TIME),
        prompt_tokens=round(prompt_tokens) if prompt_tokens is not None else None,
        prompt_tokens_cached=round(cached) if cached is not None else None,
        decode_steps=round(steps[1]) if steps is not None and steps[1] >= 0 else None,
    )


def timing_lines(text: str) -> str:
    """The lines of an exposition that the figures of one request come from: kept in raw/ beside the request,
    small enough to keep for every request (the whole text is kept per workload)."""
    names = (*_HISTOGRAMS, *_SUMMED, ACCEPTED_PER_POSITION)
    return "\n".join(line for line in text.splitlines()
                     if line.startswith(names) and not line.startswith(tuple(f"{n}_bucket" for n in _HISTOGRAMS)))
