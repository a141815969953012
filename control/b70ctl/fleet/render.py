"""Render a FleetReport: fleet.json (the model), fleet.md (paste-able into a GitHub issue at any fleet size) and
fleet.html (one self-contained file: inline CSS, plots as inline SVG, a small inline script that sorts the host
table; nothing fetched when it is opened).

fleet.md is a summary whose size does not grow with the fleet, then the hosts needing attention (outliers the
environment does not explain, then failures, then groups drifting from the majority) up to a character budget,
then a line saying how many were left out and where every host is: fleet.json and fleet.html.

Every file is written to a temporary file beside its target and moved into place, so a reader never sees half
a report; files that already hold the same report, generated earlier, are left as they are.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

from jinja2 import Environment, PackageLoader, StrictUndefined
from markupsafe import Markup
from pydantic import TypeAdapter

from b70ctl.escaping import Markdown, markdown_code, markdown_text
from b70ctl.files import write_text_atomically
from b70ctl.fleet import plots
from b70ctl.fleet.collect import cyclic_gc_paused
from b70ctl.fleet.layout import FLEET_JSON
from b70ctl.fleet.model import (
    DRIFT_FIELDS,
    FIELD_LABELS,
    USABLE,
    FieldValueEffect,
    FingerprintGroup,
    FleetReport,
    HostEntry,
    Outlier,
    RecipeFleet,
    WorkloadFigures,
)
from b70ctl.redact import printable, redact_credentials, without_controls
from b70ctl.report.markdown import efficiency_text
from b70ctl.report.model import PEAK_LABEL

FLEET_MD = "fleet.md"
FLEET_HTML = "fleet.html"
NAMES_SHOWN = 10
MARKDOWN_LIMIT = 65_536  # GitHub's limit on an issue or comment body, in characters
MARKDOWN_BUDGET = 60_000  # what fleet.md uses at most: the rest is left for the words of whoever files it
SUMMARY_BUDGET = 24_000  # the recipes' sections; the hosts needing attention get what the summary leaves
FOOTER_RESERVE = 400  # the closing line, always written
ROWS_SHOWN = 10  # claims, workloads, known failures, input problems: the rest are in fleet.json
VALUES_SHOWN = 3  # other values of a drifting field
CELL_CHARACTERS = 200  # a free-text cell from a report (a reason, a description) is cut here
_GENERATED_AT = TypeAdapter(datetime)

Attention = Literal["outlier", "failed", "drift"]
ATTENTION_ORDER: tuple[Attention, ...] = ("outlier", "failed", "drift")


def attention_of(entry: HostEntry) -> Attention | None:
    """Why a host needs attention, the first that applies: an outlier its environment does not explain (same
    fingerprint as the majority: nothing known explains it), a failure (not verified, or a claim not met), drift
    from the majority. None for a host that needs none, and for a duplicate (an input problem, not a host)."""
    if entry.status == "duplicate":
        return None
    if entry.outlier_workloads and not entry.drift_fields:
        return "outlier"
    if entry.status not in USABLE or not entry.all_claims_met:
        return "failed"
    if entry.drift_fields:
        return "drift"
    return None


def _names(hosts: Iterable[str], limit: int = NAMES_SHOWN, characters: int | None = None) -> str:
    """The first `limit` names (and, given `characters`, no more than fit in about that many), the rest counted."""
    names = list(hosts)
    shown: list[str] = []
    length = 0
    for name in names[:limit]:
        if characters is not None and shown and length + len(name) > characters:
            break
        shown.append(name)
        length += len(name) + 2
    left = len(names) - len(shown)
    return ", ".join(shown) + (f" and {left} more" if left else "")


def _markdown_names(hosts: Iterable[str], limit: int = NAMES_SHOWN) -> str:
    # Host names come from directory names (up to 255 bytes each): a cell of them is bounded by characters too.
    return _names(hosts, limit, characters=300)


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
    """A value from a report or a directory name as Markdown text (b70ctl.escaping): one line, no pipe that
    breaks the table, no link, image, emphasis or HTML tag of its own."""
    return value if isinstance(value, Markdown) else markdown_text(value, in_cell=True)


def _short(value: object, length: int = 19) -> str:
    text = "–" if value is None else str(value)
    return text if len(text) <= length else text[: length - 1] + "…"


def _cell(value: object, length: int = CELL_CHARACTERS) -> str:
    """Free text from a report in a markdown table cell: one line, no cell-breaking pipe, no HTML, bounded."""
    return markdown_text(_short(value, length), in_cell=True)


def _code(value: object, length: int = 80) -> str:
    """A value as inline code, where markdown shows every character as it is (no entities): one line, and a
    fence no backtick of the value can end."""
    if value is None:
        return Markdown("–")
    return markdown_code(_short(value, length))


def _finalize(report_kind: str) -> Any:
    """Every `{{ value }}` of a template crosses its output's boundary: in fleet.md a string that is not Markdown
    already (a filter's or b70ctl's own) is escaped; in fleet.html it is made printable, then autoescaped."""
    def markdown(value: Any) -> Any:
        return value if isinstance(value, Markdown) or not isinstance(value, str) else markdown_text(value)

    def html(value: Any) -> Any:
        return value if isinstance(value, Markup) or not isinstance(value, str) else printable(value)

    return html if report_kind == "html" else markdown


def _environment(report_kind: str) -> Environment:
    environment = Environment(
        loader=PackageLoader("b70ctl.fleet", "templates"),
        autoescape=report_kind == "html",
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        finalize=_finalize(report_kind),
    )
    def own(render: Callable[..., str]) -> Callable[..., str]:
        """A figure b70ctl formats itself ("-11.3%"): Markdown as it is, in fleet.md."""
        return render if report_kind == "html" else lambda *args: Markdown(render(*args))

    environment.filters.update(names=_names if report_kind == "html" else _markdown_names, labels=_labels,
                               group_kind=_group_kind, number=own(_number),
                               percent=own(_percent), md=_md_cell, short=_short, cell=_cell, code=_code,
                               efficiency=own(efficiency_text))
    environment.globals["peak_label"] = PEAK_LABEL  # the host reports' name for the same figure
    return environment


def _sorted_hosts(report: FleetReport) -> list[HostEntry]:
    """Hosts in fleet.md's order of attention (unexplained outliers, failures, drift), then the rest; by name."""
    rank = {kind: index for index, kind in enumerate(ATTENTION_ORDER)}

    def attention(entry: HostEntry) -> tuple[int, str]:
        kind = attention_of(entry)
        return (rank[kind] if kind is not None else len(rank)), entry.host
    return sorted(report.hosts, key=attention)


