"""`b70ctl fleet report REPORTS_DIR --out DIR`: the fleet replication report of collected per-host reports.
`b70ctl fleet mark REPORTS_DIR/HOST --kind K --reason R`: the marker (unreachable.json) of a host without a report.

Exit codes: 0 every host met every claim, 1 some host did not (or could not be verified, or an input was bad),
2 REPORTS_DIR missing or without host directories.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from b70ctl.choices import choice_option
from b70ctl.errors import BadInput
from b70ctl.files import write_failure, write_text_atomically
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
    from b70ctl.fleet.analysis import aggregate
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


class MarkerKind(str, Enum):
    unreachable = "unreachable"
    failed = "failed"


# A marker's reason is one line of what Ansible reported: enough to read in a table row.
MARKER_REASON_CHARS = 500


@app.command("mark")
def mark_command(
    host_dir: Annotated[Path, typer.Argument(help="REPORTS_DIR/<host>: the directory of the host's report")],
    kind: Annotated[str, choice_option(MarkerKind, "--kind", "unreachable: no connection; failed: a stage or verify "
                                                             "failed before report.json existed")],
    reason: Annotated[str, typer.Option(help="Why, one line (the error Ansible reported)")],
    stage: Annotated[str | None, typer.Option(help="Where it stopped: connect, before verify, verify")] = None,
    recipe: Annotated[str | None, typer.Option(help="The recipe the host serves (the inventory's b70_recipe)")] = None,
    keep_existing: Annotated[bool, typer.Option(
        help="Leave a marker already there (the host's own verify wrote it, with its reason)")] = False,
    as_json: Annotated[bool, json_option("Print the marker")] = False,
) -> None:
    """Write HOST_DIR/unreachable.json: the fleet report's row for a host that has no report of this run."""
    from b70ctl.fleet.layout import UNREACHABLE_FILE, UnreachableMarker

    path = host_dir / UNREACHABLE_FILE
    one_line = " ".join(reason.split())
    if not one_line:
        raise BadInput("--reason is empty: say why the host has no report (the error Ansible reported)")
    marker = UnreachableMarker(host=host_dir.name, kind=kind, stage=stage, recipe=recipe,
                               reason=one_line[:MARKER_REASON_CHARS], recorded_at=datetime.now(UTC))
    if not (keep_existing and path.exists()):
        try:
            write_text_atomically(path, marker.model_dump_json(indent=2) + "\n")
        except OSError as error:
            raise BadInput(f"{path}: {write_failure(error, path)}") from error
    if as_json:
        sys.stdout.write(marker.model_dump_json(indent=2) + "\n")
