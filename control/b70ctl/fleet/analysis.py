"""The fleet report from the collected entries (fleet/collect.py), pure and linear in the number of hosts (plus
sorting for medians): duplicates, grouping by recipe, claim counts from the hosts' own verdicts, distributions,
robust z-score outliers, drift against the fleet's most common values and the fingerprint groups. aggregate() is
the one entry: collect, then analyse.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from b70ctl.errors import BadInput
from b70ctl.fleet import stats
from b70ctl.fleet.collect import ClaimInfo, Collected, collect_directory, collect_files, cyclic_gc_paused, tool_version
from b70ctl.fleet.model import (
    DRIFT_FIELDS,
    USABLE,
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
from b70ctl.report.stats import median

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
                          c.describe_bound(), c.source) for c in recipe.claims]
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