# A host's own report beside its report.json, the first that exists: fleet.html links each host to it.
HOST_DOCUMENTS = ("report.html", "report.md", "report.json")


@dataclass(frozen=True)
class HostRow:
    """One host's table row, prepared here: thousands of rows through template attribute lookups cost more
    than the rest of the report."""

    entry: HostEntry
    attention: Attention | None
    attention_rank: int
    link: str | None
    claims_met: str
    claims_met_fraction: float | None
    claims_missed: str
    figures: list[WorkloadFigures | None]
    environment: list[str | None]


def host_link(entry: HostEntry, out_dir: Path | None) -> str | None:
    """A relative URL from fleet.html to the host's own report (report.html, else report.md, else report.json):
    `../<host>/report.html` in the collected layout. None when the host has no report on disk."""
    if entry.report_path is None:
        return None
    directory = Path(entry.report_path).parent
    target = next((directory / name for name in HOST_DOCUMENTS if (directory / name).is_file()), None)
    if target is None:
        return None
    if out_dir is None:  # the collected layout: the fleet report in its own directory beside the hosts'
        relative = f"../{directory.name}/{target.name}"
    else:
        relative = Path(os.path.relpath(os.path.abspath(target), os.path.abspath(out_dir))).as_posix()
    # Percent-encoded: a host name is a directory name, and may hold '#', '?', quotes or '<'.
    return quote(relative, safe="/")


