"""The serve gate's fallback from p2p to no-p2p, as its pieces run: `b70ctl host fallback` on the controller, the
record it keeps, and topology.py on the host reading that record on every later host stage.

p2p is served only where a probe opened peer memory or the owner forced it; the threads show the start can still
die there (intel/llm-scaler #398: "Fails consistently at zeMemOpenIpcHandle during IPC memory sharing between the
two GPUs"; SergiioB/intel-arc-pro-b70-inference-cookbook #8, X570 dual B70: "Add four env vars to the container.
Nothing else changes"). The roles' wiring runs for real in tests/appliance/test_recording_serve.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from b70ctl.cli import app
from b70ctl.host_documents import TopologyDocument
from b70host.topology import CCL_PROFILES, FALLBACK_PATH, apply_fallback, fallback_record, topology
from host_package import host_module
from sysfs_trees import REPO, build_tree

B70CTL = Path(sys.executable).parent / "b70ctl"
# The posted log of a dual-B70 TP=2 start (tests/fixtures/field/index.yaml, intel/llm-scaler #398).
POSTED = REPO / "tests/fixtures/field/logs/s-llm-scaler-398-b70-awq-tp2-ipc.log"
SIGNATURE = "ze-ipc-open-invalid-argument"
# tests/fixtures/sysfs.py: the switch host's two B70s.
SWITCH_GROUP = ["0000:05:00.0", "0000:09:00.0"]


@pytest.fixture(autouse=True)
def no_ze_loader(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("B70CTL_ZE_LOADER", str(tmp_path / "absent" / "libze_loader.so.1"))


def p2p_document(tmp_path: Path) -> dict:
    """The switch host served p2p by its owner's override (after ze_peer passed), as the gpu_topology role writes it."""
    root = build_tree(tmp_path, "b70x2-switch")
    document = topology(root, 2, profile="p2p", probe="never")
    assert (document["profile"], document["profile_source"]) == ("p2p", "override")
    return {key: value for key, value in document.items() if key not in ("changed", "path")}


def test_the_role_s_signal_is_the_catalogue_entry_whose_fix_is_no_p2p() -> None:
    """The vllm_serve role falls back on the failure `b70ctl diagnose --start` names as no_p2p_failure (the first
    diagnosed failure whose fix.profile is no-p2p): on the posted log that is the IPC-open entry, with the posted
    line as its evidence (what the role passes as --evidence)."""
    diagnose = yaml.safe_load((REPO / "roles/vllm_serve/tasks/diagnose.yml").read_text())
    call = next(task for task in diagnose if task["name"] == "Name known failures in the units' journals")
    assert call["b70ctl"]["command"] == ["diagnose", "--start", "-", "--json"]
    # The role's own call, with the journal read as Ansible registered it (exit 1: found).
    start = {"host": "b70-a", "health_timeout_s": 900, "failed_task": "Wait for /health",
             "journal": {"rc": 0, "stdout": json.dumps(
                 {"units": [{"unit": "b70-vllm", "lines": POSTED.read_text().splitlines()}]})}}
    diagnosed = subprocess.run([str(B70CTL), "diagnose", "--start", "-", "--json"], input=json.dumps(start),
                               capture_output=True, text=True)
    assert diagnosed.returncode == 1, diagnosed.stderr
    falls_back = json.loads(diagnosed.stdout)["no_p2p_failure"]
    assert falls_back["id"] == SIGNATURE and falls_back["fix"]["profile"] == "no-p2p"
    assert falls_back["evidence"][0]["text"] == "zeMemOpenIpcHandle, code: ZE_RESULT_ERROR_INVALID_ARGUMENT"
    rollback = yaml.safe_load((REPO / "roles/vllm_serve/tasks/rollback.yml").read_text())
    signal = next(task for task in rollback if task["name"] == "Name the failure the no-p2p profile fixes")
    assert ".no_p2p_failure" in signal["ansible.builtin.set_fact"]["vllm_serve_p2p_failure"]


