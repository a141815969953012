"""One peak: the figure the recipe's peak claim reads (PR #620's 85.9 tok/s is its best run's peak: the claim's
metric is `throughput.short.peak_tok_s.max`) is the one the host report's tables, report.html and the fleet report
show under one name. The median of the per-request peaks stays only in the workload's own distribution row."""

from __future__ import annotations

import re

from b70ctl.fleet.collect import workload_figures
from b70ctl.report.html import render_html
from b70ctl.report.load import measurements_of
from b70ctl.report.markdown import render_markdown
from b70ctl.report.model import PEAK_LABEL, RequestSample, Summary
from b70ctl.report.verdict import judge_all
from fleet_factory import make_report, shipped_recipe

RECIPE = "pr620-fp8-tp2"


def _report_with_spread_peaks():
    """Per-request peaks 80, 90 and 100 tok/s: the median (90) and the best (100) differ, as on a real run."""
    report = make_report(RECIPE, "b70-a")
    short = next(w for w in report.throughput.workloads if w.name == "short")
    peaks = [80.0, 90.0, 100.0]
    short.requests = [RequestSample(**{**r.model_dump(), "peak_tok_s": p}) for r, p in zip(short.requests, peaks)]
    short.peak_tok_s = Summary(median=90.0, min=80.0, max=100.0, mad=10.0, ci_low=80.0, ci_high=100.0, n=3)
    return report, short


def test_every_table_shows_the_peak_the_claim_judges() -> None:
    report, short = _report_with_spread_peaks()
    report.measurements = measurements_of(report)
    report.verdicts = judge_all(shipped_recipe(RECIPE).claims, report.measurements)
    verdicts = {v.claim_id: v for v in report.verdicts}
    assert short.peak == 100.0 == verdicts["short-peak"].measured

    markdown = render_markdown(report, shipped_recipe(RECIPE))
    header = next(line for line in markdown.splitlines() if line.startswith("| workload | t/s |"))
    row = next(line for line in markdown.splitlines() if line.startswith("| short |"))
    column = [cell.strip() for cell in header.split("|")].index(PEAK_LABEL)
    assert [cell.strip() for cell in row.split("|")][column] == "100.00"
    # The distribution row keeps the median of the per-request peaks, under its own name.
    assert "| peak, 1 s window (tok/s) | 90.00 | 80.00 | 100.00 |" in markdown

    html = render_html(report, shipped_recipe(RECIPE))
    assert f"<th>{PEAK_LABEL}</th>" in html
    assert re.search(r"<tr><td>short</td>(<td[^>]*>[^<]*</td>){2}<td class=\"num\">100\.00</td>", html)

    figures = {figure["name"]: figure for figure in workload_figures(report)}
    assert figures["short"]["peak_decode_tok_s"] == 100.0
