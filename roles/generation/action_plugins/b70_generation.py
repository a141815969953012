"""The controller's half of b70_generation: the inputs digest of a host, then the module on the host.

The digest covers everything a stage converges from: the appliance's code (roles, playbooks, the image sources and
the b70ctl package with its recipes and locks, as files in this checkout), the ansible-core version, and the host's
variables: every option a role declares in meta/argument_specs.yml and every variable named like a role's options
(b70_*, vllm_serve_*, ...) whose value is not the role's own default (those are in the code already; leaving them
out makes the digest the same whichever stage's play computes it), as written (not templated: facts set during a
run do not move it), plus the content of any variable that names a file on the controller (a recipe or lock given
as a path).
The role's own switches (generation_*) are left out: turning the fast path off must not change the digest.

On the host, the module's own code (library/b70_generation.py) runs as a short program on python3's stdin: one
round trip without the module wrapper and Ansible's module library to unpack and import, about a fifth of the CPU
of a module run on the host and on the controller. This check is all a converged host costs a run, so on a fleet it
is most of the run; for the same reason it also shows its verdict and carries the run's state from stage to stage
(the digest, the stages at this run's generation) in its registered result, where tasks of their own would cost a
round of work per host each. Where pipelining is off (a become method that needs a terminal), it runs as an
ordinary module.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shlex
from pathlib import Path
from typing import Any

import yaml
from ansible.errors import AnsibleActionFail
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins.action import ActionBase

REPO = Path(__file__).resolve().parents[3]
TREES = ("roles", "playbooks", "images", "control/b70ctl")
FILES = ("site.yml", "ansible.cfg")
OWN_PREFIX = "generation_"
FILE_LIMIT_BYTES = 16 << 20
MODULE = Path(__file__).resolve().parents[1] / "library" / "b70_generation.py"
# Reads {"source", "params", "check_mode"} on stdin, runs the module's execute() and prints its result.
HOST_PROGRAM = (
    "import json, sys\n"
    "request = json.load(sys.stdin)\n"
    "module = {'__name__': 'b70_generation'}\n"
    "exec(compile(request['source'], 'b70_generation.py', 'exec'), module)\n"
    "print(json.dumps(module['execute'](request['params'], request['check_mode'])))\n"
)
# libyaml's loader where PyYAML has it: every host's first check parses every role's specs and defaults.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def tree_digest(repo: Path = REPO) -> str:
    digest = hashlib.sha256()
    paths = [repo / name for name in FILES if (repo / name).is_file()]
    for top in TREES:
        for directory, subdirs, files in os.walk(repo / top):
            subdirs[:] = sorted(name for name in subdirs if name != "__pycache__")
            paths += [Path(directory) / name for name in sorted(files) if not name.endswith(".pyc")]
    for path in paths:
        digest.update(str(path.relative_to(repo)).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def declared_variables(repo: Path = REPO) -> tuple[set[str], tuple[str, ...], dict[str, object]]:
    """(the options every role declares, the role-name prefixes of variables, the roles' defaults and vars)."""
    names: set[str] = set()
    prefixes = ["b70_"]
    role_values: dict[str, object] = {}
    for role in sorted((repo / "roles").iterdir()):
        specs_path = role / "meta" / "argument_specs.yml"
        if not specs_path.is_file():
            continue
        prefixes.append(role.name + "_")
        specs = (yaml.load(specs_path.read_text(), Loader=SAFE_LOADER) or {}).get("argument_specs") or {}
        for entry in specs.values():
            names.update((entry or {}).get("options") or {})
        for values in ("defaults", "vars"):
            if (role / values / "main.yml").is_file():
                role_values.update(yaml.load((role / values / "main.yml").read_text(), Loader=SAFE_LOADER) or {})
    return names, tuple(prefix for prefix in prefixes if prefix != OWN_PREFIX), role_values


def file_content_digest(value: object) -> str | None:
    if not isinstance(value, str) or not value or "\n" in value or len(value) > 4096:
        return None
    try:
        path = Path(value).expanduser()
        if path.is_file() and path.stat().st_size <= FILE_LIMIT_BYTES:
            return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
    return None


@functools.cache
def checkout(repo: Path = REPO) -> tuple[str, tuple[set[str], tuple[str, ...], dict[str, object]]]:
    """(tree digest, declared variables) of a checkout, read once per process."""
    return tree_digest(repo), declared_variables(repo)


def inputs_digest(task_vars: dict[str, Any], repo: Path = REPO) -> str:
    tree, (names, prefixes, role_values) = checkout(repo)
    chosen = {name: task_vars[name] for name in sorted(task_vars)
              if (name in names or name.startswith(prefixes)) and not name.startswith(OWN_PREFIX)
              and not (name in role_values and task_vars[name] == role_values[name])}
    files = {name: digest for name, value in chosen.items() if (digest := file_content_digest(value))}
    document = {"tree": tree, "ansible": str((task_vars.get("ansible_version") or {}).get("full")),
                "vars": chosen, "files": files}
    return hashlib.sha256(json.dumps(document, sort_keys=True, default=str).encode()).hexdigest()


def measured_key(digest: str, current: dict[str, str], stages: object) -> str:
    """What a replication report measured, once every stage is at this run's generation: the inputs digest and what
    each stage left (its state_digest). Empty until then: a report is kept only for a configuration known whole."""
    if not isinstance(stages, list) or not stages or sorted(current) != sorted(stages):
        return ""
    document = {"digest": digest, "stages": current}
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


@functools.cache
def load_module() -> Any:
    """library/b70_generation.py as a Python module (its argument spec and code), without running its main()."""
    spec = importlib.util.spec_from_file_location("b70_generation_module", MODULE)
    assert spec is not None and spec.loader is not None, MODULE
    module: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.SOURCE = MODULE.read_text()
    return module


# Ansible imports this plugin in its main process before it forks a worker per host for the task: reading the
# checkout and the module here, once, spares every host's worker the same work.
checkout(REPO)  # the key inputs_digest() asks for
load_module()


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp: str | None = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result: dict[str, Any] = super().run(tmp, task_vars)
        task_vars = task_vars or {}
        args = dict(self._task.args)
        # The role's switch, for the message only: with the fast path off the stage runs whatever the check says.
        enabled = boolean(args.get("enabled", True))
        state = args.get("state", "check")
        if state != "absent" and not args.get("digest"):
            args["digest"] = inputs_digest(task_vars)
        if self._is_pipelining_enabled("new"):
            result.update(self._run_on_host(args, task_vars))
        else:
            result.update(self._execute_module(module_name="b70_generation", module_args=args, task_vars=task_vars))
        if state != "absent" and not result.get("failed"):
            # The run's bookkeeping, carried from stage to stage in the registered result (generation_run): the
            # stages at this run's generation so far.
            converged = state == "record" or result.get("converged") is True
            current = {**(args.get("current") or {}), **({args["stage"]: result["state_digest"]} if converged else {})}
            result["current"] = current
            result["measured_key"] = measured_key(result["digest"], current, task_vars.get("generation_stage_names"))
        if state == "check" and not result.get("failed"):
            # The check's verdict is shown for every host without -v (as a debug task would, at a task's cost).
            if not enabled:
                result["msg"] = f"{args['stage']}: runs in full (generation_enabled is false)"
            result["msg"] = f"{task_vars.get('inventory_hostname')}: {result['msg']}"
            result["_ansible_verbose_always"] = True
            result.pop("recorded_at", None)  # the message says it
            if not result.get("reasons"):
                result.pop("reasons", None)
        return result

    def _run_on_host(self, args: dict[str, Any], task_vars: dict[str, Any]) -> dict[str, Any]:
        module = load_module()
        validated = ArgumentSpecValidator(module.ARGUMENT_SPEC).validate(args)
        if validated.error_messages:
            raise AnsibleActionFail("b70_generation: " + "; ".join(validated.error_messages))
        request = json.dumps({"source": module.SOURCE, "params": validated.validated_parameters,
                              "check_mode": bool(self._task.check_mode)})
        python = self._host_python(task_vars)
        answer = self._low_level_execute_command(f"{shlex.quote(python)} -c {shlex.quote(HOST_PROGRAM)}",
                                                 in_data=request.encode())
        try:
            answered: dict[str, Any] = json.loads(answer["stdout"].strip().splitlines()[-1])
            return answered
        except (ValueError, IndexError):
            raise AnsibleActionFail(
                f"b70_generation: {python} on the host gave no result (rc {answer['rc']}): "
                f"{answer['stderr'].strip()[-500:] or answer['stdout'].strip()[-500:]}. Fix: install python3 on "
                "the host, or point ansible_python_interpreter at it") from None

    def _host_python(self, task_vars: dict[str, Any]) -> str:
        """The interpreter set for the host, one an earlier module found, else python3 on the PATH."""
        configured = self._templar.template(task_vars.get("ansible_python_interpreter") or "")
        if configured and not str(configured).startswith("auto"):
            return str(configured)
        discovered = (task_vars.get("ansible_facts") or {}).get("discovered_interpreter_python")
        return str(discovered) if discovered else "python3"