def test_fallback_command_prints_the_record_and_the_no_p2p_topology(tmp_path: Path) -> None:
    document = p2p_document(tmp_path)
    posted_line = POSTED.read_text().splitlines()[0]
    result = CliRunner().invoke(app, ["host", "fallback", "--json", "--topology", "-", "--signature", SIGNATURE,
                                      "--evidence", posted_line], input=json.dumps(document))
    assert result.exit_code == 0, result.output
    people = CliRunner().invoke(app, ["host", "fallback", "--topology", "-", "--signature", SIGNATURE,
                                      "--evidence", posted_line], input=json.dumps(document))
    assert people.exit_code == 0, people.output
    assert people.stdout.splitlines()[0] == f"profile: p2p -> no-p2p for {', '.join(SWITCH_GROUP)}"
    printed = json.loads(result.stdout)
    record, fallen = printed["record"], printed["topology"]
    assert record["group"] == SWITCH_GROUP and record["signature"] == SIGNATURE
    assert record["evidence"] == posted_line and (record["from_profile"], record["to_profile"]) == ("p2p", "no-p2p")
    assert (fallen["profile"], fallen["profile_source"]) == ("no-p2p", "fallback")
    assert fallen["ccl_env"] == CCL_PROFILES["no-p2p"]["env"]
    assert fallen["docker_args"] == CCL_PROFILES["no-p2p"]["docker_args"]
    assert SIGNATURE in fallen["profile_reason"] and FALLBACK_PATH in fallen["profile_reason"]
    # The document the serve renderer reads: it serves the no-p2p set now.
    parsed = TopologyDocument.model_validate(fallen)
    assert parsed.serve_env()["CCL_TOPO_P2P_ACCESS"] == "0" and parsed.fallback == record
    # The files the role writes are the text the host package writes: the next host stage, reading the record
    # where the role left it, writes the same topology.json byte for byte (no change to report).
    assert json.loads(printed["record_json"]) == record and json.loads(printed["topology_json"]) == fallen
    kept = tmp_path / "ccl-fallback.json"
    kept.write_text(printed["record_json"])
    again = topology(str(tmp_path / "b70x2-switch"), 2, profile="p2p", probe="never", write=True,
                     fallback_path=str(kept))
    written = (tmp_path / "b70x2-switch" / "etc/b70/topology.json").read_text()
    assert again["profile"] == "no-p2p"
    assert written.replace(str(kept), FALLBACK_PATH) == printed["topology_json"]
    # Everything else stays as the host stage wrote it.
    assert {key: value for key, value in fallen.items() if key not in (
        "profile", "profile_source", "profile_reason", "ccl_env", "docker_args", "fallback")} == {
        key: value for key, value in document.items() if key not in (
            "profile", "profile_source", "profile_reason", "ccl_env", "docker_args")}


