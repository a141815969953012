"""report.md: the replication evidence of one endpoint, shaped like the independent replication on intel/llm-scaler
PR #620 (configuration, short benchmark, sustained acceptance-friendly decode, natural text, correctness and stability,
edge cases) with a verdict per claim and the raw numbers behind each. It opens with one table shaped like the
llama-benchy table B70 users paste into issues, and a headline that names what failed."""

from __future__ import annotations

import re

from b70ctl.escaping import markdown_code, markdown_code_block
from b70ctl.escaping import markdown_text as text
from b70ctl.recipes.model import Recipe
from b70ctl.report.model import PEAK_LABEL, Environment, GateCheck, Report, Roofline, Summary, WorkloadResult

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


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _workload_verdict(report: Report, workload: str) -> str:
    verdicts = [v.verdict for v in report.verdicts if v.metric.startswith(f"throughput.{workload}.")]
    if not verdicts:
        return "–"
    for verdict in ("not_met", "not_measured"):
        if verdict in verdicts:
            return VERDICT_MARK[verdict]
    return VERDICT_MARK["met"]


def summary_table(report: Report) -> list[str]:
    """One row per workload: what llama-benchy prints (t/s, peak, TTFT), plus per-token ITL and acceptance."""
    lines = [f"| workload | t/s | {PEAK_LABEL} | TTFT ms | ITL ms | acceptance "
             "| mean acceptance length | n | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for workload in report.throughput.workloads if report.throughput else []:
        spec = workload.spec_decode if workload.spec_decode and not workload.spec_decode.polluted else None
        decode = workload.decode_tok_s
        lines.append(
            f"| {text(workload.name)} | {_fmt(decode.median if decode else None)} "
            f"| {_fmt(workload.peak)} "
            f"| {_ms(workload.ttft_s.median * 1000 if workload.ttft_s else None)} "
            f"| {_ms(workload.itl_ms.median_ms if workload.itl_ms else None)} "
            f"| {_fmt(spec.acceptance_rate * 100 if spec and spec.acceptance_rate is not None else None, 1)}"
            f"{'%' if spec and spec.acceptance_rate is not None else ''} "
            f"| {_fmt(spec.mean_acceptance_length if spec else None)} | {len(workload.requests)} "
            f"| {_workload_verdict(report, workload.name)} |")
    return lines


def failed_items(report: Report) -> list[str]:
    """What keeps the run from passing, each named: failed checks and sub-checks, claims not met or not measured."""
    items: list[str] = []
    if report.smoke is not None and not report.smoke.passed:
        items.append("smoke (" + ", ".join(c.name for c in report.smoke.checks if not c.passed) + ")")
    if report.correctness is not None and not report.correctness.passed:
        items.append(f"correctness ({report.correctness.identical}/{report.correctness.total} identical)")
    if report.gate is not None and not report.gate.passed:
        items.append("gate (" + ", ".join(c.name for c in report.gate.checks if c.passed is False) + ")")
    if report.throughput is not None and not report.throughput.passed:
        failed = [w.name for w in report.throughput.workloads if w.error or not w.requests
                  or w.token_count_mismatches]
        items.append("throughput (" + (", ".join(failed) or "no workload") + ")")
    items += [f"claim {v.claim_id} {'not met' if v.verdict == 'not_met' else 'not measured'}"
              for v in report.verdicts if v.verdict != "met"]
    return items


def _timing_lines(result: WorkloadResult) -> list[str]:
    lines = []
    if result.timing_source == "engine":
        lines.append("Timed on the engine's clock (vLLM's per-request histograms around each request).")
    if result.timing_note:
        lines.append(f"**{text(result.timing_note)}.**")
    if result.distorted_requests:
        reasons = [r.delivery_reason for r in result.requests if r.delivery == "distorted" and r.delivery_reason]
        lines.append(f"**Delivery distorted in {result.distorted_requests} of {len(result.requests)} requests** "
                     f"(e.g. {text(reasons[0]) if reasons else 'arrivals disagree with the engine'}): their client "
                     "figures are kept in report.json and left out of peak and ITL.")
    if result.peak_tok_s and result.decode_tok_s and result.peak_tok_s.median < result.decode_tok_s.median:
        lines.append("Peak reads below the decode rate: the peak counts tokens as they arrived in 1 s windows, the "
                     "decode rate is the engine's; arrivals spread wider than the engine produced the tokens (a "
                     "slow or jittery delivery within the 5% band) lower the peak.")
    if result.prompt_tokens_cached:
        lines.append(f"**{result.prompt_tokens_cached} prompt tokens came from the prefix cache: the prefill figure "
                     "measured the cache and is not judged.**")
    return lines + [""] if lines else []


def _workload(result: WorkloadResult) -> list[str]:
    lines = [f"### {WORKLOAD_TITLES.get(result.name, text(result.name))}", "", f"{text(result.description)}. "
             f"max_tokens {result.max_tokens}, temperature {result.temperature:g}"
             + (f", {result.prompt_tokens} prompt tokens" if result.prompt_tokens else "") + ".", ""]
    if result.error:
        lines += [f"**Stopped:** {text(result.error)}", ""]
    lines += ["| figure | median | min | max | MAD | 95% CI of median | n |", "|---|---|---|---|---|---|---|",
              _summary_row("decode", result.decode_tok_s, "tok/s"),
              _summary_row("decode as delivered (client)", result.client_decode_tok_s, "tok/s"),
              _summary_row("peak, 1 s window", result.peak_tok_s, "tok/s"),
              _summary_row("TTFT", result.ttft_s, "s")]
    if result.prefill_tok_s is not None:
        lines.append(_summary_row("prefill", result.prefill_tok_s, "tok/s"))
    lines.append("")
    latencies = [(label, value) for label, value in (("ITL per token, client", result.itl_ms),
                                                     ("time per output token, engine", result.engine_tpot_ms))
                 if value is not None]
    if latencies:
        lines += ["| latency | median ms | p90 ms | p99 ms | n |", "|---|---|---|---|---|"]
        lines += [f"| {label} | {value.median_ms:.2f} | {value.p90_ms:.2f} | {value.p99_ms:.2f} | {value.n} |"
                  for label, value in latencies]
        lines.append("")
    lines += _timing_lines(result)
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
            lines.append(f"**Counters polluted:** {text(spec.pollution_reason)}")
        lines.append("")
    return lines


ROOFLINE_TITLE = "Roofline: decode rate against the memory-bandwidth bound"
ROOFLINE_EXPLAINED = (
    "A decode step reads the target's weights and the KV cache of its context at least once, so the decode rate "
    "cannot pass bandwidth / bytes read per step x mean acceptance length (tokens per step). The drafter's "
    "weights, activations and the input embedding table are left out, which only raises the bound: it is an upper "
    "bound the engine cannot pass, not a rate it should reach. Efficiency = the engine's median decode rate / the "
    "bound.")
ROOFLINE_HEADER = ["workload", "context tokens (mean)", "mean acceptance length", "bytes read per step",
                   "bound tok/s", "measured tok/s", "efficiency"]


def byte_size(value: float | None) -> str:
    if value is None:
        return "–"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} bytes"


