"""The controller's half of b70_generation: the inputs digest of a host, then the module on the host.

The digest covers everything a stage converges from: the appliance's code (roles, playbooks, the image sources and
the b70ctl package with its recipes and locks, as files in this checkout), the ansible-core version, and the host's
variables: every option a role declares in meta/argument_specs.yml and every variable named like a role's options
(b70_*, vllm_serve_*, ...) whose value is not the role's own default (those are in the code already; leaving them
out makes the digest the same whichever stage's play computes it), as written (not templated: facts set during a
run do not move it), plus the content of any variable that names a file on the controller (a recipe or lock given
as a path).
The role's own switches (generation_*) are left out: turning the fast path off must not change the digest.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import yaml
from ansible.plugins.action import ActionBase

REPO = Path(__file__).resolve().parents[3]
TREES = ("roles", "playbooks", "images", "control/b70ctl")
FILES = ("site.yml", "ansible.cfg")
OWN_PREFIX = "generation_"
FILE_LIMIT_BYTES = 16 << 20


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
        specs = (yaml.safe_load(specs_path.read_text()) or {}).get("argument_specs") or {}
        for entry in specs.values():
            names.update((entry or {}).get("options") or {})
        for values in ("defaults", "vars"):
            if (role / values / "main.yml").is_file():
                role_values.update(yaml.safe_load((role / values / "main.yml").read_text()) or {})
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


def inputs_digest(task_vars: dict, repo: Path = REPO) -> str:
    names, prefixes, role_values = declared_variables(repo)
    chosen = {name: task_vars[name] for name in sorted(task_vars)
              if (name in names or name.startswith(prefixes)) and not name.startswith(OWN_PREFIX)
              and not (name in role_values and task_vars[name] == role_values[name])}
    files = {name: digest for name, value in chosen.items() if (digest := file_content_digest(value))}
    document = {"tree": tree_digest(repo), "ansible": str((task_vars.get("ansible_version") or {}).get("full")),
                "vars": chosen, "files": files}
    return hashlib.sha256(json.dumps(document, sort_keys=True, default=str).encode()).hexdigest()


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        if args.get("state", "check") != "absent" and not args.get("digest"):
            args["digest"] = inputs_digest(task_vars or {})
        result.update(self._execute_module(module_name="b70_generation", module_args=args, task_vars=task_vars))
        return result
