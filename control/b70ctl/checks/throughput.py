"""The throughput check: the recipe's workloads at concurrency 1, timed on the engine's clock, audited by raw data.

Per workload: warm-up requests (not measured), then sequential streamed requests until the median decode rate's
confidence interval is within the workload's target or its request cap is hit. /metrics is read right before and
right after EACH request: the deltas of vLLM's per-request histograms are that request's decode time, TTFT,
prefill time and token counts as the engine measured them (checks/metrics.py), so a stream the network delivered
in one burst still gets its true rate. What the client saw arrive is kept beside it (`client_*`) and compared:
a disagreement marks the request's delivery as distorted, and no verdict rests on a distorted client figure.
Spec-decode figures come from the counter deltas over the workload. Every request is written to
raw/throughput/<workload>/NNN.json with its chunk arrival times, token ids, usage and the /metrics lines its
engine figures come from, so each figure can be recomputed. Temperature is always sent (a server default of 1.0
collapses acceptance) and ignore_eos keeps the lengths fixed. Synthesized long prompts differ from the first
token on, warm-up included, so no request's prefill is served from the prefix cache.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from b70ctl.checks.client import EndpointError, StreamResult, VllmClient
from b70ctl.checks.metrics import (
    REQUEST_DECODE_TIME,
    MetricsSnapshot,
    MetricsUnavailable,
    request_timing,
    snapshot,
    spec_decode_stats,
    timing_lines,
)
from b70ctl.files import WRITE_LIMITS, write_json_atomically, write_text_atomically
from b70ctl.recipes.model import Recipe, Workload
from b70ctl.report.model import (
    BenchKeys,
    EngineTiming,
    Percentiles,
    Report,
    RequestSample,
    SpecDecodeStats,
    Summary,
    ThroughputResult,
    WorkloadResult,
)
from b70ctl.report.stats import (
    converged,
    decode_tok_s,
    delivery_check,
    median,
    peak_tok_s,
    per_token_gaps_s,
    percentile,
    summarize,
)

Progress = Callable[[str], None]
Prompt = str | list[int]

# Seed text of a synthesized long prompt when the workload names none; any text the tokenizer splits works.
DEFAULT_PROMPT_SEED = "The quick brown fox jumps over the lazy dog while the server streams tokens."
# A one-token prompt takes the path of the BF16 ESIMD decode crash (docs/facts.md, Known failures): the smoke check
# probes it on purpose; a throughput workload must not measure it by accident.
MIN_PROMPT_TOKENS = 2


# An engine figure past these is not a measurement. The roofline (report/roofline.py) is already an upper bound
# (the drafter's reads are left out); the margin covers a bandwidth input measured low (a copy benchmark, not the
# peak read rate). Per step at most k+1 tokens come out: every draft accepted plus the bonus token.
ROOFLINE_MARGIN = 3.0
# A burst makes the client's rate read far above the engine's (docs/facts.md, Added after the first release:
# "Delivery can lie"); the opposite is no delivery artefact: an engine that claims to decode ten times faster than
# the tokens ever arrived, on most requests, is reporting a clock, not a decode.
CLIENT_CONTRADICTION_FACTOR = 10.0


class WorkloadFailed(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def run_throughput(client: VllmClient, recipe: Recipe, raw_dir: Path, progress: Progress | None = None,
                   baseline: VllmClient | None = None) -> ThroughputResult:
    """Run every workload of the recipe, each on the server it names (the endpoint, or the target-only baseline).
    A failing workload records its error and the next one still runs."""
    report = progress or (lambda _message: None)
    workloads = []
    for workload in recipe.workloads:
        if workload.server == "baseline" and baseline is None:
            workloads.append(summarize_workload(workload, [], [], converged=False, error=(
                "runs on the target-only baseline: pass --baseline-endpoint (a reference file has no timing)")))
            continue
        server = baseline if workload.server == "baseline" and baseline is not None else client
        workloads.append(_run_workload(server, workload, Path(raw_dir), report))
    passed = bool(workloads) and all(
        w.error is None and w.requests and w.token_count_mismatches == 0 for w in workloads
    )
    return ThroughputResult(passed=passed, workloads=workloads)


def reject_impossible_engine_figures(report: Report, recipe: Recipe) -> None:
    """Marks unmeasurable (error set: its claims are then not measured, the check fails) every workload whose
    engine figures are physically impossible or not one run's: a request decoding above the host's bandwidth bound,
    most requests' engine rate contradicted by the client by more than an order of magnitude, a server restart
    inside the workload, or more tokens per draft step than a step can yield."""
    from b70ctl.report.roofline import bandwidth_input, kv_input, memory_domains, weight_input, workload_roofline

    if report.throughput is None:
        return
    spec = recipe.serve.speculative
    tokens_per_step = spec.num_speculative_tokens + 1 if spec is not None else 1
    # The bound at one token per step, scaled to the most a step can yield: the counters' acceptance length is
    # one of the figures on trial, so it cannot set the bound.
    plain = recipe.model_copy(update={"serve": recipe.serve.model_copy(update={"speculative": None})})
    domains = memory_domains(recipe)
    inputs = (bandwidth_input(recipe, report.environment), weight_input(report.environment, domains),
              kv_input(recipe, report, domains))
    for result in report.throughput.workloads:
        if result.error is not None:
            continue
        reason = None
        bound = workload_roofline(result, plain, report.environment.target_shape, domains, *inputs).bound_tok_s
        engine_rates = [(index, sample.engine.decode_tok_s) for index, sample in enumerate(result.requests, 1)
                        if sample.engine is not None and sample.engine.decode_tok_s is not None]
        if bound is not None:
            limit = bound * tokens_per_step * ROOFLINE_MARGIN
            over = [(index, rate) for index, rate in engine_rates if rate > limit]
            if over:
                index, rate = over[0]
                reason = (f"request {index}'s engine decode rate {rate:.4g} tok/s is above {ROOFLINE_MARGIN:g}x the "
                          f"host's bandwidth bound ({bound * tokens_per_step:.4g} tok/s at {tokens_per_step} "
                          f"token(s) per step; {len(over)} of {len(engine_rates)} requests)")
        compared = [(sample.engine.decode_tok_s, sample.client_decode_tok_s) for sample in result.requests
                    if sample.engine is not None and sample.engine.decode_tok_s and sample.client_decode_tok_s]
        contradicted = [engine / client for engine, client in compared
                        if engine > client * CLIENT_CONTRADICTION_FACTOR]
        if reason is None and compared and len(contradicted) * 2 > len(compared):
            reason = (f"the engine's decode rate is more than {CLIENT_CONTRADICTION_FACTOR:g}x what the client saw "
                      f"arrive on {len(contradicted)} of {len(compared)} requests (up to {max(contradicted):.3g}x): "
                      "the engine's clock is not a measurement")
        restarted = [index for index, sample in enumerate(result.requests, 1)
                     if "the server restarted" in (sample.engine_unavailable or "")]
        if reason is None and (restarted or (result.spec_decode is not None
                                             and "restarted" in (result.spec_decode.pollution_reason or ""))):
            reason = ("the server restarted during the workload (its counters went backwards"
                      + (f" around request {restarted[0]}" if restarted else "") + "): its figures are not one run's")
        stats = result.spec_decode
        if reason is None and spec is not None and stats is not None and not stats.polluted \
                and stats.mean_acceptance_length is not None and stats.mean_acceptance_length > tokens_per_step:
            reason = (f"the spec-decode counters give {stats.mean_acceptance_length:.4g} tokens per draft step, more "
                      f"than the {tokens_per_step} a step of k={spec.num_speculative_tokens} can yield")
        if reason is not None:
            result.error = f"unmeasurable: {reason}"
            report.throughput.passed = False


def synthesize_prompt_token_ids(client: VllmClient, token_count: int, seed_text: str,
                                marker: str = "") -> list[int]:
    """A prompt of exactly `token_count` token ids: the marker's tokens, then the seed text's repeated, cut. Sent as
    ids, so the server cannot re-tokenize it into another length. A marker of its own per request makes the first
    cache block differ, so no part of the prompt can come from vLLM's prefix cache."""
    seed_ids = client.tokenize(seed_text)
    if not seed_ids:
        raise WorkloadFailed(f"the server's tokenizer turned {seed_text!r} into no tokens")
    marker_ids = client.tokenize(marker) if marker else []
    repeats = -(-max(token_count - len(marker_ids), 0) // len(seed_ids))
    return (marker_ids + seed_ids * repeats)[:token_count]


class PromptSource:
    """The prompt of request `index` (warm-ups count down from -1): the workload's prompts in turn, or a
    synthesized prompt that is new for every request of this run."""

    def __init__(self, client: VllmClient, workload: Workload):
        self.client, self.workload = client, workload
        self.run_marker = secrets.token_hex(4)
        if workload.prompt_tokens is not None and workload.api != "completions":
            raise WorkloadFailed("prompt_tokens needs api 'completions': a chat request cannot carry token ids")
        if workload.prompt_tokens is None and workload.api == "completions":
            for prompt in workload.prompts:
                count = len(client.tokenize(prompt))
                if count < MIN_PROMPT_TOKENS:
                    raise WorkloadFailed(
                        f"prompt {prompt!r} is {count} token(s) by the server's tokenizer: a one-token prompt "
                        f"takes the BF16 one-token crash path; give the workload a prompt of at least "
                        f"{MIN_PROMPT_TOKENS} tokens")

    def __call__(self, index: int) -> Prompt:
        workload = self.workload
        if workload.prompt_tokens is None:
            return workload.prompts[index % len(workload.prompts)]
        seed_text = workload.prompts[0] if workload.prompts else DEFAULT_PROMPT_SEED
        return synthesize_prompt_token_ids(self.client, workload.prompt_tokens, seed_text,
                                           marker=f"{index} {self.run_marker}:")


def _run_workload(client: VllmClient, workload: Workload, raw_dir: Path, report: Progress) -> WorkloadResult:
    samples: list[RequestSample] = []
    gaps: list[list[float]] = []
    mismatches = 0
    error: str | None = None
    metrics_error: str | None = None
    spec = None
    workload_dir = raw_dir / "throughput" / workload.name
    received_tokens = 0.0
    converged_now = False
    try:
        prompt_for = PromptSource(client, workload)
        for index in range(workload.warmup_requests):
            report(f"{workload.name}: warm-up {index + 1}/{workload.warmup_requests}")
            warmup = _stream(client, workload, prompt_for(-1 - index))
            if warmup.error is not None:
                raise WorkloadFailed(f"warm-up request {index + 1}: {warmup.error}")

        first: MetricsSnapshot | None = None
        try:
            first = snapshot(client, client.model)
            write_text_atomically(workload_dir / "metrics_before.txt", first.text)
        except MetricsUnavailable as unavailable:
            metrics_error = unavailable.reason
        before = last = first

        decode_rates: list[float] = []
        for index in range(workload.max_requests):
            prompt = prompt_for(index)
            report(f"{workload.name}: request {index + 1}/{workload.max_requests}")
            stream = _stream(client, workload, prompt)
            after: MetricsSnapshot | None = None
            if before is not None:
                after, problem = _snapshot_after_request(client, before)
                metrics_error = metrics_error or problem
            timing = request_timing(before, after) if before is not None and after is not None else None
            raw_path = workload_dir / f"{index + 1:03d}.json"
            write_json_atomically(raw_path, _raw_record(workload, index, prompt, stream, before, after, timing),
                                  compact=True)
            if after is not None:
                before = last = after
            if stream.error is not None:
                raise WorkloadFailed(f"request {index + 1}: {stream.error}")
            sample = measure_request(stream, workload.prompt_tokens,
                                     raw_file=str(raw_path.relative_to(raw_dir.parent)),
                                     engine=timing if isinstance(timing, EngineTiming) else None,
                                     engine_unavailable=(timing if isinstance(timing, str)
                                                         else metrics_error or "/metrics was not read"))
            if sample is None:
                raise WorkloadFailed(
                    f"request {index + 1}: the stream carried no token ids (the server ignores return_token_ids?)"
                )
            samples.append(sample)
            gaps.append(per_token_gaps_s(chunk for chunk in stream.chunks if chunk.token_ids))
            # No usage at all counts too: the cross-check we asked the server for could not be made.
            if sample.usage_completion_tokens != sample.completion_tokens:
                mismatches += 1
            received_tokens += (sample.usage_completion_tokens if sample.usage_completion_tokens is not None
                                else sample.completion_tokens)
            if sample.decode_tok_s is not None:
                decode_rates.append(sample.decode_tok_s)
            report(f"{workload.name}: request {index + 1}/{workload.max_requests}: "
                   + (f"{sample.decode_tok_s:.1f} tok/s ({sample.timing_source})" if sample.decode_tok_s is not None
                      else "no decode rate")
                   + (" — delivery distorted" if sample.delivery == "distorted" else ""))
            converged_now = converged(decode_rates, workload.target_relative_halfwidth)
            if len(samples) >= workload.min_requests and converged_now:
                break

        if first is not None and last is not None and last is not first:
            write_text_atomically(workload_dir / "metrics_after.txt", last.text)
            spec = spec_decode_stats(first, last, received_tokens)
    except WorkloadFailed as failed:
        error = failed.reason
    except EndpointError as endpoint_error:
        error = endpoint_error.reason
    except OSError as os_error:  # raw/ not writable: the run cannot be audited, so it stops
        if os_error.errno in WRITE_LIMITS:
            raise  # a full disk, a quota, the file-size limit: the run ends, its report marked partial with why
        error = f"cannot write raw data: {os_error}"

    if error is not None:
        report(f"{workload.name}: failed: {error}")
    return summarize_workload(workload, samples, gaps, converged=converged_now, mismatches=mismatches, spec=spec,
                              metrics_error=metrics_error, error=error)


def _snapshot_after_request(client: VllmClient, before: MetricsSnapshot, settle_s: float = 1.0,
                            sleep: Callable[[float], None] = time.sleep
                            ) -> tuple[MetricsSnapshot | None, str | None]:
    """/metrics once the engine has recorded the request that just ended. vLLM records a finished request in the
    output step that ends its stream, before the client can see the end, so the first read normally has it; the
    re-reads cover a server that records later. A server without per-request timing is read once."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            after = snapshot(client, client.model)
        except MetricsUnavailable as unavailable:
            return None, unavailable.reason
        recorded = (not (before.has_request_timing and after.has_request_timing)
                    or after.histograms[REQUEST_DECODE_TIME][1] > before.histograms[REQUEST_DECODE_TIME][1])
        if recorded or time.monotonic() >= deadline:
            return after, None
        sleep(0.05)


def measure_request(stream: StreamResult, synthesized_prompt_tokens: int | None = None,
                    raw_file: str | None = None, engine: EngineTiming | None = None,
                    engine_unavailable: str | None = None) -> RequestSample | None:
    """The figures of one streamed request: the engine's where it timed the request, the client's beside them.
    None when no chunk carried token ids."""
    token_chunks = [chunk for chunk in stream.chunks if chunk.token_ids]
    if not token_chunks:
        return None
    token_count = sum(len(chunk.token_ids) for chunk in token_chunks)
    client_ttft_s = token_chunks[0].t_s
    client_decode = decode_tok_s(token_count, token_chunks[0].t_s, token_chunks[-1].t_s)
    client_peak = peak_tok_s(token_chunks)
    usage = stream.usage or {}
    usage_prompt_tokens = usage.get("prompt_tokens")
    usage_completion = usage.get("completion_tokens")

    if engine is not None and engine.generation_tokens != token_count:
        engine_unavailable = (f"the engine recorded {engine.generation_tokens} generated tokens, the stream carried "
                              f"{token_count}: the histograms are not this request's")
        engine = None
    if engine is not None:
        source = "engine"
        decode = engine.decode_tok_s
        ttft_s = engine.ttft_s if engine.ttft_s is not None else client_ttft_s
        prefill_time_s = engine.prefill_time_s
        delivery, delivery_reason = delivery_check(client_decode, decode)
    else:
        source, decode, ttft_s, prefill_time_s = "client", client_decode, client_ttft_s, client_ttft_s
        delivery, delivery_reason = "unchecked", None
    prefill_tok_s = None
    if synthesized_prompt_tokens is not None and prefill_time_s:
        prefill_tok_s = (usage_prompt_tokens or synthesized_prompt_tokens) / prefill_time_s
    return RequestSample(
        timing_source=source,
        decode_tok_s=decode,
        peak_tok_s=None if delivery == "distorted" else client_peak,
        ttft_s=ttft_s,
        prefill_tok_s=prefill_tok_s,
        completion_tokens=token_count,
        usage_completion_tokens=int(usage_completion) if usage_completion is not None else None,
        prompt_tokens=int(usage_prompt_tokens) if usage_prompt_tokens is not None else None,
        chunks=len(token_chunks),
        raw_file=raw_file,
        engine=engine,
        engine_unavailable=None if engine is not None else engine_unavailable,
        client_decode_tok_s=client_decode,
        client_peak_tok_s=client_peak,
        client_ttft_s=client_ttft_s,
        delivery=delivery,
        delivery_reason=delivery_reason,
        prompt_tokens_cached=engine.prompt_tokens_cached if engine is not None else None,
    )


def summarize_workload(workload: Workload, samples: list[RequestSample], gaps_by_request: list[list[float]],
                       *, converged: bool, mismatches: int = 0, spec: SpecDecodeStats | None = None,
                       metrics_error: str | None = None, error: str | None = None) -> WorkloadResult:
    """The workload's figures from its requests. `gaps_by_request` are each request's per-token arrival gaps;
    only requests delivered on time contribute to the client's ITL."""
    sources = {sample.timing_source for sample in samples}
    timing_source = "mixed" if len(sources) > 1 else (next(iter(sources)) if sources else "client")
    client_timed = [sample for sample in samples if sample.timing_source == "client"]
    timing_note = None
    if client_timed:
        timing_note = (f"{len(client_timed)} of {len(samples)} requests timed by the client only: "
                       f"{client_timed[0].engine_unavailable or 'no engine timing'}")
    on_time_gaps = [gap for sample, request_gaps in zip(samples, gaps_by_request, strict=True)
                    if sample.delivery != "distorted" for gap in request_gaps]
    tpots_s = [sample.engine.decode_time_s / (sample.engine.generation_tokens - 1) for sample in samples
               if sample.engine is not None and sample.engine.generation_tokens > 1]
    cached = [sample.prompt_tokens_cached for sample in samples if sample.prompt_tokens_cached is not None]
    result = WorkloadResult(
        name=workload.name,
        description=workload.description,
        temperature=workload.temperature,
        max_tokens=workload.max_tokens,
        prompt_tokens=workload.prompt_tokens,
        requests=samples,
        decode_tok_s=_summary([sample.decode_tok_s for sample in samples]),
        peak_tok_s=_summary([sample.peak_tok_s for sample in samples]),
        ttft_s=_summary([sample.ttft_s for sample in samples]),
        prefill_tok_s=_summary([sample.prefill_tok_s for sample in samples]),
        converged=converged,
        token_count_mismatches=mismatches,
        spec_decode=spec,
        metrics_error=metrics_error,
        error=error,
        timing_source=timing_source,
        timing_note=timing_note,
        client_decode_tok_s=_summary([sample.client_decode_tok_s for sample in samples]),
        distorted_requests=sum(sample.delivery == "distorted" for sample in samples),
        itl_ms=_percentiles(on_time_gaps),
        engine_tpot_ms=_percentiles(tpots_s),
        prompt_tokens_cached=sum(cached) if cached else None,
    )
    result.bench = bench_keys(result)
    return result


def bench_keys(result: WorkloadResult) -> BenchKeys:
    """The workload in the names `vllm bench serve --save-result` uses. TPOT is the engine's per-token decode
    time when it timed the requests; ITL is per token (vLLM's benchmark takes one per chunk)."""
    spec = result.spec_decode
    usable = spec if spec is not None and not spec.polluted else None
    if result.engine_tpot_ms is not None:
        tpot_ms: float | None = result.engine_tpot_ms.median_ms
    elif result.decode_tok_s is not None and result.decode_tok_s.median > 0:
        tpot_ms = 1000 / result.decode_tok_s.median
    else:
        tpot_ms = None
    return BenchKeys(
        median_ttft_ms=result.ttft_s.median * 1000 if result.ttft_s is not None else None,
        median_tpot_ms=tpot_ms,
        median_itl_ms=result.itl_ms.median_ms if result.itl_ms is not None else None,
        p99_itl_ms=result.itl_ms.p99_ms if result.itl_ms is not None else None,
        spec_decode_acceptance_rate=(usable.acceptance_rate * 100 if usable and usable.acceptance_rate is not None
                                     else None),
        spec_decode_acceptance_length=usable.mean_acceptance_length if usable else None,
        spec_decode_num_drafts=round(usable.num_drafts) if usable else None,
        spec_decode_draft_tokens=round(usable.num_draft_tokens) if usable else None,
        spec_decode_accepted_tokens=round(usable.num_accepted_tokens) if usable else None,
        spec_decode_per_position_acceptance_rates=list(usable.per_position_acceptance) if usable else [],
    )


def _stream(client: VllmClient, workload: Workload, prompt: Prompt) -> StreamResult:
    return client.stream(workload.api, prompt, workload.max_tokens, temperature=workload.temperature,
                         ignore_eos=workload.ignore_eos)


def _summary(values: list[float | None]) -> Summary | None:
    present = [value for value in values if value is not None]
    return summarize(present) if present else None


def _percentiles(values_s: list[float]) -> Percentiles | None:
    if not values_s:
        return None
    return Percentiles(n=len(values_s), median_ms=median(values_s) * 1000, p90_ms=percentile(values_s, 90) * 1000,
                       p99_ms=percentile(values_s, 99) * 1000)


def _raw_record(workload: Workload, index: int, prompt: Prompt, stream: StreamResult,
                before: MetricsSnapshot | None, after: MetricsSnapshot | None,
                timing: EngineTiming | str | None) -> dict[str, Any]:
    return {
        "workload": workload.name,
        "request": index + 1,
        "api": workload.api,
        "prompt": prompt,
        "max_tokens": workload.max_tokens,
        "temperature": workload.temperature,
        "ignore_eos": workload.ignore_eos,
        **stream.raw(),
        "engine": timing.model_dump() if isinstance(timing, EngineTiming) else None,
        "engine_unavailable": timing if isinstance(timing, str) else None,
        "metrics_before": timing_lines(before.text) if before is not None else None,
        "metrics_after": timing_lines(after.text) if after is not None else None,
    }
