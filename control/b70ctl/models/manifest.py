"""`b70ctl model manifest`: every file a host receives from a model directory, with its size and sha256.

The model_store role compares this with the manifest a host recorded after it last verified its copy, and sends
files only when they differ: a re-run reads no weight bytes on either side. A weight `model fetch` verified (or
a hard link to one, as `model convert` makes) takes the hash fetch checked against the lock, found by its size,
mtime and inode in DEST/.b70ctl/verified-ROLE.json; only files fetch never saw (a converted config.json, the
provenance) are hashed, and they are small.
"""

from __future__ import annotations

from pathlib import Path

from b70ctl.documents import Document, Pinned
from b70ctl.errors import BadInput
from b70ctl.files import read_own_json_object
from b70ctl.lock.resolve import sha256_file

# The manifest a host writes into each installed model directory once every file in it is verified.
HOST_MANIFEST_FILE = ".b70-manifest.json"
# Bookkeeping directories that never reach a host: fetch's state and partial downloads, hub caches.
SKIPPED_DIRS = {".b70ctl", ".cache", ".quarantine"}


class ManifestFile(Pinned):
    path: str
    size_bytes: int
    sha256: str


class Manifest(Document):
    directory: str
    files: list[ManifestFile]
    hashed_bytes: int  # what building this manifest read: 0 when fetch had verified every file


def _verified_hashes(directory: Path) -> dict[tuple[int, int, int], str]:
    """(inode, size, mtime_ns) -> sha256 of every file `model fetch` verified beside DIRECTORY."""
    known: dict[tuple[int, int, int], str] = {}
    for state_file in sorted((directory.parent / ".b70ctl").glob("verified-*.json")):
        files = (read_own_json_object(state_file) or {}).get("files", {})
        for stamp in files.values() if isinstance(files, dict) else []:
            try:
                known[(int(stamp["inode"]), int(stamp["size_bytes"]), int(stamp["mtime_ns"]))] = str(stamp["sha256"])
            except (KeyError, TypeError, ValueError):
                continue
    return known


def directory_manifest(directory: Path) -> Manifest:
    """Every regular file under DIRECTORY (bookkeeping and the host's own manifest left out), sorted by path. The
    listing is checked whole before any byte is hashed: a link late in it is refused at once, not after hours of
    hashing the weights before it."""
    if not directory.is_dir():
        raise BadInput(f"{directory} is not a directory: fetch (and convert) the recipe's models first")
    known = _verified_hashes(directory)
    regular: list[Path] = []
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if SKIPPED_DIRS.intersection(relative.parts[:-1]) or relative.name == HOST_MANIFEST_FILE:
            continue
        if path.is_symlink():
            raise BadInput(f"{path} is a symbolic link: a host receives files, give the directory of real files")
        if path.is_file():
            regular.append(path)
    files: list[ManifestFile] = []
    hashed_bytes = 0
    for path in regular:
        stat = path.stat()
        sha256 = known.get((stat.st_ino, stat.st_size, stat.st_mtime_ns))
        if sha256 is None:
            try:
                sha256 = sha256_file(path)
            except OSError as error:  # /proc/self/mem and its like: a regular file that cannot be read
                raise BadInput(f"{path}: cannot be read ({error.strerror}): give a directory of model files") \
                    from error
            hashed_bytes += stat.st_size
        files.append(ManifestFile(path=path.relative_to(directory).as_posix(), size_bytes=stat.st_size,
                                  sha256=sha256))
    return Manifest(directory=str(directory), files=files, hashed_bytes=hashed_bytes)
