"""Whole files or nothing: every document b70ctl writes goes through here.

The text is written to a temporary file beside the target, flushed to disk, and renamed over the target, so
a reader (or a run killed mid-write) sees the old file or the new one, never half of one. The JSON and YAML
documents a user hands in are read here too, so each way a file can be wrong is worded once.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from b70ctl.errors import BadInput
from b70ctl.redact import credentials_in_use, redact

# Most bytes of a secret file read: a key is a line, /dev/zero or a log given by mistake must not fill memory.
MAX_SECRET_FILE_BYTES = 64 * 1024
# Most bytes of a JSON document a host or b70ctl wrote and b70ctl reads back whole: host facts, a topology, a
# model's config.json, a marker. Each is a few KiB (a model config.json with an id2label table some hundreds of
# KiB); 16 MiB holds any of them and refuses a log, a weights file or /dev/zero given by mistake before a byte is
# read (json.loads needs several times a text's size in memory).
MAX_DOCUMENT_BYTES = 16 * 2**20


def write_text_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    """`mode` defaults to readable by all (reports, locks are meant to be shared): no secret of this run is ever
    in the text (redacted here, whatever a server echoed), so a 0644 document carries none. While this run sends
    a credential (an API key, a URL's password), a server may echo it in a form no redaction knows: what it writes
    is then for this user only (0600)."""
    path = Path(path)
    text = redact(text)
    if credentials_in_use():
        mode &= 0o700
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


# Write errors that end a run (verify's) with its report marked partial and one line, never a traceback: a full
# disk, a quota, and the process's file-size limit (ulimit -f: Python ignores SIGXFSZ, so the write fails with
# EFBIG). Each with the words of the reason and of the fix.
WRITE_LIMITS = {errno.ENOSPC: ("disk full", "free space"),
                errno.EDQUOT: ("disk quota exceeded", "free space under the quota"),
                errno.EFBIG: ("file-size limit reached", "raise the file-size limit (ulimit -f)")}


def file_kind(mode: int) -> str:
    """What a path is, in words, for a message that refuses it."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def require_replaceable(path: Path, what: str) -> None:
    """An output path given on the command line may be new or a regular file (which is replaced whole): never a
    link, a FIFO, a device or a directory, which the rename would replace (as root, /dev/null itself). BadInput
    naming what is there, before anything was asked of a server or written."""
    try:
        found = os.lstat(path)
    except OSError:
        return  # nothing there, or no way there: the writer says why it cannot write
    if not stat.S_ISREG(found.st_mode):
        raise BadInput(f"{what} {path}: {file_kind(found.st_mode)}, not a regular file: nothing was changed; give a "
                       "new path or a file to replace")


def write_failure(error: OSError, path: Path) -> str:
    """Why writing at `path` failed, in words that lead to the fix: a file standing where a directory must be, a
    full disk, a place this user may not write to, else the system's words. The writer above has already removed
    its temporary file, so the message can say nothing was left half-written."""
    where = Path(error.filename) if error.filename else Path(path)
    if error.errno in (errno.ENOTDIR, errno.EEXIST):
        in_the_way = next((part for part in [*reversed(where.parents), where]
                           if os.path.lexists(part) and not part.is_dir()), None)
        if in_the_way is not None:
            return f"{in_the_way} is a file, not a directory: move it away or choose another path"
    if error.errno == errno.EISDIR:
        return f"{path} is a directory: give the path of a file"
    # A temporary file or a directory that failed to appear is not worth naming: the directory it was to be in is.
    place = where if os.path.lexists(where) else where.parent
    shown = f" ({place})" if place != Path(path) else ""
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"{error.strerror}{shown}: free space there and run again; nothing was left half-written"
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{error.strerror}{shown}: choose a directory you may write to"
    return f"{error.strerror or error}{shown}: choose another path"


def write_json_atomically(path: Path, data: Any, mode: int = 0o644, compact: bool = False,
                          sort_keys: bool = False) -> None:
    """Indented for people by default; `compact` for bulky raw data nobody reads by eye."""
    text = (json.dumps(data, separators=(",", ":"), sort_keys=sort_keys) if compact
            else json.dumps(data, indent=2, sort_keys=sort_keys) + "\n")
    write_text_atomically(path, text, mode)


def size_text(count: int) -> str:
    """A byte count as people read it: 1.5 GiB, 16 MiB, 300 bytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{count} bytes"


_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISSOCK, "a socket"))


def over_cap(where: str, size: int | None, limit: int, fix: str) -> BadInput:
    """The one line for a file past its cap: `where`, its size (None: it grew while read), the cap, `fix`."""
    found = size_text(size) if size is not None else "more"
    return BadInput(f"{where}: {found}, over the {size_text(limit)} cap: {fix}")


def open_regular(path: str | Path, limit: int, where: str, fix: str) -> int:
    """A descriptor of the regular file at `path` for reading, refused (one BadInput line naming `where`, what it
    is or its size and the cap, then `fix`) when it is not a regular file or holds more than `limit` bytes: a FIFO
    would block forever and /dev/zero never ends, so it is opened non-blocking and checked before a byte is read.
    A directory raises IsADirectoryError and a file that cannot be opened the OSError open raised, so each caller
    keeps its own words for those."""
    handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        found = os.fstat(handle)
        if stat.S_ISDIR(found.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(found.st_mode):
            kind = next((name for test, name in _NOT_REGULAR if test(found.st_mode)), "not a file")
            raise BadInput(f"{where}: {kind}, not a regular file: {fix}")
        if found.st_size > limit:
            raise over_cap(where, found.st_size, limit, fix)
    except BaseException:
        os.close(handle)
        raise
    return handle


def read_bounded(path: str | Path, limit: int, where: str, fix: str) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them (open_regular says what is refused)."""
    handle = open_regular(path, limit, where, fix)
    chunks: list[bytes] = []
    total = 0
    try:
        while total <= limit and (chunk := os.read(handle, min(2**20, limit + 1 - total))):
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(handle)
    if total > limit:  # it grew while it was read
        raise over_cap(where, None, limit, fix)
    return b"".join(chunks)


def read_bounded_stdin(limit: int, where: str, fix: str) -> str:
    """What stdin holds, refused (one BadInput line) past `limit` characters: `< /dev/zero` must not fill memory."""
    text = sys.stdin.read(limit + 1)
    if len(text) > limit:
        raise over_cap(where, None, limit, fix)
    return text


def parse_json(text: str | bytes, where: str, fix: str, **options: Any) -> Any:
    """json.loads, with the two ways valid-looking JSON breaks Python's parser as one BadInput line each: nesting
    deeper than the interpreter's recursion limit (RecursionError) and an integer longer than
    sys.get_int_max_str_digits() digits (ValueError, CVE-2020-10735's guard). A JSONDecodeError or
    UnicodeDecodeError is raised as it is, for the caller's own words. `options` go to json.loads. A key given twice
    in one object is refused too (BadInput naming it): Python keeps the last, other readers the first, so a file
    holding two could say one thing to b70ctl and another to whoever reads it next."""
    options.setdefault("object_pairs_hook", _unique_object)
    try:
        return json.loads(text, **options)
    except DuplicateKey as error:
        raise BadInput(f"{where}: {error}: {fix}") from None
    except RecursionError as error:
        raise BadInput(f"{where}: JSON nested too deeply (Python reads about {sys.getrecursionlimit()} levels): "
                       f"{fix}") from error
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise
    except ValueError as error:
        raise BadInput(f"{where}: a JSON number of more than {sys.get_int_max_str_digits()} digits: {fix}") \
            from error


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise DuplicateKey(f"key {key[:80]!r} is given twice in one object: keep one (JSON readers disagree on "
                               "which one counts)")
        found[key] = value
    return found


def read_document_text(source: str | Path, limit: int, where: str, fix: str, missing: str | None = None) -> str:
    """The text of a document a user hands in: the file at `source`, or stdin when it is '-', of at most `limit`
    bytes. A file that is missing, a directory, not a regular file, too large or not UTF-8 is one BadInput line:
    `where`, the problem, `fix`; `missing`, when given, is the whole line for a file that does not exist (whose fix
    is usually another command than the other problems')."""
    try:
        return (read_bounded_stdin(limit, where, fix) if str(source) == "-"
                else read_bounded(source, limit, where, fix).decode("utf-8"))
    except FileNotFoundError as error:
        raise BadInput(missing or f"{where}: {error.strerror}: {fix}") from error
    except UnicodeDecodeError as error:
        raise BadInput(f"{where}: not UTF-8 text (byte {error.start}): {fix}") from error
    except IsADirectoryError as error:
        raise BadInput(f"{where}: is a directory: {fix}") from error
    except OSError as error:
        raise BadInput(f"{where}: {error.strerror}: {fix}") from error


def read_json_object(source: str | Path, where: str, fix: str,
                     limit: int = MAX_DOCUMENT_BYTES, missing: str | None = None) -> dict[str, Any]:
    """A JSON object from a file, or from stdin when source is '-' (read_document_text: what is refused, and
    `missing`); not JSON or not an object is one BadInput line too."""
    text = read_document_text(source, limit, where, fix, missing)
    try:
        data: Any = parse_json(text, where, fix)
    except json.JSONDecodeError as error:
        raise BadInput(f"{where}: not valid JSON (line {error.lineno}): {fix}") from error
    if not isinstance(data, dict):
        raise BadInput(f"{where}: expected a JSON object, found {type(data).__name__}: {fix}")
    return data


def read_own_json_object(path: str | Path, limit: int = MAX_DOCUMENT_BYTES) -> dict[str, Any] | None:
    """A JSON object b70ctl wrote itself (a marker, a state file, a record of what it did), or None when the file is
    missing, unreadable, not a regular file, over `limit`, not UTF-8, not JSON or not an object: such a file is not
    one of b70ctl's, so what it would have said is found or done again, never a reason to stop."""
    try:
        return read_json_object(path, str(path), "", limit)
    except BadInput:
        return None


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""


class DuplicateKey(Exception):
    pass


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        try:
            first = seen.setdefault(key, line)
        except TypeError:
            continue  # an unhashable key: construct_mapping refuses it with its own error
        if first != line:
            raise DuplicateKey(f"key {key!r} on line {line} is given already on line {first}: keep one (YAML "
                               "would silently keep the last)")
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_yaml_unique(text: str, what: str) -> Any:
    """YAML as yaml.safe_load reads it, except that a key given twice in one mapping is refused (BadInput naming
    `what`, the key and both lines), and so are the two ways valid-looking YAML breaks Python, as in parse_json:
    nesting deeper than the recursion limit and an integer longer than sys.get_int_max_str_digits() digits."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except DuplicateKey as error:
        raise BadInput(f"{what}: {error}") from None
    except RecursionError as error:
        raise BadInput(f"{what}: YAML nested too deeply (Python reads about {sys.getrecursionlimit()} levels): "
                       "write it flatter") from error
    except ValueError as error:
        if "integer string conversion" not in str(error):
            raise
        raise BadInput(f"{what}: a YAML number of more than {sys.get_int_max_str_digits()} digits: "
                       "write a shorter number") from error


def read_yaml_mapping(path: str | Path, where: str, fix: str, limit: int = MAX_DOCUMENT_BYTES) -> dict[str, Any]:
    """A YAML mapping from the file at `path` (read_document_text: what is refused), read as yaml.safe_load reads it
    but with a key given twice refused; not YAML or not a mapping is one BadInput line too. The caller validates
    the mapping."""
    text = read_document_text(path, limit, where, fix)
    try:
        data = load_yaml_unique(text, where)
    except yaml.YAMLError as error:
        mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
        found = f"line {mark.line + 1}: {problem}" if mark is not None and problem else type(error).__name__
        raise BadInput(f"{where}: not valid YAML ({found}): {fix}") from error
    if not isinstance(data, dict):
        raise BadInput(f"{where}: expected a mapping, found {_yaml_kind(data)}: {fix}")
    return data


def _yaml_kind(data: Any) -> str:
    return {type(None): "an empty document", list: "a list", str: "a string"}.get(type(data), type(data).__name__)


def read_secret_file(path: Path, where: str) -> str:
    """The text of a file holding a secret, refused (one BadInput line) when it is not a regular file (a FIFO would
    block, /dev/zero never ends), larger than a secret, or readable by others. Others: ssh refuses such a key
    (openssh-portable authfile.c, sshkey_perm_ok: "Permissions 0%3.3o for '%s' are too open." ... "This private
    key will be ignored."), and so does b70ctl, rather than use a key every local user may have copied."""
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as error:
        raise BadInput(f"{where}: {error.strerror}: give a readable file holding the key") from error
    try:
        found = os.fstat(handle)
        if not stat.S_ISREG(found.st_mode):
            raise BadInput(f"{where}: not a regular file: write the key into a plain file (chmod 600)")
        if found.st_mode & 0o077 and found.st_uid == os.getuid():
            raise BadInput(f"{where}: permissions {stat.S_IMODE(found.st_mode):04o} are too open, others may read "
                           f"the key: chmod 600 {path}")
        data = os.read(handle, MAX_SECRET_FILE_BYTES + 1)
    finally:
        os.close(handle)
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise BadInput(f"{where}: larger than {MAX_SECRET_FILE_BYTES // 1024} KiB, not a key: give the file holding "
                       "only the key")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadInput(f"{where}: not UTF-8 text: write the key as plain text") from error
