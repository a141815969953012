"""Fleet aggregation on generated report sets with known answers: every planted fact is found, nothing else."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from b70ctl.errors import BadInput
from b70ctl.fleet import stats
from b70ctl.fleet.analysis import aggregate
from b70ctl.fleet.model import FleetReport, RecipeFleet
from fleet_factory import (
    CORRUPT_HOST,
    DSPARK,
    DSPARK_HOSTS,
    DUPLICATE_HOST,
    EMPTY_HOST,
    FUTURE_SCHEMA_HOST,
    HOST_FACTS,
    NO_P2P_HOSTS,
    OTHER_IMAGE_HOST,
    OTHER_KERNEL_HOST,
    PR620,
    PR620_WORKLOADS,
    SCHEMA_0_HOST,
    SLOW_HOST,
    STARTED_AT,
    TRUNCATED_HOST,
    UNREACHABLE_HOST,
    build_planted_fleet,
    environment_for,
    make_report,
    write_host,
)


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> FleetReport:
    reports_dir = tmp_path_factory.mktemp("fleet") / "reports"
    build_planted_fleet(reports_dir)
    return aggregate(reports_dir)


def _recipe(report: FleetReport, name: str) -> RecipeFleet:
    return next(fleet for fleet in report.recipes if fleet.recipe == name)


def _host(report: FleetReport, name: str):
    return next(entry for entry in report.hosts if entry.host == name)


def test_summary_counts_every_host_once(planted):
    summary = planted.summary
    assert summary.hosts == 29  # 20 + unreachable + schema 0 + 4 bad files + 3 DSpark; the duplicate not again
    assert (summary.verified, summary.partial, summary.unreachable, summary.bad_report, summary.duplicate) == (
        24, 0, 1, 4, 1)
    assert summary.recipes == [DSPARK, PR620]
    assert summary.all_claims_met == 20 + 3  # every verified host but the slow one
    assert summary.drifting_hosts == 1 + 1 + len(NO_P2P_HOSTS)
    assert summary.outliers == 1 + len(NO_P2P_HOSTS)
    assert planted.all_met is False


def test_every_bad_input_is_named_once(planted):
    found = {(problem.kind, problem.host, problem.action) for problem in planted.problems}
    assert found == {
        ("truncated", TRUNCATED_HOST, "excluded"),
        ("corrupt", CORRUPT_HOST, "excluded"),
        ("unknown_schema_version", FUTURE_SCHEMA_HOST, "excluded"),
        ("duplicate_host", DUPLICATE_HOST, "excluded"),
        ("empty", EMPTY_HOST, "excluded"),
        ("mixed_recipes", None, "grouped"),
    }
    by_kind = {problem.kind: problem for problem in planted.problems}
    assert "schema_version 5 is unknown" in by_kind["unknown_schema_version"].reason
    duplicate = by_kind["duplicate_host"]
    assert "b70-05/report.json (kept" in duplicate.reason and "b70-25/report.json (excluded" in duplicate.reason
    assert f"{DSPARK} (3 hosts)" in by_kind["mixed_recipes"].reason
    assert f"{PR620} (22 hosts)" in by_kind["mixed_recipes"].reason


def test_host_statuses(planted):
    statuses = {entry.host: entry.status for entry in planted.hosts}
    assert statuses[UNREACHABLE_HOST] == "unreachable"
    assert "No route to host" in _host(planted, UNREACHABLE_HOST).reason
    assert _host(planted, UNREACHABLE_HOST).reason.startswith("unreachable at verify:")
    for host in (TRUNCATED_HOST, CORRUPT_HOST, FUTURE_SCHEMA_HOST, EMPTY_HOST):
        assert statuses[host] == "bad_report"
    assert statuses[DUPLICATE_HOST] == "duplicate"
    assert statuses["b70-05"] == "verified"
    assert [host for host, status in statuses.items() if status == "verified"] == sorted(
        [f"b70-{i:02d}" for i in range(20)] + [SCHEMA_0_HOST] + DSPARK_HOSTS)


def test_recipes_are_grouped_and_judged_on_their_own_claims(planted):
    pr620, dspark = _recipe(planted, PR620), _recipe(planted, DSPARK)
    assert (pr620.hosts, pr620.hosts_verified, pr620.hosts_all_claims_met) == (22, 21, 20)
    assert pr620.hosts_unverified == [UNREACHABLE_HOST]
    assert (dspark.hosts, dspark.hosts_verified, dspark.hosts_all_claims_met) == (3, 3, 3)
    assert [c.claim_id for c in dspark.claims] == ["per-position-acceptance", "mean-acceptance-length",
                                                   "long-prompt-rate"]
    assert all(c.met == 3 and c.not_met == 0 and c.not_measured == 0 for c in dspark.claims)
    assert (dspark.drift, dspark.outliers) == ([], [])


def test_claim_counts_reuse_the_hosts_verdicts(planted):
    counts = {c.claim_id: (c.met, c.not_met, c.not_measured, c.hosts_not_met) for c in _recipe(planted, PR620).claims}
    assert counts == {
        "short-median": (20, 1, 0, [SLOW_HOST]),
        "short-peak": (20, 1, 0, [SLOW_HOST]),
        "acceptance-friendly-acceptance": (21, 0, 0, []),
        "natural-text-rate": (20, 1, 0, [SLOW_HOST]),
        "greedy-identical": (21, 0, 0, []),
    }
    assert _host(planted, SLOW_HOST).all_claims_met is False
    assert all(_host(planted, host).all_claims_met for host in NO_P2P_HOSTS)  # slower, still within the claims


def test_drift_finds_exactly_the_planted_differences(planted):
    pr620 = _recipe(planted, PR620)
    drift = {d.field: (d.majority_value, d.drifting_hosts, d.unknown_hosts) for d in pr620.drift}
    assert drift == {
        "appliance_hash": (environment_for("x").appliance_hash, [OTHER_IMAGE_HOST], [SCHEMA_0_HOST]),
        "image_digest": ("sha256:" + "a1" * 32, [OTHER_IMAGE_HOST], [SCHEMA_0_HOST]),
        "kernel": ("6.17.0-1009-intel", [OTHER_KERNEL_HOST], []),
        "p2p_profile": ("p2p", NO_P2P_HOSTS, []),
    }
    flagged = {entry.host: entry.drift_fields for entry in planted.hosts if entry.drift_fields}
    assert flagged == {
        OTHER_KERNEL_HOST: ["kernel"],
        OTHER_IMAGE_HOST: ["appliance_hash", "image_digest"],
        **{host: ["p2p_profile"] for host in NO_P2P_HOSTS},
    }


def test_schema_0_host_is_filled_from_its_facts_and_not_drift(planted):
    entry = _host(planted, SCHEMA_0_HOST)
    assert entry.report_schema_version == 0
    assert entry.environment.vllm_version == "0.21.1.dev0"  # from the report itself
    assert entry.environment.kernel == "6.17.0-1009-intel"  # from host_facts.json
    assert entry.environment.image_digest is None  # known to neither
    assert entry.drift_fields == [] and entry.outlier_workloads == []
    assert entry.all_claims_met is True
    assert entry.workload("short").per_position_acceptance == []
    assert entry.workload("short").median_decode_tok_s == pytest.approx(76.0, rel=0.02)


def test_outliers_are_the_planted_slow_hosts(planted):
    pr620 = _recipe(planted, PR620)
    found = {(o.host, o.workload): (o.direction, o.explained_by) for o in pr620.outliers}
    expected = {}
    for workload in PR620_WORKLOADS:
        expected[(SLOW_HOST, workload)] = ("slow", [])
        for host in NO_P2P_HOSTS:
            expected[(host, workload)] = ("slow", ["p2p_profile"])
    assert found == expected
    slow = next(o for o in pr620.outliers if o.host == SLOW_HOST and o.workload == "short")
    assert slow.robust_z < -10
    assert slow.fleet_median_decode_tok_s == pytest.approx(76.0, rel=0.02)


def test_no_p2p_hosts_are_twelve_percent_slower(planted):
    pr620 = _recipe(planted, PR620)
    effects = {(e.field, e.value): e for e in pr620.field_effects}
    assert set(effects) == {("appliance_hash", environment_for("x").appliance_hash),
                            ("appliance_hash", environment_for("x", image_digest="sha256:" + "b2" * 32).appliance_hash),
                            ("image_digest", "sha256:" + "a1" * 32), ("image_digest", "sha256:" + "b2" * 32),
                            ("kernel", "6.17.0-1009-intel"), ("kernel", "6.14.0-1011-intel"),
                            ("p2p_profile", "p2p"), ("p2p_profile", "no-p2p")}
    no_p2p = effects[("p2p_profile", "no-p2p")]
    assert no_p2p.hosts == 4 and not no_p2p.is_majority
    for figure in no_p2p.figures:
        assert figure.relative_to_reference == pytest.approx(-0.12, abs=0.02), figure
    # One other kernel or image, same speed: no effect beyond the jitter.
    for key in (("kernel", "6.14.0-1011-intel"), ("image_digest", "sha256:" + "b2" * 32)):
        assert all(abs(f.relative_to_reference) < 0.04 for f in effects[key].figures)
    assert effects[("p2p_profile", "p2p")].hosts == 17  # 16 + the schema 0 host, whose facts say p2p


def test_fingerprint_groups(planted):
    groups = {tuple(g.differs_from_majority): g for g in _recipe(planted, PR620).fingerprint_groups}
    majority = [g for g in _recipe(planted, PR620).fingerprint_groups
                if not g.differs_from_majority and None not in g.fingerprint.values()]
    assert len(majority) == 1
    assert sorted(majority[0].hosts) == sorted(
        f"b70-{i:02d}" for i in range(20) if f"b70-{i:02d}" not in {OTHER_KERNEL_HOST, OTHER_IMAGE_HOST,
                                                                      *NO_P2P_HOSTS})
    assert groups[("p2p_profile",)].hosts == NO_P2P_HOSTS
    assert groups[("kernel",)].hosts == [OTHER_KERNEL_HOST]
    assert groups[("appliance_hash", "image_digest")].hosts == [OTHER_IMAGE_HOST]
    assert all(f.relative_to_reference == pytest.approx(-0.12, abs=0.02) for f in groups[("p2p_profile",)].figures)


def test_distributions_against_claim_lines(planted):
    short = next(w for w in _recipe(planted, PR620).workloads if w.workload == "short")
    assert short.hosts_measured == 21
    assert short.median_decode_tok_s.median == pytest.approx(76.0, rel=0.02)
    assert short.median_decode_tok_s.min == pytest.approx(76.0 * 0.6, rel=0.02)
    assert {line.claim_id: line.lower_with_tolerance for line in short.claims} == {
        "short-median": pytest.approx(72.2 * 0.9), "short-peak": pytest.approx(85.9 * 0.9)}
    assert short.per_position_acceptance_median == [0.82, 0.61, 0.44, 0.30]
    natural = next(w for w in _recipe(planted, PR620).workloads if w.workload == "natural")
    (line,) = natural.claims
    assert (line.op, line.lower_with_tolerance, line.upper_with_tolerance) == (
        "between", pytest.approx(38 * 0.9), pytest.approx(53 * 1.1))


def test_a_clean_fleet_is_all_met(tmp_path):
    for index in range(6):
        host = f"ok-{index}"
        write_host(tmp_path, host, make_report("cpu-tiny", host, environment=environment_for(host)))
    report = aggregate(tmp_path)
    assert report.all_met is True
    assert report.problems == [] and report.summary.all_claims_met == 6
    (fleet,) = report.recipes
    assert fleet.drift == [] and fleet.outliers == [] and len(fleet.fingerprint_groups) == 1


def test_an_unreachable_host_alone_fails_the_fleet(tmp_path):
    for index in range(3):
        write_host(tmp_path, f"ok-{index}", make_report("cpu-tiny", f"ok-{index}"))
    write_host(tmp_path, "gone", unreachable={"reason": "timed out", "kind": "failed", "stage": "verify"})
    report = aggregate(tmp_path)
    assert report.all_met is False and report.problems == []
    (fleet,) = report.recipes  # one recipe: the host without a report counts against it
    assert fleet.hosts == 4 and fleet.hosts_unverified == ["gone"]
    assert _host(report, "gone").reason == "failed at verify: timed out"


def test_a_tie_names_no_majority_and_flags_nobody(tmp_path):
    for index, kernel in enumerate(["6.17.0-1009-intel", "6.17.0-1009-intel", "7.0.1", "7.0.1"]):
        host = f"h{index}"
        write_host(tmp_path, host, make_report("cpu-tiny", host, environment=environment_for(host, kernel=kernel)))
    (fleet,) = aggregate(tmp_path).recipes
    (drift,) = fleet.drift
    assert (drift.field, drift.majority_value, drift.drifting_hosts) == ("kernel", None, [])
    assert [(v.value, v.hosts) for v in drift.values] == [("6.17.0-1009-intel", 2), ("7.0.1", 2)]
    assert {(e.value, e.hosts) for e in fleet.field_effects} == {("6.17.0-1009-intel", 2), ("7.0.1", 2)}


def test_marker_and_facts_problems(tmp_path):
    write_host(tmp_path, "both", make_report("cpu-tiny", "both"), unreachable={"reason": "verify failed"})
    write_host(tmp_path, "bad-marker").joinpath("unreachable.json").write_text("{not json")
    write_host(tmp_path, "bad-facts", make_report("cpu-tiny", "bad-facts")).joinpath(
        "host_facts.json").write_text('{"gpu_count": "two"}')
    write_host(tmp_path, "nothing")
    write_host(tmp_path, "partial", make_report("cpu-tiny", "partial", partial=True))
    report = aggregate(tmp_path)
    assert {(p.kind, p.host, p.action) for p in report.problems} == {
        ("conflicting_markers", "both", "excluded"),
        ("bad_marker", "bad-marker", "used"),
        ("bad_host_facts", "bad-facts", "excluded"),
        ("missing_report", "nothing", "excluded"),
    }
    statuses = {entry.host: entry.status for entry in report.hosts}
    assert statuses == {"both": "unreachable", "bad-marker": "unreachable", "bad-facts": "verified",
                        "nothing": "bad_report", "partial": "partial"}
    assert _host(report, "partial").reason == "stopped by the user"
    assert _host(report, "partial").all_claims_met is False
    assert "gpu_count" in next(p for p in report.problems if p.kind == "bad_host_facts").reason


def test_report_files_given_one_by_one(tmp_path):
    paths = []
    for root in ("a", "b"):
        directory = write_host(tmp_path / root, "same-name", make_report(
            "cpu-tiny", "same-name", started_at=STARTED_AT + timedelta(hours=1 if root == "b" else 0)))
        paths.append(directory / "report.json")
    report = aggregate(paths)
    assert report.source == "2 report files"
    (problem,) = report.problems
    assert problem.kind == "duplicate_host" and problem.path == str(paths[0])
    assert [entry.status for entry in report.hosts] == ["duplicate", "verified"]


def test_unknown_recipe_takes_its_claims_from_the_verdicts(tmp_path):
    for index in range(3):
        report = make_report("cpu-tiny", f"c{index}")
        report.recipe = "site-custom"
        write_host(tmp_path, f"c{index}", report)
    (fleet,) = aggregate(tmp_path).recipes
    assert fleet.recipe == "site-custom" and fleet.recipe_known is False
    assert [c.claim_id for c in fleet.claims] == ["greedy-identical", "acceptance-friendly-acceptance",
                                                  "decode-follows-acceptance", "speculation-vs-target-only"]
    assert all(c.met == 3 for c in fleet.claims)
    assert all(w.claims == [] for w in fleet.workloads)


def test_own_output_and_hidden_directories_are_not_hosts(tmp_path):
    write_host(tmp_path, "h1", make_report("cpu-tiny", "h1"))
    (tmp_path / "fleet").mkdir()
    (tmp_path / "fleet" / "fleet.json").write_text("{}")
    (tmp_path / ".cache").mkdir()
    report = aggregate(tmp_path)
    assert [entry.host for entry in report.hosts] == ["h1"] and report.problems == []


def test_naive_and_aware_start_times_compare(tmp_path):
    aware = make_report("cpu-tiny", "a")
    naive = make_report("cpu-tiny", "b", environment=environment_for("a"),
                        started_at=STARTED_AT.replace(tzinfo=None) + timedelta(minutes=5))
    write_host(tmp_path, "a", aware)
    write_host(tmp_path, "b", naive)
    report = aggregate(tmp_path)
    assert {entry.host: entry.status for entry in report.hosts} == {"a": "duplicate", "b": "verified"}


def test_an_unlistable_host_directory_is_named(tmp_path, monkeypatch):
    import os

    write_host(tmp_path, "fine", make_report("cpu-tiny", "fine"))
    write_host(tmp_path, "locked", make_report("cpu-tiny", "locked"))
    real_access = os.access
    # Root reads every directory; a user running the report may not.
    monkeypatch.setattr(os, "access", lambda path, mode: not str(path).endswith("locked") and real_access(path, mode))
    report = aggregate(tmp_path)
    (problem,) = report.problems
    assert (problem.kind, problem.host) == ("unreadable", "locked")
    assert "permission denied" in problem.reason
    assert {entry.host: entry.status for entry in report.hosts} == {"fine": "verified", "locked": "bad_report"}


def test_figures_from_measurements_when_no_structured_results(tmp_path):
    report = make_report("cpu-tiny", "flat")
    report.throughput = None  # a report that kept only the flat figures
    write_host(tmp_path, "flat", report)
    (entry,) = aggregate(tmp_path).hosts
    short = entry.workload("short")
    assert short.median_decode_tok_s == report.measurements["throughput.short.decode_tok_s.median"]
    assert short.peak_decode_tok_s == report.measurements["throughput.short.peak_tok_s.max"]
    assert short.per_position_acceptance == [0.82, 0.61, 0.44, 0.30]
    assert entry.workload("acceptance_friendly").acceptance_rate == pytest.approx(0.988)


def test_missing_or_empty_directory_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="does not exist"):
        aggregate(tmp_path / "missing")
    (tmp_path / "stray.txt").write_text("x")
    with pytest.raises(BadInput, match="has no host directories"):
        aggregate(tmp_path)
    with pytest.raises(BadInput, match="no report files"):
        aggregate([])


def test_robust_z_scores():
    assert stats.robust_z_scores([1.0, 2.0]) is None
    assert stats.robust_z_scores([5.0, 5.0, 5.0]) == [0.0, 0.0, 0.0]
    assert stats.robust_z_scores([0.0, 0.0, 0.0]) is None
    scores = stats.robust_z_scores([10.0, 11.0, 12.0, 13.0, 30.0])
    # median 12, MAD 1: z = 0.6745 * (x - 12)
    assert scores == pytest.approx([-1.349, -0.6745, 0.0, 0.6745, 12.141])
    # More than half equal: MAD is 0, the mean absolute deviation (2) stands in.
    scores = stats.robust_z_scores([50.0, 50.0, 50.0, 50.0, 40.0])
    assert scores == pytest.approx([0, 0, 0, 0, -0.7979 * 10 / 2])
    # Hosts agreeing to 0.1%: the spread floor (1% of the median) keeps a 1% difference from standing out...
    scores = stats.robust_z_scores([100.0, 100.1, 99.9, 100.05, 99.0])
    assert scores == pytest.approx([0, 0.1, -0.1, 0.05, -1.0])
    # ...while a 12% one still does.
    assert stats.robust_z_scores([100.0, 100.1, 99.9, 100.05, 88.0])[-1] == pytest.approx(-12.0)


def test_distribution_quantiles():
    d = stats.distribution([float(v) for v in range(1, 11)])
    assert (d.n, d.median, d.mad, d.min, d.max) == (10, 5.5, 2.5, 1.0, 10.0)
    assert (d.p10, d.p90) == (pytest.approx(1.9), pytest.approx(9.1))
    assert stats.distribution([]) is None


def test_hosts_on_emulated_hardware_are_counted_and_each_carries_its_root(tmp_path):
    from b70ctl.fleet.render import render_html, render_markdown
    write_host(tmp_path, "real", make_report("cpu-tiny", "real"))
    write_host(tmp_path, "fixture-1", make_report("cpu-tiny", "fixture-1", environment=environment_for(
        "fixture-1", hardware_root="/opt/b70-fixture")))
    # A report that did not record it, with host facts that did (host_facts.json fills what a report left out).
    write_host(tmp_path, "fixture-2", make_report("cpu-tiny", "fixture-2"),
               facts={**HOST_FACTS, "hardware_root": "/srv/fixture-2"})
    report = aggregate(tmp_path)
    assert report.summary.emulated == 2 and report.summary.hosts == 3
    assert {entry.host: entry.environment.hardware_root for entry in report.hosts} == {
        "real": None, "fixture-1": "/opt/b70-fixture", "fixture-2": "/srv/fixture-2"}
    on_disk = json.loads(report.model_dump_json())
    assert on_disk["summary"]["emulated"] == 2
    assert [h["environment"]["hardware_root"] for h in on_disk["hosts"]] == [
        "/opt/b70-fixture", "/srv/fixture-2", None]
    # Not a drift field: each fixture has its own root, and that is no difference between hosts to explain.
    assert all(d.field != "hardware_root" for fleet in report.recipes for d in fleet.drift)
    said = "**Emulated hardware on 2 of 3 hosts**: their GPU facts were read from a fixture's sysfs tree"
    assert said in render_markdown(report)
    assert "<strong>Emulated hardware on 2 of 3 hosts</strong>" in render_html(report)
    # A fleet of real hosts says nothing about it.
    real_only = aggregate([tmp_path / "real" / "report.json"])
    assert real_only.summary.emulated == 0 and "Emulated" not in render_markdown(real_only)