def _host_row(entry: HostEntry, workloads: list[str], out_dir: Path | None) -> HostRow:
    met = sum(1 for v in entry.verdicts if v.verdict == "met")
    figures_of = {f.name: f for f in entry.workloads}
    environment = [getattr(entry.environment, name) for name in DRIFT_FIELDS]
    attention = attention_of(entry)
    return HostRow(
        entry=entry,
        attention=attention,
        attention_rank=ATTENTION_ORDER.index(attention) if attention is not None else len(ATTENTION_ORDER),
        link=host_link(entry, out_dir),
        claims_met=f"{met}/{len(entry.verdicts)}" if entry.verdicts else "–",
        claims_met_fraction=met / len(entry.verdicts) if entry.verdicts else None,
        claims_missed=", ".join(f"{v.claim_id} {v.verdict}" for v in entry.verdicts if v.verdict != "met"),
        figures=[figures_of.get(name) for name in workloads],
        environment=[None if value is None else str(value) for value in environment],
    )


def _context(report: FleetReport, out_dir: Path | None) -> dict[str, object]:
    workloads_of = {fleet.recipe: [w.workload for w in fleet.workloads] for fleet in report.recipes}
    all_workloads = list(dict.fromkeys(name for names in workloads_of.values() for name in names))
    return {
        "report": report,
        "rows": [_host_row(entry, all_workloads, out_dir) for entry in _sorted_hosts(report)],
        "drift_fields": DRIFT_FIELDS,
        "field_labels": FIELD_LABELS,
        "workloads_of": workloads_of,
        "all_workloads": all_workloads,
    }


@dataclass
class _Budgeted:
    """Markdown lines added while they fit in a number of characters (each line counts its newline)."""

    remaining: int
    lines: list[str]

    @staticmethod
    def cost(*lines: str) -> int:
        return sum(len(line) + 1 for line in lines)

    def add(self, *lines: str) -> bool:
        if self.cost(*lines) > self.remaining:
            return False
        self.lines.extend(lines)
        self.remaining -= self.cost(*lines)
        return True


# A row of the attention section, made for the characters it may use: its text and the hosts it names, or None
# when it cannot fit.
RowMaker = Callable[[int], "tuple[str, list[str]] | None"]


def _fixed_row(row: str, hosts: list[str]) -> RowMaker:
    return lambda room: (row, hosts) if len(row) <= room else None


def _claims_cell(entry: HostEntry) -> str:
    if not entry.verdicts:
        return "–"
    met = sum(1 for v in entry.verdicts if v.verdict == "met")
    missed = ", ".join(f"{v.claim_id} {v.verdict.replace('_', ' ')}" for v in entry.verdicts if v.verdict != "met")
    return f"{met}/{len(entry.verdicts)}" + (f": {_cell(missed)}" if missed else "")


def _outlier_row(entry: HostEntry, outliers: list[Outlier], recipe_column: bool) -> str:
    figures = "; ".join(f"{o.workload}: {o.median_decode_tok_s:.1f} vs {o.fleet_median_decode_tok_s:.1f} "
                        f"({o.robust_z:+.1f})" for o in outliers)
    recipe = f" {_code(entry.recipe)} |" if recipe_column else ""
    return f"| {_md_cell(entry.host)} |{recipe} {_cell(figures)} | {_claims_cell(entry)} |"


def _failure_row(entry: HostEntry, recipe_column: bool) -> str:
    recipe = f" {_code(entry.recipe)} |" if recipe_column else ""
    return f"| {_md_cell(entry.host)} | {entry.status} |{recipe} {_claims_cell(entry)} | {_cell(entry.reason or '')} |"


def _drift_row(fleet: RecipeFleet, group: FingerprintGroup, outliers: int, recipe_column: bool) -> RowMaker:
    """A drift group's row naming as many of its hosts as fit; the others are counted."""
    differs = ", ".join(f"{FIELD_LABELS[name]}={_code(group.fingerprint[name], 40)}"
                        for name in group.differs_from_majority)
    costs = ", ".join(f"{f.workload} {_percent(f.relative_to_reference)}" for f in group.figures)
    recipe = f" {_code(fleet.recipe)} |" if recipe_column else ""
    start = f"|{recipe} {differs} | {len(group.hosts)} | {_cell(costs)} | {outliers} | "

    def make(room: int) -> tuple[str, list[str]] | None:
        names: list[str] = []
        length = len(start) + len(" |")
        for host in group.hosts:
            addition = len(_md_cell(host)) + (2 if names else 0)
            left = len(group.hosts) - len(names) - 1
            if length + addition + (len(f" and {left} more") if left else 0) > room:
                break
            names.append(host)
            length += addition
        left = len(group.hosts) - len(names)
        counted = (" and " if names else "") + f"{left} more" if left else ""
        row = start + ", ".join(_md_cell(name) for name in names) + counted + " |"
        return (row, names) if len(row) <= room else None
    return make


