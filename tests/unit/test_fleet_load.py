"""report/load.py: every known schema version is upgraded, every unusable file is classified with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from b70ctl.errors import BadInput
from b70ctl.report.load import (
    NOT_RECORDED_IN_SCHEMA_0,
    LoadedReport,
    ReportProblem,
    ReportUnusable,
    load_report,
    read_report,
    upgrade_report_json,
)
from fleet_factory import environment_for, make_report, to_schema_0


@pytest.fixture(scope="module")
def report_json() -> str:
    return make_report("pr620-fp8-tp2", "b70-01", environment=environment_for("b70-01")).model_dump_json()


def _write(tmp_path: Path, content: str | bytes) -> Path:
    path = tmp_path / "report.json"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def test_current_schema_loads_unchanged(tmp_path, report_json):
    loaded = read_report(_write(tmp_path, report_json))
    assert isinstance(loaded, LoadedReport)
    assert loaded.upgraded_from is None
    assert loaded.report.model_dump_json() == report_json


def test_schema_0_is_upgraded(tmp_path):
    original = make_report("pr620-fp8-tp2", "b70-02", environment=environment_for("b70-02"))
    old = to_schema_0(original)
    assert "schema_version" not in old and "environment" not in old and "measurements" not in old
    loaded = read_report(_write(tmp_path, json.dumps(old)))
    assert isinstance(loaded, LoadedReport), loaded
    report = loaded.report
    assert loaded.upgraded_from == 0
    assert report.schema_version == 4
    # Moved from the top level into environment; what schema 0 never knew stays unknown.
    assert report.environment.vllm_version == "0.21.1.dev0"
    assert report.environment.served_model == "qwen3.8-27b-fp8"
    assert report.environment.kernel is None and report.environment.image_digest is None
    # Measurements rebuilt from the structured results: the same figures the original carried.
    assert report.measurements["throughput.short.decode_tok_s.median"] == pytest.approx(
        original.measurements["throughput.short.decode_tok_s.median"])
    assert report.measurements["correctness.identical_fraction"] == 1.0
    assert report.measurements["throughput.acceptance_friendly.acceptance_rate"] == pytest.approx(0.988)
    assert "throughput.short.per_position_acceptance" not in report.measurements
    spec = report.throughput.workloads[0].spec_decode
    assert spec.per_position_acceptance == [] and spec.polluted is False
    assert [v.verdict for v in report.verdicts] == [v.verdict for v in original.verdicts]
    assert {v.bound for v in report.verdicts} == {NOT_RECORDED_IN_SCHEMA_0}
    assert report.partial is False


def test_schema_2_is_upgraded_without_a_word_on_emulation(tmp_path, report_json):
    # Schema 2 had no hardware_root: it did not record whether the hardware was emulated.
    data = json.loads(report_json)
    data["schema_version"] = 2
    del data["environment"]["hardware_root"]
    loaded = read_report(_write(tmp_path, json.dumps(data)))
    assert isinstance(loaded, LoadedReport), loaded
    assert loaded.upgraded_from == 2 and loaded.report.schema_version == 4
    assert loaded.report.environment.hardware_root is None
    assert loaded.report.environment.kernel == json.loads(report_json)["environment"]["kernel"] is not None


def test_schema_3_is_upgraded_without_a_roofline(tmp_path, report_json):
    # Schema 3 recorded no memory bandwidth and no target shape: its roofline stays unknown, not computed.
    data = json.loads(report_json)
    data["schema_version"] = 3
    for key in ("memory_bandwidth", "target_shape", "memory_bandwidth_unavailable", "target_shape_unavailable"):
        data["environment"].pop(key, None)
    data.pop("roofline", None)
    loaded = read_report(_write(tmp_path, json.dumps(data)))
    assert isinstance(loaded, LoadedReport), loaded
    assert loaded.upgraded_from == 3 and loaded.report.schema_version == 4
    assert loaded.report.roofline is None and loaded.report.environment.memory_bandwidth is None


def test_explicit_schema_0_key_is_the_same_layout(tmp_path):
    old = to_schema_0(make_report("cpu-tiny", "tiny-1"))
    old["schema_version"] = 0
    loaded = read_report(_write(tmp_path, json.dumps(old)))
    assert isinstance(loaded, LoadedReport) and loaded.upgraded_from == 0


@pytest.mark.parametrize("version", [5, 7, -1, "1", 1.5, None, [1]])
def test_unknown_schema_version_is_refused_with_the_reason(tmp_path, report_json, version):
    data = json.loads(report_json)
    data["schema_version"] = version
    problem = read_report(_write(tmp_path, json.dumps(data)))
    assert isinstance(problem, ReportProblem)
    assert problem.kind == "unknown_schema_version"
    assert "schema_version" in problem.reason and str(tmp_path) in problem.reason
    if version == 7:
        assert "unknown to this b70ctl (it reads 0..4)" in problem.reason


def test_every_prefix_of_a_report_is_truncated(tmp_path, report_json):
    # Wherever a copy stops, the file is named truncated, never corrupt, never a crash.
    for cut in range(1, len(report_json), 97):
        problem = read_report(_write(tmp_path, report_json[:cut]))
        assert isinstance(problem, ReportProblem), cut
        assert problem.kind == "truncated", (cut, report_json[cut - 20:cut], problem.reason)
        assert "collect the report again" in problem.reason


@pytest.mark.parametrize(
    ("content", "kind", "fragment"),
    [
        (b"", "empty", "empty file"),
        (b"  \n", "empty", "empty file"),
        (b'{"schema_version": 1,, "recipe": "x"}', "corrupt", "not valid JSON (line 1 column 22"),
        (b'{"schema_version": 1, "recipe": xyz, "a": 1}', "corrupt", "not valid JSON"),
        (b"\xff\xfe{}", "corrupt", "not UTF-8"),
        (b"[1, 2, 3]", "corrupt", "top level is a JSON list"),
        (b'"report"', "corrupt", "top level is a JSON str"),
        (b'{"schema_version": 1, "recipe": "pr620-fp8-tp2"}', "invalid", "not a valid schema 1 report"),
        (b'{"recipe": "x", "throughput": {"workloads": [{"no_name": 1}]}}', "invalid",
         "not a valid schema 0 report: tool_version: Field required"),
        (b'{"recipe": "x", "verdicts": 5}', "invalid", "not a schema 0 report (TypeError"),
    ],
)
def test_unusable_files_are_classified(tmp_path, content, kind, fragment):
    problem = read_report(_write(tmp_path, content))
    assert isinstance(problem, ReportProblem)
    assert problem.kind == kind
    assert fragment in problem.reason


def test_corrupt_in_the_middle(tmp_path, report_json):
    middle = len(report_json) // 2
    garbled = report_json[:middle] + "\x00#%" + report_json[middle + 3:]
    problem = read_report(_write(tmp_path, garbled))
    assert isinstance(problem, ReportProblem) and problem.kind == "corrupt"


def test_missing_file_is_unreadable(tmp_path):
    problem = read_report(tmp_path / "nope.json")
    assert isinstance(problem, ReportProblem) and problem.kind == "unreadable"
    assert "No such file" in problem.reason


def test_load_report_raises_bad_input_with_the_reason(tmp_path, report_json):
    assert load_report(_write(tmp_path, report_json)).recipe == "pr620-fp8-tp2"
    with pytest.raises(ReportUnusable) as raised:
        load_report(_write(tmp_path, report_json[:100]))
    assert isinstance(raised.value, BadInput)
    assert raised.value.problem.kind == "truncated"
    assert str(raised.value).endswith("collect the report again")


def test_upgrade_report_json_leaves_current_versions_alone(report_json):
    data = json.loads(report_json)
    assert upgrade_report_json(data) is data
    with pytest.raises(ValueError, match="schema_version 9 is unknown"):
        upgrade_report_json({**data, "schema_version": 9})
