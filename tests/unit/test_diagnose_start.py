"""b70ctl diagnose --start: the serve play's failure message and the serve gate's fallback decision, from the units'
journals as b70host.journal hands them on and Ansible's own failed-task result.

The journals are real: a vLLM CPU start that asked for more KV cache than the machine has (captured from a real
server, tests/fixtures/diagnose/README.md) and a B70 owner's TP=2 start that died opening the peer's memory
(tests/fixtures/field/index.yaml). The appliance test of a start that never becomes healthy runs the same command
through the role on a systemd host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from b70ctl.diagnose.start import FailedStart, diagnose_start
from host_package import host_module, host_python

B70CTL = str(Path(sys.executable).with_name("b70ctl"))
REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
KV_CACHE_LOG = FIXTURES / "diagnose" / "real" / "kv-cache-too-large.log"
HEALTHY_LOG = FIXTURES / "diagnose" / "real" / "healthy.log"
P2P_LOG = FIXTURES / "field" / "logs" / "s-llm-scaler-398-b70-awq-tp2-ipc.log"
# What Ansible's fail task in start.yml leaves in ansible_failed_result: serve_wait's reason.
DIED = ("b70-vllm died while starting (1 time(s); systemd: activating/auto-restart, result exit-code) before "
        "/health answered on port 8000, after 41 s")


def registered(stdout: str, rc: int = 0, stderr: str = "") -> dict:
    """A command task's result as Ansible registers it (the keys ansible.builtin.command's RETURN documents, in
    ansible-core 2.19's modules/command.py): the role passes its journal read on whole. The role's own tasks hand
    over what Ansible really registers in test_the_roles_own_diagnose_tasks_through_ansible below."""
    return {"changed": False, "cmd": ["/usr/bin/python3", "-P", "-B", "-m", "b70host.journal"], "rc": rc,
            "start": "2026-12-04 10:00:00.000001", "end": "2026-12-04 10:00:00.080001", "delta": "0:00:00.080000",
            "msg": "" if rc == 0 else "non-zero return code", "stdout": stdout, "stdout_lines": stdout.splitlines(),
            "stderr": stderr, "stderr_lines": stderr.splitlines(), "failed": False}


def journal_read(units: dict[str, list[str]]) -> dict:
    return registered(json.dumps({"units": [{"unit": unit, "lines": lines, "error": None}
                                            for unit, lines in units.items()]}))


def document(journals: dict[str, Path], **fields: object) -> dict:
    return {"host": "b70-app-1", "health_timeout_s": 900, "failed_task": "Wait for /health",
            "failed_result": {"msg": DIED, "failed": True, "changed": False},
            "journal": journal_read({unit: path.read_text().splitlines() for unit, path in journals.items()}),
            **fields}


def test_a_start_that_died_is_named_with_vllms_reason_the_rollback_and_the_fix() -> None:
    found = diagnose_start(FailedStart.model_validate(document(
        {"b70-vllm": KV_CACHE_LOG, "b70-vllm-baseline": HEALTHY_LOG})), last_good=True)
    assert found.message.startswith(f"b70-app-1: vLLM is not serving: Wait for /health failed ({DIED}; health "
                                    "timeout 900 s). The last healthy configuration was put back and restarted.")
    # vLLM's own reason from the unit that died (its error lines, not its traceback's last frames); the healthy
    # unit's last lines as they are.
    quoted = found.message.split("Last log lines: ")[1].split("Diagnosis: ")[0]
    died, healthy = quoted.split("[b70-vllm-baseline] ")
    assert died.startswith("[b70-vllm] ") and "(100000.0 GiB)" in died and "File \"" not in died
    assert healthy.strip() and "(100000.0 GiB)" not in healthy
    assert "Diagnosis: [b70-vllm] kv-cache-larger-than-host-memory: Lower VLLM_CPU_KVCACHE_SPACE" in found.message
    assert "[b70-vllm-baseline] kv-cache" not in found.message
    assert found.message.endswith("Fix: read `journalctl -u b70-vllm` on the host, correct the setting, run the play "
                                  "again.")
    assert found.no_p2p_failure is None and found.found_failure


def test_a_p2p_start_that_died_opening_peer_memory_names_the_no_p2p_failure() -> None:
    found = diagnose_start(FailedStart.model_validate(document({"b70-vllm": P2P_LOG})))
    assert found.no_p2p_failure is not None
    assert (found.no_p2p_failure.id, found.no_p2p_failure.fix.profile) == ("ze-ipc-open-invalid-argument", "no-p2p")
    assert "ZE_RESULT_ERROR_INVALID_ARGUMENT" in found.no_p2p_failure.evidence[0].text
    # Before the rollback the message says nothing of one; after a fallback's start failed too, it says so.
    assert "healthy configuration" not in found.message
    again = diagnose_start(FailedStart.model_validate(document({"b70-vllm": P2P_LOG},
                                                               fell_back="ze-ipc-open-invalid-argument")),
                           last_good=False)
    assert ("It had been restarted once with no-p2p after the p2p start died at ze-ipc-open-invalid-argument "
            "(/etc/b70/ccl-fallback.json); that start failed too. No earlier healthy configuration exists to put "
            "back.") in again.message


def test_a_failed_loop_is_named_by_its_first_failed_item_and_an_empty_journal_by_nothing_matched() -> None:
    refused = "Status code was -1 and not [200]: Request failed: <urlopen error [Errno 111] Connection refused>"
    found = diagnose_start(FailedStart.model_validate({
        "host": "h", "health_timeout_s": 60, "failed_task": "Check /v1/models serves the recipe's model",
        "failed_result": {"msg": "One or more items failed", "failed": True, "results": [
            {"item": {"unit": "b70-vllm"}, "failed": False, "status": 200},
            {"item": {"unit": "b70-vllm-baseline"}, "failed": True, "msg": refused}]},
        "journal": journal_read({"b70-vllm": []})}))
    assert f"Check /v1/models serves the recipe's model failed ({refused}; health timeout 60 s)" in found.message
    assert "Diagnosis: no known failure matched (b70ctl diagnose)." in found.message
    assert not found.found_failure


def test_journals_that_could_not_be_read_are_said_so_and_the_start_still_gets_its_message() -> None:
    """The host's read of the journals failed (here: the host package missing, as on a host whose package was
    removed), or journalctl refused one unit: the message names that, where the log lines would be."""
    missing = "/usr/bin/python3: No module named b70host.journal"
    unread = diagnose_start(FailedStart.model_validate({**document({}), "journal": registered("", 1, missing)}))
    assert (f"The units' journals could not be read on the host (b70host.journal exited 1: {missing})."
            in unread.message)
    assert "Last log lines" not in unread.message and unread.units == [] and not unread.found_failure
    printed_else = diagnose_start(FailedStart.model_validate({**document({}), "journal": registered("[]")}))
    assert ("could not be read on the host (b70host.journal printed no journal document: (top level): Input "
            "should be an object).") in printed_else.message
    refused = diagnose_start(FailedStart.model_validate({**document({}), "journal": registered(json.dumps(
        {"units": [{"unit": "b70-vllm", "lines": [], "error": "No journal files were found."}]}))}))
    assert "Last log lines: [b70-vllm] (journalctl: No journal files were found.)" in refused.message
    # No interpreter on the host: Ansible's module failure, as it registered it for a pyenv shim without its Python.
    no_python = {"changed": False, "failed": False, "failed_when_result": False, "rc": 127, "module_stdout": "",
                 "msg": "Module result deserialization failed: No start of json char found",
                 "module_stderr": "pyenv: python3.13: command not found\n\nThe `python3.13' command exists in these "
                                  "Python versions:\n  3.13.0\n\nNote: See 'pyenv help global' for tips on allowing "
                                  "multiple\n      Python versions to be found at the same time.\n"}
    gone = diagnose_start(FailedStart.model_validate({**document({}), "journal": no_python}))
    assert "(b70host.journal exited 127: pyenv: python3.13: command not found)." in gone.message
    skipped = diagnose_start(FailedStart.model_validate({**document({}), "journal": {
        "changed": False, "skipped": True, "skip_reason": "Conditional result was False"}}))
    assert "could not be read on the host (b70host.journal did not run (no exit status))." in skipped.message


def test_the_role_hands_over_exactly_a_failed_start_and_says_the_rollback_with_the_flag() -> None:
    """The vllm_serve role's document is this model's fields, no more (the model refuses others), and its two
    calls are the ones above: before the rollback with --json, after it with --last-good or --no-last-good."""
    tasks = yaml.safe_load((REPO / "roles/vllm_serve/tasks/diagnose.yml").read_text())
    kept = next(task for task in tasks if task["name"] == "Keep what failed")
    assert set(kept["ansible.builtin.set_fact"]["vllm_serve_failed_start"]) == set(FailedStart.model_fields)
    rollback = yaml.safe_load((REPO / "roles/vllm_serve/tasks/rollback.yml").read_text())
    block = next(task for task in rollback if "block" in task and any(
        inner.get("name") == "Name the failure, the rollback and the fix" for inner in task["block"]))
    call = next(inner for inner in block["block"] if inner.get("name") == "Name the failure, the rollback and the fix")
    command = call["b70ctl"]["command"]
    assert command[:3] == ["diagnose", "--start", "-"] and "--last-good" in command[3] \
        and "--no-last-good" in command[3]
    assert call["b70ctl"]["input"] == "{{ vllm_serve_failed_start }}"  # sent as JSON by the b70ctl action


def run(*args: str, stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([B70CTL, "diagnose", *args], input=stdin, capture_output=True, text=True, timeout=60)


def test_the_command_prints_the_message_or_the_json_and_exits_1_when_a_failure_is_known() -> None:
    text = json.dumps(document({"b70-vllm": KV_CACHE_LOG}))
    plain = run("--start", "-", "--last-good", stdin=text)
    assert plain.returncode == 1 and plain.stdout.startswith("b70-app-1: vLLM is not serving: ")
    assert plain.stdout.count("\n") == 1  # one line: the play's fail message
    # The rollback's outcome is the flag the role's second call adds; the first call (before it) says nothing of it.
    assert "The last healthy configuration was put back and restarted." in plain.stdout
    assert "No earlier healthy configuration" in run("--start", "-", "--no-last-good", stdin=text).stdout
    assert "healthy configuration" not in run("--start", "-", stdin=text).stdout
    as_json = json.loads(run("--start", "-", "--last-good", "--json", stdin=text).stdout)
    assert as_json["message"] == plain.stdout.strip() and as_json["no_p2p_failure"] is None
    assert [unit["unit"] for unit in as_json["units"]] == ["b70-vllm"]


@pytest.mark.parametrize(("args", "stdin", "named"), [
    (["--start", "-"], "{\"host\": \"h\"}", "--start: journal: Field required"),
    (["--start", "-"], "[]", "--start: expected a JSON object"),
    (["--start", "-", "--log", "x.log"], "{}", "--start reads the journals its document carries"),
    (["--log", "x.log", "--last-good"], "", "--last-good/--no-last-good say how a failed start's rollback ended"),
    (["--start", "-"], json.dumps({**document({}), "last_good": True}),
     "--start: last_good: Extra inputs are not permitted"),
])
def test_a_bad_document_is_one_line_and_exit_2(args: list[str], stdin: str, named: str) -> None:
    result = run(*args, stdin=stdin)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and named in result.stderr, result.stderr


def test_the_hosts_journal_document_is_what_the_command_reads(tmp_path: Path) -> None:
    """b70host.journal as the role runs it (the installed package, the system Python), with journalctl answering
    from the captured log for one unit and refusing the other, as it does for a unit it has no lines of."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "journalctl").write_text(
        "#!/bin/sh\n"
        f"echo \"$@\" >> {tmp_path / 'argv'}\n"
        f"[ \"$2\" = b70-vllm ] && exec cat {KV_CACHE_LOG}\n"
        "echo 'No journal files were found.' >&2; exit 1\n")
    (bin_dir / "journalctl").chmod(0o755)
    servers = json.dumps([{"unit": "b70-vllm", "port": 8000, "baseline": False},
                          {"unit": "b70-vllm-baseline", "port": 8001, "baseline": True}])
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    journal = subprocess.run(host_module("journal"), input=servers, capture_output=True, text=True, env=env,
                             timeout=60)
    assert journal.returncode == 0, journal.stderr
    assert (tmp_path / "argv").read_text().splitlines()[0] == "--unit b70-vllm --lines 400 --no-pager --output cat"
    units = json.loads(journal.stdout)["units"]
    assert [(unit["unit"], len(unit["lines"])) for unit in units] == [
        ("b70-vllm", len(KV_CACHE_LOG.read_text().splitlines())), ("b70-vllm-baseline", 0)]
    assert [unit["error"] for unit in units] == [None, "No journal files were found."]
    start = {"host": "h", "health_timeout_s": 900, "journal": registered(journal.stdout)}
    found = json.loads(run("--start", "-", "--json", stdin=json.dumps(start)).stdout)
    assert [[match["id"] for match in unit["failures"]] for unit in found["units"]] == [
        ["kv-cache-larger-than-host-memory"], []]
    bad = subprocess.run(host_module("journal"), input="[{\"unit\": \"b70 vllm\"}]", capture_output=True, text=True,
                         env=env, timeout=60)
    assert bad.returncode == 2 and "give {\"unit\": NAME, \"port\": 1-65535}" in bad.stderr