@dataclass(frozen=True)
class AttentionSection:
    """The hosts needing attention as fleet.md lists them: how many of each kind, the markdown, how many of them
    it could not name."""

    hosts: int
    outlier: int
    failed: int
    drift: int
    left_out: int
    markdown: str


def _attention_section(report: FleetReport, characters: int) -> AttentionSection:
    """Unexplained outliers (most extreme first), failures, then drift groups (largest first), while they fit in
    `characters`; the closing line says how many hosts needing attention were left out and where they are."""
    kinds = {entry.host: kind for entry in report.hosts if (kind := attention_of(entry)) is not None}
    entries = {entry.host: entry for entry in report.hosts}
    recipe_column = len(report.recipes) > 1
    recipe_header, recipe_rule = (" recipe |", "---|") if recipe_column else ("", "")
    budget = _Budgeted(characters - FOOTER_RESERVE, [])
    named: set[str] = set()
    full = False

    def section(title: str, header: list[str], rows: Iterable[RowMaker]) -> None:
        """The title and table header come with the first row; the first row that does not fit ends the list."""
        nonlocal full
        opening = [title, "", *header]
        for make in rows:
            if full:
                return
            made = make(budget.remaining - budget.cost(*opening) - 1)
            if made is None or not budget.add(*opening, made[0]):
                full = True
                return
            opening = []
            named.update(made[1])
        if not opening:
            budget.add("")

    outliers_of: dict[str, list[Outlier]] = {}
    for fleet in report.recipes:
        for outlier in fleet.outliers:
            outliers_of.setdefault(outlier.host, []).append(outlier)
    unexplained = sorted((host for host, kind in kinds.items() if kind == "outlier"),
                         key=lambda host: (-max(abs(o.robust_z) for o in outliers_of[host]), host))
    section(f"### Outliers the environment does not explain ({len(unexplained)})",
            [f"| host |{recipe_header} workload: tok/s vs fleet median (robust z) | claims met |",
             f"|---|{recipe_rule}---|---|"],
            (_fixed_row(_outlier_row(entries[host], outliers_of[host], recipe_column), [host])
             for host in unexplained))
    status_rank = {"bad_report": 0, "unreachable": 1, "partial": 2, "verified": 3}
    failed = sorted((entries[host] for host, kind in kinds.items() if kind == "failed"),
                    key=lambda entry: (status_rank.get(entry.status, 0), entry.host))
    section(f"### Failed ({len(failed)}): not verified, or a claim not met",
            [f"| host | status |{recipe_header} claims met | reason |", f"|---|---|{recipe_rule}---|---|"],
            (_fixed_row(_failure_row(entry, recipe_column), [entry.host]) for entry in failed))
    groups = sorted(((fleet, group) for fleet in report.recipes for group in fleet.fingerprint_groups
                     if group.differs_from_majority), key=lambda item: (-len(item[1].hosts), item[1].hosts[0]))
    drifting = sum(1 for kind in kinds.values() if kind == "drift")
    section(f"### Drifting from the majority ({drifting} hosts; {len(groups)} groups)",
            [f"|{recipe_header} differs in | hosts | tok/s vs the majority | outliers | members |",
             f"|{recipe_rule}---|---:|---|---:|---|"],
            (_drift_row(fleet, group, sum(1 for host in group.hosts if entries[host].outlier_workloads),
                        recipe_column) for fleet, group in groups))

    left_out = sum(1 for host in kinds if host not in named)
    if not kinds:
        footer = f"Every host's figures and environment are in fleet.json and fleet.html ({len(entries)} hosts)."
    elif left_out:
        footer = (f"**{left_out} of {len(kinds)} hosts needing attention are not listed here**, to keep this file "
                  f"under GitHub's {MARKDOWN_LIMIT:,}-character limit: every host is in fleet.json (`hosts`) and in "
                  "fleet.html (its host table sorts by any column).")
    else:
        footer = (f"All {len(kinds)} hosts needing attention are listed above; every host, with its figures and "
                  "environment, is in fleet.json (`hosts`) and fleet.html (its host table sorts by any column).")
    counts = {kind: sum(1 for k in kinds.values() if k == kind) for kind in ATTENTION_ORDER}
    markdown = "\n".join([f"## Hosts needing attention ({len(kinds)} of {report.summary.hosts})", "",
                          *budget.lines, footer]) + "\n"
    return AttentionSection(hosts=len(kinds), outlier=counts["outlier"], failed=counts["failed"],
                            drift=counts["drift"], left_out=left_out, markdown=Markdown(markdown))


