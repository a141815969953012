"""`b70ctl fleet report REPORTS_DIR --out DIR`: the fleet replication report of collected per-host reports.

Exit codes: 0 every host met every claim, 1 some host did not (or could not be verified, or an input was bad),
2 REPORTS_DIR missing or without host directories.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from b70ctl.errors import BadInput
from b70ctl.files import write_failure
from b70ctl.options import json_option

if TYPE_CHECKING:  # the models are built when a report is made, not at every b70ctl command's start-up
    from b70ctl.fleet.model import FleetReport
    from b70ctl.fleet.render import FleetFiles

app = typer.Typer(no_args_is_help=True, help="Fleet replication reports from many hosts' reports.")


def exit_code(report: FleetReport) -> int:
    return 0 if report.all_met else 1


def _print_summary(report: FleetReport, files: FleetFiles) -> None:
    out = Console(highlight=False, soft_wrap=True)  # stdout, unwrapped: `| tee` and grep keep whole lines
    summary = report.summary
    style = "green" if report.all_met else "red"
    out.print(f"[bold {style}]{summary.all_claims_met} of {summary.hosts} hosts met every claim[/]  "
              f"(verified {summary.verified}, partial {summary.partial}, unreachable {summary.unreachable}, "
              f"bad report {summary.bad_report}, duplicate {summary.duplicate})")
    for fleet in report.recipes:
        out.print(f"[bold]{fleet.recipe}[/]: {fleet.hosts_all_claims_met}/{fleet.hosts} met every claim")
        for claim in fleet.claims:
            out.print(f"  {claim.claim_id}: {claim.met} met, {claim.not_met} not met, "
                      f"{claim.not_measured} not measured")
        for drift in fleet.drift:
            out.print(f"  drift {drift.field}: {len(drift.drifting_hosts)} hosts differ from "
                      f"{drift.majority_value}")
        if fleet.outliers:
            hosts = sorted({o.host for o in fleet.outliers})
            out.print(f"  outliers: {', '.join(hosts[:10])}{' ...' if len(hosts) > 10 else ''}")
    for problem in report.problems:
        out.print(f"[yellow]{problem.kind}[/] ({problem.action}): {problem.reason}", soft_wrap=True)
    for path in files.values():
        out.print(f"{'wrote' if files.written else 'unchanged'} {path}")


@app.command("report")
def report_command(
    reports_dir: Annotated[Path, typer.Argument(help="REPORTS_DIR: one directory per host with report.json "
                                                     "(or unreachable.json), as the verify play collects them")],
    out: Annotated[Path, typer.Option("--out", help="Directory for fleet.json, fleet.md and fleet.html")],
    as_json: Annotated[bool, json_option("Print fleet.json to stdout")] = False,
) -> None:
    """Aggregate per-host reports into fleet.json, fleet.md and fleet.html, with verdicts, drift and outliers."""
    # Imported here: jinja2 and the recipes are not needed by any other b70ctl command's start-up.
    from b70ctl.fleet.aggregate import aggregate
    from b70ctl.fleet.render import write_fleet_report

    report = aggregate(reports_dir)
    try:
        files = write_fleet_report(report, out)
    except OSError as error:
        raise BadInput(f"--out {out}: {write_failure(error, out)}") from error
    if as_json:
        sys.stdout.write(report.model_dump_json(indent=2) + "\n")
    else:
        _print_summary(report, files)
    raise typer.Exit(exit_code(report))
