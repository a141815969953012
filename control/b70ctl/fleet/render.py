"""Render a FleetReport: fleet.json (the model), fleet.md (paste-able into a GitHub issue) and fleet.html (one
self-contained file: inline CSS, plots as inline SVG, nothing fetched when it is opened).

Every file is written to a temporary file beside its target and moved into place, so a reader never sees half
a report.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from jinja2 import Environment, PackageLoader, StrictUndefined

from b70ctl.files import write_text_atomically
from b70ctl.fleet import plots
from b70ctl.fleet.aggregate import cyclic_gc_paused
from b70ctl.fleet.layout import FLEET_JSON
from b70ctl.fleet.model import (
    DRIFT_FIELDS,
    FIELD_LABELS,
    FingerprintGroup,
    FleetReport,
    HostEntry,
    RecipeFleet,
    WorkloadFigures,
)

FLEET_MD = "fleet.md"
FLEET_HTML = "fleet.html"
NAMES_SHOWN = 10



def _names(hosts: Iterable[str], limit: int = NAMES_SHOWN) -> str:
    names = list(hosts)
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f" and {len(names) - limit} more"


def _labels(fields: Iterable[str]) -> str:
    return ", ".join(FIELD_LABELS.get(name, name) for name in fields)


def _group_kind(group: FingerprintGroup) -> str:
    unrecorded = [name for name, value in group.fingerprint.items() if value is None]
    if unrecorded:
        return f"(majority where recorded; not recorded: {_labels(unrecorded)})"
    return "(majority)"


def _number(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:+.1f}%"


def _md_cell(value: object) -> str:
    # A pipe or newline inside a value would break the markdown table.
    return str(value).replace("|", "\\|").replace("\n", " ")


def _short(value: object, length: int = 19) -> str:
    text = "–" if value is None else str(value)
    return text if len(text) <= length else text[: length - 1] + "…"


def _environment(report_kind: str) -> Environment:
    environment = Environment(
        loader=PackageLoader("b70ctl.fleet", "templates"),
        autoescape=report_kind == "html",
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    environment.filters.update(names=_names, labels=_labels, group_kind=_group_kind, number=_number, percent=_percent, md=_md_cell, short=_short)
    return environment


def _sorted_hosts(report: FleetReport) -> list[HostEntry]:
    """Hosts that need attention first (not verified, claims not met, outliers, drift), then by name."""
    def attention(entry: HostEntry) -> tuple[int, str]:
        if entry.status not in ("verified", "partial"):
            rank = 0
        elif not entry.all_claims_met:
            rank = 1
        elif entry.outlier_workloads or entry.drift_fields:
            rank = 2
        else:
            rank = 3
        return rank, entry.host
    return sorted(report.hosts, key=attention)


@dataclass(frozen=True)
class HostRow:
    """One host's table row, prepared here: thousands of rows through template attribute lookups cost more
    than the rest of the report."""

    entry: HostEntry
    claims_met: str
    claims_missed: str
    figures: list[WorkloadFigures | None]
    environment: list[str | None]


def _host_row(entry: HostEntry, workloads: list[str]) -> HostRow:
    met = sum(1 for v in entry.verdicts if v.verdict == "met")
    figures_of = {f.name: f for f in entry.workloads}
    environment = [getattr(entry.environment, name) for name in DRIFT_FIELDS]
    return HostRow(
        entry=entry,
        claims_met=f"{met}/{len(entry.verdicts)}" if entry.verdicts else "–",
        claims_missed=", ".join(f"{v.claim_id} {v.verdict}" for v in entry.verdicts if v.verdict != "met"),
        figures=[figures_of.get(name) for name in workloads],
        environment=[None if value is None else str(value) for value in environment],
    )


def _context(report: FleetReport) -> dict[str, object]:
    workloads_of = {fleet.recipe: [w.workload for w in fleet.workloads] for fleet in report.recipes}
    all_workloads = list(dict.fromkeys(name for names in workloads_of.values() for name in names))
    return {
        "report": report,
        "rows": [_host_row(entry, all_workloads) for entry in _sorted_hosts(report)],
        "drift_fields": DRIFT_FIELDS,
        "field_labels": FIELD_LABELS,
        "workloads_of": workloads_of,
        "all_workloads": all_workloads,
    }


def render_markdown(report: FleetReport) -> str:
    return _environment("md").get_template("fleet.md.j2").render(**_context(report))


def _plots_of(fleet: RecipeFleet, hosts: list[HostEntry]) -> dict[str, str | None]:
    members = [h for h in hosts if h.recipe == fleet.recipe]
    return {
        "decode": plots.decode_per_host_svg(fleet, members),
        "acceptance": plots.acceptance_curves_svg(fleet, members),
        "drift": plots.drift_effects_svg(fleet),
    }


def render_html(report: FleetReport) -> str:
    context = _context(report)
    context["plots"] = {fleet.recipe: _plots_of(fleet, report.hosts) for fleet in report.recipes}
    return _environment("html").get_template("fleet.html.j2").render(**context)


def write_fleet_report(report: FleetReport, out_dir: Path) -> dict[str, Path]:
    """fleet.json, fleet.md and fleet.html in out_dir; returns their paths by name."""
    paths = {name: out_dir / name for name in (FLEET_JSON, FLEET_MD, FLEET_HTML)}
    with cyclic_gc_paused():
        write_text_atomically(paths[FLEET_JSON], report.model_dump_json(indent=2) + "\n")
        write_text_atomically(paths[FLEET_MD], render_markdown(report))
        write_text_atomically(paths[FLEET_HTML], render_html(report))
    return paths
