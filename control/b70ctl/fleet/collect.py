"""The fleet's one pass over its inputs: each host's report read, upgraded and reduced to a small HostEntry, then
dropped, so memory holds the entries only (thousands of hosts). Its facts, its unreachable marker and its tune are
attached to the entry; what cannot be read becomes an input problem, never an exception. fleet/analysis.py works
on what this returns, without I/O.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from b70ctl.errors import BadInput
from b70ctl.files import parse_json, read_bounded
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
    HostEntry,
    InputProblem,
)
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
