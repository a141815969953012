"""`b70ctl fleet report`: the three files, --json, and exit codes 0 (all met), 1 (some not), 2 (bad input)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fleet_factory import b70ctl, make_report, write_host


def test_all_met_exits_0_and_writes_three_files(tmp_path):
    for index in range(3):
        write_host(tmp_path / "reports", f"h{index}", make_report("cpu-tiny", f"h{index}"))
    result = b70ctl("fleet", "report", str(tmp_path / "reports"), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    # The summary is the command's output for people: stdout, so `| tee` keeps it.
    assert "3 of 3 hosts met every claim" in result.stdout and "hosts met every claim" not in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["fleet.html", "fleet.json", "fleet.md"]


def test_a_host_not_meeting_a_claim_exits_1_and_json_goes_to_stdout(tmp_path):
    # pr620's short-median claim is 72.2 tok/s: a host at a tenth of the typical rate cannot meet it.
    write_host(tmp_path / "reports", "fast", make_report("pr620-fp8-tp2", "fast"))
    write_host(tmp_path / "reports", "slow", make_report("pr620-fp8-tp2", "slow", speed=0.1))
    result = b70ctl("fleet", "report", str(tmp_path / "reports"), "--out", str(tmp_path / "out"), "--json")
    assert result.returncode == 1, result.stderr
    printed = json.loads(result.stdout)
    assert printed == json.loads((tmp_path / "out" / "fleet.json").read_text())
    (fleet,) = printed["recipes"]
    assert {c["claim_id"]: c["hosts_not_met"] for c in fleet["claims"]}["short-median"] == ["slow"]


def test_corrupt_report_exits_1_and_is_named(tmp_path):
    write_host(tmp_path / "reports", "ok", make_report("cpu-tiny", "ok"))
    write_host(tmp_path / "reports", "broken").joinpath("report.json").write_text('{"schema_version": 1, "rec')
    result = b70ctl("fleet", "report", str(tmp_path / "reports"), "--out", str(tmp_path / "out"))
    assert result.returncode == 1
    assert "truncated (excluded): " in result.stdout and "broken/report.json" in result.stdout


def test_missing_or_empty_reports_dir_exits_2_with_one_line(tmp_path):
    for reports_dir in (tmp_path / "missing", tmp_path):
        result = b70ctl("fleet", "report", str(reports_dir), "--out", str(tmp_path / "out"))
        assert result.returncode == 2
        assert result.stderr.startswith("error: reports directory ")
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_entry_point_is_registered():
    result = b70ctl("fleet", "--help")
    assert result.returncode == 0 and "report" in result.stdout
    assert Path(sys.executable).with_name("b70ctl").exists()


def test_mark_writes_the_marker_the_fleet_report_reads(tmp_path):
    """The verify play's markers come from `fleet mark`: one line of reason, read back as that host's row; a
    marker the host's own verify wrote stays under --keep-existing, and nothing is written on a bad call."""
    reports = tmp_path / "reports"
    write_host(reports, "ok", make_report("cpu-tiny", "ok"))
    lost = reports / "lost"
    marked = b70ctl("fleet", "mark", str(lost), "--kind", "unreachable", "--stage", "connect", "--recipe",
                    "cpu-tiny", "--reason", "no SSH answer at 10.0.0.9\n within 5 s", "--json")
    assert marked.returncode == 0, marked.stderr
    written = json.loads((lost / "unreachable.json").read_text())
    assert written == json.loads(marked.stdout)
    assert (written["host"], written["kind"], written["reason"]) == ("lost", "unreachable",
                                                                     "no SSH answer at 10.0.0.9 within 5 s")
    kept = b70ctl("fleet", "mark", str(lost), "--kind", "failed", "--reason", "later", "--keep-existing")
    assert kept.returncode == 0, kept.stderr
    assert json.loads((lost / "unreachable.json").read_text())["reason"] == written["reason"]
    report = b70ctl("fleet", "report", str(reports), "--out", str(tmp_path / "out"), "--json")
    assert report.returncode == 1, report.stderr  # a host without a report is not a host that met the claims
    rows = {host["host"]: host for host in json.loads(report.stdout)["hosts"]}
    assert rows["lost"]["status"] == "unreachable" and "no SSH answer at 10.0.0.9" in rows["lost"]["reason"]

    bad = b70ctl("fleet", "mark", str(reports / "other"), "--kind", "gone", "--reason", "x")
    assert bad.returncode == 2 and "--kind 'gone'" in bad.stderr and bad.stderr.count("\n") == 1
    assert not (reports / "other").exists()
