"""Aggregate per-host reports into one FleetReport.

I/O happens once per host at the start (`collect_hosts`): each report is read, upgraded, reduced to a HostEntry
and dropped, so memory holds the small entries only. Everything after that is pure and linear in the number of
hosts (plus sorting for medians): grouping by recipe, claim counts from the hosts' own verdicts, distributions,
robust z-score outliers, drift against the fleet's most common values and the fingerprint groups.
"""

from __future__ import annotations

import gc
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from b70ctl.report.stats import median
from b70ctl.errors import BadInput
from b70ctl.files import parse_json, read_bounded
from b70ctl.fleet import stats
from b70ctl.fleet.layout import (
    FLEET_JSON,
    HOST_FACTS_FILE,
    REPORT_FILE,
    TUNE_FILE,
    UNREACHABLE_FILE,
    read_host_facts,
    read_marker,
)
from b70ctl.fleet.model import (
    USABLE,
    DRIFT_FIELDS,
    ClaimCount,
    ClaimLine,
    DiagnosedGroup,
    DriftValue,
    EfficiencyRank,
    FieldDrift,
    FieldValueEffect,
    FingerprintGroup,
    FleetReport,
    FleetSummary,
    GroupFigure,
    HostEntry,
    InputProblem,
    Outlier,
    RecipeFleet,
    WorkloadDistribution,
    WorkloadFigures,
)
from b70ctl.recipes import load_recipe, recipe_names
from b70ctl.recipes.model import Claim, Recipe
from b70ctl.report.load import MAX_REPORT_BYTES, LoadedReport, ReportProblem, read_report
from b70ctl.report.model import Report



@dataclass(frozen=True)
class ClaimInfo:
    claim_id: str
    description: str
    metric: str
    bound: str
    source: str


@dataclass
class Collected:
    entries: list[HostEntry] = field(default_factory=list)
    problems: list[InputProblem] = field(default_factory=list)
    # Per recipe, the claims its reports gave verdicts on (first seen): the claims of a recipe b70ctl does not ship.
    report_claims: dict[str, dict[str, ClaimInfo]] = field(default_factory=dict)
    # Known failures the reports name: diagnose id -> (title, fix), as the first report gave them.
    failures: dict[str, tuple[str, str]] = field(default_factory=dict)


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Reading and rendering thousands of hosts allocates millions of objects and no reference cycles: reference
    counting frees every report as soon as its entry is built. The cyclic collector would find nothing, yet
    re-scan the growing set of live entries again and again: a quarter of the time at 5,000 hosts."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def tool_version() -> str:
    try:
        return metadata.version("b70ctl")
    except metadata.PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------------------------------------- reading


# The per-host parts of a HostEntry are passed to pydantic-core as plain dicts and validated with the entry in one
# call: at thousands of hosts that is several times cheaper than model_construct, which runs in Python per model.

_FLAT_FIGURES = {
    "decode_tok_s.median": "median_decode_tok_s",
    "peak_tok_s.max": "peak_decode_tok_s",
    "acceptance_rate": "acceptance_rate",
    "mean_acceptance_length": "mean_acceptance_length",
}


def _figures_from_measurements(report: Report) -> list[dict[str, Any]]:
    """Workload figures from the flat measurements, for a report that kept no structured throughput results."""
    by_workload: dict[str, dict[str, Any]] = {}
    for key, value in report.measurements.items():
        parts = key.split(".")
        if len(parts) < 3 or parts[0] != "throughput":
            continue
        figures = by_workload.setdefault(parts[1], {"name": parts[1]})
        metric = ".".join(parts[2:])
        if metric == "per_position_acceptance" and isinstance(value, list):
            figures["per_position_acceptance"] = [float(v) for v in value]
        elif not isinstance(value, list) and metric in _FLAT_FIGURES:
            figures[_FLAT_FIGURES[metric]] = value
    return list(by_workload.values())


