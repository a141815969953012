"""The fleet replication report (fleet.json): one pydantic model, schema versioned.

It is built from a directory of per-host reports collected on the controller (see fleet/layout.py) and says,
host by host and per recipe, whether the recipe's published claims replicated, which hosts drift from the fleet's
majority (kernel, firmware, image, model revisions, P2P profile ...) and how much that costs in tok/s.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final, Literal

from pydantic import Field, PrivateAttr

from b70ctl.documents import Document as Model
from b70ctl.report.model import Environment, Verdict

FLEET_SCHEMA_VERSION: Final = 1

# Environment fields that must agree across a fleet serving one recipe; a host that differs from the majority
# is flagged as drift. Order = the order of columns in tables.
DRIFT_FIELDS: tuple[str, ...] = (
    "appliance_hash",
    "image_digest",
    "vllm_version",
    "model_revision",
    "drafter_revision",
    "kernel",
    "xe_guc_firmware",
    "xe_huc_firmware",
    "compute_runtime",
    "gpu_model",
    "gpu_count",
    "p2p_profile",
)

# Short column names of the drift fields in tables and plots.
FIELD_LABELS = {
    "appliance_hash": "appliance hash",
    "image_digest": "image digest",
    "vllm_version": "vLLM",
    "model_revision": "model rev",
    "drafter_revision": "drafter rev",
    "kernel": "kernel",
    "xe_guc_firmware": "GuC",
    "xe_huc_firmware": "HuC",
    "compute_runtime": "compute runtime",
    "gpu_model": "GPU",
    "gpu_count": "GPUs",
    "p2p_profile": "P2P",
}

HostStatus = Literal["verified", "partial", "unreachable", "bad_report", "duplicate"]
# The statuses whose report the fleet reads figures from: a partial report counts for what it measured.
USABLE: tuple[HostStatus, ...] = ("verified", "partial")

ProblemKind = Literal[
    "unreadable",
    "empty",
    "truncated",
    "corrupt",
    "unknown_schema_version",
    "invalid",
    "duplicate_host",
    "missing_report",
    "conflicting_markers",
    "bad_marker",
    "bad_host_facts",
    "mixed_recipes",
]


class InputProblem(Model):
    """A file or host the aggregation could not take at face value, and what it did instead."""

    kind: ProblemKind
    host: str | None
    path: str
    reason: str
    action: Literal["excluded", "used", "grouped"] = Field(
        description="excluded: left out of the figures; used: taken with the caveat; grouped: kept apart"
    )


class WorkloadFigures(Model):
    """One workload's figures on one host, taken from the report's throughput results."""

    name: str
    median_decode_tok_s: float | None = None
    peak_decode_tok_s: float | None = None
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    per_position_acceptance: list[float] = Field(default_factory=list)
    converged: bool | None = None
    error: str | None = None


class HostClaimVerdict(Model):
    claim_id: str
    verdict: Verdict
    measured: float | list[float] | None = None
    reason: str | None = None


class HostTune(Model):
    """The host's tune (reports/<host>/tune/tune.json, written by playbooks/tune.yml): its winner against the
    recipe's default, both measured back to back at the end of the tune (scores: median - 1.4826 x MAD, tok/s)."""

    outcome: Literal["tuned", "default_best", "no_candidate"]
    overrides: dict[str, int | str | None] = Field(description="What b70_tuned.yml applies; empty: the default")
    tuned_score_tok_s: float | None = Field(None, description="The score of what the host serves after the tune")
    default_score_tok_s: float | None = None
    gain: float | None = Field(None, description="tuned / default - 1")
    spent_requests: int
    budget_requests: int
    finished_at: datetime
    summary: str


class HostEntry(Model):
    host: str = Field(description="The host's directory name under REPORTS_DIR (the inventory name)")
    status: HostStatus
    reason: str | None = Field(None, description="Why the host is not verified (unreachable, bad report ...)")
    report_path: str | None = None
    recipe: str | None = None
    report_schema_version: int | None = Field(None, description="Schema version of the file as written")
    started_at: datetime | None = None
    endpoint: str | None = None
    environment: Environment = Field(default_factory=Environment)
    smoke_passed: bool | None = None
    correctness_passed: bool | None = None
    correctness_identical: int | None = None
    correctness_total: int | None = None
    workloads: list[WorkloadFigures] = Field(default_factory=list)
    verdicts: list[HostClaimVerdict] = Field(default_factory=list)
    all_claims_met: bool = False
    diagnosed: list[str] = Field(default_factory=list, description="Known failures its report names (diagnose ids)")
    drift_fields: list[str] = Field(default_factory=list, description="Fields differing from the recipe majority")
    outlier_workloads: list[str] = Field(default_factory=list)
    tune: HostTune | None = Field(None, description="Tuned against default, when the host has a tune report")
    roofline_efficiency: float | None = Field(
        None, description="Median decode rate over the memory-bandwidth bound, median over workloads (report "
                          "roofline.efficiency)")
    roofline_not_measured: str | None = Field(None, description="Why the report has no efficiency")

    _figures_by_name: dict[str, WorkloadFigures] | None = PrivateAttr(None)

    def workload(self, name: str) -> WorkloadFigures | None:
        # Looked up per host, workload and statistic: a dict built once beats a scan at thousands of hosts.
        if self._figures_by_name is None:
            self._figures_by_name = {figures.name: figures for figures in self.workloads}
        return self._figures_by_name.get(name)


