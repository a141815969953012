#!/usr/bin/python
"""A stage's generation on the host: the inputs digest it last converged from, and what it left behind.

A stage (the host layer, the image, the model store, serving) that finished on this host records, in one root-only
file, the digest of the inputs it ran from (computed on the controller: the appliance's code and the host's
variables) and a fingerprint of what it manages: the files it writes (small ones by sha256, large ones such as
model weights by size and mtime, so nothing heavy is read), their modes and owners, the output of read-only probes
(systemctl states, the docker image list, dpkg's database) and the host's PCI devices under its root prefix.

state=check: the stage is converged when the recorded digest equals the one given and the fingerprint is the same
now: the play then skips the stage. Any difference is named (the first few) and the stage runs in full; with
forget, its record is dropped first, so a run that fails half-way is never taken for converged.
state=record: after a stage ran in full, write the digest and the fingerprint (temp file + rename).
Both check and record return the fingerprint's own digest (state_digest): with the inputs digest, it names the
configuration a replication report measured.
state=absent: forget the stage (a run limited by --tags changed part of it), so the next full run converges it.
"""

from __future__ import annotations

import datetime
import glob
import hashlib
import json
import os
import stat
import subprocess
import tempfile
from typing import Any

DOCUMENTATION = r"""
module: b70_generation
short_description: Check, record or forget the generation a stage of the appliance last converged to
options:
  stage: {description: The stage (host, image, models, serve), type: str, required: true}
  state: {description: check, record or absent, type: str, default: check, choices: [check, record, absent]}
  digest: {description: The inputs digest (the controller's action plugin fills it in), type: str}
  paths: {description: "Globs of what the stage writes (directories are walked)", type: list, elements: str,
          default: []}
  probes: {description: Read-only commands (argv lists) whose exit code and output are part of the state,
           type: list, elements: list, default: []}
  hardware_root: {description: Root prefix whose sys/bus/pci/devices is part of the state (none when empty),
                  type: str, default: ""}
  forget: {description: "state=check: drop the stage's record unless it is converged (the stage runs now)",
           type: bool, default: false}
  store: {description: The generations file, type: path, default: /var/lib/b70/generation.json}
  enabled: {description: "state=check: whether the play skips a converged stage (false: the verdict shown says the
            stage runs in full)", type: bool, default: true}
  current: {description: "The stages already at this run's generation, each with its state_digest; the action
            plugin returns them with this one added when it is converged or recorded", type: dict, default: {}}
"""

# Files above this are recorded by size and mtime: a no-op run reads no model weights.
HASH_LIMIT_BYTES = 1 << 20
SHOWN_DIFFERENCES = 5


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_entry(path: str) -> str:
    info = os.lstat(path)
    owner = f"{stat.S_IMODE(info.st_mode):o}:{info.st_uid}:{info.st_gid}"
    if stat.S_ISLNK(info.st_mode):
        return f"link:{os.readlink(path)}:{owner}"
    if stat.S_ISDIR(info.st_mode):
        return f"dir:{owner}"
    if not stat.S_ISREG(info.st_mode):
        return f"special:{stat.S_IFMT(info.st_mode):o}:{owner}"
    if info.st_size > HASH_LIMIT_BYTES:
        return f"size-mtime:{info.st_size}:{info.st_mtime_ns}:{owner}"
    with open(path, "rb") as handle:
        return f"sha256:{sha256_bytes(handle.read())}:{owner}"


def walk(path: str) -> list[str]:
    if os.path.isdir(path) and not os.path.islink(path):
        found = [path]
        for directory, subdirs, files in os.walk(path):
            subdirs.sort()
            found += [os.path.join(directory, name) for name in sorted(subdirs + files)]
        return found
    return [path]


def fingerprint(paths: list[str], probes: list[list[str]], hardware_root: str) -> dict[str, str]:
    state: dict[str, str] = {}
    for pattern in paths:
        matches = sorted(glob.glob(pattern))
        if not matches:
            state[f"path {pattern}"] = "absent"
        for match in matches:
            for path in walk(match):
                try:
                    state[f"path {path}"] = file_entry(path)
                except OSError as error:  # gone between the walk and the stat, or unreadable
                    state[f"path {path}"] = f"error:{error.errno}"
    for argv in probes:
        try:
            result = subprocess.run(argv, capture_output=True, timeout=30, check=False)
            state[f"probe {' '.join(argv)}"] = f"rc={result.returncode}:{sha256_bytes(result.stdout)}"
        except (OSError, subprocess.TimeoutExpired) as error:
            state[f"probe {' '.join(argv)}"] = f"error:{type(error).__name__}"
    if hardware_root:
        state["pci devices"] = pci_fingerprint(hardware_root)
    return state


def pci_fingerprint(root: str) -> str:
    """Each PCI function's name, its place in the bus (the link target) and its ids: cards added, moved or swapped
    change it, and with it what the host layer derived (the GPU inventory, the P2P topology, the oneCCL profile)."""
    devices = os.path.join(root, "sys", "bus", "pci", "devices")
    lines = []
    for name in sorted(os.listdir(devices)) if os.path.isdir(devices) else []:
        device = os.path.join(devices, name)
        fields = [name, os.readlink(device) if os.path.islink(device) else ""]
        for attribute in ("vendor", "device", "class"):
            try:
                with open(os.path.join(device, attribute), "rb") as handle:
                    fields.append(handle.read(64).decode("ascii", "replace").strip())
            except OSError:
                fields.append("")
        lines.append(" ".join(fields))
    return sha256_bytes("\n".join(lines).encode())