def workload_figures(report: Report) -> list[dict[str, Any]]:
    """The fields of each workload's WorkloadFigures."""
    if report.throughput is None:
        return _figures_from_measurements(report)
    figures = []
    for workload in report.throughput.workloads:
        spec = workload.spec_decode
        figures.append({
            "name": workload.name,
            "median_decode_tok_s": workload.decode_tok_s.median if workload.decode_tok_s else None,
            "peak_decode_tok_s": workload.peak,
            "acceptance_rate": spec.acceptance_rate if spec else None,
            "mean_acceptance_length": spec.mean_acceptance_length if spec else None,
            "per_position_acceptance": spec.per_position_acceptance if spec else [],
            "converged": workload.converged,
            "error": workload.error,
        })
    return figures


def host_entry_from_report(host: str, loaded: LoadedReport, facts: BaseModel | None) -> HostEntry:
    report = loaded.report
    environment = report.environment
    if facts is not None:
        # The report recorded what was true while it measured; facts only fill what it did not record.
        missing = {name: value for name, value in facts.model_dump(exclude_none=True).items()
                   if getattr(environment, name) is None}
        if missing:
            environment = environment.model_copy(update=missing)
    correctness = report.correctness
    return HostEntry.model_validate({
        "host": host,
        "status": "partial" if report.partial else "verified",
        "reason": (report.partial_reason or "the report is marked partial") if report.partial else None,
        "report_path": loaded.path,
        "recipe": report.recipe,
        "report_schema_version": loaded.upgraded_from if loaded.upgraded_from is not None else report.schema_version,
        "started_at": report.started_at,
        "endpoint": report.endpoint,
        "environment": environment,  # an Environment instance: taken as it is, not validated again
        "smoke_passed": report.smoke.passed if report.smoke else None,
        "correctness_passed": correctness.passed if correctness else None,
        "correctness_identical": correctness.identical if correctness else None,
        "correctness_total": correctness.total if correctness else None,
        "workloads": workload_figures(report),
        "verdicts": [{"claim_id": v.claim_id, "verdict": v.verdict, "measured": v.measured, "reason": v.reason}
                     for v in report.verdicts],
        "diagnosed": [failure.id for failure in report.diagnosis],
        "roofline_efficiency": report.roofline.efficiency if report.roofline else None,
        "roofline_not_measured": (report.roofline.not_measured if report.roofline
                                  else "the report was written before reports had a roofline"),
    })


def _read_host(host: str, report_path: Path, facts_path: Path | None, marker_path: Path | None,
               collected: Collected) -> None:
    if marker_path is not None:
        marker = read_marker(marker_path)
        if isinstance(marker, str):
            collected.problems.append(InputProblem(kind="bad_marker", host=host, path=str(marker_path),
                                                   reason=marker, action="used"))
            reason, recipe = f"not verified (its {UNREACHABLE_FILE} is unreadable)", None
        else:
            where = f" at {marker.stage}" if marker.stage else ""
            reason, recipe = f"{marker.kind}{where}: {marker.reason}", marker.recipe
        if report_path.exists():
            collected.problems.append(InputProblem(
                kind="conflicting_markers", host=host, path=str(report_path), action="excluded",
                reason=f"{host}: both {REPORT_FILE} and {UNREACHABLE_FILE}; the report is taken as stale from an "
                       f"earlier run: the play must remove one of them"))
        collected.entries.append(HostEntry(host=host, status="unreachable", reason=reason, recipe=recipe))
        return
    if not report_path.exists():
        collected.problems.append(InputProblem(
            kind="missing_report", host=host, path=str(report_path), action="excluded",
            reason=f"{host}: neither {REPORT_FILE} nor {UNREACHABLE_FILE}: collect the report or mark the host"))
        collected.entries.append(HostEntry(host=host, status="bad_report", reason=f"no {REPORT_FILE}"))
        return
    loaded = _read_report(report_path)
    if not isinstance(loaded, LoadedReport):
        collected.problems.append(InputProblem(kind=loaded.kind, host=host, path=loaded.path,
                                               reason=loaded.reason, action="excluded"))
        collected.entries.append(HostEntry(host=host, status="bad_report", reason=loaded.kind.replace("_", " "),
                                           report_path=loaded.path))
        return
    facts = None
    if facts_path is not None:
        read = read_host_facts(facts_path)
        if isinstance(read, str):
            collected.problems.append(InputProblem(kind="bad_host_facts", host=host, path=str(facts_path),
                                                   reason=read, action="excluded"))
        else:
            facts = read
    collected.entries.append(host_entry_from_report(host, loaded, facts))
    for failure in loaded.report.diagnosis:
        collected.failures.setdefault(failure.id, (failure.title, failure.fix))
    claims = collected.report_claims.setdefault(loaded.report.recipe, {})
    for verdict in loaded.report.verdicts:
        if verdict.claim_id not in claims:
            claims[verdict.claim_id] = ClaimInfo(verdict.claim_id, verdict.description, verdict.metric,
                                                 verdict.bound, verdict.source)


