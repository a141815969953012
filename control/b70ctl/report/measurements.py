"""The flat figures a report's claims are judged on (report.measurements: smoke.passed, correctness.*, gate.*,
throughput.<workload>.*), from the report's structured results. One author: verify computes them when it finishes a
run, and reading an old report rebuilds them the same way (report/load.py).

Each section's figures leave out what was not measured, so a claim on it reads "not measured" instead of being
judged on a zero or on another client's traffic.
"""

from __future__ import annotations

from b70ctl.report.model import CorrectnessResult, GateResult, Report, Summary, ThroughputResult


def measurements_of(report: Report) -> dict[str, float | list[float]]:
    """Every section's figures the report has."""
    measurements: dict[str, float | list[float]] = {}
    if report.smoke is not None:
        measurements["smoke.passed"] = 1.0 if report.smoke.passed else 0.0
    if report.correctness is not None:
        measurements.update(correctness_measurements(report.correctness))
    if report.gate is not None:
        measurements.update(gate_measurements(report.gate))
    if report.throughput is not None:
        measurements.update(throughput_measurements(report.throughput))
    return measurements


def correctness_measurements(result: CorrectnessResult) -> dict[str, float]:
    """Flat figures for the report's measurements (claims refer to them). Nothing compared: no fraction, so a
    claim on it reads 'not measured' instead of 0."""
    measurements: dict[str, float] = {
        "correctness.identical": float(result.identical),
        "correctness.total": float(result.total),
        "correctness.garbage_findings": float(len(result.garbage)),
    }
    if result.total:
        measurements["correctness.identical_fraction"] = result.identical_fraction
    return measurements


def gate_measurements(result: GateResult) -> dict[str, float]:
    """Flat figures for the report's measurements: gate.passed (1/0) and each check's (1/0; not run: absent)."""
    measurements = {"gate.passed": 1.0 if result.passed else 0.0}
    for check in result.checks:
        if check.passed is not None:
            measurements[f"gate.{check.name}.passed"] = 1.0 if check.passed else 0.0
    return measurements


def throughput_measurements(result: ThroughputResult) -> dict[str, float | list[float]]:
    """The flat figures claims refer to (throughput.<workload>.<figure>). A workload that failed contributes
    nothing, and polluted spec-decode counters are left out: a claim on them is then not measured rather than
    judged on another client's traffic. A prefill rate with cached prompt tokens in it measured the cache, not the
    prefill, and is left out too."""
    figures: dict[str, float | list[float]] = {}
    for workload in result.workloads:
        if workload.error is not None:
            continue
        prefix = f"throughput.{workload.name}"
        summaries: list[tuple[str, Summary | None, tuple[str, ...]]] = [
            ("decode_tok_s", workload.decode_tok_s, ("median", "min", "max")),
            ("peak_tok_s", workload.peak_tok_s, ("median", "max")),
            ("ttft_s", workload.ttft_s, ("median",)),
        ]
        if not workload.prompt_tokens_cached:
            summaries.append(("prefill_tok_s", workload.prefill_tok_s, ("median",)))
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
