"""report.html: one endpoint's replication evidence as figures, beside report.md and report.json.

One self-contained file (inline CSS, plots as inline SVG, no script, nothing fetched): the headline, the verdict
of each claim, each request's decode tok/s against the decode claims, and per-position acceptance against the
per-position claims. Every string from the report is escaped: a host name or an endpoint is text, never markup.
"""

from __future__ import annotations

from b70ctl.escaping import html_text as escape
from b70ctl.recipes.model import Recipe
from b70ctl.report.markdown import (
    GATE_EXPLAINED,
    GATE_TITLE,
    ROOFLINE_EXPLAINED,
    ROOFLINE_HEADER,
    ROOFLINE_TITLE,
    VERDICT_MARK,
    emulated_hardware_line,
    firmware_line,
    gate_difference_text,
    gate_result_text,
    roofline_headline,
    roofline_input_rows,
    roofline_workload_rows,
    status_line,
)
from b70ctl.report.model import PEAK_LABEL, Report, Summary
from b70ctl.report.plots import acceptance_per_position_svg, decode_per_request_svg

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1.5rem auto; max-width: 1200px;
       padding: 0 1rem; color: #1b1b1b; }
h2 { margin-top: 2rem; border-bottom: 2px solid #ddd; padding-bottom: .2rem; }
.verdict { font-size: 1.1rem; font-weight: 600; padding: .6rem .9rem; border-radius: 6px; margin: .8rem 0; }
.ok { background: #e6f4ea; color: #0d5b22; } .bad { background: #fdecea; color: #8a1c14; }
.partial { background: #fff8e1; color: #6b4e00; }
.emulated { background: #fff8e1; color: #6b4e00; border-left: 4px solid #e0a800; padding: .4rem .9rem; }
.meta { color: #555; font-size: .9rem; }
table { border-collapse: collapse; margin: .6rem 0; font-size: .88rem; }
th, td { border: 1px solid #ddd; padding: .25rem .5rem; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.not_met td { background: #fdecea; } tr.not_measured td { background: #fff8e1; }
code { font-size: .85rem; background: #f4f4f4; padding: 0 .2rem; border-radius: 3px; overflow-wrap: anywhere; }
.plot svg { max-width: 100%; height: auto; } .plot { margin: .8rem 0; }
"""


def _text(value: object) -> str:
    return escape("–" if value is None else str(value))


def _number(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _median(summary: Summary | None, digits: int = 1) -> str:
    return _number(summary.median if summary else None, digits)


def _source(source: str, url: str | None) -> str:
    # Only a web address is a link: a report is input, and "javascript:" in it must stay text.
    if url and url.lower().startswith(("https://", "http://")):
        return f'<a href="{escape(url)}">{escape(source)}</a>'
    return escape(source)


def _measured(measured: float | list[float] | None) -> str:
    if isinstance(measured, list):
        return " ".join(f"{value:.2f}" for value in measured)
    return _number(measured, 3)


def _workload_table(report: Report) -> list[str]:
    rows = ["<table>", f"<tr><th>workload</th><th>decode tok/s (median)</th><th>clock</th><th>{PEAK_LABEL}</th>"
            "<th>TTFT ms</th><th>acceptance</th><th>mean acceptance length</th><th>requests</th></tr>"]
    for workload in report.throughput.workloads if report.throughput else []:
        spec = workload.spec_decode if workload.spec_decode and not workload.spec_decode.polluted else None
        ttft = workload.ttft_s.median * 1000 if workload.ttft_s else None
        rows.append(
            f"<tr><td>{_text(workload.name)}</td><td class=\"num\">{_median(workload.decode_tok_s, 2)}</td>"
            f"<td>{_text(workload.timing_source)}</td><td class=\"num\">{_number(workload.peak, 2)}</td>"
            f"<td class=\"num\">{_number(ttft)}</td>"
            f"<td class=\"num\">{_number(spec.acceptance_rate if spec else None, 3)}</td>"
            f"<td class=\"num\">{_number(spec.mean_acceptance_length if spec else None, 2)}</td>"
            f"<td class=\"num\">{len(workload.requests)}</td></tr>")
    return rows + ["</table>"]


def _verdict_table(report: Report) -> list[str]:
    rows = ["<table>", "<tr><th>claim</th><th>required</th><th>measured</th><th>verdict</th><th>source</th></tr>"]
    for verdict in report.verdicts:
        reason = f" — {escape(verdict.reason)}" if verdict.reason else ""
        rows.append(
            f"<tr class=\"{verdict.verdict}\"><td><code>{_text(verdict.claim_id)}</code> {_text(verdict.description)}"
            f"</td><td>{_text(verdict.bound)}</td><td class=\"num\">{_measured(verdict.measured)}</td>"
            f"<td>{escape(VERDICT_MARK[verdict.verdict])}{reason}</td><td>{_source(verdict.source, verdict.url)}</td>"
            "</tr>")
    return rows + ["</table>"]


def _table(header: list[str], rows: list[list[str]], numeric: set[int]) -> list[str]:
    lines = ["<table>", "<tr>" + "".join(f"<th>{escape(cell)}</th>" for cell in header) + "</tr>"]
    for row in rows:
        lines.append("<tr>" + "".join(
            f'<td class="num">{escape(cell)}</td>' if index in numeric and not cell.startswith("not measured")
            else f"<td>{escape(cell)}</td>" for index, cell in enumerate(row)) + "</tr>")
    return lines + ["</table>"]


def _roofline_section(report: Report) -> list[str]:
    """The bound, the measured rates and the efficiency, with every input and where it came from."""
    lines = [f"<h2>{escape(ROOFLINE_TITLE)}</h2>", f"<p>{escape(ROOFLINE_EXPLAINED)}</p>",
             f"<p><strong>{escape(roofline_headline(report.roofline))}</strong></p>"]
    roofline = report.roofline
    if roofline is None:
        return lines
    lines += _table(["input", "value", "source"], roofline_input_rows(roofline), numeric={1})
    rows = roofline_workload_rows(roofline)
    if rows:
        lines += _table(ROOFLINE_HEADER, rows, numeric=set(range(1, len(ROOFLINE_HEADER))))
    return lines


def _code(value: str) -> str:
    return f"<code>{escape(value)}</code>" if value else "–"


def _gate_section(report: Report) -> list[str]:
    """Each check of the gate against silent garbage, and where a failing one found two answers parting."""
    lines = [f"<h2>{escape(GATE_TITLE)}</h2>"]
    gate = report.gate
    if gate is None:
        return lines + ["<p>Not run.</p>"]
    lines += [f"<p>{escape(GATE_EXPLAINED)}</p>",
              f"<div class=\"verdict {'ok' if gate.passed else 'bad'}\">{'passed' if gate.passed else 'FAILED'}</div>",
              "<table>", "<tr><th>check</th><th>result</th><th>detail</th><th>first difference</th></tr>"]
    for check in gate.checks:
        kind = "" if check.passed is not False else ' class="not_met"'
        lines.append(f"<tr{kind}><td>{_text(check.name)}</td><td>{escape(gate_result_text(check.passed))}</td>"
                     f"<td>{_text(check.detail)}</td><td>{_code(gate_difference_text(check))}</td></tr>")
    return lines + ["</table>"]


def render_html(report: Report, recipe: Recipe) -> str:
    """report.html of a report: what report.md says in tables, drawn."""
    environment = report.environment
    met = sum(v.verdict == "met" for v in report.verdicts)
    kind = "partial" if report.partial else "ok" if report.passed else "bad"
    host = environment.hostname or report.endpoint
    meta = [f"endpoint <code>{_text(report.endpoint)}</code>", f"recipe <code>{_text(recipe.name)}</code>",
            f"vLLM {_text(environment.vllm_version)}", f"run {report.started_at:%Y-%m-%d %H:%M:%S} UTC",
            f"b70ctl {_text(report.tool_version)}"]
    if environment.hostname:
        meta.insert(0, f"host <code>{_text(environment.hostname)}</code>")
    firmware = firmware_line(environment)
    meta += ([f"kernel {_text(environment.kernel)}"] if environment.kernel else []) + \
        ([_text(firmware)] if firmware else [])
    emulated = emulated_hardware_line(environment)
    lines = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>Replication report: {_text(recipe.name)} on {_text(host)}</title>",
        f"<style>{STYLE}</style>", "</head>", "<body>",
        f"<h1>Replication report: {_text(recipe.name)}</h1>",
        f"<p class=\"meta\">{' · '.join(meta)}</p>",
        f"<div class=\"verdict {kind}\">{_text(status_line(report))}. Claims met: {met} of {len(report.verdicts)}."
        "</div>",
        *([f"<p class=\"emulated\"><strong>{_text(emulated)}.</strong></p>"] if emulated else []),
        "<h2>Verdicts</h2>", *_verdict_table(report),
        "<h2>Throughput (concurrency 1)</h2>",
    ]
    if report.throughput is None or not report.throughput.workloads:
        lines.append("<p>Not measured.</p>")
    else:
        lines += _workload_table(report)
        decode = decode_per_request_svg(report, recipe)
        if decode:
            lines += ["<p>Each point is one request (its tooltip: its number, rate and clock); the engine's clock is "
                      "vLLM's own per-request timing, the client's what arrived over the network.</p>",
                      f'<div class="plot">{decode}</div>']
        acceptance = acceptance_per_position_svg(report, recipe)
        if acceptance:
            lines += ["<h2>Per-position acceptance</h2>", f'<div class="plot">{acceptance}</div>']
    lines += _gate_section(report)
    lines += _roofline_section(report)
    lines += ["<p class=\"meta\">The figures behind every verdict are in report.json, each request's raw data in "
              "raw/; report.md says the same in text.</p>", "</body>", "</html>", ""]
    return "\n".join(lines)
