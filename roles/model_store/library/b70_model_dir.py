#!/usr/bin/python
"""An installed model directory against the manifest it must match (path, size, sha256 per file).

state=planned: a directory whose recorded manifest (.b70-manifest.json, written only after every file was
verified) equals the wanted one and whose files have the wanted sizes is in place, and nothing is read. Otherwise
the recorded manifest goes first (an interrupted transfer never leaves one claiming completeness), files the
manifest does not list go, files of the wanted size are hashed and kept when they match (what an interrupted
transfer already delivered is not sent again), and the rest are listed to send.
state=verified: after the transfer, every file not verified by the plan is hashed; all match, then the manifest
is written atomically, last.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

DOCUMENTATION = r"""
module: b70_model_dir
short_description: Compare, verify and record an installed model directory against its manifest
options:
  path: {description: The installed model directory, type: path, required: true}
  files:
    description: The wanted files, each with path (relative), size_bytes and sha256
    type: list
    elements: dict
    required: true
  state: {description: planned or verified, type: str, default: planned, choices: [planned, verified]}
  verified: {description: Paths the plan already hashed and found good (state=verified), type: list, elements: str,
             default: []}
"""

MANIFEST_FILE = ".b70-manifest.json"


def sha256_file(path: str, chunk_bytes: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(chunk_bytes)
            if not chunk:
                return digest.hexdigest()
            digest.update(chunk)


def wanted_files(files: list[dict]) -> dict[str, dict]:
    """path -> {size_bytes, sha256}; a path that would leave the directory is refused."""
    wanted = {}
    for entry in files:
        path = str(entry["path"])
        parts = path.split("/")
        if path.startswith("/") or ".." in parts or "" in parts or path == MANIFEST_FILE:
            raise ValueError(f"manifest path {path!r} is not a plain relative path")
        wanted[path] = {"size_bytes": int(entry["size_bytes"]), "sha256": str(entry["sha256"])}
    return wanted


def recorded_manifest(directory: str) -> dict[str, dict] | None:
    try:
        with open(os.path.join(directory, MANIFEST_FILE)) as handle:
            return wanted_files(json.load(handle)["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def present_files(directory: str) -> dict[str, int | None]:
    """Relative path -> size of every regular file (None for anything else: a link, a fifo), stat only."""
    present: dict[str, int | None] = {}
    for root, dirs, names in os.walk(directory):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            full = os.path.join(root, name)
            relative = os.path.relpath(full, directory)
            if relative == MANIFEST_FILE:
                continue
            present[relative] = os.path.getsize(full) if os.path.isfile(full) and not os.path.islink(full) else None
    return present


def plan(directory: str, wanted: dict[str, dict], check_mode: bool = False) -> dict:
    present = present_files(directory) if os.path.isdir(directory) else {}
    sizes = {path: entry["size_bytes"] for path, entry in wanted.items()}
    if recorded_manifest(directory) == wanted and present == sizes:
        return {"changed": False, "in_place": True, "send": [], "verified": [], "removed": [], "hashed_bytes": 0}
    changed = False
    manifest = os.path.join(directory, MANIFEST_FILE)
    if os.path.lexists(manifest):
        changed = True
        if not check_mode:
            os.unlink(manifest)
    removed = sorted(path for path in present if path not in wanted or present[path] is None)
    for path in removed:
        changed = True
        if not check_mode:
            full = os.path.join(directory, path)
            if os.path.isdir(full) and not os.path.islink(full):
                raise ValueError(f"{full} is a directory where the manifest has no file: move it away and re-run")
            os.unlink(full)
    send, verified, hashed_bytes = [], [], 0
    for path, entry in sorted(wanted.items()):
        full = os.path.join(directory, path)
        if present.get(path) == entry["size_bytes"]:
            hashed_bytes += entry["size_bytes"]
            if sha256_file(full) == entry["sha256"]:
                verified.append(path)
                continue
        send.append(path)
        if not check_mode:
            os.makedirs(os.path.dirname(full), mode=0o755, exist_ok=True)
    return {"changed": changed, "in_place": False, "send": send, "verified": verified, "removed": removed,
            "hashed_bytes": hashed_bytes}


def record(directory: str, wanted: dict[str, dict], verified: list[str], check_mode: bool = False) -> dict:
    """Hash what the plan did not, then write the manifest (temporary file, fsync, rename, fsync directory)."""
    bad, hashed_bytes = [], 0
    for path, entry in sorted(wanted.items()):
        if path in verified:
            continue
        full = os.path.join(directory, path)
        if os.path.islink(full) or not os.path.isfile(full):
            bad.append(f"{path}: missing")
            continue
        hashed_bytes += os.path.getsize(full)
        actual = sha256_file(full)
        if actual != entry["sha256"] or os.path.getsize(full) != entry["size_bytes"]:
            bad.append(f"{path}: sha256 {actual}, {os.path.getsize(full)} bytes; wanted {entry['sha256']}, "
                       f"{entry['size_bytes']} bytes")
    if bad or check_mode:
        return {"changed": not bad, "bad": bad, "hashed_bytes": hashed_bytes}
    files = [{"path": path, **entry} for path, entry in sorted(wanted.items())]
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=MANIFEST_FILE, suffix=".tmp")
    with os.fdopen(handle, "w") as out:
        json.dump({"files": files}, out, indent=1, sort_keys=True)
        out.write("\n")
        out.flush()
        os.fsync(out.fileno())
    os.chmod(temporary, 0o644)
    os.replace(temporary, os.path.join(directory, MANIFEST_FILE))
    directory_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)
    return {"changed": True, "bad": [], "hashed_bytes": hashed_bytes}


def main() -> None:
    # Imported here, not at the top: importing ansible.module_utils patches sys.intern for the whole process,
    # which breaks torch in a test process that loads this module for its functions.
    from ansible.module_utils.basic import AnsibleModule

    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "files": {"type": "list", "elements": "dict", "required": True},
            "state": {"type": "str", "default": "planned", "choices": ["planned", "verified"]},
            "verified": {"type": "list", "elements": "str", "default": []},
        },
        supports_check_mode=True,
    )
    directory = module.params["path"]
    try:
        wanted = wanted_files(module.params["files"])
        if module.params["state"] == "planned":
            module.exit_json(**plan(directory, wanted, module.check_mode))
        result = record(directory, wanted, module.params["verified"], module.check_mode)
    except (OSError, ValueError) as error:
        module.fail_json(msg=f"{directory}: {error}")
    if result["bad"]:
        module.fail_json(msg=f"{directory}: files differ from the manifest after the transfer: "
                             f"{'; '.join(result['bad'])}. Re-run to send them again.", **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
