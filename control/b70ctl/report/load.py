"""Reading report.json files written by any version of `b70ctl verify`.

`read_report` never raises: a file that cannot be used comes back as a `ReportProblem` whose kind and reason say
why (empty, truncated, corrupt, unknown schema version, invalid), so a fleet of thousands of reports can be
aggregated past a few bad ones. `load_report` is the one-report form: it returns the `Report` or raises
`ReportUnusable` (a BadInput, exit 2) carrying that same problem.

Schema versions
- 0: the first report layout. No `schema_version` key (or 0). What the endpoint told about itself sat at the top
  level (`vllm_version`, `served_model`); there was no `environment`, no flat `measurements`, no `partial`
  marking, no `baseline`. Spec-decode stats had no `per_position_acceptance` and no pollution flag, and claim
  verdicts had no `bound` and no `source`.
- 1: every figure as the client saw the stream arrive; no engine timing, no delivery check.
- 2: figures on the engine's clock where the server timed the request, the client's beside them as `client_*`,
  each request's delivery checked.
- 3: the environment says whether the hardware was emulated (`hardware_root`, the root prefix the GPU facts
  were read under when not /).
- 4: the current `Report` (report/model.py): the decode rates against the memory-bandwidth bound (`roofline`),
  and the environment's inputs to it (`memory_bandwidth`, `target_shape`).
Upgrading 3 -> 4 adds nothing: a schema 3 report did not record those inputs, so its roofline stays unknown
(None) rather than computed from figures the host gave no one.
Upgrading 2 -> 3 adds nothing: a schema 2 report did not record emulation, and its `hardware_root` stays unknown
(None), as on a report of real hardware.
Upgrading 1 -> 2 keeps every figure and names it for what it was: the client's (`timing_source: client`,
`client_*` filled, delivery "unchecked", a timing note saying so).
Upgrading 0 -> 1 moves the top-level fields into `environment`, rebuilds `measurements` from the structured
results (with verify's own functions: the keys claims refer to) and fills what schema 0 never recorded with an
explicit "not recorded".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from b70ctl.errors import BadInput, first_problem
from b70ctl.files import parse_json, read_bounded
from b70ctl.report.measurements import measurements_of
from b70ctl.report.model import REPORT_SCHEMA_VERSION, Report

ProblemKind = Literal["unreadable", "empty", "truncated", "corrupt", "unknown_schema_version", "invalid"]

NOT_RECORDED_IN_SCHEMA_0 = "not recorded (schema 0 report)"
# Most bytes of a report.json read: verify keeps each request's raw data in raw/, so a report is tens of KiB (a few
# hundred with every check and a baseline). 64 MiB is far past any report and bounds what one host's file costs a
# fleet report of thousands (parsing takes several times a file's size, and the report is copied into fleet.json).
MAX_REPORT_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ReportProblem:
    """Why a report file cannot be used. `reason` is one line that names the file's problem and the fix."""

    kind: ProblemKind
    path: str
    reason: str


@dataclass(frozen=True)
class LoadedReport:
    report: Report
    path: str
    upgraded_from: int | None = None


class ReportUnusable(BadInput):
    def __init__(self, problem: ReportProblem) -> None:
        super().__init__(problem.reason)
        self.problem = problem


def _upgrade_0_to_1(data: dict[str, Any]) -> dict[str, Any]:
    upgraded = dict(data)
    upgraded["schema_version"] = 1
    environment: dict[str, Any] = {}
    for key in ("vllm_version", "served_model", "hostname"):
        if key in upgraded:
            environment[key] = upgraded.pop(key)
    upgraded["environment"] = environment
    throughput = upgraded.get("throughput")
    if isinstance(throughput, dict):
        for workload in throughput.get("workloads") or []:
            spec = workload.get("spec_decode") if isinstance(workload, dict) else None
            if isinstance(spec, dict):
                spec.setdefault("per_position_acceptance", [])
    for verdict in upgraded.get("verdicts") or []:
        if isinstance(verdict, dict):
            verdict.setdefault("bound", NOT_RECORDED_IN_SCHEMA_0)
            verdict.setdefault("source", NOT_RECORDED_IN_SCHEMA_0)
    upgraded["measurements"] = {}  # rebuilt from the validated results by read_report
    return upgraded


NOT_TIMED_IN_SCHEMA_1 = "schema 1 report: timed by the client only, delivery not checked against the engine"


def _upgrade_1_to_2(data: dict[str, Any]) -> dict[str, Any]:
    upgraded = dict(data)
    upgraded["schema_version"] = 2
    throughput = upgraded.get("throughput")
    if isinstance(throughput, dict):
        for workload in throughput.get("workloads") or []:
            if not isinstance(workload, dict):
                continue
            workload["timing_source"] = "client"
            workload["client_decode_tok_s"] = workload.get("decode_tok_s")
            if workload.get("requests"):
                workload["timing_note"] = NOT_TIMED_IN_SCHEMA_1
            for sample in workload.get("requests") or []:
                if isinstance(sample, dict):
                    sample["timing_source"] = "client"
                    sample["client_decode_tok_s"] = sample.get("decode_tok_s")
                    sample["client_peak_tok_s"] = sample.get("peak_tok_s")
                    sample["client_ttft_s"] = sample.get("ttft_s")
    return upgraded


