"""Plausible per-host reports, generated with known answers, for the fleet aggregation's tests and benchmark.

`make_report` builds a valid `Report` (the same model verify writes) for a recipe: every workload with request
samples, summaries and spec-decode counters, greedy correctness with token ids, the flat measurements and one
verdict per claim, computed by verify's own functions (report.load.measurements_of, report.verdict.judge_all). A host is
described by its speed (a factor on the recipe's typical decode rates), acceptance and environment.
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any

from b70ctl.fleet.collect import Collected, host_entry_from_report
from b70ctl.fleet.model import HostEntry, InputProblem
from b70ctl.recipes import load_recipe
from b70ctl.recipes.model import Recipe
from b70ctl.report.load import LoadedReport, measurements_of
from b70ctl.report.model import (
    CorrectnessResult,
    Environment,
    PromptComparison,
    Report,
    RequestSample,
    SmokeResult,
    SpecDecodeStats,
    SubCheck,
    Summary,
    ThroughputResult,
    WorkloadResult,
)
from b70ctl.report.verdict import judge_all

# Typical median decode tok/s per workload at speed 1.0 (what a good host of each recipe measures).
TYPICAL_DECODE_TOK_S: dict[str, dict[str, float]] = {
    "pr620-fp8-tp2": {"short": 76.0, "acceptance_friendly": 104.0, "natural": 45.0, "long_prompt": 68.0},
    "dspark-int4-tp1": {"long_prompt": 54.0, "short": 58.0},
    "cpu-tiny": {"short": 120.0, "acceptance_friendly": 150.0, "acceptance_friendly_baseline": 100.0, "natural": 110.0,
                 "long_prompt": 90.0},
}
TYPICAL_ACCEPTANCE: dict[str, float] = {"acceptance_friendly": 0.988}
PER_POSITION_K7 = [0.76, 0.45, 0.31, 0.14, 0.10, 0.02, 0.00]
PER_POSITION_K4 = [0.82, 0.61, 0.44, 0.30]
PEAK_OVER_MEDIAN = 1.18
# Per-host jitter of every rate: uniform ±JITTER, seeded by the host name (the same host, the same figures).
JITTER = 0.015

MAJORITY_ENVIRONMENT: dict[str, Any] = {
    "image_digest": "sha256:" + "a1" * 32,
    "vllm_version": "0.21.1.dev0",
    "model_revision": "4f1c" * 10,
    "drafter_revision": "9e0d" * 10,
    "kernel": "6.17.0-1009-intel",
    "xe_guc_firmware": "70.54.0",
    "xe_huc_firmware": "8.2.10",
    "compute_runtime": "26.14.37833.4",
    "gpu_count": 2,
    "gpu_model": "Arc Pro B70 (8086:e223)",
    "p2p_profile": "p2p",
}

STARTED_AT = datetime(2026, 11, 30, 6, 0, tzinfo=UTC)


@cache
def shipped_recipe(name: str) -> Recipe:
    """Parsing the recipe's YAML took most of a report's generation: read once per recipe (never modified)."""
    return load_recipe(name)


def appliance_hash(environment: dict[str, Any]) -> str:
    """Derived from the pinned inputs only (image, vLLM, model revisions, compute runtime), as the lock does:
    a host whose image differs also has another appliance hash; a different kernel does not change it."""
    pinned = [str(environment.get(k)) for k in ("image_digest", "vllm_version", "model_revision",
                                                "drafter_revision", "compute_runtime")]
    return hashlib.sha256("\n".join(pinned).encode()).hexdigest()[:16]


def environment_for(host: str, **overrides: Any) -> Environment:
    fields = {**MAJORITY_ENVIRONMENT, **overrides}
    fields.setdefault("hostname", host)
    fields["appliance_hash"] = appliance_hash(fields)
    return Environment(served_model="qwen3.8-27b-fp8", **fields)


def _summary(values: list[float]) -> Summary:
    ordered = sorted(values)
    middle = ordered[len(ordered) // 2] if len(ordered) % 2 else (ordered[len(ordered) // 2 - 1]
                                                                 + ordered[len(ordered) // 2]) / 2
    deviations = sorted(abs(v - middle) for v in ordered)
    mad = deviations[len(deviations) // 2]
    return Summary(n=len(ordered), median=middle, min=ordered[0], max=ordered[-1], mad=mad,
                   ci_low=ordered[0], ci_high=ordered[-1])


def make_report(
    recipe: Recipe | str,
    host: str,
    *,
    speed: float = 1.0,
    acceptance: float | None = None,
    per_position: list[float] | None = None,
    environment: Environment | None = None,
    identical: int | None = None,
    partial: bool = False,
    started_at: datetime = STARTED_AT,
    requests_per_workload: int = 5,
    tokens_per_comparison: int = 48,
) -> Report:
    """A plausible verify report of `host` for `recipe`. Rates are TYPICAL_DECODE_TOK_S x speed x jitter."""
    recipe = shipped_recipe(recipe) if isinstance(recipe, str) else recipe
    generator = random.Random(host)
    typical = TYPICAL_DECODE_TOK_S[recipe.name]
    spec = recipe.serve.speculative
    k = spec.num_speculative_tokens if spec else 0
    workloads = []
    for workload in recipe.workloads:
        rate = typical[workload.name] * speed * (1 + generator.uniform(-JITTER, JITTER))
        rates = [rate * (1 + generator.uniform(-0.004, 0.004)) for _ in range(requests_per_workload - 1)] + [rate]
        requests = [
            RequestSample(decode_tok_s=r, peak_tok_s=r * PEAK_OVER_MEDIAN, ttft_s=0.05, completion_tokens=
                          workload.max_tokens, usage_completion_tokens=workload.max_tokens, prompt_tokens=12,
                          chunks=workload.max_tokens // 2, raw_file=f"raw/{workload.name}-{i}.json")
            for i, r in enumerate(rates)
        ]
        spec_stats = None
        if k:
            rate_accepted = acceptance if acceptance is not None else TYPICAL_ACCEPTANCE.get(workload.name)
            if per_position is not None:
                curve = list(per_position)
            elif rate_accepted is not None:
                curve = [rate_accepted] * k
            else:
                curve = (PER_POSITION_K7 if k == 7 else PER_POSITION_K4)[:k]
            if rate_accepted is None:
                rate_accepted = sum(curve) / len(curve)
            drafts = float(workload.max_tokens * requests_per_workload // 2)
            spec_stats = SpecDecodeStats(
                num_drafts=drafts, num_draft_tokens=drafts * k, num_accepted_tokens=drafts * k * rate_accepted,
                acceptance_rate=rate_accepted, mean_acceptance_length=1 + k * rate_accepted,
                per_position_acceptance=list(curve), generation_tokens=float(workload.max_tokens * len(rates)))
        workloads.append(WorkloadResult(
            name=workload.name, description=workload.description, temperature=workload.temperature,
            max_tokens=workload.max_tokens, requests=requests, decode_tok_s=_summary(rates),
            peak_tok_s=_summary([r * PEAK_OVER_MEDIAN for r in rates]), ttft_s=_summary([0.05] * len(rates)),
            converged=True, spec_decode=spec_stats))
    prompts = recipe.correctness.prompts
    identical = len(prompts) if identical is None else identical
    comparisons = []
    for index, prompt in enumerate(prompts):
        expected = [generator.randrange(1000, 150000) for _ in range(tokens_per_comparison)]
        same = index < identical
        actual = list(expected) if same else expected[:10] + [t + 1 for t in expected[10:]]
        comparisons.append(PromptComparison(prompt=prompt, identical=same, tokens_compared=len(expected),
                                            first_divergence=None if same else 10, expected_token_ids=expected,
                                            actual_token_ids=actual))
    correctness = CorrectnessResult(passed=identical / len(prompts) >= 0.8, baseline="reference.json",
                                    identical=identical, total=len(prompts),
                                    identical_fraction=identical / len(prompts), comparisons=comparisons)
    report = Report(
        tool_version="0.1.0", recipe=recipe.name, endpoint=f"http://{host}:8000", started_at=started_at,
        finished_at=started_at + timedelta(minutes=6), partial=partial,
        partial_reason="stopped by the user" if partial else None,
        environment=environment or environment_for(host),
        smoke=SmokeResult(passed=True, checks=[SubCheck(name="models", passed=True),
                                                SubCheck(name="health", passed=True)]),
        correctness=correctness, throughput=ThroughputResult(passed=True, workloads=workloads))
    # The figures and verdicts as verify computes them, with its own functions.
    report.measurements = measurements_of(report)
    report.verdicts = judge_all(recipe.claims, report.measurements)
    report.passed = all(v.verdict == "met" for v in report.verdicts)
    return report


def to_schema_0(report: Report) -> dict[str, Any]:
    """The report as the first report layout wrote it (see report/load.py): no schema_version, environment,
    measurements, partial marking or per-position acceptance; vllm_version and served_model at the top."""
    data = report.model_dump(mode="json")
    environment = data.pop("environment")
    for key in ("schema_version", "measurements", "partial", "partial_reason", "baseline"):
        data.pop(key, None)
    data["vllm_version"] = environment["vllm_version"]
    data["served_model"] = environment["served_model"]
    for workload in data["throughput"]["workloads"]:
        if workload["spec_decode"]:
            for key in ("per_position_acceptance", "polluted", "pollution_reason"):
                workload["spec_decode"].pop(key)
    for verdict in data["verdicts"]:
        verdict.pop("bound")
        verdict.pop("source")
    return data


def write_host(reports_dir: Path, host: str, report: Report | dict[str, Any] | None = None, *,
               facts: dict[str, Any] | None = None, unreachable: dict[str, Any] | None = None) -> Path:
    """One host directory as the verify play leaves it; returns the directory."""
    directory = reports_dir / host
    directory.mkdir(parents=True, exist_ok=True)
    if isinstance(report, Report):
        (directory / "report.json").write_text(report.model_dump_json())
    elif report is not None:
        (directory / "report.json").write_text(json.dumps(report))
    if facts is not None:
        (directory / "host_facts.json").write_text(json.dumps(facts))
    if unreachable is not None:
        (directory / "unreachable.json").write_text(json.dumps({"host": host, **unreachable}))
    return directory


def fleet_host_kind(index: int) -> tuple[str, float, dict[str, Any]]:
    """What host number `index` of a generated fleet is, as the fleet benchmark plants it: "unreachable" 0.5%,
    "truncated" (a cut report.json) 0.2%, else "report" with its speed and environment overrides: 10% no-P2P hosts
    12% slower, 3% on another kernel, 1% slow outliers (40% slower) of the majority's environment."""
    if index % 200 == 17:
        return "unreachable", 0.0, {}
    if index % 500 == 99:
        return "truncated", 1.0, {}
    overrides: dict[str, Any] = {}
    speed = 1.0
    if index % 10 == 3:
        overrides["p2p_profile"] = "no-p2p"
        speed = 0.88
    if index % 33 == 5:
        overrides["kernel"] = "6.14.0-1011-intel"
    if index % 100 == 51:
        speed = 0.6
    return "report", speed, overrides


