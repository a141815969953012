"""roles/b70/action_plugins/b70ctl.py, the roles' one door into b70ctl, run by ansible-playbook itself.

A stand-in b70ctl answers as its arguments say (an exit code, stdout, a line on stderr) and echoes its stdin and one
environment variable, so what the action makes of each exit code, of `input` and of the task's `environment:` is
Ansible's own doing. The last test holds every role and playbook to the door.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]

STAND_IN = """#!{python}
import json, os, sys
words = sys.argv[1:]
stdin = sys.stdin.read()
if words[0] == "answer":
    code = int(words[1])
    sys.stdout.write(json.dumps({{"words": words, "stdin": stdin, "FROM_TASK": os.environ.get("FROM_TASK")}}) + "\\n")
    if code:
        sys.stderr.write("progress line\\n" + "error: --flag 'x' is wrong: give y" + "\\n")
    sys.exit(code)
sys.stdout.write("a table, not JSON\\n")
"""


def run_play(tmp_path: Path, tasks: list[dict], *options: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """The tasks on localhost with the stand-in as b70_ctl; each registered result is written to results.json."""
    fake = tmp_path / "b70ctl"
    fake.write_text(STAND_IN.format(python=sys.executable))
    fake.chmod(0o755)
    results = tmp_path / "results.json"
    names = [task["register"] for task in tasks]
    play = [{"hosts": "localhost", "gather_facts": False, "vars": {"b70_ctl": str(fake)},
             "tasks": [*tasks, {"ansible.builtin.copy": {
                 "content": "{{ {" + ", ".join(f"'{name}': {name}" for name in names) + "} | to_json }}",
                 "dest": str(results)}, "check_mode": False}]}]
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump(play))
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"), "ANSIBLE_PYTHON_INTERPRETER": sys.executable}
    done = subprocess.run([str(Path(sys.executable).with_name("ansible-playbook")), "-i", "localhost,", "-c", "local",
                           str(playbook), *options], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    return done, json.loads(results.read_text()) if results.is_file() else {}


def test_exit_codes_are_ok_finding_and_failed_and_nothing_is_ever_changed(tmp_path: Path) -> None:
    tasks = [
        {"name": "answered", "b70ctl": {"command": ["answer", "0"], "input": {"host": "b70-1", "gpus": [0, 1]}},
         "register": "zero", "environment": {"FROM_TASK": "yes"}},
        {"name": "a finding", "b70ctl": {"command": ["answer", "1"], "input": "raw text"}, "register": "one"},
        {"name": "not JSON", "b70ctl": {"command": ["table"]}, "register": "text"},
        {"name": "bad input", "b70ctl": {"command": ["answer", "2"]}, "register": "two", "ignore_errors": True},
    ]
    done, results = run_play(tmp_path, tasks)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    zero, one, text, two = results["zero"], results["one"], results["text"], results["two"]
    # The input arrives as JSON, the task's environment reaches the process, the JSON printed is the document.
    assert json.loads(zero["document"]["stdin"]) == {"host": "b70-1", "gpus": [0, 1]}
    assert zero["document"]["FROM_TASK"] == "yes" and zero["document"]["words"] == ["answer", "0"]
    assert (zero["failed"], zero["changed"], zero["finding"], zero["answered"]) == (False, False, False, True)
    assert one["document"]["stdin"] == "raw text"  # a string is sent as it is
    assert (one["failed"], one["changed"], one["finding"], one["answered"]) == (False, False, True, True)
    assert text["document"] is None and text["stdout"] == "a table, not JSON\n"
    assert (two["failed"], two["changed"], two["answered"], two["exit_code"]) == (True, False, False, 2)
    assert two["msg"] == "b70ctl answer 2: error: --flag 'x' is wrong: give y"  # b70ctl's own line, whole
    recap = next(line for line in done.stdout.splitlines() if line.startswith("localhost"))
    assert "changed=1 " in recap  # the results file only: no b70ctl call counts as a change


def test_check_mode_still_asks_b70ctl(tmp_path: Path) -> None:
    """Nothing b70ctl answers changes a host, so a dry run (--check) gets the real answers the later tasks read."""
    done, results = run_play(tmp_path, [{"name": "answered", "b70ctl": {"command": ["answer", "0"]},
                                         "register": "zero"}], "--check")
    assert done.returncode == 0, done.stdout[-3000:]
    assert results["zero"]["document"]["words"] == ["answer", "0"] and not results["zero"].get("skipped")


def test_every_role_and_playbook_calls_b70ctl_through_the_door() -> None:
    """No task runs the b70ctl executable itself: ansible.builtin.command / shell / script with b70_ctl in it."""

    def walk(tasks: list[dict] | None) -> list[dict]:
        found: list[dict] = []
        for task in tasks or []:
            found.append(task)
            for key in ("block", "rescue", "always"):
                found += walk(task.get(key))
        return found

    files = sorted((REPO / "roles").glob("*/tasks/*.yml")) + sorted((REPO / "playbooks").glob("*.yml"))
    through_door, around = 0, []
    for path in files:
        document = yaml.safe_load(path.read_text()) or []
        plays = document if path.parent.name == "playbooks" else [{"tasks": document}]
        for play in plays:
            for task in walk([*play.get("pre_tasks", []), *play.get("tasks", []), *play.get("post_tasks", [])]):
                through_door += "b70ctl" in task
                for module in ("ansible.builtin.command", "ansible.builtin.shell", "ansible.builtin.script",
                               "command", "shell"):
                    if module in task and "b70_ctl" in json.dumps(task[module]):
                        around.append(f"{path.relative_to(REPO)}: {task.get('name')}")
    assert around == []
    assert through_door >= 20