def efficiency_text(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{100 * value:.{1 if value >= 0.01 else 2}f}%"


def roofline_input_rows(roofline: Roofline) -> list[list[str]]:
    """[input, value, source] per input of the roofline (per card on GPUs, for the host's memory on a CPU)."""
    where = "per card" if roofline.memory == "card" else "host memory"
    bandwidth = roofline.bandwidth_bytes_per_s.value
    kv = roofline.kv_bytes_per_token.value
    return [[f"memory bandwidth ({where})", "–" if bandwidth is None else f"{bandwidth / 1e9:.1f} GB/s",
             roofline.bandwidth_bytes_per_s.source],
            [f"target weights read per step ({where})", byte_size(roofline.weight_bytes.value),
             roofline.weight_bytes.source],
            [f"KV cache per context token ({where})", "–" if kv is None else f"{kv:,.0f} bytes",
             roofline.kv_bytes_per_token.source]]


def roofline_workload_rows(roofline: Roofline) -> list[list[str]]:
    """One row per workload, ROOFLINE_HEADER's columns; a missing figure's cell says why."""
    rows = []
    for figures in roofline.workloads:
        efficiency = efficiency_text(figures.efficiency)
        if figures.efficiency is None and figures.not_measured:
            efficiency = f"not measured: {figures.not_measured}"
        rows.append([figures.workload, _fmt(figures.mean_context_tokens, 0), _fmt(figures.mean_acceptance_length),
                     byte_size(figures.bytes_per_step), _fmt(figures.bound_tok_s, 1), _fmt(figures.measured_tok_s, 1),
                     efficiency])
    return rows


def roofline_headline(roofline: Roofline | None) -> str:
    """One sentence: the efficiency, or why there is none."""
    if roofline is None:
        return "Not measured: this report was written before reports had a roofline."
    if roofline.efficiency is None:
        return f"Not measured: {roofline.not_measured or 'no workload has a bound and a decode rate'}."
    sentence = (f"Efficiency {efficiency_text(roofline.efficiency)} of the memory-bandwidth bound (median over "
                f"{sum(1 for w in roofline.workloads if w.efficiency is not None)} workload(s)).")
    if roofline.efficiency > 1:
        sentence += (" Above the bound: an input is wrong (the bandwidth measured low, or fewer bytes are read per "
                     "step than counted).")
    elif roofline.efficiency < 0.05:
        sentence += " Far below it: something other than memory bandwidth limits each step (per-step overhead)."
    return sentence


def _roofline(report: Report) -> list[str]:
    lines = [f"## {ROOFLINE_TITLE}", "", ROOFLINE_EXPLAINED, "", f"**{text(roofline_headline(report.roofline))}**",
             ""]
    roofline = report.roofline
    if roofline is None:
        return lines
    lines += ["| input | value | source |", "|---|---|---|"]
    lines += ["| " + " | ".join(text(cell) for cell in row) + " |" for row in roofline_input_rows(roofline)]
    lines.append("")
    rows = roofline_workload_rows(roofline)
    if rows:
        lines += ["| " + " | ".join(ROOFLINE_HEADER) + " |", "|" + "---|" * len(ROOFLINE_HEADER)]
        lines += ["| " + " | ".join(text(cell) for cell in row) + " |" for row in rows]
        lines.append("")
    return lines


GATE_TITLE = "Gate against silent garbage"
GATE_EXPLAINED = (
    "At temperature 0 the same prompt must give the same token ids: asked again (from the prefix cache), as a long "
    "prompt answered cold and then from the cache, and after a restart. A code canary must give its known answer "
    "and no answer may be one token over and over.")


def gate_result_text(passed: bool | None) -> str:
    return "not run" if passed is None else "pass" if passed else "FAIL"


def gate_difference_text(check: GateCheck) -> str:
    """The first differing position and both tokens, in words; empty when the check found none."""
    found = check.first_difference
    if found is None:
        return ""
    def token(value: int | None) -> str:
        return "end" if value is None else str(value)

    line = (f"prompt {found.prompt}: token {found.position}: {token(found.expected_token)} expected, "
            f"{token(found.got_token)} got")
    if found.expected_text is not None and found.got_text is not None:
        line += f" ({found.expected_text} vs {found.got_text})"
    return line


def _gate(report: Report) -> list[str]:
    lines = [f"## {GATE_TITLE}", ""]
    gate = report.gate
    if gate is None:
        return lines + ["Not run.", ""]
    lines += [GATE_EXPLAINED, "", f"**{'passed' if gate.passed else 'FAILED'}.**", "",
              "| check | result | detail |", "|---|---|---|"]
    for check in gate.checks:
        lines.append(f"| {text(check.name, in_cell=True)} | {gate_result_text(check.passed)} "
                     f"| {text(check.detail, in_cell=True)} |")
    lines.append("")
    for check in gate.checks:
        found = check.first_difference
        if found is None:
            continue
        lines.append(f"- {text(check.name)}: {markdown_code(found.prompt, 80)}, first difference at generated token "
                     f"{found.position}: expected token {found.expected_token}, got {found.got_token}"
                     + (f" — expected {markdown_code(found.expected_text)} vs got {markdown_code(found.got_text)}"
                        if found.expected_text is not None and found.got_text is not None else ""))
    return lines + [""]


def status_line(report: Report) -> str:
    """The run in a few words: partial and why, passed, or what failed."""
    if report.partial:
        return "PARTIAL — " + (report.partial_reason or "stopped early")
    return "all checks passed" if report.passed else "failed: " + "; ".join(failed_items(report) or ["see below"])


def emulated_hardware_line(environment: Environment) -> str | None:
    """The headline's warning that the hardware was emulated (facts read under a root prefix), or None."""
    if not environment.hardware_root:
        return None
    return (f"Hardware: emulated (GPU facts read from the sysfs tree under {environment.hardware_root}; kernel and "
            "firmware values are the fixture's)")


def firmware_line(environment: Environment) -> str | None:
    """GuC and HuC versions, each saying where it came from: "GuC 70.54.0 (loaded), HuC 8.2.10 (file)"."""
    parts = [f"{name} {value}" for name, value in (("GuC", environment.xe_guc_firmware),
                                                   ("HuC", environment.xe_huc_firmware)) if value]
    return ", ".join(parts) or None


def markdown_link(label: str, url: str | None) -> str:
    """A claim's source, linked when its URL is an http(s) address: the label escaped, the address in angle
    brackets (no space, no angle bracket, no control character in it); anything else is shown as text."""
    if url and re.fullmatch(r"https?://[^\s<>\\`\x00-\x1f\x7f]+", url):
        return f"[{text(label)}](<{url}>)"
    return text(label) + (f" ({text(url)})" if url else "")


def render_markdown(report: Report, recipe: Recipe) -> str:
    env = report.environment
    spec = recipe.serve.speculative
    status = status_line(report)
    met = sum(v.verdict == "met" for v in report.verdicts)
    emulated = emulated_hardware_line(env)
    lines = [
        f"# Replication report: {text(recipe.name)}", "",
        f"**{text(status)}.** Claims met: {met} of {len(report.verdicts)}.", "",
    ]
    if emulated:
        lines += [f"**{text(emulated)}.**", ""]
    if report.throughput is not None and report.throughput.workloads:
        lines += summary_table(report) + [""]
    lines += [
        "## Configuration", "",
        f"- Recipe: {markdown_code(recipe.name)} — {text(recipe.description)}",
        f"- Endpoint: {text(report.endpoint)}" + (f"; baseline: {text(report.baseline)}" if report.baseline else ""),
        f"- Served model: {text(env.served_model or '–')}; vLLM {text(env.vllm_version or '–')}",
        "- Speculative decoding (recipe): " + (text(f"{spec.method}, k={spec.num_speculative_tokens}"
                                                     + (f", {spec.draft_sample_method}" if spec.draft_sample_method
                                                        else "")) if spec else "none"),
        "- Speculative decoding (served, from its counters): " + (
            "–" if env.served_speculative_positions is None else
            f"k={env.served_speculative_positions}" if env.served_speculative_positions else "none"),
        f"- Serve: TP={recipe.serve.tensor_parallel_size}, dtype {text(recipe.serve.dtype)}, max_model_len "
        f"{recipe.serve.max_model_len}",
    ]
    fixtures = " (emulated: the fixture's)" if emulated else ""
    kernel, firmware = env.kernel, firmware_line(env)
    for label, value in (("Host", env.hostname), ("Appliance hash", env.appliance_hash),
                         ("Image", env.image_digest), ("Kernel", kernel and kernel + fixtures),
                         ("Firmware", firmware and firmware + fixtures),
                         # The UMD vLLM runs is the image's own, which the recipe names; the host's may differ.
                         ("Image compute runtime", recipe.image.compute_runtime
                          and f"{recipe.image.compute_runtime} ({recipe.image.compute_runtime_source or 'recipe'})"),
                         # gpu_model counts per model already ("2x B70"): the count is not printed twice
                         ("GPUs", env.gpu_model),
                         ("P2P profile", env.p2p_profile and (f"{env.p2p_profile} ({env.p2p_profile_reason})"
                                                              if env.p2p_profile_reason else env.p2p_profile))):
        if value:
            lines.append(f"- {label}: {text(value)}")
    lines += [f"- Run: {report.started_at:%Y-%m-%d %H:%M:%S} UTC, b70ctl {text(report.tool_version)}", ""]
    if env.serve_command:
        lines += ["Serve command:", "", *markdown_code_block(env.serve_command), ""]
    if env.serve_exec_start:
        lines += ["The serving unit's ExecStart:", "", *markdown_code_block(f"ExecStart={env.serve_exec_start}"), ""]
    if env.serve_prefix_caching:
        lines += [f"Prefix caching: {text(env.serve_prefix_caching)}.", ""]
    if env.rehearsal:
        lines += ["**Rehearsal:** served from a stand-in base with vLLM's CPU build; the overlay "
                  "(control/b70ctl/serve/rehearsal.yaml) changed only this:", ""]
        lines += [f"- {text(line)}" for line in env.rehearsal] + [""]

    lines += ["## Verdicts", "", "| claim | required | measured | verdict | source |", "|---|---|---|---|---|"]
    for verdict in report.verdicts:
        measured = verdict.measured
        shown = (" ".join(f"{m:.2f}" for m in measured) if isinstance(measured, list)
                 else _fmt(measured, 3) if measured is not None else "–")
        note = f" — {text(verdict.reason)}" if verdict.reason else ""
        lines.append(f"| {text(verdict.description)} | {text(verdict.bound)} | {shown} "
                     f"| {VERDICT_MARK[verdict.verdict]}{note} | {markdown_link(verdict.source, verdict.url)} |")
    lines.append("")

    if report.diagnosis:
        lines += ["## Diagnosis", "", "Known failures the findings below match (`b70ctl diagnose`'s catalogue):", ""]
        for failure in report.diagnosis:
            lines.append(f"- **{text(failure.id)}** — {text(failure.title)}. Fix: {text(failure.fix)}")
            lines += [f"  - {markdown_code(evidence, 200)}" for evidence in failure.evidence]
        lines.append("")

    lines += ["## Throughput (concurrency 1)", ""]
    if report.throughput is None:
        lines += ["Not measured.", ""]
    else:
        if report.throughput.max_requests is not None:
            lines += [f"At most {report.throughput.max_requests} request(s) per workload (`--max-requests`): a quick "
                      "check. Where that is below a workload's `min_requests`, its median's interval is wider than "
                      "the recipe asks for a replication.", ""]
        for workload in report.throughput.workloads:
            lines += _workload(workload)

    lines += _roofline(report)

    lines += ["## Correctness and stability", ""]
    correctness = report.correctness
    if correctness is None:
        lines += ["Not measured.", ""]
    else:
        lines += [f"Greedy outputs compared by token id with {text(correctness.baseline)}: "
                  f"**{correctness.identical}/{correctness.total} identical**.", ""]
        if correctness.reason:
            lines += [f"**{text(correctness.reason)}**", ""]
        for comparison in correctness.comparisons:
            if not comparison.identical:
                lines += [f"- {markdown_code(comparison.prompt, 60)}: first divergence at token "
                          f"{comparison.first_divergence} — baseline {markdown_code(comparison.expected_context)} vs "
                          f"served {markdown_code(comparison.actual_context)}"]
        for finding in correctness.garbage:
            lines.append(f"- garbage guard, {text(finding.kind)}: {markdown_code(finding.prompt, 60)} — "
                         f"{text(finding.detail)}")
        lines.append("")

    lines += _gate(report)

    lines += ["## Edge cases and smoke", ""]
    if report.smoke is None:
        lines += ["Not run.", ""]
    else:
        lines += ["| check | result |", "|---|---|"]
        for check in report.smoke.checks:
            lines.append(f"| {text(check.name)} | {'pass' if check.passed else 'FAIL: ' + text(check.reason or '')} |")
        lines.append("")
    lines += ["Raw data (per-chunk arrival times, token ids, /metrics before and after) is in `raw/`.", ""]
    return "\n".join(lines)