def fleet_host_name(index: int) -> str:
    return f"b70-{index:05d}"


def synthetic_fleet(hosts: int, recipe: str = "pr620-fp8-tp2",
                    kind_of: Callable[[int], tuple[str, float, dict[str, Any]]] = fleet_host_kind) -> Collected:
    """The hosts of fleet_host_kind as the aggregation collects them (HostEntry and input problems), without files:
    one report per kind of host goes through the aggregation's own reduction, and each host is a copy of its
    kind's entry under its own name with its rates jittered (seeded by the name). Thousands of hosts in a second."""
    collected = Collected()
    entry_of_kind: dict[tuple[float, tuple[tuple[str, Any], ...]], HostEntry] = {}
    for index in range(hosts):
        host = fleet_host_name(index)
        kind, speed, overrides = kind_of(index)
        if kind == "unreachable":
            collected.entries.append(HostEntry(host=host, status="unreachable", recipe=recipe,
                                               reason="unreachable at verify: ssh: connect timed out"))
            continue
        if kind == "truncated":
            path = f"reports/{host}/report.json"
            collected.problems.append(InputProblem(kind="truncated", host=host, path=path, action="excluded",
                                                   reason=f"{path}: ends early (truncated): copy it again"))
            collected.entries.append(HostEntry(host=host, status="bad_report", reason="truncated", report_path=path))
            continue
        key = (speed, tuple(sorted(overrides.items())))
        if key not in entry_of_kind:
            template = make_report(recipe, "template", speed=speed,
                                   environment=environment_for("template", **overrides))
            entry_of_kind[key] = host_entry_from_report("template", LoadedReport(template, "template"), None)
        template_entry = entry_of_kind[key]
        factor = 1 + random.Random(host).uniform(-JITTER, JITTER)
        workloads = [figures.model_copy(update={
            "median_decode_tok_s": figures.median_decode_tok_s * factor if figures.median_decode_tok_s else None,
            "peak_decode_tok_s": figures.peak_decode_tok_s * factor if figures.peak_decode_tok_s else None,
        }) for figures in template_entry.workloads]
        collected.entries.append(template_entry.model_copy(update={
            "host": host, "report_path": f"reports/{host}/report.json", "endpoint": f"http://{host}:8000",
            "environment": template_entry.environment.model_copy(update={"hostname": host}),
            "workloads": workloads, "verdicts": list(template_entry.verdicts), "diagnosed": [],
            "drift_fields": [], "outlier_workloads": [],
        }))
    return collected


