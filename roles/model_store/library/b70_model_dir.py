#!/usr/bin/python
"""An installed model directory against the manifest it must match (path, size, sha256 per file).

state=planned: a directory whose recorded manifest (.b70-manifest.json, written only after every file was
verified) equals the wanted one and whose files have the wanted sizes is in place, and nothing is read. Otherwise
the recorded manifest goes first (an interrupted transfer never leaves one claiming completeness), files the
manifest does not list go, files of the wanted size are hashed and kept when they match (what an interrupted
transfer already delivered is not sent again), and the rest are listed to send, each as its manifest entry.
A file of another size (or other bytes) is not thrown away: it becomes NAME.partial, the start of a resumed
transfer.
state=partial: one file's transfer, chunk by chunk (the action plugin of the same role drives it from the
controller). The controller sends the sha256 of each chunk of its copy; the host hashes the chunks NAME.partial
already holds (cutting off bytes past the file's size) and answers which are missing or wrong; chunks the
controller staged on the host are written at their offsets only when their sha256 matches; once every chunk is
there, the whole partial is hashed and renamed into place only when it matches the lock's sha256.
state=verified: after the transfer, every file not verified by the plan (or placed by state=partial in this run,
which checked its sha256: `sent` takes the send loop's results as registered, and this module picks its own
directory's) is hashed; all match, then the manifest is written atomically, last.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

DOCUMENTATION = r"""
module: b70_model_dir
short_description: Compare, verify and record an installed model directory against its manifest
options:
  path: {description: The installed model directory, type: path, required: true}
  files:
    description: The wanted files, each with path (relative), size_bytes and sha256 (states planned and verified)
    type: list
    elements: dict
  state: {description: planned, partial or verified, type: str, default: planned,
          choices: [planned, partial, verified]}
  verified: {description: "state=verified: paths the plan hashed and found good", type: list, elements: str,
             default: []}
  sent: {description: "state=verified: the results of b70_model_send, for any directory; the files it placed in
         this one (their sha256 checked on the host) are not read again", type: list, elements: dict, default: []}
  file: {description: "state=partial: the file being sent, as path, size_bytes, sha256", type: dict}
  chunk_bytes: {description: "state=partial: the chunk size the controller hashed with", type: int}
  chunk_sha256: {description: "state=partial: the sha256 of each chunk of the controller's copy", type: list,
                 elements: str}
  staged: {description: "state=partial: chunk index -> a file the controller put on the host holding that chunk",
           type: dict, default: {}}
  finish: {description: "state=partial: hash the whole partial and rename it into place when it matches",
           type: bool, default: false}
"""

MANIFEST_FILE = ".b70-manifest.json"
PARTIAL_SUFFIX = ".partial"


def sha256_file(path: str, chunk_bytes: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(chunk_bytes)
            if not chunk:
                return digest.hexdigest()
            digest.update(chunk)


def wanted_files(files: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """path -> {size_bytes, sha256}; a path that would leave the directory is refused."""
    wanted = {}
    for entry in files:
        path = str(entry["path"])
        parts = path.split("/")
        if path.startswith("/") or ".." in parts or "" in parts or path == MANIFEST_FILE:
            raise ValueError(f"manifest path {path!r} is not a plain relative path")
        wanted[path] = {"size_bytes": int(entry["size_bytes"]), "sha256": str(entry["sha256"])}
    return wanted


def recorded_manifest(directory: str) -> dict[str, dict[str, Any]] | None:
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


def partial_path(full: str) -> str:
    return full + PARTIAL_SUFFIX


def plan(directory: str, wanted: dict[str, dict[str, Any]], check_mode: bool = False) -> dict[str, Any]:
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
    send, verified, hashed_bytes = [], [], 0
    for path, entry in sorted(wanted.items()):
        full = os.path.join(directory, path)
        if present.get(path) == entry["size_bytes"]:
            hashed_bytes += entry["size_bytes"]
            if sha256_file(full) == entry["sha256"]:
                verified.append(path)
                continue
        send.append(path)
    # A partial is kept only for a file still to send; the rest of what the manifest does not list goes.
    partials = {path + PARTIAL_SUFFIX for path in send}
    removed = sorted(path for path in present
                     if (path not in wanted and path not in partials) or present[path] is None)
    for path in removed:
        changed = True
        if not check_mode:
            full = os.path.join(directory, path)
            if os.path.isdir(full) and not os.path.islink(full):
                raise ValueError(f"{full} is a directory where the manifest has no file: move it away and re-run")
            os.unlink(full)
    for path in send:
        full = os.path.join(directory, path)
        if check_mode:
            continue
        os.makedirs(os.path.dirname(full), mode=0o755, exist_ok=True)
        # A cut or stale copy in place becomes the partial the transfer resumes from: its chunks that match are
        # kept. A partial already there is the newer transfer's and wins.
        if present.get(path) is not None:
            changed = True
            if present.get(path + PARTIAL_SUFFIX) is None:
                os.replace(full, partial_path(full))
            else:
                os.unlink(full)
    return {"changed": changed, "in_place": False, "send": [{"path": path, **wanted[path]} for path in send],
            "verified": verified, "removed": removed, "hashed_bytes": hashed_bytes}


def chunk_count(size_bytes: int, chunk_bytes: int) -> int:
    return -(-size_bytes // chunk_bytes)


def chunk_sha256s(path: str, size_bytes: int, chunk_bytes: int) -> tuple[list[str], str, int]:
    """The sha256 of each whole chunk among the first SIZE_BYTES of PATH, the sha256 of the bytes read, and how
    many were read: one pass. A file shorter than SIZE_BYTES yields the chunks it holds in full."""
    whole, read_bytes = hashlib.sha256(), 0
    chunks: list[str] = []
    with open(path, "rb") as handle:
        for index in range(chunk_count(size_bytes, chunk_bytes)):
            remaining = min(chunk_bytes, size_bytes - index * chunk_bytes)
            digest = hashlib.sha256()
            while remaining:
                block = handle.read(min(remaining, 8 << 20))
                if not block:
                    return chunks, whole.hexdigest(), read_bytes
                digest.update(block)
                whole.update(block)
                read_bytes += len(block)
                remaining -= len(block)
            chunks.append(digest.hexdigest())
    return chunks, whole.hexdigest(), read_bytes


def _fsync_directory(directory: str) -> None:
    directory_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_fd)
    finally:
        os.close(directory_fd)


def transfer_chunks(directory: str, entry: dict[str, Any], chunk_bytes: int, chunk_sha256: list[str],
                    staged: dict[str, str], finish: bool, check_mode: bool = False) -> dict[str, Any]:
    """One step of a file's transfer into DIRECTORY/PATH.partial (state=partial).

    Staged chunks are written at their offsets only when their length and sha256 match the controller's. Without
    staged chunks, or to finish, the partial is hashed chunk by chunk: `missing` names every chunk absent or
    wrong. Finishing renames the partial into place only when it has the file's size and the lock's sha256.
    """
    ((relative, wanted),) = wanted_files([entry]).items()
    size_bytes = wanted["size_bytes"]
    if chunk_bytes <= 0 or len(chunk_sha256) != chunk_count(size_bytes, chunk_bytes):
        raise ValueError(f"{relative}: {len(chunk_sha256)} chunk hashes for {size_bytes} bytes in chunks of "
                         f"{chunk_bytes}")
    full = os.path.join(directory, relative)
    partial = partial_path(full)
    result: dict[str, Any] = {"changed": False, "placed": False, "missing": [], "written": [], "rejected": [],
                              "kept_bytes": 0,
              "hashed_bytes": 0}
    if check_mode:
        return {**result, "changed": True}
    os.makedirs(os.path.dirname(full), mode=0o755, exist_ok=True)
    with open(os.open(partial, os.O_RDWR | os.O_CREAT, 0o644), "r+b") as handle:
        if os.fstat(handle.fileno()).st_size > size_bytes:  # bytes past the end cannot be the file's
            handle.truncate(size_bytes)
            result["changed"] = True
        for index_text, staged_file in sorted(staged.items(), key=lambda item: int(item[0])):
            index = int(index_text)
            if not 0 <= index < len(chunk_sha256):
                raise ValueError(f"{relative}: chunk {index} is outside the file's {len(chunk_sha256)} chunks")
            with open(staged_file, "rb") as chunk_file:
                data = chunk_file.read(chunk_bytes + 1)
            os.unlink(staged_file)  # the host's temporary space holds one batch at most
            length = min(chunk_bytes, size_bytes - index * chunk_bytes)
            if len(data) != length or hashlib.sha256(data).hexdigest() != chunk_sha256[index]:
                result["rejected"].append(index)
                continue
            handle.seek(index * chunk_bytes)
            handle.write(data)
            result["written"].append(index)
            result["changed"] = True
        handle.flush()
        os.fsync(handle.fileno())
    if staged and not finish:
        return result
    held, whole, read_bytes = chunk_sha256s(partial, size_bytes, chunk_bytes)
    result["hashed_bytes"] = read_bytes
    result["missing"] = [index for index, expected in enumerate(chunk_sha256)
                         if index >= len(held) or held[index] != expected]
    missing = set(result["missing"])
    result["kept_bytes"] = sum(min(chunk_bytes, size_bytes - index * chunk_bytes)
                               for index in range(len(chunk_sha256)) if index not in missing)
    if finish and not result["missing"] and read_bytes == size_bytes and whole == wanted["sha256"]:
        os.chmod(partial, 0o644)
        os.replace(partial, full)
        _fsync_directory(os.path.dirname(full))
        result.update(changed=True, placed=True)
    return result


def send_file(source: str, entry: dict[str, Any], chunk_bytes: int, batch_bytes: int,
              host: Callable[[list[str], dict[str, str], bool], dict[str, Any]],
              stage: Callable[[int, int, int], str]) -> dict[str, Any]:
    """The controller's side of one file's transfer: hash the source's chunks (and check the whole against the
    manifest, so a changed cache is never sent), ask the host which chunks it lacks, stage and write them a batch
    at a time (a cut transfer loses at most the batch in flight), then finish; chunks still wrong are sent once
    more. host(chunk_sha256, staged, finish) is one state=partial step on the host; stage(index, offset, length)
    puts that chunk of the source on the host and says where."""
    size_bytes = int(entry["size_bytes"])
    if os.path.getsize(source) != size_bytes:
        raise ValueError(f"{source} has {os.path.getsize(source)} bytes, its manifest {size_bytes}: describe the "
                         "controller's copy again (b70ctl model manifest)")
    chunk_sha256, whole, _ = chunk_sha256s(source, size_bytes, chunk_bytes)
    if whole != entry["sha256"]:
        raise ValueError(f"{source} has sha256 {whole}, its manifest {entry['sha256']}: the controller's copy "
                         "changed after it was described; fetch it again")

    def length(index: int) -> int:
        return min(chunk_bytes, size_bytes - index * chunk_bytes)

    answer = host(chunk_sha256, {}, False)
    kept_bytes = answer["kept_bytes"]
    per_batch = max(1, batch_bytes // chunk_bytes)
    sent: list[int] = []
    for _attempt in range(2):
        missing = answer["missing"]
        batches = [missing[start:start + per_batch] for start in range(0, len(missing), per_batch)] or [[]]
        for number, batch in enumerate(batches):
            staged = {str(index): stage(index, index * chunk_bytes, length(index)) for index in batch}
            answer = host(chunk_sha256, staged, number == len(batches) - 1)
            sent.extend(batch)
        if answer["placed"]:
            return {"changed": True, "kept_bytes": kept_bytes, "sent_bytes": sum(length(i) for i in sent),
                    "chunks_sent": len(sent), "chunks": len(chunk_sha256)}
    raise ValueError(f"{entry['path']}: chunks {answer['missing']} still differ on the host after being sent "
                     "twice: check the host's disk and re-run")


def placed_in(directory: str, sent: list[dict[str, Any]]) -> list[str]:
    """The paths b70_model_send placed in this directory, from the send loop's results as registered (a skipped or
    check-mode item placed nothing)."""
    return [result["path"] for result in sent
            if result.get("placed") and os.path.normpath(str(result.get("directory"))) == os.path.normpath(directory)]


def record(directory: str, wanted: dict[str, dict[str, Any]], verified: list[str],
           check_mode: bool = False) -> dict[str, Any]:
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
    _fsync_directory(directory)
    return {"changed": True, "bad": [], "hashed_bytes": hashed_bytes}


def main() -> None:
    # Imported here, not at the top: importing ansible.module_utils patches sys.intern for the whole process,
    # which breaks torch in a test process that loads this module for its functions.
    from ansible.module_utils.basic import AnsibleModule

    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "files": {"type": "list", "elements": "dict"},
            "state": {"type": "str", "default": "planned", "choices": ["planned", "partial", "verified"]},
            "verified": {"type": "list", "elements": "str", "default": []},
            "sent": {"type": "list", "elements": "dict", "default": []},
            "file": {"type": "dict"},
            "chunk_bytes": {"type": "int"},
            "chunk_sha256": {"type": "list", "elements": "str"},
            "staged": {"type": "dict", "default": {}},
            "finish": {"type": "bool", "default": False},
        },
        required_if=[("state", "planned", ["files"]), ("state", "verified", ["files"]),
                     ("state", "partial", ["file", "chunk_bytes", "chunk_sha256"])],
        supports_check_mode=True,
    )
    directory = module.params["path"]
    try:
        if module.params["state"] == "partial":
            module.exit_json(**transfer_chunks(
                directory, module.params["file"], module.params["chunk_bytes"], module.params["chunk_sha256"],
                module.params["staged"], module.params["finish"], module.check_mode))
        wanted = wanted_files(module.params["files"])
        if module.params["state"] == "planned":
            module.exit_json(**plan(directory, wanted, module.check_mode))
        result = record(directory, wanted, module.params["verified"] + placed_in(directory, module.params["sent"]),
                        module.check_mode)
    except (OSError, ValueError) as error:
        module.fail_json(msg=f"{directory}: {error}")
    if result["bad"]:
        module.fail_json(msg=f"{directory}: files differ from the manifest after the transfer: "
                             f"{'; '.join(result['bad'])}. Re-run to send them again.", **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
