"""report.md: the replication evidence of one endpoint, shaped like the independent replication in seed 000
(configuration, short benchmark, sustained acceptance-friendly decode, natural text, correctness and stability,
edge cases) with a verdict per claim and the raw numbers behind each."""

from __future__ import annotations

from b70ctl.recipes.model import Recipe
from b70ctl.report.model import Report, Summary, WorkloadResult

VERDICT_MARK = {"met": "✅ met", "not_met": "❌ not met", "not_measured": "➖ not measured"}
WORKLOAD_TITLES = {
    "short": "Short benchmark (PR-style, ~zero prefill)",
    "acceptance_friendly": "Sustained acceptance-friendly decode",
    "natural": "Acceptance-dependent natural text",
    "long_prompt": "Long prompt (prefill + decode)",
}


def _fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _summary_row(label: str, summary: Summary | None, unit: str) -> str:
    if summary is None:
        return f"| {label} | – | – | – | – | – | – |"
    return (f"| {label} ({unit}) | {summary.median:.2f} | {summary.min:.2f} | {summary.max:.2f} | "
            f"{summary.mad:.2f} | {summary.ci_low:.2f} .. {summary.ci_high:.2f} | {summary.n} |")


def _workload(result: WorkloadResult) -> list[str]:
    lines = [f"### {WORKLOAD_TITLES.get(result.name, result.name)}", "", f"{result.description}. "
             f"max_tokens {result.max_tokens}, temperature {result.temperature:g}"
             + (f", {result.prompt_tokens} prompt tokens" if result.prompt_tokens else "") + ".", ""]
    if result.error:
        lines += [f"**Stopped:** {result.error}", ""]
    lines += ["| figure | median | min | max | MAD | 95% CI of median | n |", "|---|---|---|---|---|---|---|",
              _summary_row("decode", result.decode_tok_s, "tok/s"),
              _summary_row("peak, 1 s window", result.peak_tok_s, "tok/s"),
              _summary_row("TTFT", result.ttft_s, "s")]
    if result.prefill_tok_s is not None:
        lines.append(_summary_row("prefill", result.prefill_tok_s, "tok/s"))
    lines.append("")
    if not result.converged and result.requests:
        lines += [f"The median's confidence interval did not reach the target width within "
                  f"{len(result.requests)} requests.", ""]
    if result.token_count_mismatches:
        lines += [f"**{result.token_count_mismatches} request(s) streamed a different number of token ids than "
                  "usage reported.**", ""]
    spec = result.spec_decode
    if spec is not None:
        rates = " ".join(f"{rate:.2f}" for rate in spec.per_position_acceptance) or "–"
        lines += [f"Speculative decoding (from /metrics deltas): {spec.num_accepted_tokens:.0f} accepted of "
                  f"{spec.num_draft_tokens:.0f} draft tokens in {spec.num_drafts:.0f} drafts — acceptance "
                  f"{_fmt(spec.acceptance_rate and spec.acceptance_rate * 100, 1)}%, mean acceptance length "
                  f"{_fmt(spec.mean_acceptance_length)}, per position {rates}."]
        if spec.polluted:
            lines.append(f"**Counters polluted:** {spec.pollution_reason}")
        lines.append("")
    return lines


def render_markdown(report: Report, recipe: Recipe) -> str:
    env = report.environment
    spec = recipe.serve.speculative
    status = "PARTIAL — " + (report.partial_reason or "stopped early") if report.partial else (
        "all checks passed" if report.passed else "some checks failed")
    met = sum(v.verdict == "met" for v in report.verdicts)
    lines = [
        f"# Replication report: {recipe.name}", "",
        f"**{status}.** Claims met: {met} of {len(report.verdicts)}.", "",
        "## Configuration", "",
        f"- Recipe: `{recipe.name}` — {recipe.description}",
        f"- Endpoint: {report.endpoint}" + (f"; baseline: {report.baseline}" if report.baseline else ""),
        f"- Served model: {env.served_model or '–'}; vLLM {env.vllm_version or '–'}",
        "- Speculative decoding: " + (f"{spec.method}, k={spec.num_speculative_tokens}"
                                       + (f", {spec.draft_sample_method}" if spec.draft_sample_method else "")
                                       if spec else "none"),
        f"- Serve: TP={recipe.serve.tensor_parallel_size}, dtype {recipe.serve.dtype}, max_model_len "
        f"{recipe.serve.max_model_len}",
    ]
    for label, value in (("Host", env.hostname), ("Appliance hash", env.appliance_hash),
                         ("Image", env.image_digest), ("Kernel", env.kernel), ("GPUs", env.gpu_model and
                         f"{env.gpu_count} × {env.gpu_model}"), ("P2P profile", env.p2p_profile)):
        if value:
            lines.append(f"- {label}: {value}")
    lines += [f"- Run: {report.started_at:%Y-%m-%d %H:%M:%S} UTC, b70ctl {report.tool_version}", ""]

    lines += ["## Verdicts", "", "| claim | required | measured | verdict | source |", "|---|---|---|---|---|"]
    for verdict in report.verdicts:
        measured = verdict.measured
        shown = (" ".join(f"{m:.2f}" for m in measured) if isinstance(measured, list)
                 else _fmt(measured, 3) if measured is not None else "–")
        note = f" — {verdict.reason}" if verdict.reason else ""
        lines.append(f"| {verdict.description} | {verdict.bound} | {shown} | {VERDICT_MARK[verdict.verdict]}{note} "
                     f"| {verdict.source} |")
    lines.append("")

    lines += ["## Throughput (concurrency 1)", ""]
    if report.throughput is None:
        lines += ["Not measured.", ""]
    else:
        for workload in report.throughput.workloads:
            lines += _workload(workload)

    lines += ["## Correctness and stability", ""]
    correctness = report.correctness
    if correctness is None:
        lines += ["Not measured.", ""]
    else:
        lines += [f"Greedy outputs compared by token id with {correctness.baseline}: "
                  f"**{correctness.identical}/{correctness.total} identical**.", ""]
        if correctness.reason:
            lines += [f"**{correctness.reason}**", ""]
        for comparison in correctness.comparisons:
            if not comparison.identical:
                lines += [f"- `{comparison.prompt[:60]}`: first divergence at token {comparison.first_divergence}"
                          f" — baseline `{comparison.expected_context}` vs served `{comparison.actual_context}`"]
        for finding in correctness.garbage:
            lines.append(f"- garbage guard, {finding.kind}: `{finding.prompt[:60]}` — {finding.detail}")
        lines.append("")

    lines += ["## Edge cases and smoke", ""]
    if report.smoke is None:
        lines += ["Not run.", ""]
    else:
        lines += ["| check | result |", "|---|---|"]
        for check in report.smoke.checks:
            lines.append(f"| {check.name} | {'pass' if check.passed else 'FAIL: ' + (check.reason or '')} |")
        lines.append("")
    lines += ["Raw data (per-chunk arrival times, token ids, /metrics before and after) is in `raw/`.", ""]
    return "\n".join(lines)