def test_fallback_from_the_topology_file_is_the_fallback_from_stdin(tmp_path: Path) -> None:
    """--topology FILE (read once: validated as the serving stage reads it, and used as written) gives what the
    role's stdin gives; a file that is not a valid topology is refused before anything is printed."""
    document = p2p_document(tmp_path)
    path = tmp_path / "topology.json"
    path.write_text(json.dumps(document))
    args = ["host", "fallback", "--json", "--signature", SIGNATURE, "--evidence", "x"]
    from_stdin = CliRunner().invoke(app, [*args, "--topology", "-"], input=json.dumps(document))
    from_file = CliRunner().invoke(app, [*args, "--topology", str(path)])
    assert from_stdin.exit_code == from_file.exit_code == 0, from_file.output

    def untimed(printed: str) -> dict:
        """The record, and the reason quoting it, carry the second each was made: two runs may straddle one."""
        stamped = re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", "<time>", printed)
        return {key: value for key, value in json.loads(stamped).items() if key not in ("record", "record_json")}

    assert untimed(from_file.stdout) == untimed(from_stdin.stdout)
    path.write_text(json.dumps({**document, "ccl_env": {}}))
    refused = subprocess.run([str(B70CTL), *args, "--topology", str(path)], capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stdout == ""
    assert "ccl_env differs from profile p2p's set" in refused.stderr


@pytest.mark.parametrize("case, expected", [
    ("no-p2p", "the profile is no-p2p, not p2p: there is nothing to fall back from"),
    ("wrong-signature", "--signature xe-engine-reset-fault: not a catalogue entry whose fix is the no-p2p profile"),
    ("not-json", "--topology -: not valid JSON (line 1): pipe in /etc/b70/topology.json"),
])
def test_fallback_command_refuses_with_one_line(tmp_path: Path, case: str, expected: str) -> None:
    document = p2p_document(tmp_path)
    signature = "xe-engine-reset-fault" if case == "wrong-signature" else SIGNATURE
    if case == "no-p2p":
        document["profile"] = "no-p2p"
    stdin = "{not json" if case == "not-json" else json.dumps(document)
    result = subprocess.run([str(B70CTL), "host", "fallback", "--topology", "-", "--signature", signature,
                             "--evidence", "x"], input=stdin, capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_record_of_another_group_or_a_no_p2p_document_changes_nothing(tmp_path: Path) -> None:
    document = p2p_document(tmp_path)
    record = fallback_record(document, SIGNATURE, "line", "2026-12-02T00:00:00Z")
    assert apply_fallback(document, dict(record, group=["0000:05:00.0", "0000:0d:00.0"])) == document
    assert apply_fallback(document, None) == document
    no_p2p = dict(document, profile="no-p2p")
    assert apply_fallback(no_p2p, record) == no_p2p


def run_script(*args: str) -> subprocess.CompletedProcess:
    """topology.py as the gpu_topology role runs it: the host's python3, the host package alone."""
    return subprocess.run(host_module("topology", "--probe", "never", "--tensor-parallel-size", "2", *args),
                          capture_output=True, text=True, cwd="/")


def test_the_host_stage_keeps_no_p2p_while_the_record_names_the_group(tmp_path: Path) -> None:
    """Every later host stage runs topology.py with --fallback-record: the owner's p2p override does not bring back
    the start that died; removing the record does. A record that cannot be read stops the stage (exit 2)."""
    root = build_tree(tmp_path, "b70x2-switch")
    record_path = tmp_path / "ccl-fallback.json"
    absent = run_script("--root", root, "--profile", "p2p", "--fallback-record", str(record_path))
    assert absent.returncode == 0, absent.stderr
    assert json.loads(absent.stdout)["profile"] == "p2p"
    document = json.loads(absent.stdout)
    record_path.write_text(json.dumps(fallback_record(document, SIGNATURE, "line", "2026-12-02T00:00:00Z")))
    kept = run_script("--root", root, "--profile", "p2p", "--fallback-record", str(record_path))
    assert kept.returncode == 0, kept.stderr
    assert (json.loads(kept.stdout)["profile"], json.loads(kept.stdout)["profile_source"]) == ("no-p2p", "fallback")
    record_path.write_text("{broken")
    broken = run_script("--root", root, "--profile", "p2p", "--fallback-record", str(record_path))
    assert broken.returncode == 2
    assert broken.stderr.startswith(f"error: fallback record {record_path} cannot be read")
    assert len(broken.stderr.strip().splitlines()) == 1


def test_the_gpu_topology_role_passes_the_record_beside_topology_json() -> None:
    tasks = yaml.safe_load((REPO / "roles/gpu_topology/tasks/main.yml").read_text())
    decide = next(task for task in tasks if task["name"] == "Decide P2P and the oneCCL profile")
    argv = decide["ansible.builtin.command"]["argv"]
    assert "'--fallback-record', (gpu_topology_path | dirname) ~ '/ccl-fallback.json', '--document'" in argv
    assert FALLBACK_PATH == "/etc/b70/ccl-fallback.json"


def test_the_document_the_role_copies_is_the_one_write_writes(tmp_path: Path) -> None:
    """The role writes topology.json from --document's stdout (the command module drops its last newline): the same
    bytes topology.py's own --write leaves, and a document the serve renderer reads."""
    root = build_tree(tmp_path, "b70x2-switch")
    printed = run_script("--root", root, "--profile", "p2p", "--document")
    assert printed.returncode == 0, printed.stderr
    assert run_script("--root", root, "--profile", "p2p", "--write").returncode == 0
    written = (Path(root) / "etc" / "b70" / "topology.json").read_text()
    assert printed.stdout == written and "changed" not in json.loads(written)
    assert TopologyDocument.model_validate_json(printed.stdout).profile == "p2p"


def test_the_report_says_which_profile_and_why(tmp_path: Path) -> None:
    """The host's topology.json reaches the report through host_facts.json: the profile and, for a fallback, what
    died and how to try p2p again; the markdown prints both on the P2P profile line."""
    from b70ctl.host.environment import HostBundle, host_environment
    from b70ctl.lock.model import load_recipe_and_lock

    document = p2p_document(tmp_path)
    fallen = apply_fallback(document, fallback_record(document, SIGNATURE, "zeMemOpenIpcHandle, code: "
                                                      "ZE_RESULT_ERROR_INVALID_ARGUMENT", "2026-12-02T00:00:00Z"))
    recipe, lock, _ = load_recipe_and_lock("pr620-fp8-tp2", None)
    environment = host_environment(HostBundle(hostname="b70-a", topology=fallen), recipe, lock)
    assert environment.p2p_profile == "no-p2p"
    assert environment.p2p_profile_reason.startswith("fallback: p2p died at start on these cards "
                                                     f"({SIGNATURE}, 2026-12-02T00:00:00Z: zeMemOpenIpcHandle")
    forced = host_environment(HostBundle(hostname="b70-a", topology=document), recipe, lock)
    assert forced.p2p_profile == "p2p" and forced.p2p_profile_reason.startswith("override: ")
