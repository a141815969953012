"""The one door from the roles into b70ctl: run it on the controller, hand it a document, read its document back.

    - name: Check the play's recipes
      b70ctl:
        command: [recipes, check, --json, --, cpu-tiny]   # the words after b70ctl
        input: "{{ {'host': inventory_hostname} }}"          # optional: sent on stdin as JSON (a string as it is)
      register: checked                                     # checked.document: the JSON b70ctl printed

Why a plugin and not `ansible.builtin.command` delegated to localhost: b70ctl and its reports live on the
controller, every call is a read of what b70ctl decides (nothing on a host changes), and its exit codes carry a
meaning the roles used to restate task by task. Here they are read once:
  0  ok
  1  ok, with `finding: true`: b70ctl answered and the answer is a finding (a host unfit, a lock that differs, a
     verdict that failed); the role decides what a finding means for it
(`answered: true` for both: a task that must go on whatever b70ctl did, failed_when: false, tests that)
  2  failed, the message being b70ctl's own one-line error (BadInput's line: the problem and the fix)
  else failed, with the last line b70ctl wrote
It is never "changed": what b70ctl writes is the controller's (caches, reports), and a host change is made, and
counted, by the task that makes it. It runs in check mode too, since nothing it does changes a host.

The executable is the play's `b70_ctl`. The task's `environment:` reaches it, as it would reach a command's.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.module_utils.common.text.converters import to_text
from ansible.plugins.action import ActionBase

EXIT_FINDING = 1
EXIT_BAD_INPUT = 2


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(("command", "input"))
    _supports_check_mode = True
    _requires_connection = False

    def _environment(self) -> dict[str, str]:
        """The controller's environment with the task's `environment:` (a dict, or a list of them) over it."""
        merged = dict(os.environ)
        for entry in self._task.environment or []:
            templated = self._templar.template(entry)
            if isinstance(templated, dict):
                merged.update({str(name): str(value) for name, value in templated.items()})
        return merged

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result: dict[str, Any] = super().run(tmp, task_vars)
        del tmp
        task_vars = task_vars or {}
        words = self._task.args.get("command")
        if not isinstance(words, list) or not words:
            raise AnsibleActionFail("b70ctl: command is the list of words after b70ctl, e.g. [recipes, check, --json]")
        if "b70_ctl" not in task_vars:
            raise AnsibleActionFail("b70ctl: b70_ctl (the controller's b70ctl executable) is not set")
        executable = to_text(self._templar.template(task_vars["b70_ctl"]))
        document = self._task.args.get("input")
        stdin = None if document is None else document if isinstance(document, str) else json.dumps(document)
        argv = [executable, *(to_text(word) for word in words)]
        try:
            done = subprocess.run(argv, input=stdin if stdin is not None else "", capture_output=True, text=True,
                                  env=self._environment(), check=False)
        except OSError as error:
            raise AnsibleActionFail(f"b70ctl could not be run ({executable}): {error}: install it beside "
                                    "ansible-playbook (make venv) or set b70_ctl") from error
        stderr_lines = done.stderr.splitlines()
        answered = done.returncode in (0, EXIT_FINDING)
        # exit_code, not rc: Ansible fails any result whose rc is not 0, and a finding (1) is an answer.
        result.update(changed=False, exit_code=done.returncode, stdout=done.stdout, stderr=done.stderr,
                      stderr_lines=stderr_lines, answered=answered, finding=done.returncode == EXIT_FINDING,
                      document=None)
        if done.stdout.strip():
            try:
                result["document"] = json.loads(done.stdout)
            except json.JSONDecodeError:
                pass  # a command that prints text (a table, a message): its stdout is the answer
        if not answered:
            last = next((line.strip() for line in reversed(stderr_lines) if line.strip()), f"exit {done.returncode}")
            result.update(failed=True, msg=f"b70ctl {' '.join(argv[1:3])}: {last}")
        return result