def test_the_roles_own_diagnose_tasks_through_ansible(tmp_path: Path) -> None:
    """roles/vllm_serve/tasks/diagnose.yml as the play includes it, run by ansible-playbook on a local connection:
    the journal read is registered by Ansible itself and passed on whole. Once with journalctl answering from the
    captured log, once with a host Python that does not exist (the command module's own failure)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "journalctl").write_text(f"#!/bin/sh\nexec cat {KV_CACHE_LOG}\n")
    (bin_dir / "journalctl").chmod(0o755)
    results = tmp_path / "results"
    results.mkdir()
    run_as = {"read": host_python(), "unreadable": ["/nonexistent/python3", "-m"]}
    playbook = tmp_path / "diagnose.yml"
    playbook.write_text(json.dumps([{
        "hosts": "localhost", "connection": "local", "gather_facts": False,
        "vars": {"b70_ctl": B70CTL, "vllm_serve_health_timeout": 900,
                 "vllm_serve_servers": [{"unit": "b70-vllm", "port": 8000, "baseline": False}]},
        "tasks": [task for case, python in run_as.items() for task in (
            {"ansible.builtin.include_tasks": str(REPO / "roles/vllm_serve/tasks/diagnose.yml"),
             "vars": {"b70_host_python": python}},
            {"ansible.builtin.copy": {"content": "{{ vllm_serve_diagnosis.stdout }}",
                                      "dest": str(results / f"{case}.json")}})]}]))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-local"), "ANSIBLE_REMOTE_TMP": str(tmp_path / "remote")}
    run = subprocess.run([str(Path(sys.executable).with_name("ansible-playbook")), "-i", "localhost,",
                          str(playbook)], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    read = json.loads((results / "read.json").read_text())
    assert [[match["id"] for match in unit["failures"]] for unit in read["units"]] == [
        ["kv-cache-larger-than-host-memory"]]
    assert "Last log lines: [b70-vllm] " in read["message"] and "(100000.0 GiB)" in read["message"]
    unreadable = json.loads((results / "unreadable.json").read_text())
    assert unreadable["units"] == []
    # ansible-core 2.19 registers a command it could not execute as rc 2, msg "Error executing command.", the
    # errno in a traceback it does not show: that is all there is to say.
    assert ("The units' journals could not be read on the host (b70host.journal exited 2: Error executing "
            "command.).") in unreadable["message"]
