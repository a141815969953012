"""`b70ctl verify`: smoke, greedy correctness (with the gate against silent garbage) and throughput against one
endpoint, judged against the recipe.

The report is rewritten after every check, marked partial until the last one finished, so an interrupted or
failing run still leaves what it measured (report.json, report.md, report.html, raw/) and says where it stopped.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from pydantic import ValidationError

from b70ctl import __version__
from b70ctl.checks.client import Endpoint, EndpointError, RunDeadlineExceeded, VllmClient
from b70ctl.checks.correctness import (
    Reference,
    load_reference,
    run_correctness,
    server_vllm_version,
)
from b70ctl.checks.gate import cite_correctness, run_gate
from b70ctl.checks.metrics import NUM_DRAFTS, CountersUnusable, MetricsUnavailable, snapshot
from b70ctl.checks.smoke import run_smoke
from b70ctl.checks.throughput import reject_impossible_engine_figures, run_throughput
from b70ctl.errors import B70Error, BadInput, Unreachable, first_problem
from b70ctl.files import WRITE_LIMITS, file_kind, read_json_object
from b70ctl.recipes.model import Recipe
from b70ctl.redact import printable
from b70ctl.report.measurements import measurements_of
from b70ctl.report.model import (
    HOST_FACT_FIELDS,
    CorrectnessResult,
    DiagnosedFailure,
    Environment,
    Report,
    RooflineInputs,
)
from b70ctl.report.roofline import compute_roofline
from b70ctl.report.verdict import judge_all
from b70ctl.stops import Terminated, sigterm_ends_the_run
from b70ctl.verify.run_dir import ReportWriter, RunDirectory

Progress = Callable[[str], None]

ROOFLINE_FIX = "pass the JSON b70host/roofline_inputs.py printed on the serving host"


@dataclass
class VerifyRequest:
    recipe: Recipe
    endpoint: Endpoint
    out_dir: Path
    baseline_endpoint: Endpoint | None = None
    reference_path: Path | None = None
    host_facts_path: Path | None = None
    host: str | None = None  # the verified host's name, when no host facts give it
    # The served target's directory when the server runs on this machine (the embedded default): verify then
    # reads the target's shape there and, for a CPU recipe, measures this machine's memory bandwidth.
    model_dir: Path | None = None
    roofline_inputs_path: Path | None = None  # what b70host/roofline_inputs.py printed on the serving host
    checks: tuple[str, ...] = ("smoke", "correctness", "throughput")
    # Seconds the whole run may take once the servers answered (--deadline); None: no limit. Past it the run
    # ends with the report marked partial, naming the step it was in.
    deadline_s: float | None = None
    # At most this many requests per workload (--max-requests); None: the recipe's own min/max.
    max_requests: int | None = None


def load_host_facts(path: Path) -> Environment:
    """The host facts a report records; a file that is not one is refused naming the field, before any request."""
    fix = "pass the host_facts.json `b70ctl host environment` wrote (or `b70ctl host facts --json`)"
    facts = read_json_object(path, f"host facts {path}", fix)
    # Host facts (b70ctl host facts --json, or the appliance's collected facts) onto the report's Environment:
    # report.model's HOST_FACT_FIELDS, the fleet report's too. Missing keys stay None: a bare endpoint tells little
    # about its host.
    known = {key: facts[key] for key in HOST_FACT_FIELDS if facts.get(key) is not None}
    # Raw `b70ctl host facts --json` names its tree `root`: read anywhere but "/", the hardware is emulated.
    if "hardware_root" not in known and isinstance(facts.get("root"), str) and facts["root"] != "/":
        known["hardware_root"] = facts["root"]
    # What the server says of itself (vllm_version, served_model) wins over the facts: not repeated as extra.
    extra = {key: value for key, value in facts.items() if key not in Environment.model_fields
             and isinstance(value, (str, int, float, bool))}
    try:
        return Environment(**known, extra=extra)
    except ValidationError as error:
        raise BadInput(f"host facts {path}: {first_problem(error)}: {fix}") from error


def _preflight(request: VerifyRequest) -> tuple[Reference | None, Environment]:
    """Everything that can be refused before a single request: exit 2, nothing written."""
    if request.baseline_endpoint is not None and request.reference_path is not None:
        raise BadInput("give either --baseline-endpoint or --reference, not both")
    if "correctness" in request.checks and request.baseline_endpoint is None and request.reference_path is None:
        raise BadInput("correctness needs a baseline: pass --baseline-endpoint URL (target-only server) or "
                       "--reference FILE (recorded with --record-reference)")
    reference = load_reference(request.reference_path, request.recipe) if request.reference_path else None
    if request.model_dir is not None and not (request.model_dir / "config.json").is_file():
        raise BadInput(f"--model-dir {request.model_dir}: no config.json there: give the served target's "
                       "directory on this machine")
    environment = load_host_facts(request.host_facts_path) if request.host_facts_path else Environment()
    if request.roofline_inputs_path is not None:
        path = request.roofline_inputs_path
        found = read_json_object(path, f"roofline inputs {path}", ROOFLINE_FIX)
        try:
            record_roofline_inputs(environment, RooflineInputs.model_validate(found))
        except ValidationError as error:
            raise BadInput(f"roofline inputs {path}: {first_problem(error)}: {ROOFLINE_FIX}") from error
    if request.host is not None and (not request.host or any(ch.isspace() or not ch.isprintable()
                                                                for ch in request.host)):
        raise BadInput(f"--host {request.host!r}: a host name is one word without spaces, line breaks or control "
                       "characters: give the name as the inventory has it")
    out = request.out_dir
    if out.is_symlink() and not out.exists():
        raise BadInput(f"--out {out}: a link to {os.readlink(out)}, which does not exist: give a directory")
    if out.exists() and not out.is_dir():  # mkdir's own word for it, "File exists", says nothing
        what = "a file" if out.is_file() else file_kind(out.stat().st_mode)
        raise BadInput(f"--out {out}: {what}, not a directory: give a directory for the reports")
    try:
        request.out_dir.mkdir(parents=True, exist_ok=True)
        probe = request.out_dir / ".write-test"
        if probe.is_symlink():
            raise BadInput(f"--out {request.out_dir}: .write-test is a link verify did not create: remove it, or "
                           "choose another --out")
        probe.unlink(missing_ok=True)  # left by a run killed right here
        # O_EXCL: never through a link planted under that name since
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        probe.unlink()
    except OSError as error:
        raise BadInput(f"--out {request.out_dir}: not writable ({error.strerror}): choose another directory") \
            from error
    RunDirectory(request.out_dir).check_owned()  # checked again under the lock
    return reference, environment


def require_reachable(client: VllmClient, what: str) -> list[str]:
    """The endpoint answers /v1/models, or exit 2 naming it and why."""
    try:
        return client.models()
    except EndpointError as error:
        if error.answered:
            raise BadInput(f"{what} {client.endpoint.base_url}: {error.reason}") from error
        raise Unreachable(f"{what} {client.endpoint.base_url} unreachable: {error.reason}: check the URL and that "
                       "the server is up (/health)") from error


def verify(request: VerifyRequest, progress: Progress | None = None) -> Report:
    steps = ["starting"]  # the last step announced: a run ended by its deadline names it

    def say(message: str) -> None:
        steps.append(message)
        if progress is not None:
            progress(message)

    if request.max_requests is not None:  # every step below measures the capped workloads
        request = replace(request, recipe=request.recipe.with_request_cap(request.max_requests))
    recipe = request.recipe
    reference, environment = _preflight(request)

    # Every request names the model checked here, so a server with several models is checked on the right one.
    model = request.endpoint.model or recipe.serve.served_model_name
    client = VllmClient(replace(request.endpoint, model=model))
    baseline_client = VllmClient(request.baseline_endpoint) if request.baseline_endpoint else None
    try:
        served = require_reachable(client, "endpoint")
        if baseline_client is not None:
            require_reachable(baseline_client, "baseline endpoint")
        if model not in served:
            raise BadInput(f"endpoint {request.endpoint.base_url} serves {', '.join(served)}, not the recipe's "
                           f"{model!r}: pass the right --recipe, or --model NAME")
        baseline_unchecked = None
        if baseline_client is not None and "correctness" in request.checks:
            try:
                require_separate_target_only(client, baseline_client)
            except BaselineUnchecked as unchecked:
                baseline_unchecked = unchecked.reason

        environment.served_model = model
        environment.vllm_version = server_vllm_version(client)
        # The verified host: its facts, else --host, else none (the fleet report then names it by its directory);
        # never the machine verify runs on, which would make every hand-made report the same host.
        environment.hostname = environment.hostname or request.host
        report = Report(tool_version=__version__, recipe=recipe.name, endpoint=request.endpoint.base_url,
                        baseline=(request.baseline_endpoint.base_url if request.baseline_endpoint
                                  else str(request.reference_path) if request.reference_path else None),
                        started_at=datetime.now(UTC), partial=True, partial_reason="running",
                        environment=environment)
        writer = ReportWriter(report, recipe, request.out_dir)
        raw_dir = request.out_dir / "raw"
        if request.deadline_s is not None:
            for each in (client, baseline_client):
                if each is not None:
                    each.run_deadline_at, each.run_deadline_s = time.monotonic() + request.deadline_s, \
                        request.deadline_s
        with RunDirectory(request.out_dir), sigterm_ends_the_run():
            try:
                return _run_checks(request, report, writer, client, baseline_client, reference, raw_dir, say,
                                   baseline_unchecked)
            except RunDeadlineExceeded as passed:
                _close_unfinished(report, recipe, writer,
                                  f"deadline: --deadline {passed.deadline_s:g} s passed during {steps[-1]}")
                raise
            except (Terminated, KeyboardInterrupt) as stop:  # a stop, not a failure: there is no traceback
                _close_unfinished(report, recipe, writer,
                                  "terminated" if isinstance(stop, Terminated) else "interrupted")
                raise
            except BaseException as error:
                _close_unfinished(report, recipe, writer, f"failed: {_failure(error)}")
                raise
    finally:
        client.close()
        if baseline_client is not None:
            baseline_client.close()


def _run_checks(request: VerifyRequest, report: Report, writer: ReportWriter, client: VllmClient,
                baseline_client: VllmClient | None, reference: Reference | None, raw_dir: Path,
                say: Progress, baseline_unchecked: str | None = None) -> Report:
    recipe, environment = request.recipe, report.environment
    try:
        writer.save()
        if request.model_dir is not None:
            say("roofline inputs: the target's shape" + (" and this machine's memory bandwidth"
                                                          if recipe.host.accelerator == "cpu" else ""))
            measure_roofline_inputs(environment, request.model_dir, recipe.host.accelerator == "cpu")
        try:
            if "smoke" in request.checks:
                say("smoke: health, models, completion, chat, one-token prompt, stream, metrics, speculation")
                report.smoke = run_smoke(client, recipe)
                speculation = next((c for c in report.smoke.checks if c.name == "speculation"), None)
                if speculation is not None and "speculative_positions" in speculation.detail:
                    environment.served_speculative_positions = speculation.detail["speculative_positions"]
                writer.save()
            if "correctness" in request.checks:
                baseline = reference if reference is not None else baseline_client
                assert baseline is not None
                # Before the correctness prompts: the gate's first answers to them are then cold on a fresh server.
                say("gate: repeated prompts, a long prompt from the prefix cache, a code canary")
                report.gate = run_gate(client, recipe, raw_dir,
                                       baseline=baseline if baseline_unchecked is None else None)
                writer.save()
                say(f"correctness: {len(recipe.correctness.prompts)} greedy prompts against "
                    f"{report.baseline}")
                if baseline_unchecked is not None:
                    report.correctness = CorrectnessResult(
                        passed=False, baseline=str(report.baseline), identical=0, total=0, identical_fraction=0.0,
                        comparisons=[], reason=f"not compared: {baseline_unchecked}: the baseline cannot be told "
                                               "to be a separate target-only server")
                else:
                    report.correctness = run_correctness(client, recipe, baseline, raw_dir)
                report.gate = cite_correctness(report.gate, report.correctness, recipe)
                writer.save()
            if "throughput" in request.checks:
                report.throughput = run_throughput(client, recipe, raw_dir, progress=say, baseline=baseline_client)
                report.throughput.max_requests = request.max_requests
                writer.save()
        except (KeyboardInterrupt, Terminated) as stop:
            _finish(report, recipe, complete=False)
            writer.save_partial("interrupted" if isinstance(stop, KeyboardInterrupt) else "terminated")
            raise
        _finish(report, recipe, complete=True)
        writer.save()
        return report
    except OSError as error:
        if error.errno not in WRITE_LIMITS:
            raise
        reason, fix = WRITE_LIMITS[error.errno]
        _finish(report, recipe, complete=False)
        writer.save_partial(reason)
        raise BadInput(f"--out {request.out_dir}: {reason}; the report is marked partial ({reason}): {fix} and run "
                       "again") from error


def _failure(error: BaseException) -> str:
    """One line of why the run stopped: a refusal's own message, else the error's kind (its text may be long)."""
    if isinstance(error, B70Error):
        return printable(str(error)).replace("\n", " ")[:300]
    return f"{error.__class__.__name__} (an unexpected error: b70ctl's error line says where its traceback is)"


def _close_unfinished(report: Report, recipe: Recipe, writer: ReportWriter, reason: str) -> None:
    """A run that stopped without closing its report (an unexpected error, a refusal mid-run, the deadline) never
    leaves it saying "running": it is judged on what it measured and marked partial with why it stopped."""
    if not (report.partial and report.partial_reason == "running"):
        return  # closed already: interrupted, terminated, disk full
    try:
        _finish(report, recipe, complete=False)
    except Exception:  # noqa: BLE001 - the report must still be closed when judging it is what failed
        report.passed = False
    writer.save_partial(reason)


BASELINE_PROBE_TOKENS = 8


class BaselineUnchecked(Exception):
    """Both servers answer /metrics, but with counters that are no count (NaN, a series twice): whether the baseline
    is a separate target-only server cannot be told. Correctness is then not judged; the rest of the run goes on."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def require_separate_target_only(client: VllmClient, baseline: VllmClient) -> None:
    """The baseline is another server, and one that does not speculate, or exit 2 naming it: comparing a server
    with itself, or with another speculative server, proves nothing about lossless speculation. One request to the
    baseline between two reads of both servers' counters tells: the endpoint's must not move, the baseline's
    must, and without a single draft. Counters that are no count raise BaselineUnchecked."""
    try:
        endpoint_before = snapshot(client, client.model)
    except CountersUnusable as unusable:
        raise BaselineUnchecked(f"the endpoint's {unusable.reason}") from unusable
    except MetricsUnavailable as unavailable:  # the endpoint's, not the baseline's: named as such
        raise BadInput(f"baseline check: the endpoint's /metrics is unreadable ({unavailable.reason}): the endpoint "
                       "must be a vLLM server with its stats on") from unavailable
    try:
        baseline_before = snapshot(baseline, baseline.model)
        baseline.complete("completions", "The baseline", BASELINE_PROBE_TOKENS, temperature=0.0)
        endpoint_after = snapshot(client, client.model)
        baseline_after = snapshot(baseline, baseline.model)
    except CountersUnusable as unusable:
        raise BaselineUnchecked(unusable.reason) from unusable
    except MetricsUnavailable as unavailable:
        raise BadInput(f"baseline check: /metrics unreadable ({unavailable.reason}): the baseline must be a vLLM "
                       "server with its stats on") from unavailable
    except EndpointError as error:
        raise BadInput(f"baseline {baseline.endpoint.base_url}: {error.reason}") from error
    endpoint_moved = (endpoint_after.generation_tokens or 0) - (endpoint_before.generation_tokens or 0)
    baseline_moved = (baseline_after.generation_tokens or 0) - (baseline_before.generation_tokens or 0)
    if endpoint_moved > 0 and endpoint_moved == baseline_moved:
        raise BadInput(f"--baseline-endpoint {baseline.endpoint.base_url} answers with the endpoint's counters (a "
                       "request to it counted on the endpoint): pass a separate target-only server")
    if NUM_DRAFTS in baseline_before.non_finite + baseline_after.non_finite:
        raise BaselineUnchecked(f"the baseline's /metrics gives {NUM_DRAFTS} as NaN or infinite: whether it "
                                "speculates cannot be told")
    drafts = (baseline_after.num_drafts or 0) - (baseline_before.num_drafts or 0)
    if drafts > 0:
        raise BadInput(f"--baseline-endpoint {baseline.endpoint.base_url} speculates ({drafts:g} drafts for one "
                       "request): the baseline must be target-only (serve it without --speculative-config)")