def differences(recorded: dict[str, str], now: dict[str, str]) -> list[str]:
    named = []
    for key in sorted(set(recorded) | set(now)):
        if key not in now:
            named.append(f"{key}: no longer managed")
        elif key not in recorded:
            named.append(f"{key}: new")
        elif recorded[key] != now[key]:
            named.append(f"{key}: changed")
    return named


def state_digest(state: dict[str, Any]) -> str:
    """One digest of a stage's fingerprint: what the stage left, as the record holds it."""
    return sha256_bytes(json.dumps(state, sort_keys=True).encode())


def load(store: str) -> dict[str, Any]:
    try:
        with open(store, encoding="utf-8") as handle:
            document = json.load(handle)
    except (OSError, ValueError):
        return {"stages": {}}
    if not isinstance(document, dict) or not isinstance(document.get("stages"), dict):
        return {"stages": {}}
    return document


def save(store: str, document: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(store), mode=0o755, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(store), prefix=".generation.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(document, out, indent=2, sort_keys=True)
            out.write("\n")
        os.chmod(temporary, 0o600)  # the fingerprint hashes files that hold secrets (the API key's env file)
        os.replace(temporary, store)
    except BaseException:
        os.unlink(temporary)
        raise


def run(params: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    stage, state, store = params["stage"], params["state"], params["store"]
    document = load(store)
    recorded = document["stages"].get(stage)
    if state == "absent":
        if recorded is None:
            return {"changed": False, "msg": f"{stage}: no generation recorded"}
        if not check_mode:
            del document["stages"][stage]
            save(store, document)
        return {"changed": False, "msg": f"{stage}: generation forgotten (a partial run)"}
    now = fingerprint(params["paths"], params["probes"], params["hardware_root"])
    if state == "record":
        document["stages"][stage] = {
            "digest": params["digest"], "state": now,
            "recorded_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        if not check_mode:
            save(store, document)
        # Bookkeeping of what the stage did, not a change of its own.
        return {"changed": False, "digest": params["digest"], "entries": len(now), "state_digest": state_digest(now),
                "msg": f"{stage}: generation {params['digest'][:12]} recorded ({len(now)} entries)"}
    if recorded is None:
        reasons = ["no generation recorded"]
    elif recorded.get("digest") != params["digest"]:
        reasons = [f"inputs changed (recorded {str(recorded.get('digest'))[:12]}, now {params['digest'][:12]})"]
    else:
        reasons = differences(recorded.get("state") or {}, now)
    converged = not reasons
    if not converged and recorded is not None and params["forget"] and not check_mode:
        del document["stages"][stage]
        save(store, document)
    shown = reasons[:SHOWN_DIFFERENCES] + ([f"and {len(reasons) - SHOWN_DIFFERENCES} more"]
                                          if len(reasons) > SHOWN_DIFFERENCES else [])
    return {"changed": False, "converged": converged, "digest": params["digest"], "reasons": shown,
            "state_digest": state_digest(now),
            "recorded_at": (recorded or {}).get("recorded_at"),
            "msg": (f"{stage}: converged to generation {params['digest'][:12]} "
                    f"(recorded {recorded['recorded_at']}): nothing to do" if converged else
                    f"{stage}: runs in full: " + "; ".join(shown))}


ARGUMENT_SPEC = {
    "stage": {"type": "str", "required": True},
    "state": {"type": "str", "default": "check", "choices": ["check", "record", "absent"]},
    "digest": {"type": "str", "default": ""},
    "paths": {"type": "list", "elements": "str", "default": []},
    "probes": {"type": "list", "elements": "list", "default": []},
    "hardware_root": {"type": "str", "default": ""},
    "forget": {"type": "bool", "default": False},
    "store": {"type": "path", "default": "/var/lib/b70/generation.json"},
    "enabled": {"type": "bool", "default": True},
    "current": {"type": "dict", "default": {}},
}


def execute(params: dict[str, Any], check_mode: bool) -> dict[str, Any]:
    """run() on validated parameters, as the module's result: main() and the action plugin's direct run share it."""
    if params["state"] != "absent" and not params["digest"]:
        return {"failed": True, "msg": "b70_generation: no inputs digest (run it through the role's action plugin)"}
    params = {**params, "probes": [[str(arg) for arg in argv] for argv in params["probes"]]}
    try:
        return run(params, check_mode)
    except OSError as error:
        return {"failed": True, "msg": f"b70_generation: {error.filename or params['store']}: {error.strerror}"}


def main() -> None:
    # Imported here: importing ansible patches process-wide state, which tests that load this module must not get.
    from ansible.module_utils.basic import AnsibleModule

    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    result = execute(module.params, module.check_mode)
    if result.get("failed"):
        module.fail_json(**result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