def _effects_shown(fleet: RecipeFleet) -> list[FieldValueEffect]:
    """Per drifting field: the majority and its VALUES_SHOWN largest other values."""
    shown, others = [], dict.fromkeys((e.field for e in fleet.field_effects), 0)
    for effect in fleet.field_effects:
        if effect.is_majority:
            shown.append(effect)
        elif others[effect.field] < VALUES_SHOWN:
            others[effect.field] += 1
            shown.append(effect)
    return shown


def _recipe_blocks(report: FleetReport, environment: Environment) -> tuple[list[str], int]:
    """Each recipe's section, the largest recipes first while they fit SUMMARY_BUDGET (the first always: its
    cells and rows are bounded), in the report's order; and how many were left out."""
    template = environment.get_template("fleet_recipe.md.j2")
    blocks: dict[int, str] = {}
    used = 0
    for index in sorted(range(len(report.recipes)), key=lambda index: -report.recipes[index].hosts):
        fleet = report.recipes[index]
        block = template.render(fleet=fleet, field_labels=FIELD_LABELS, rows_shown=ROWS_SHOWN,
                                values_shown=VALUES_SHOWN, effects=_effects_shown(fleet),
                                workloads=[w.workload for w in fleet.workloads][:ROWS_SHOWN])
        if blocks and used + len(block) > SUMMARY_BUDGET:
            break
        blocks[index] = block
        used += len(block)
    return [Markdown(blocks[index]) for index in sorted(blocks)], len(report.recipes) - len(blocks)


def render_markdown(report: FleetReport, budget: int = MARKDOWN_BUDGET) -> str:
    """fleet.md in at most `budget` characters, whatever the fleet's size: the summary, then the hosts needing
    attention in the characters the summary leaves."""
    environment = _environment("md")
    blocks, recipes_left_out = _recipe_blocks(report, environment)
    template = environment.get_template("fleet.md.j2")
    context = {"report": report, "recipe_blocks": blocks, "recipes_left_out": recipes_left_out,
               "rows_shown": ROWS_SHOWN, "tuned_hosts": tuned_hosts(report)}
    counts_only = replace(_attention_section(report, FOOTER_RESERVE), markdown=Markdown(""))
    summary = template.render(**context, attention=counts_only)
    if len(summary) > budget - 2 * FOOTER_RESERVE:
        # Only reports made to break it get here (hundreds of recipes, names of hundreds of characters): the
        # recipes' sections go, the fleet's headline and the hosts needing attention stay.
        context.update(recipe_blocks=[], recipes_left_out=len(report.recipes))
        summary = template.render(**context, attention=counts_only)
    attention = _attention_section(report, budget - len(summary))
    return template.render(**context, attention=attention)


def _plots_of(fleet: RecipeFleet, hosts: list[HostEntry]) -> dict[str, str | None]:
    members = [h for h in hosts if h.recipe == fleet.recipe]
    return {
        "decode": plots.decode_per_host_svg(fleet, members),
        "acceptance": plots.acceptance_curves_svg(fleet, members),
        "drift": plots.drift_effects_svg(fleet),
    }


