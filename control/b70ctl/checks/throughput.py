"""The throughput check: the recipe's workloads at concurrency 1, measured per token, audited by raw data.

Per workload: warm-up requests (not measured), a /metrics snapshot, sequential streamed requests until the
median decode rate's confidence interval is within the workload's target or its request cap is hit, then a
second snapshot; spec-decode figures come from the counter deltas (checks/metrics.py). Every request is written
to raw/throughput/<workload>/NNN.json with its chunk arrival times, token ids and usage, so each figure can be
recomputed. Temperature is always sent (a server default of 1.0 collapses acceptance) and ignore_eos keeps the
lengths fixed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from b70ctl.checks.client import EndpointError, StreamResult, VllmClient
from b70ctl.checks.metrics import MetricsSnapshot, MetricsUnavailable, snapshot, snapshot_after, spec_decode_stats
from b70ctl.checks.stats import converged, decode_tok_s, peak_tok_s, summarize
from b70ctl.files import write_json_atomically, write_text_atomically
from b70ctl.recipes.model import Recipe, Workload
from b70ctl.report.model import RequestSample, Summary, ThroughputResult, WorkloadResult

Progress = Callable[[str], None]
Prompt = str | list[int]

# Seed text of a synthesized long prompt when the workload names none; any text the tokenizer splits works.
DEFAULT_PROMPT_SEED = "The quick brown fox jumps over the lazy dog while the server streams tokens."


class WorkloadFailed(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def run_throughput(client: VllmClient, recipe: Recipe, raw_dir: Path,
                   progress: Progress | None = None) -> ThroughputResult:
    """Run every workload of the recipe. A failing workload records its error and the next one still runs."""
    report = progress or (lambda _message: None)
    workloads = [_run_workload(client, workload, Path(raw_dir), report) for workload in recipe.workloads]
    passed = bool(workloads) and all(
        w.error is None and w.requests and w.token_count_mismatches == 0 for w in workloads
    )
    return ThroughputResult(passed=passed, workloads=workloads)


def synthesize_prompt_token_ids(client: VllmClient, token_count: int, seed_text: str) -> list[int]:
    """A prompt of exactly `token_count` token ids: the seed text's tokens repeated and cut. Sent as ids, so the
    server cannot re-tokenize it into another length."""
    seed_ids = client.tokenize(seed_text)
    if not seed_ids:
        raise WorkloadFailed(f"the server's tokenizer turned {seed_text!r} into no tokens")
    repeats = -(-token_count // len(seed_ids))
    return (seed_ids * repeats)[:token_count]


def _prompts(client: VllmClient, workload: Workload) -> list[Prompt]:
    if workload.prompt_tokens is None:
        return list(workload.prompts)
    if workload.api != "completions":
        raise WorkloadFailed("prompt_tokens needs api 'completions': a chat request cannot carry token ids")
    seed_text = workload.prompts[0] if workload.prompts else DEFAULT_PROMPT_SEED
    return [synthesize_prompt_token_ids(client, workload.prompt_tokens, seed_text)]


def _run_workload(client: VllmClient, workload: Workload, raw_dir: Path, report: Progress) -> WorkloadResult:
    samples: list[RequestSample] = []
    mismatches = 0
    error: str | None = None
    metrics_error: str | None = None
    spec = None
    workload_dir = raw_dir / "throughput" / workload.name
    received_tokens = 0.0
    converged_now = False
    try:
        prompts = _prompts(client, workload)
        for index in range(workload.warmup_requests):
            report(f"{workload.name}: warm-up {index + 1}/{workload.warmup_requests}")
            warmup = _stream(client, workload, prompts[index % len(prompts)])
            if warmup.error is not None:
                raise WorkloadFailed(f"warm-up request {index + 1}: {warmup.error}")

        before: MetricsSnapshot | None = None
        try:
            before = snapshot(client, client.model)
            write_text_atomically(workload_dir / "metrics_before.txt", before.text)
        except MetricsUnavailable as unavailable:
            metrics_error = unavailable.reason

        decode_rates: list[float] = []
        for index in range(workload.max_requests):
            prompt = prompts[index % len(prompts)]
            stream = _stream(client, workload, prompt)
            raw_path = workload_dir / f"{index + 1:03d}.json"
            write_json_atomically(raw_path, _raw_record(workload, index, prompt, stream), compact=True)
            if stream.error is not None:
                raise WorkloadFailed(f"request {index + 1}: {stream.error}")
            sample = measure_request(stream, workload.prompt_tokens,
                                     raw_file=str(raw_path.relative_to(raw_dir.parent)))
            if sample is None:
                raise WorkloadFailed(
                    f"request {index + 1}: the stream carried no token ids (the server ignores return_token_ids?)"
                )
            samples.append(sample)
            # No usage at all counts too: the cross-check we asked the server for could not be made.
            if sample.usage_completion_tokens != sample.completion_tokens:
                mismatches += 1
            received_tokens += (sample.usage_completion_tokens if sample.usage_completion_tokens is not None
                                else sample.completion_tokens)
            if sample.decode_tok_s is not None:
                decode_rates.append(sample.decode_tok_s)
            report(f"{workload.name}: request {index + 1}/{workload.max_requests}: "
                   + (f"{sample.decode_tok_s:.1f} tok/s" if sample.decode_tok_s is not None else "no decode rate"))
            converged_now = converged(decode_rates, workload.target_relative_halfwidth)
            if len(samples) >= workload.min_requests and converged_now:
                break

        if before is not None:
            try:
                after = snapshot_after(client, before, received_tokens, client.model)
                write_text_atomically(workload_dir / "metrics_after.txt", after.text)
                spec = spec_decode_stats(before, after, received_tokens)
            except MetricsUnavailable as unavailable:
                metrics_error = unavailable.reason
    except WorkloadFailed as failed:
        error = failed.reason
    except EndpointError as endpoint_error:
        error = endpoint_error.reason
    except OSError as os_error:  # raw/ not writable: the run cannot be audited, so it stops
        error = f"cannot write raw data: {os_error}"

    if error is not None:
        report(f"{workload.name}: failed: {error}")
    return WorkloadResult(
        name=workload.name,
        description=workload.description,
        temperature=workload.temperature,
        max_tokens=workload.max_tokens,
        prompt_tokens=workload.prompt_tokens,
        requests=samples,
        decode_tok_s=_summary([s.decode_tok_s for s in samples]),
        peak_tok_s=_summary([s.peak_tok_s for s in samples]),
        ttft_s=_summary([s.ttft_s for s in samples]),
        prefill_tok_s=_summary([s.prefill_tok_s for s in samples]),
        converged=converged_now,
        token_count_mismatches=mismatches,
        spec_decode=spec,
        metrics_error=metrics_error,
        error=error,
    )


def measure_request(stream: StreamResult, synthesized_prompt_tokens: int | None = None,
                    raw_file: str | None = None) -> RequestSample | None:
    """The figures of one streamed request, from the chunks that carried token ids. None without any."""
    token_chunks = [chunk for chunk in stream.chunks if chunk.token_ids]
    if not token_chunks:
        return None
    token_count = sum(len(chunk.token_ids) for chunk in token_chunks)
    ttft_s = token_chunks[0].t_s
    usage = stream.usage or {}
    usage_prompt_tokens = usage.get("prompt_tokens")
    prefill_tok_s = None
    if synthesized_prompt_tokens is not None and ttft_s > 0:
        prefill_tok_s = (usage_prompt_tokens or synthesized_prompt_tokens) / ttft_s
    usage_completion = usage.get("completion_tokens")
    return RequestSample(
        decode_tok_s=decode_tok_s(token_count, token_chunks[0].t_s, token_chunks[-1].t_s),
        peak_tok_s=peak_tok_s(token_chunks),
        ttft_s=ttft_s,
        prefill_tok_s=prefill_tok_s,
        completion_tokens=token_count,
        usage_completion_tokens=int(usage_completion) if usage_completion is not None else None,
        prompt_tokens=int(usage_prompt_tokens) if usage_prompt_tokens is not None else None,
        chunks=len(token_chunks),
        raw_file=raw_file,
    )


def throughput_measurements(result: ThroughputResult) -> dict[str, float | list[float]]:
    """The flat figures claims refer to (throughput.<workload>.<figure>). A workload that failed contributes
    nothing, and polluted spec-decode counters are left out: a claim on them is then not measured rather than
    judged on another client's traffic."""
    figures: dict[str, float | list[float]] = {}
    for workload in result.workloads:
        if workload.error is not None:
            continue
        prefix = f"throughput.{workload.name}"
        summaries: list[tuple[str, Summary | None, tuple[str, ...]]] = [
            ("decode_tok_s", workload.decode_tok_s, ("median", "min", "max")),
            ("peak_tok_s", workload.peak_tok_s, ("median", "max")),
            ("ttft_s", workload.ttft_s, ("median",)),
            ("prefill_tok_s", workload.prefill_tok_s, ("median",)),
        ]
        for figure, summary, fields in summaries:
            if summary is None:
                continue
            for field_name in fields:
                figures[f"{prefix}.{figure}.{field_name}"] = float(getattr(summary, field_name))
        spec = workload.spec_decode
        if spec is None or spec.polluted:
            continue
        if spec.acceptance_rate is not None:
            figures[f"{prefix}.acceptance_rate"] = spec.acceptance_rate
        if spec.mean_acceptance_length is not None:
            figures[f"{prefix}.mean_acceptance_length"] = spec.mean_acceptance_length
        if spec.per_position_acceptance:
            figures[f"{prefix}.per_position_acceptance"] = list(spec.per_position_acceptance)
    return figures


def _stream(client: VllmClient, workload: Workload, prompt: Prompt) -> StreamResult:
    return client.stream(workload.api, prompt, workload.max_tokens, temperature=workload.temperature,
                         ignore_eos=workload.ignore_eos)


def _summary(values: list[float | None]) -> Summary | None:
    present = [value for value in values if value is not None]
    return summarize(present) if present else None


def _raw_record(workload: Workload, index: int, prompt: Prompt, stream: StreamResult) -> dict[str, Any]:
    return {
        "workload": workload.name,
        "request": index + 1,
        "api": workload.api,
        "prompt": prompt,
        "max_tokens": workload.max_tokens,
        "temperature": workload.temperature,
        "ignore_eos": workload.ignore_eos,
        **stream.raw(),
    }


