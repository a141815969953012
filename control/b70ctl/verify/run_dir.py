"""verify's run directory: the --out it owns (a lock, its marker, raw/ cleared of an earlier run's data) and the
report written into it after every check."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

from b70ctl.errors import BadInput
from b70ctl.files import WRITE_LIMITS, read_own_json_object, write_text_atomically
from b70ctl.recipes.model import Recipe
from b70ctl.redact import without_controls
from b70ctl.report.html import render_html
from b70ctl.report.load import MAX_REPORT_BYTES
from b70ctl.report.markdown import render_markdown
from b70ctl.report.model import Report


class OutDirBusy(BadInput):
    pass


class RunDirectory:
    """A run owns its --out directory: an exclusive lock (released by the kernel however the run ends) keeps a
    second run from writing into it at the same time, and raw data of an earlier run is cleared so raw/ only ever
    holds what this report was computed from.

    verify owns only what it made: --out and raw/ each carry its marker file once it wrote there. A raw/ or a
    report without the marker (a user's `--out .` or `--out ~/data`) is refused, never cleared or overwritten,
    and so is any link where verify writes: nothing is written through a link it did not create."""

    LOCK_NAME = ".verify.lock"
    MARKER_NAME = "b70ctl-verify.marker"
    MARKER_TEXT = ("Written by b70ctl verify: the next run into this directory replaces report.json, report.md, "
                   "report.html and raw/.\n")
    OWNED = ("report.json", "report.md", "report.html", "raw")
    STALE_RAW_PREFIX = ".raw-stale-"

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self._handle: Any = None

    def _refuse(self, path: Path, problem: str, fix: str) -> None:
        raise BadInput(f"--out {self.out_dir}: {path.relative_to(self.out_dir)} {problem}: {fix}")

    def _open_lock(self) -> Any:
        try:
            fd = os.open(self.out_dir / self.LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as error:
            if error.errno == errno.ELOOP:
                self._refuse(self.out_dir / self.LOCK_NAME, "is a link verify did not create",
                             "remove it, or choose another --out")
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            self._refuse(self.out_dir / self.LOCK_NAME, "is not a regular file", "remove it, or choose another --out")
        return os.fdopen(fd, "r+")

    def check_owned(self) -> bool:
        """Whether --out already carries the marker; refuses what verify would replace but did not make."""
        lock = self.out_dir / self.LOCK_NAME
        if lock.is_symlink():
            self._refuse(lock, "is a link verify did not create", "remove it, or choose another --out")
        out_marker = self.out_dir / self.MARKER_NAME
        if out_marker.is_symlink() or (out_marker.exists() and not out_marker.is_file()):
            self._refuse(out_marker, "is not a marker verify wrote", "remove it, or choose another --out")
        owned = out_marker.is_file()
        for name in self.OWNED:
            path = self.out_dir / name
            if path.is_symlink():
                self._refuse(path, "is a link verify did not create (it would write through it)",
                             "remove the link, or choose another --out")
            if not os.path.lexists(path):
                continue
            if name == "raw":
                raw_marker = path / self.MARKER_NAME
                if not path.is_dir() or raw_marker.is_symlink() or not raw_marker.is_file() or not owned:
                    self._refuse(path, "was not made by b70ctl verify (no marker), it would be deleted",
                                 "move it away, or choose an empty --out")
            elif not owned or not path.is_file():
                self._refuse(path, "was not written by b70ctl verify (no marker), it would be overwritten",
                             "move it away, or choose an empty --out")
        return owned

    def _clear_stale(self) -> None:
        """What a run killed outright (SIGKILL, power loss) left behind: raw/ it was clearing, and temporary files
        of its reports. Only names verify itself makes, in a directory that carries its marker; each is named."""
        for path in sorted(self.out_dir.iterdir()):
            name = path.name
            ours_raw = name.startswith(self.STALE_RAW_PREFIX) and path.is_dir() and not path.is_symlink()
            ours_tmp = (any(name.startswith(f".{owned}.") for owned in self.OWNED) and name.endswith(".tmp")
                        and path.is_file() and not path.is_symlink())
            if ours_raw or ours_tmp:
                sys.stderr.write(f"warning: removing {path}, left by an earlier run that was killed\n")
                if ours_raw:
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)

    def _name_unfinished(self) -> None:
        """A report still saying "running" while this run holds the lock was left by a run killed outright."""
        path = self.out_dir / "report.json"
        earlier = read_own_json_object(path, MAX_REPORT_BYTES)  # None: not a report this run could have left
        if earlier is not None and earlier.get("partial_reason") == "running":
            sys.stderr.write(f"warning: {self.out_dir / 'report.json'} says \"running\": the run that wrote it was "
                             "killed before it could close it; this run replaces it\n")

    def _write_marker(self, directory: Path) -> None:
        fd = os.open(directory / self.MARKER_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as marker:
            marker.write(self.MARKER_TEXT)

    def __enter__(self) -> RunDirectory:
        self._handle = self._open_lock()
        try:
            fcntl.flock(self._handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as error:
            self._handle.close()
            raise OutDirBusy(f"--out {self.out_dir}: another b70ctl verify is writing there: wait for it, or choose "
                             "another directory") from error
        try:
            owned = self.check_owned()
            if owned:
                self._clear_stale()
                self._name_unfinished()
            self._handle.seek(0)
            self._handle.truncate()
            self._handle.write(f"{os.getpid()}\n")
            self._handle.flush()
            raw = self.out_dir / "raw"
            if raw.is_dir():  # checked above: verify's own raw/
                stale = self.out_dir / f"{self.STALE_RAW_PREFIX}{os.getpid()}"
                raw.rename(stale)
                shutil.rmtree(stale, ignore_errors=True)
            self._write_marker(self.out_dir)
            raw.mkdir()
            self._write_marker(raw)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None


class ReportWriter:
    def __init__(self, report: Report, recipe: Recipe, out_dir: Path):
        self.report, self.recipe, self.out_dir = report, recipe, out_dir

    def save(self) -> None:
        """Every server-supplied string in the report (error bodies, model names, log lines) is stored redacted
        (files.write_text_atomically) and, in the files people open in a terminal or a browser, without control
        characters: report.json escapes them itself."""
        write_text_atomically(self.out_dir / "report.json", self.report.model_dump_json(indent=2) + "\n")
        write_text_atomically(self.out_dir / "report.md", without_controls(render_markdown(self.report, self.recipe)))
        write_text_atomically(self.out_dir / "report.html", without_controls(render_html(self.report, self.recipe)))

    def save_partial(self, reason: str) -> None:
        """The last consistent report, marked partial with why it stopped. When even that cannot be written (a
        full disk), the report of an earlier step would claim the run is still going: it is removed instead, and
        the error says so."""
        self.report.partial, self.report.partial_reason = True, reason
        try:
            self.save()
        except OSError as error:
            for name in ("report.json", "report.md", "report.html"):
                (self.out_dir / name).unlink(missing_ok=True)
            fix = WRITE_LIMITS.get(error.errno or 0, ("", "free space"))[1]
            raise BadInput(f"--out {self.out_dir}: {reason}, and the partial report could not be written "
                           f"({error.strerror}): no report was left; {fix} and run again") from error