def measure_roofline_inputs(environment: Environment, model_dir: Path, copy_benchmark: bool) -> None:
    """The target's shape (from its files) and this machine's copy bandwidth, where the host facts gave none:
    only for a server running on this machine. What cannot be read stays None, and the roofline says why."""
    from b70host.roofline_inputs import collect

    found = collect(str(model_dir), copy_benchmark and environment.memory_bandwidth is None)
    record_roofline_inputs(environment, RooflineInputs.model_validate(found))


def record_roofline_inputs(environment: Environment, found: RooflineInputs) -> None:
    """The inputs the serving host gave, where the environment has none yet, and why any is missing."""
    if environment.target_shape is None:
        environment.target_shape = found.target_shape
        environment.target_shape_unavailable = found.target_shape_unavailable
    if environment.memory_bandwidth is None:
        environment.memory_bandwidth = found.memory_bandwidth
        environment.memory_bandwidth_unavailable = found.memory_bandwidth_unavailable


def _finish(report: Report, recipe: Recipe, complete: bool) -> None:
    if report.throughput is not None:
        reject_impossible_engine_figures(report, recipe)
    measurements = measurements_of(report)
    report.measurements = measurements
    failed = {f"throughput.{w.name}": w.error for w in (report.throughput.workloads if report.throughput else [])
              if w.error is not None}
    report.verdicts = judge_all(recipe.claims, measurements, failed)
    report.roofline = compute_roofline(report, recipe)
    report.finished_at = datetime.now(UTC)
    if complete:
        report.partial, report.partial_reason = False, None
    checks_passed = all(check is None or check.passed
                        for check in (report.smoke, report.correctness, report.gate, report.throughput))
    # A claim left unjudged is not a pass: "all checks passed" means every claim was measured and met.
    report.passed = (complete and checks_passed
                     and all(verdict.verdict == "met" for verdict in report.verdicts))
    report.diagnosis = diagnose_report(report)


def diagnose_report(report: Report) -> list[DiagnosedFailure]:
    """The known failures (b70ctl diagnose's catalogue) that the report's own findings match: garbage output, a
    failed probe, a crashed server... named with the fix, in the report and from there in the fleet report."""
    from b70ctl.diagnose import diagnose_lines, load_catalogue
    from b70ctl.diagnose.collect import report_lines

    lines = report_lines(report.model_dump(mode="json"), "report.json")
    found = diagnose_lines(load_catalogue(), lines, ["report.json"])
    return [DiagnosedFailure(id=match.id, title=match.title, fix=match.fix.text,
                             evidence=[line.text for line in match.evidence]) for match in found.failures]