def _read_report(path: Path) -> LoadedReport | ReportProblem:
    """read_report, with a key given twice in one object refused as every other JSON reader of b70ctl refuses it
    (files.parse_json). read_report's fast path, pydantic-core parsing and validating the bytes in one pass, keeps
    the last of the two silently, so a host's report could say one thing to the fleet and another to whoever reads
    it next. The check parses the file a second time, with the standard library: about 0.3 ms for a 34 KiB report,
    1.5 CPU-s over 5,000 hosts. A report upgraded from an older schema went through parse_json already."""
    loaded = read_report(path)
    if not isinstance(loaded, LoadedReport) or loaded.upgraded_from is not None:
        return loaded
    name = loaded.path
    try:
        parse_json(read_bounded(path, MAX_REPORT_BYTES, name, "collect the report again").decode("utf-8"), name,
                   "not a report: collect the report again")
    except BadInput as error:
        return ReportProblem("corrupt", name, str(error))
    except (OSError, ValueError) as error:  # replaced since it was read, or JSON only pydantic-core reads
        return ReportProblem("corrupt", name, f"{name}: changed while it was read, or JSON that only some readers "
                                              f"take ({error.__class__.__name__}): collect the report again")
    return loaded


def _decodable(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def collect_directory(reports_dir: Path) -> Collected:
    """Every host directory under REPORTS_DIR (layout in fleet/layout.py), in host-name order."""
    if not reports_dir.is_dir():
        raise BadInput(f"reports directory {reports_dir} does not exist: give the directory the verify play "
                       "collected into (REPORTS_DIR/<host>/report.json)")
    try:
        with os.scandir(reports_dir) as scan:
            host_dirs = sorted(entry.name for entry in scan if entry.is_dir() and not entry.name.startswith("."))
    except OSError as error:
        raise BadInput(f"reports directory {reports_dir}: cannot list it ({error.strerror}): check its "
                       "permissions") from error
    # A fleet report written into REPORTS_DIR (--out REPORTS_DIR/fleet) is not a host.
    host_dirs = [name for name in host_dirs if not (reports_dir / name / FLEET_JSON).exists()
                 or (reports_dir / name / REPORT_FILE).exists()]
    if not host_dirs:
        raise BadInput(f"reports directory {reports_dir} has no host directories: expected "
                       f"{reports_dir}/<host>/{REPORT_FILE} (or {UNREACHABLE_FILE})")
    collected = Collected()
    for host in host_dirs:
        directory = reports_dir / host
        if not _decodable(host):
            # A name that is not UTF-8 cannot be written into fleet.json or fleet.md: it is named, escaped.
            shown = host.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            collected.problems.append(InputProblem(
                kind="unreadable", host=shown, path=str(reports_dir / shown), action="excluded",
                reason=f"{reports_dir / shown}: the host directory's name is not UTF-8: rename it to the host's "
                       "inventory name"))
            collected.entries.append(HostEntry(host=shown, status="bad_report", reason="name not UTF-8"))
            continue
        if not os.access(directory, os.R_OK | os.X_OK):
            collected.problems.append(InputProblem(
                kind="unreadable", host=host, path=str(directory), action="excluded",
                reason=f"{directory}: cannot read it (permission denied): check its permissions"))
            collected.entries.append(HostEntry(host=host, status="bad_report", reason="unreadable"))
            continue
        facts, marker = directory / HOST_FACTS_FILE, directory / UNREACHABLE_FILE
        _read_host(host, directory / REPORT_FILE, facts if facts.is_file() else None,
                   marker if marker.is_file() else None, collected)
        if (directory / TUNE_FILE).is_file():
            attach_tune(collected, host, directory / TUNE_FILE)
    return collected


def collect_files(report_paths: Sequence[Path]) -> Collected:
    """Report files given one by one; each host is named by the directory holding its report."""
    if not report_paths:
        raise BadInput("no report files given: pass REPORTS_DIR or report.json paths")
    collected = Collected()
    for path in report_paths:
        facts = path.parent / HOST_FACTS_FILE
        _read_host(path.parent.name or str(path), path, facts if facts.is_file() else None, None, collected)
    return collected


# ------------------------------------------------------------------------------------------------ duplicates


def _started(entry: HostEntry) -> datetime:
    """Comparable start time: a report without a time zone is taken as UTC (verify writes UTC)."""
    started = entry.started_at or datetime.min
    return started.replace(tzinfo=UTC) if started.tzinfo is None else started


def _mark_duplicates(entries: list[HostEntry], problems: list[InputProblem]) -> None:
    """Two usable reports that name the same machine (the hostname it reported, else its directory name): keep
    the newer one (later started_at; on a tie the first path) and exclude the other, naming both."""
    kept_by_identity: dict[str, HostEntry] = {}
    for entry in entries:
        if entry.status not in USABLE:
            continue
        identity = entry.environment.hostname or entry.host
        kept = kept_by_identity.get(identity)
        if kept is None:
            kept_by_identity[identity] = entry
            continue
        newer, older = (entry, kept) if _started(entry) > _started(kept) else (kept, entry)
        kept_by_identity[identity] = newer
        older.status = "duplicate"
        older.reason = f"same host {identity!r} as {newer.report_path}, which is newer and was kept"
        problems.append(InputProblem(
            kind="duplicate_host", host=older.host, path=older.report_path or older.host, action="excluded",
            reason=f"two reports for host {identity!r}: {newer.report_path} (kept, started "
                   f"{newer.started_at}) and {older.report_path} (excluded, started {older.started_at}): "
                   "remove the stale one"))


# ------------------------------------------------------------------------------------------------ per recipe


def _claim_bound(claim: Claim) -> str:
    tolerance = claim.tolerance
    slack = []
    if tolerance.relative:
        slack.append(f"±{tolerance.relative:.0%}")
    if tolerance.absolute:
        slack.append(f"±{tolerance.absolute:g}")
    suffix = f" ({' or '.join(slack)})" if slack else ""
    if claim.op == "between":
        return f"{claim.low:g} .. {claim.high:g}{suffix}"
    if claim.op == "per_position":
        return "per position " + " ".join(f"{v:.2f}" for v in claim.values or []) + suffix
    return f"{claim.op} {claim.value:g}{suffix}"


def claim_line(claim: Claim) -> ClaimLine:
    line = ClaimLine(claim_id=claim.id, metric=claim.metric, op=claim.op, value=claim.value, low=claim.low,
                     high=claim.high, values=claim.values)
    if claim.op == ">=" and claim.value is not None:
        line.lower_with_tolerance = claim.value - claim.tolerance.slack(claim.value)
    elif claim.op == "<=" and claim.value is not None:
        line.upper_with_tolerance = claim.value + claim.tolerance.slack(claim.value)
    elif claim.op == "between" and claim.low is not None and claim.high is not None:
        line.lower_with_tolerance = claim.low - claim.tolerance.slack(claim.low)
        line.upper_with_tolerance = claim.high + claim.tolerance.slack(claim.high)
    return line


def _claims_of(recipe: Recipe | None, entries: Iterable[HostEntry], report_claims: dict[str, ClaimInfo]
               ) -> list[ClaimInfo]:
    if recipe is not None:
        return [ClaimInfo(c.id, c.description, c.metric if c.divided_by is None else f"{c.metric} / {c.divided_by}",
                          _claim_bound(c), c.source) for c in recipe.claims]
    # A recipe b70ctl does not ship: the claims are those the hosts' reports gave verdicts on.
    ordered: dict[str, ClaimInfo] = {}
    for entry in entries:
        for verdict in entry.verdicts:
            if verdict.claim_id not in ordered and verdict.claim_id in report_claims:
                ordered[verdict.claim_id] = report_claims[verdict.claim_id]
    return list(ordered.values())


def _count_claims(claims: list[ClaimInfo], usable: list[HostEntry]) -> list[ClaimCount]:
    counts = []
    verdict_maps = [(entry.host, {v.claim_id: v.verdict for v in entry.verdicts}) for entry in usable]
    for claim in claims:
        met, not_met, not_measured = 0, [], []
        for host, verdicts in verdict_maps:
            verdict = verdicts.get(claim.claim_id, "not_measured")
            if verdict == "met":
                met += 1
            elif verdict == "not_met":
                not_met.append(host)
            else:
                not_measured.append(host)
        counts.append(ClaimCount(claim_id=claim.claim_id, description=claim.description, metric=claim.metric,
                                 bound=claim.bound, source=claim.source, met=met, not_met=len(not_met),
                                 not_measured=len(not_measured), hosts_not_met=not_met,
                                 hosts_not_measured=not_measured))
    return counts


def _workload_names(recipe: Recipe | None, usable: list[HostEntry]) -> list[str]:
    names: dict[str, None] = {w.name: None for w in recipe.workloads} if recipe is not None else {}
    for entry in usable:
        for figures in entry.workloads:
            names.setdefault(figures.name, None)
    return list(names)


@dataclass
class _Columns:
    """What the statistics of one recipe read from its usable hosts, taken from each host once: host i of
    `usable` is row i of every column. Groups of hosts are lists of row numbers."""

    usable: list[HostEntry]
    fingerprints: list[tuple[str | None, ...]]  # values of DRIFT_FIELDS, as text
    figures: dict[str, list[WorkloadFigures | None]]  # per workload
    decode: dict[str, list[float | None]]  # per workload: the median decode tok/s


def fingerprint_value(entry: HostEntry, name: str) -> str | None:
    value = getattr(entry.environment, name)
    return None if value is None else str(value)


def _columns(usable: list[HostEntry], workloads: list[str]) -> _Columns:
    fingerprints = [tuple(fingerprint_value(entry, name) for name in DRIFT_FIELDS) for entry in usable]
    by_name = [{figures.name: figures for figures in entry.workloads} for entry in usable]
    figures = {name: [host.get(name) for host in by_name] for name in workloads}
    decode = {name: [f.median_decode_tok_s if f is not None else None for f in column]
              for name, column in figures.items()}
    return _Columns(usable, fingerprints, figures, decode)


def _per_position_median(curves: list[list[float]]) -> list[float]:
    if not curves:
        return []
    length = max(len(curve) for curve in curves)
    return [median([c[p] for c in curves if len(c) > p]) for p in range(length)]


def _workload_distributions(names: list[str], recipe: Recipe | None, columns: _Columns
                            ) -> list[WorkloadDistribution]:
    distributions = []
    for name in names:
        figures = [f for f in columns.figures[name] if f is not None]
        decode = [f.median_decode_tok_s for f in figures if f.median_decode_tok_s is not None]
        # A ratio claim is not a line on a tok/s axis.
        lines = [claim_line(c) for c in recipe.claims
                 if c.metric.startswith(f"throughput.{name}.") and c.divided_by is None] \
            if recipe is not None else []
        distributions.append(WorkloadDistribution(
            workload=name,
            hosts_measured=len(decode),
            median_decode_tok_s=stats.distribution(decode),
            peak_decode_tok_s=stats.distribution([f.peak_decode_tok_s for f in figures
                                                  if f.peak_decode_tok_s is not None]),
            acceptance_rate=stats.distribution([f.acceptance_rate for f in figures if f.acceptance_rate is not None]),
            per_position_acceptance_median=_per_position_median([f.per_position_acceptance for f in figures
                                                                 if f.per_position_acceptance]),
            claims=lines,
        ))
    return distributions


def _drift(columns: _Columns) -> tuple[list[FieldDrift], dict[str, str | None]]:
    """Fields with more than one known value across the recipe's hosts, and each field's most common value."""
    drifts, majority_of = [], {}
    usable = columns.usable
    for index, name in enumerate(DRIFT_FIELDS):
        values = [fingerprint[index] for fingerprint in columns.fingerprints]
        counts = Counter(value for value in values if value is not None)
        majority = stats.plurality(counts)
        majority_of[name] = majority
        if len(counts) < 2:
            continue
        unknown = [entry.host for entry, value in zip(usable, values, strict=True) if value is None]
        drifting = []
        if majority is not None:
            for entry, value in zip(usable, values, strict=True):
                if value is not None and value != majority:
                    drifting.append(entry.host)
                    entry.drift_fields.append(name)
        drifts.append(FieldDrift(field=name, majority_value=majority,
                                 values=[DriftValue(value=v, hosts=n) for v, n in counts.most_common()],
                                 drifting_hosts=drifting, unknown_hosts=unknown))
    return drifts, majority_of


def _group_figures(members: list[int], workloads: list[str], columns: _Columns,
                   reference: dict[str, float | None]) -> list[GroupFigure]:
    figures = []
    for name in workloads:
        decode = columns.decode[name]
        values = [value for value in (decode[row] for row in members) if value is not None]
        group_median = median(values) if values else None
        base = reference.get(name)
        relative = group_median / base - 1 if group_median is not None and base else None
        figures.append(GroupFigure(workload=name, hosts_measured=len(values), median_decode_tok_s=group_median,
                                   relative_to_reference=relative))
    return figures


def _group_medians(members: list[int], workloads: list[str], columns: _Columns) -> dict[str, float | None]:
    return {g.workload: g.median_decode_tok_s for g in _group_figures(members, workloads, columns, {})}


def _field_effects(drifts: list[FieldDrift], columns: _Columns, workloads: list[str]) -> list[FieldValueEffect]:
    effects = []
    for drift in drifts:
        index = DRIFT_FIELDS.index(drift.field)
        groups: dict[str, list[int]] = defaultdict(list)
        for row, fingerprint in enumerate(columns.fingerprints):
            value = fingerprint[index]
            if value is not None:  # hosts that do not record the field say nothing about its effect
                groups[value].append(row)
        reference_value = drift.majority_value if drift.majority_value is not None else max(
            groups, key=lambda value: len(groups[value]))
        reference = _group_medians(groups[reference_value], workloads, columns)
        for value, members in sorted(groups.items(), key=lambda item: (-len(item[1]), str(item[0]))):
            effects.append(FieldValueEffect(field=drift.field, value=value, hosts=len(members),
                                            is_majority=value == drift.majority_value,
                                            figures=_group_figures(members, workloads, columns, reference)))
    return effects


def _fingerprint_groups(columns: _Columns, majority_of: dict[str, str | None], workloads: list[str]
                        ) -> list[FingerprintGroup]:
    groups: dict[tuple[str | None, ...], list[int]] = defaultdict(list)
    for row, fingerprint in enumerate(columns.fingerprints):
        groups[fingerprint].append(row)
    majority_key = tuple(majority_of[name] for name in DRIFT_FIELDS)
    reference_key = majority_key if majority_key in groups else max(groups, key=lambda key: len(groups[key]))
    reference = _group_medians(groups[reference_key], workloads, columns)
    result = []
    for key, members in sorted(groups.items(), key=lambda item: (-len(item[1]), [str(v) for v in item[0]])):
        differs = [name for name, value in zip(DRIFT_FIELDS, key, strict=True)
                   if value is not None and majority_of[name] is not None and value != majority_of[name]]
        result.append(FingerprintGroup(fingerprint=dict(zip(DRIFT_FIELDS, key, strict=True)),
                                       differs_from_majority=differs,
                                       hosts=[columns.usable[row].host for row in members],
                                       figures=_group_figures(members, workloads, columns, reference)))
    return result


def _outliers(workloads: list[str], columns: _Columns) -> list[Outlier]:
    outliers = []
    for name in workloads:
        measured = [(entry, value) for entry, value in zip(columns.usable, columns.decode[name], strict=True)
                    if value is not None]
        values = [value for _, value in measured]
        scores = stats.robust_z_scores(values)
        if scores is None:
            continue
        center = median(values)
        for (entry, value), score in zip(measured, scores, strict=True):
            if abs(score) > stats.OUTLIER_THRESHOLD:
                entry.outlier_workloads.append(name)
                outliers.append(Outlier(host=entry.host, workload=name, median_decode_tok_s=value,
                                        fleet_median_decode_tok_s=center, robust_z=score,
                                        direction="slow" if score < 0 else "fast",
                                        explained_by=list(entry.drift_fields)))
    return outliers


def _known_recipe(name: str, shipped: set[str]) -> Recipe | None:
    if name not in shipped:
        return None
    try:
        return load_recipe(name)
    except BadInput:
        return None


def _recipe_fleet(name: str, members: list[HostEntry], shipped: set[str], report_claims: dict[str, ClaimInfo]
                  ) -> RecipeFleet:
    recipe = _known_recipe(name, shipped)
    usable = [entry for entry in members if entry.status in USABLE]
    claims = _claims_of(recipe, usable, report_claims)
    claim_ids = [claim.claim_id for claim in claims]
    for entry in usable:
        verdicts = {v.claim_id: v.verdict for v in entry.verdicts}
        entry.all_claims_met = entry.status == "verified" and all(verdicts.get(c) == "met" for c in claim_ids)
    workloads = _workload_names(recipe, usable)
    columns = _columns(usable, workloads)
    drifts, majority_of = _drift(columns)
    outliers = _outliers(workloads, columns)
    return RecipeFleet(
        recipe=name,
        recipe_known=recipe is not None,
        hosts=len(members),
        hosts_verified=sum(1 for entry in members if entry.status == "verified"),
        hosts_all_claims_met=sum(1 for entry in usable if entry.all_claims_met),
        hosts_unverified=[entry.host for entry in members if entry.status != "verified"],
        claims=_count_claims(claims, usable),
        workloads=_workload_distributions(workloads, recipe, columns),
        outliers=outliers,
        drift=drifts,
        field_effects=_field_effects(drifts, columns, workloads),
        fingerprint_groups=_fingerprint_groups(columns, majority_of, workloads) if usable else [],
        efficiency_ranking=efficiency_ranking(usable),
        hosts_without_efficiency=[entry.host for entry in usable if entry.roofline_efficiency is None],
    )


def efficiency_ranking(usable: list[HostEntry]) -> list[EfficiencyRank]:
    """Hosts by their measured decode rate as a fraction of their own memory-bandwidth bound, highest first (by
    name among equals)."""
    measured = sorted(((entry.roofline_efficiency, entry.host) for entry in usable
                       if entry.roofline_efficiency is not None), key=lambda item: (-item[0], item[1]))
    return [EfficiencyRank(rank=index, host=host, efficiency=efficiency)
            for index, (efficiency, host) in enumerate(measured, start=1)]


def diagnosed_groups(entries: Iterable[HostEntry], failures: dict[str, tuple[str, str]]) -> list[DiagnosedGroup]:
    """Hosts grouped by the known failure their reports name, the largest group first."""
    hosts: dict[str, list[str]] = {}
    for entry in entries:
        for failure_id in entry.diagnosed:
            hosts.setdefault(failure_id, []).append(entry.host)
    return [DiagnosedGroup(id=failure_id, title=failures.get(failure_id, (failure_id, ""))[0],
                           fix=failures.get(failure_id, ("", "see b70ctl diagnose"))[1], hosts=sorted(members))
            for failure_id, members in sorted(hosts.items(), key=lambda item: (-len(item[1]), item[0]))]


def build_fleet_report(collected: Collected, source: str, *, generated_at: datetime | None = None
                       ) -> FleetReport:
    """Pure: the fleet report of already collected host entries."""
    entries, problems = collected.entries, list(collected.problems)
    _mark_duplicates(entries, problems)
    by_recipe: dict[str, list[HostEntry]] = defaultdict(list)
    without_recipe = []
    for entry in entries:
        if entry.recipe is None or entry.status == "duplicate":
            without_recipe.append(entry)
        else:
            by_recipe[entry.recipe].append(entry)
    if len(by_recipe) == 1:
        # One recipe: hosts whose report could not tell theirs belong to it (and count against it).
        only = next(iter(by_recipe.values()))
        only.extend(entry for entry in without_recipe if entry.status != "duplicate")
    elif len(by_recipe) > 1:
        sizes = ", ".join(f"{name} ({len(members)} hosts)" for name, members in sorted(by_recipe.items()))
        problems.append(InputProblem(kind="mixed_recipes", host=None, path=source, action="grouped",
                                     reason=f"{len(by_recipe)} recipes in one fleet: {sizes}: each is "
                                            "aggregated against its own claims"))
    shipped = set(recipe_names())
    recipes = [_recipe_fleet(name, members, shipped, collected.report_claims.get(name, {}))
               for name, members in sorted(by_recipe.items())]
    status_counts = Counter(entry.status for entry in entries)
    summary = FleetSummary(
        hosts=len(entries) - status_counts["duplicate"],
        verified=status_counts["verified"],
        partial=status_counts["partial"],
        unreachable=status_counts["unreachable"],
        bad_report=status_counts["bad_report"],
        duplicate=status_counts["duplicate"],
        all_claims_met=sum(1 for entry in entries if entry.all_claims_met),
        recipes=sorted(by_recipe),
        drifting_hosts=sum(1 for entry in entries if entry.drift_fields),
        outliers=sum(1 for entry in entries if entry.outlier_workloads),
        problems=len(problems),
        emulated=sum(1 for entry in entries if entry.status != "duplicate" and entry.environment.hardware_root),
    )
    failing_problems = [p for p in problems if p.action != "grouped"]
    all_met = (summary.hosts > 0 and summary.all_claims_met == summary.hosts and not failing_problems)
    return FleetReport(
        tool_version=tool_version(),
        generated_at=generated_at or datetime.now(UTC),
        source=source,
        all_met=all_met,
        summary=summary,
        recipes=recipes,
        hosts=entries,
        problems=problems,
        diagnosed=diagnosed_groups(entries, collected.failures),
        outlier_threshold=stats.OUTLIER_THRESHOLD,
    )


def aggregate(source: Path | str | Sequence[Path | str], *, generated_at: datetime | None = None) -> FleetReport:
    """The fleet report of REPORTS_DIR (one directory per host) or of a list of report.json files."""
    with cyclic_gc_paused():
        if isinstance(source, (str, Path)):
            reports_dir = Path(source)
            collected = collect_directory(reports_dir)
            label = str(reports_dir)
        else:
            paths = [Path(p) for p in source]
            collected = collect_files(paths)
            label = f"{len(paths)} report files"
        return build_fleet_report(collected, label, generated_at=generated_at)


def attach_tune(collected: Collected, host: str, path: Path) -> None:
    """The host's tune, tuned against default, on its entry (the last one collected)."""
    from b70ctl.fleet.layout import read_tune
    from b70ctl.fleet.model import HostTune

    tune = read_tune(path)
    if isinstance(tune, str):
        collected.problems.append(InputProblem(kind="invalid", host=host, path=str(path), reason=tune,
                                               action="excluded"))
        return
    final = tune.final
    default = final.default.score_tok_s if final is not None and final.default is not None else None
    winner = final.winner.score_tok_s if final is not None else None
    served = winner if tune.outcome == "tuned" else default
    collected.entries[-1].tune = HostTune(
        outcome=tune.outcome, overrides=tune.tuned_overrides, tuned_score_tok_s=served,
        default_score_tok_s=default,
        gain=served / default - 1 if served is not None and default else None,
        spent_requests=tune.spent_requests, budget_requests=tune.budget_requests, finished_at=tune.finished_at,
        summary=tune.summary)