def render_html(report: FleetReport, out_dir: Path | None = None) -> str:
    """fleet.html; host links are relative to out_dir (where fleet.html goes), or the collected layout's."""
    context = _context(report, out_dir)
    context["plots"] = {fleet.recipe: _plots_of(fleet, report.hosts) for fleet in report.recipes}
    context["tuned_hosts"] = tuned_hosts(report)
    return _environment("html").get_template("fleet.html.j2").render(**context)


# The fleet report copies what each host's report quotes of its server: a report written by an older verify, or
# on a host whose secrets this process cannot know, may hold an echoed Authorization header or a URL's password
# (b70ctl.redact). Every fleet file is written through these, and compared through them on a re-run.
def _json_text(report: FleetReport) -> str:
    return redact_credentials(report.model_dump_json(indent=2)) + "\n"


def _markdown_text(report: FleetReport) -> str:
    return without_controls(render_markdown(report))


def _html_text(report: FleetReport, out_dir: Path | None) -> str:
    return without_controls(render_html(report, out_dir))


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def previous_generation(report: FleetReport, out_dir: Path) -> datetime | None:
    """When the fleet files in out_dir are exactly what `report` would write had it been generated when they were
    (the same aggregate, only the generation time differs), that time; else None. fleet.json is compared first:
    fleet.md and fleet.html are rendered only when it matches (they also depend on the templates, and fleet.html
    on which host documents exist)."""
    existing_json = _read(out_dir / FLEET_JSON)
    if existing_json is None:
        return None
    try:
        generated_at = _GENERATED_AT.validate_python(json.loads(existing_json)["generated_at"])
    except (ValueError, TypeError, KeyError):  # not JSON, not an object, no or a bad time: not ours to keep
        return None
    previous = report.model_copy(update={"generated_at": generated_at})
    if _json_text(previous) != existing_json:
        return None
    renderers: tuple[tuple[str, Callable[[], str]], ...] = ((FLEET_MD, lambda: _markdown_text(previous)),
                                                           (FLEET_HTML, lambda: _html_text(previous, out_dir)))
    for name, render in renderers:
        existing = _read(out_dir / name)
        if existing is None or existing != render():
            return None
    return generated_at


class FleetFiles(dict[str, Path]):
    """The fleet files' paths by name, and whether this run wrote them (False: left as an earlier run wrote them)."""

    def __init__(self, paths: dict[str, Path], written: bool):
        super().__init__(paths)
        self.written = written


def write_fleet_report(report: FleetReport, out_dir: Path) -> FleetFiles:
    """fleet.json, fleet.md and fleet.html in out_dir; returns their paths by name.

    A re-run over unchanged host reports leaves the three files untouched (the play that runs it reports no
    change, and it makes none): `report` takes the files' generation time and stderr says "fleet report
    unchanged". Otherwise all three are rendered before any is written, then each replaced atomically."""
    paths = {name: out_dir / name for name in (FLEET_JSON, FLEET_MD, FLEET_HTML)}
    with cyclic_gc_paused():
        generated_at = previous_generation(report, out_dir)
        if generated_at is not None:
            report.generated_at = generated_at
            sys.stderr.write(f"fleet report unchanged: {out_dir} left as generated at "
                             f"{generated_at:%Y-%m-%d %H:%M:%S %Z}\n")
            return FleetFiles(paths, written=False)
        texts = {FLEET_JSON: _json_text(report), FLEET_MD: _markdown_text(report),
                 FLEET_HTML: _html_text(report, out_dir)}
        for name, text in texts.items():
            write_text_atomically(paths[name], text)
    return FleetFiles(paths, written=True)


def tuned_hosts(report: FleetReport) -> list[HostEntry]:
    """Hosts with a tune report, the largest gain over the recipe's default first (no figure last)."""
    tuned = [entry for entry in report.hosts if entry.tune is not None]
    def order(entry: HostEntry) -> tuple[bool, float, str]:
        gain = entry.tune.gain if entry.tune is not None else None
        return gain is None, -(gain or 0.0), entry.host
    return sorted(tuned, key=order)