# ---- the planted fleet: 20 pr620 hosts with known drift and outliers, every kind of bad report, 3 DSpark hosts
PR620 = "pr620-fp8-tp2"
DSPARK = "dspark-int4-tp1"
PR620_WORKLOADS = ["short", "acceptance_friendly", "natural", "long_prompt"]

OTHER_KERNEL_HOST = "b70-03"
OTHER_IMAGE_HOST = "b70-07"
SLOW_HOST = "b70-11"  # same fingerprint as the majority, 40% slower: an outlier drift does not explain
NO_P2P_HOSTS = ["b70-15", "b70-16", "b70-17", "b70-18"]  # 12% slower, with the no-p2p profile
UNREACHABLE_HOST = "b70-20"
SCHEMA_0_HOST = "b70-21"
TRUNCATED_HOST = "b70-22"
CORRUPT_HOST = "b70-23"
FUTURE_SCHEMA_HOST = "b70-24"
DUPLICATE_HOST = "b70-25"  # an older report of the machine b70-05
EMPTY_HOST = "b70-26"
DSPARK_HOSTS = ["dsp-00", "dsp-01", "dsp-02"]

HOST_FACTS = {"kernel": "6.17.0-1009-intel", "xe_guc_firmware": "70.54.0", "xe_huc_firmware": "8.2.10",
              "compute_runtime": "26.14.37833.4", "gpu_count": 2, "gpu_model": "Arc Pro B70 (8086:e223)",
              "p2p_profile": "p2p", "unrelated_fact": {"ignored": True}}


