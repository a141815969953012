"""The fleet report shows each host's tune against the recipe's default: fleet.json hosts[].tune from
reports/<host>/tune/tune.json (what playbooks/tune.yml leaves), a bounded section of fleet.md and a table in
fleet.html."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from b70ctl.fleet import render
from b70ctl.fleet.analysis import aggregate, build_fleet_report
from b70ctl.fleet.model import FleetReport, HostTune
from b70ctl.tune.model import Figures, FinalComparison, TuneReport
from fleet_factory import make_report, synthetic_fleet, write_host

FINISHED = datetime(2026, 12, 1, 6, 30, tzinfo=UTC)


def tune_report(outcome: str, default: float | None, winner: float | None, overrides: dict) -> TuneReport:
    final = None if winner is None else FinalComparison(
        default_key="d", winner_key="w" if outcome == "tuned" else "d",
        default=None if default is None else Figures(n=12, score_tok_s=default), winner=Figures(n=12,
                                                                                                 score_tok_s=winner))
    return TuneReport(recipe="cpu-tiny", vllm_version="0.32.0", knobs={"num_speculative_tokens": [1, 2, 3]},
                      default_overrides={"num_speculative_tokens": 4}, workloads=["short"], budget_requests=120,
                      spent_requests=118, started_at=FINISHED, finished_at=FINISHED, rounds=[], candidates=[],
                      final=final, outcome=outcome, tuned_overrides=overrides, summary=f"{outcome} summary")


def write_tune(reports, host: str, report: TuneReport | str) -> None:
    directory = reports / host / "tune"
    directory.mkdir(parents=True)
    (directory / "tune.json").write_text(report if isinstance(report, str) else report.model_dump_json())


def test_each_host_shows_its_tune_against_the_default(tmp_path):
    reports = tmp_path / "reports"
    for host in ("fast-tune", "kept-default", "never-tuned", "broken-tune"):
        write_host(reports, host, make_report("cpu-tiny", host))
    write_tune(reports, "fast-tune", tune_report("tuned", 40.0, 50.0, {"num_speculative_tokens": 2}))
    write_tune(reports, "kept-default", tune_report("default_best", 45.0, 44.0, {}))
    write_tune(reports, "broken-tune", "{not json")
    report = aggregate(reports)
    tunes = {entry.host: entry.tune for entry in report.hosts}
    assert tunes["fast-tune"] == HostTune(outcome="tuned", overrides={"num_speculative_tokens": 2},
                                          tuned_score_tok_s=50.0, default_score_tok_s=40.0, gain=0.25,
                                          spent_requests=118, budget_requests=120, finished_at=FINISHED,
                                          summary="tuned summary")
    # the default stayed: what is served is the default, measured at 45 (the halving's winner lost the final)
    assert tunes["kept-default"].tuned_score_tok_s == 45.0 and tunes["kept-default"].gain == 0.0
    assert tunes["never-tuned"] is None and tunes["broken-tune"] is None
    problem = next(p for p in report.problems if p.host == "broken-tune")
    assert problem.kind == "invalid" and "tune report not used" in problem.reason
    assert FleetReport.model_validate_json(report.model_dump_json()) == report

    paths = render.write_fleet_report(report, reports / "fleet")
    markdown = paths["fleet.md"].read_text()
    section = markdown.split("## Tuned against the recipe's default", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows == [
        "| fast-tune | cpu-tiny | tuned | num_speculative_tokens=2 | 50.0 | 40.0 | +25.0% | 118/120 | 2026-12-01 |",
        "| kept-default | cpu-tiny | default best | the default stays | 45.0 | 45.0 | +0.0% | 118/120 | 2026-12-01 |",
    ]
    html = paths["fleet.html"].read_text()
    assert 'id="tuned"' in html and "<td>num_speculative_tokens=2</td>" in html
    written = {entry["host"]: entry["tune"] for entry in json.loads(paths["fleet.json"].read_text())["hosts"]}
    assert written["fast-tune"]["gain"] == 0.25 and written["never-tuned"] is None


def test_a_fleet_without_tunes_has_no_section_and_a_large_one_stays_within_budget(tmp_path):
    reports = tmp_path / "reports"
    write_host(reports, "plain", make_report("cpu-tiny", "plain"))
    plain = render.render_markdown(aggregate(reports))
    assert "Tuned against" not in plain

    collected = synthetic_fleet(40)
    for index, entry in enumerate(collected.entries):
        entry.tune = HostTune(outcome="tuned", overrides={"num_speculative_tokens": index % 6 + 1,
                                                          "CCL_SYCL_ALLGATHERV_SMALL_THRESHOLD": 262144},
                              tuned_score_tok_s=40.0 + index, default_score_tok_s=40.0,
                              gain=index / 40.0, spent_requests=290, budget_requests=300, finished_at=FINISHED,
                              summary="x" * 500)
    markdown = render.render_markdown(build_fleet_report(collected, "synthetic"))
    assert len(markdown) <= render.MARKDOWN_BUDGET
    section = markdown.split("## Tuned against the recipe's default", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == render.ROWS_SHOWN and "+97.5%" in rows[0]  # the largest gains first
    assert "30 more tuned hosts in fleet.json (`hosts[].tune`)" in section