class ClaimCount(Model):
    """How many hosts of a recipe meet one claim, from the verdicts in their own reports."""

    claim_id: str
    description: str
    metric: str
    bound: str
    source: str
    met: int
    not_met: int
    not_measured: int
    hosts_not_met: list[str]
    hosts_not_measured: list[str]


class Distribution(Model):
    """A figure across hosts. mad is the raw median absolute deviation (not scaled)."""

    n: int
    median: float
    mad: float
    min: float
    max: float
    p10: float
    p90: float


class ClaimLine(Model):
    """A claim on a workload's figure, as the line a plot draws: the published value and the bound with the
    claim's tolerance applied."""

    claim_id: str
    metric: str
    op: Literal[">=", "<=", "between", "per_position"]
    value: float | None = None
    low: float | None = None
    high: float | None = None
    values: list[float] | None = None
    lower_with_tolerance: float | None = None
    upper_with_tolerance: float | None = None


class WorkloadDistribution(Model):
    workload: str
    hosts_measured: int
    median_decode_tok_s: Distribution | None
    peak_decode_tok_s: Distribution | None
    acceptance_rate: Distribution | None
    per_position_acceptance_median: list[float]
    claims: list[ClaimLine]


class Outlier(Model):
    host: str
    workload: str
    median_decode_tok_s: float
    fleet_median_decode_tok_s: float
    robust_z: float
    direction: Literal["slow", "fast"]
    explained_by: list[str] = Field(description="The host's drift fields: the differences that may explain it")


class DriftValue(Model):
    value: str | None
    hosts: int


class FieldDrift(Model):
    """One fingerprint field whose value is not the same on every host of a recipe."""

    field: str
    majority_value: str | None = Field(description="None when no value has a strict majority (a tie)")
    values: list[DriftValue]
    drifting_hosts: list[str] = Field(description="Hosts whose known value differs from the majority")
    unknown_hosts: list[str] = Field(description="Hosts whose reports do not record this field")


class GroupFigure(Model):
    workload: str
    hosts_measured: int
    median_decode_tok_s: float | None
    relative_to_reference: float | None = Field(
        None, description="(group median / reference median) - 1; the reference is the majority/largest group"
    )


class FieldValueEffect(Model):
    """Hosts sharing one value of one drifting field, with their median tok/s per workload."""

    field: str
    value: str | None
    hosts: int
    is_majority: bool
    figures: list[GroupFigure]


class FingerprintGroup(Model):
    fingerprint: dict[str, str | None]
    differs_from_majority: list[str]
    hosts: list[str]
    figures: list[GroupFigure]


class EfficiencyRank(Model):
    """A host's place among its recipe's hosts by efficiency against its own memory-bandwidth bound."""

    rank: int = Field(description="1: the closest to its bound")
    host: str
    efficiency: float


class RecipeFleet(Model):
    recipe: str
    recipe_known: bool = Field(description="A recipe b70ctl ships: claims and claim lines come from it")
    hosts: int
    hosts_verified: int
    hosts_all_claims_met: int
    hosts_unverified: list[str] = Field(description="Partial reports and hosts without a usable report")
    claims: list[ClaimCount]
    workloads: list[WorkloadDistribution]
    outliers: list[Outlier]
    drift: list[FieldDrift]
    field_effects: list[FieldValueEffect]
    fingerprint_groups: list[FingerprintGroup]
    efficiency_ranking: list[EfficiencyRank] = Field(
        default_factory=list, description="Usable hosts with a roofline efficiency, highest first")
    hosts_without_efficiency: list[str] = Field(default_factory=list,
                                                description="Usable hosts whose report has no roofline efficiency")


class FleetSummary(Model):
    hosts: int
    verified: int
    partial: int
    unreachable: int
    bad_report: int
    duplicate: int
    all_claims_met: int
    recipes: list[str]
    drifting_hosts: int
    outliers: int = Field(description="Hosts that are an outlier in at least one workload")
    problems: int
    emulated: int = Field(0, description="Hosts whose report was made on emulated hardware (environment."
                                         "hardware_root: GPU facts read from a fixture's sysfs tree)")


class DiagnosedGroup(Model):
    """Hosts whose reports name the same known failure (b70ctl diagnose's catalogue), with its fix."""

    id: str
    title: str
    fix: str
    hosts: list[str]


class FleetReport(Model):
    schema_version: Literal[1] = FLEET_SCHEMA_VERSION
    tool_version: str
    generated_at: datetime
    source: str = Field(description="REPORTS_DIR or a description of the report files aggregated")
    all_met: bool = Field(description="Every host has a usable report, met every claim, and no input problem")
    summary: FleetSummary
    recipes: list[RecipeFleet]
    hosts: list[HostEntry]
    problems: list[InputProblem]
    diagnosed: list[DiagnosedGroup] = Field(default_factory=list, description="Hosts grouped by known failure")
    outlier_threshold: float = Field(description="|robust z| above which a host is an outlier")