def build_planted_fleet(reports_dir: Path) -> None:
    for index in range(20):
        host = f"b70-{index:02d}"
        overrides: dict[str, object] = {}
        speed = 1.0
        if host == OTHER_KERNEL_HOST:
            overrides["kernel"] = "6.14.0-1011-intel"
        if host == OTHER_IMAGE_HOST:
            overrides["image_digest"] = "sha256:" + "b2" * 32
        if host in NO_P2P_HOSTS:
            overrides["p2p_profile"] = "no-p2p"
            speed = 0.88
        if host == SLOW_HOST:
            speed = 0.6
        write_host(reports_dir, host, make_report(PR620, host, speed=speed,
                                                  environment=environment_for(host, **overrides)))
    write_host(reports_dir, UNREACHABLE_HOST, unreachable={
        "kind": "unreachable", "stage": "verify", "recipe": PR620,
        "reason": "Failed to connect to the host via ssh: connect to host 10.0.0.20 port 22: No route to host"})
    # A report from the first layout, with the host's facts collected beside it.
    write_host(reports_dir, SCHEMA_0_HOST, to_schema_0(make_report(PR620, SCHEMA_0_HOST)), facts=HOST_FACTS)
    valid = make_report(PR620, TRUNCATED_HOST).model_dump_json()
    write_host(reports_dir, TRUNCATED_HOST).joinpath("report.json").write_text(valid[: len(valid) // 3])
    # Stray brackets after a comma past the middle: broken JSON wherever the fields happen to fall.
    middle = valid.index(',"', len(valid) // 2) + 1
    write_host(reports_dir, CORRUPT_HOST).joinpath("report.json").write_text(valid[:middle] + "}}]]" + valid[middle:])
    future = json.loads(make_report(PR620, FUTURE_SCHEMA_HOST).model_dump_json())
    future["schema_version"] = 5
    write_host(reports_dir, FUTURE_SCHEMA_HOST, future)
    write_host(reports_dir, DUPLICATE_HOST, make_report(
        PR620, DUPLICATE_HOST, environment=environment_for("b70-05"), started_at=STARTED_AT - timedelta(days=2)))
    write_host(reports_dir, EMPTY_HOST).joinpath("report.json").write_text("")
    for host in DSPARK_HOSTS:
        write_host(reports_dir, host, make_report(DSPARK, host, environment=environment_for(
            host, vllm_version="0.29.0", gpu_count=1, image_digest="sha256:" + "c3" * 32, p2p_profile="single-gpu")))


def b70ctl(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a separate process, as an owner runs it."""
    return subprocess.run([sys.executable, "-c", "from b70ctl.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=300)