def _upgrade_2_to_3(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "schema_version": 3}


def _upgrade_3_to_4(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "schema_version": 4}


def report_schema_version(data: dict[str, Any]) -> int | None:
    """The schema version a report declares; schema 0 had no key. None when the value is not an integer."""
    version = data.get("schema_version", 0)
    if not isinstance(version, int):  # a JSON true passes, as the Report model's Literal[1] lets it
        return None
    return version


def upgrade_report_json(data: dict[str, Any]) -> dict[str, Any]:
    """A report's JSON object of any known schema version, upgraded to the current one. Raises ValueError for a
    version this b70ctl does not know (a newer one: upgrade b70ctl, never guess)."""
    version = report_schema_version(data)
    if version is None:
        raise ValueError(f"schema_version {data.get('schema_version')!r} is not an integer")
    if version > REPORT_SCHEMA_VERSION or version < 0:
        raise ValueError(
            f"schema_version {version} is unknown to this b70ctl (it reads 0..{REPORT_SCHEMA_VERSION}): "
            "aggregate with the b70ctl that wrote it, or upgrade b70ctl"
        )
    if version == 0:
        data = _upgrade_0_to_1(data)
    if version <= 1:
        data = _upgrade_1_to_2(data)
    if version <= 2:
        data = _upgrade_2_to_3(data)
    if version <= 3:
        data = _upgrade_3_to_4(data)
    return data


def _cut_short(text: str, error: json.JSONDecodeError) -> bool:
    """True when the JSON text is a prefix of a document: it ends inside a string, a number or a literal, or
    the parser ran out of text where it expected more."""
    if error.pos >= len(text.rstrip()) or error.msg.startswith("Unterminated string"):
        return True
    remainder = text[error.pos:].rstrip()
    if error.msg.startswith("Invalid \\uXXXX escape"):
        return len(remainder) < 6
    # A token cut mid-way ("tru", "12e", "-"): no structure or whitespace after the point of error.
    return len(remainder) <= 24 and not any(c in remainder for c in ',:[]{}" \t\r\n')


def _decode_problem(path: str, text: str, error: json.JSONDecodeError) -> ReportProblem:
    # A JSON error at the very end of the text means the writer stopped mid-file (copy cut short, disk full):
    # "truncated" tells the user to collect it again rather than to look for a bug in verify.
    if _cut_short(text, error):
        return ReportProblem("truncated", path, f"{path}: truncated JSON (ends after {len(text)} bytes): "
                                                "collect the report again")
    return ReportProblem("corrupt", path, f"{path}: not valid JSON (line {error.lineno} column {error.colno}: "
                                          f"{error.msg}): collect the report again")


def read_report(path: Path | str) -> LoadedReport | ReportProblem:
    """One report file, upgraded to the current schema, or the reason it cannot be used. Never raises."""
    name = str(path)
    try:
        raw = read_bounded(path, MAX_REPORT_BYTES, name, "collect the report again (report.json only, not raw/)")
    except BadInput as error:
        return ReportProblem("unreadable", name, str(error))
    except OSError as error:
        return ReportProblem("unreadable", name, f"{name}: cannot read ({error.strerror}): check the path and "
                                                 "its permissions")
    if not raw.strip():
        return ReportProblem("empty", name, f"{name}: empty file: collect the report again")
    try:
        # The common case, a current report, parsed and validated in one pass by pydantic-core (several times
        # faster than json.loads + validation: it matters for thousands of hosts). Anything else falls through
        # to the step-by-step (and lax) path below, which upgrades it or says what is wrong.
        return LoadedReport(report=Report.model_validate_json(raw, strict=True), path=name)
    except ValidationError:
        pass
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return ReportProblem("corrupt", name, f"{name}: not UTF-8 text (byte {error.start}): collect the "
                                              "report again")
    try:
        data = parse_json(text, name, "not a report: collect the report again")
    except json.JSONDecodeError as error:
        return _decode_problem(name, text, error)
    except BadInput as error:
        return ReportProblem("corrupt", name, str(error))
    if not isinstance(data, dict):
        return ReportProblem("corrupt", name, f"{name}: top level is a JSON {type(data).__name__}, a report is "
                                              "an object")
    version = report_schema_version(data)
    try:
        upgraded = upgrade_report_json(data)
    except ValueError as error:
        return ReportProblem("unknown_schema_version", name, f"{name}: {error}")
    except (TypeError, KeyError, AttributeError) as error:
        # Upgrading walks the old layout; a file of the right version but the wrong shape lands here.
        return ReportProblem("invalid", name, f"{name}: not a schema {version} report ({error!r})")
    try:
        report = Report.model_validate(upgraded)
    except ValidationError as error:
        return ReportProblem("invalid", name, f"{name}: not a valid schema {version} report: "
                                              f"{first_problem(error)}")
    if version == 0:
        report.measurements = measurements_of(report)
    return LoadedReport(report=report, path=name, upgraded_from=version if version != REPORT_SCHEMA_VERSION
                        else None)


def load_report(path: Path | str) -> Report:
    """One report file, upgraded to the current schema. Raises ReportUnusable (exit 2) with the reason."""
    result = read_report(path)
    if isinstance(result, ReportProblem):
        raise ReportUnusable(result)
    return result.report
