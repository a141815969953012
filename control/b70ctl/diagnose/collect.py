"""Collect the lines a diagnosis reads: log files (or stdin), a local unit's journal with the kernel log around it,
the same from a remote host over SSH (paramiko), and the findings of a verify report.

The journal commands are built by pure functions, so the local and the SSH path run the same argv.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from itertools import chain
from pathlib import Path
from typing import Any, TextIO

from b70ctl.diagnose.match import LineBatch
from b70ctl.diagnose.model import LogKind, LogLine
from b70ctl.errors import BadInput, Unreachable
from b70ctl.extras import require
from b70ctl.files import open_regular, over_cap
from b70ctl.report.load import MAX_REPORT_BYTES

UNIT_LOG_LINES = 3000
KERNEL_LOG_LINES = 2000
# The kernel log is read from a little before the unit's first line to a little after its last one.
KERNEL_WINDOW_MARGIN = timedelta(minutes=5)
SSH_TIMEOUT_S = 15.0
# Most bytes of one --log read. Lines are matched as they are read and only the evidence is kept, so memory stays
# the same whatever a log's size; the time does not. 1 GiB is days of a serve unit's output at debug level: a
# larger file is a log of everything, and /dev/zero-like input never ends.
MAX_LOG_BYTES = 2**30
LOG_FIX = "save the log (the part around the failure: tail -c 100M, journalctl --since) to a file, or pipe it in"
LOG_CUT_FIX = "give the part around the failure (tail -c 100M, journalctl --since)"
# A log is read this many characters at a time, cut into lines: a line with no end (a tensor dump, a binary file)
# is read in pieces, never whole, and the matcher's prefilter searches a whole read at once.
READ_CHARS = 2**20
# Characters kept of one line: the matcher reads a line's first MAX_LINE_CHARS (match.py); the rest of a longer
# line is read and dropped.
MAX_KEPT_LINE_CHARS = 2**16

# (exit code, stdout, stderr) of one command, locally or on a remote host.
Runner = Callable[[list[str]], tuple[int, str, str]]

_UNIT_NAME = re.compile(r"^[A-Za-z0-9@._:\\-]+$")
# Kernel lines inside a mixed file, in each shape they are pasted in: journal/syslog ("Aug 04 10:11:12 host
# kernel: ...", short-iso too, or only "kernel: ..." when the paste dropped the stamp and host), dmesg
# ("[  12.345678] ...", "<6>[  12.345678] ..." from dmesg -r, "kern  :err   : ..." from dmesg -x), dmesg -T
# ("[Tue Aug  4 10:11:12 2026] ..."), and a device driver's own line with no prefix, or only a time stamp, often
# indented in a paste ("xe 0000:03:00.0: [drm] ...", "2026-09-13T22:23:00 xe 0000:3d:00.0: ..."): a driver name,
# then the device's PCI address.
_KERNEL_LINE = re.compile(
    r"^\S+(\s+\S+){0,3}\s+kernel: "
    r"|^kernel: "
    r"|^(<\d>)?\[\s*\d+\.\d+\] "
    r"|^kern\s*:\s*\w+\s*: "
    r"|^\[\w{3} \w{3} [ \d]\d \d{2}:\d{2}:\d{2} \d{4}\] "
    r"|^\s*(\d{4}-\d{2}-\d{2}T[\d:.,]+(Z|[+-]\d{2}:?\d{2})?\s+)?"
    r"(xe|i915|pcieport|pci|nvme|amdgpu|nouveau|nvidia|snd_hda_intel|mei_\w+) "
    r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]: ")
_ISO_PREFIX = re.compile(r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2}))\s")


def classify(text: str) -> LogKind:
    return "kernel" if _KERNEL_LINE.search(text) else "serve"


def lines_from_text(text: str, log: str, kind: LogKind | None = None) -> list[LogLine]:
    """Each line of a log; kind None means per line (a file may hold both vLLM and kernel lines)."""
    return [LogLine(log=log, kind=kind or classify(line), number=number, text=line)
            for number, line in enumerate(text.splitlines(), start=1)]


# ---------------------------------------------------------------- verify reports

def report_lines(report: dict[str, Any], log: str) -> list[LogLine]:
    """The findings of a verify report.json, one line each, in the form the catalogue's `verify` patterns read."""
    found: list[str] = []
    correctness = report.get("correctness") or {}
    if correctness:
        found.append(f"verify correctness: identical {correctness.get('identical')}/{correctness.get('total')} "
                     f"(passed={correctness.get('passed')})")
        for garbage in correctness.get("garbage") or []:
            found.append(f"verify correctness: garbage kind={garbage.get('kind')} prompt={garbage.get('prompt')!r}: "
                         f"{garbage.get('detail')}")
    for check in (report.get("smoke") or {}).get("checks") or []:
        if not check.get("passed"):
            found.append(f"verify smoke: {check.get('name')} failed: {check.get('reason')}")
    for workload in (report.get("throughput") or {}).get("workloads") or []:
        if workload.get("error"):
            found.append(f"verify throughput {workload.get('name')}: error {workload.get('error')}")
    if report.get("partial"):
        found.append(f"verify partial: {report.get('partial_reason')}")
    return [LogLine(log=log, kind="verify", number=number, text=text) for number, text in enumerate(found, 1)]


def _as_report(text: str) -> dict[str, Any] | None:
    if not text.lstrip().startswith("{"):
        return None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, nested too deeply, a number too long: a log, then
        return None
    if isinstance(data, dict) and "recipe" in data and ("correctness" in data or "smoke" in data):
        return data
    return None


# What str.splitlines() cuts at. A text ending in \r may be cut in the middle of a \r\n.
_LINE_BREAKS = frozenset("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")


def _text_batches(stream: TextIO, where: str, first: str = "") -> Iterator[tuple[list[str], int]]:
    """The lines of `first` and the rest of `stream` (as str.splitlines() would cut the whole text, without holding
    it), READ_CHARS at a time: each time the complete lines read, and how many characters that read took. A line is
    kept up to MAX_KEPT_LINE_CHARS (the rest of it is read and dropped); past MAX_LOG_BYTES, a BadInput (stdin, or a
    file still being written, has no size to check before)."""
    total = 0
    carry = ""
    for chunk in chain([first], iter(lambda: stream.read(READ_CHARS), "")):
        if not chunk:
            continue
        total += len(chunk)
        if total > MAX_LOG_BYTES:
            raise over_cap(where, None, MAX_LOG_BYTES, LOG_CUT_FIX)
        text = carry + chunk
        lines = text.splitlines()
        ends_line = text[-1] in _LINE_BREAKS and text[-1] != "\r"
        carry = ""
        if not ends_line:  # the last line goes on in the next read (a \r may be the first half of a \r\n)
            carry = lines.pop()[:MAX_KEPT_LINE_CHARS] + ("\r" if text[-1] == "\r" else "")
        if lines and max(map(len, lines)) > MAX_KEPT_LINE_CHARS:
            lines = [line[:MAX_KEPT_LINE_CHARS] for line in lines]
        yield lines, len(chunk)
    if carry:
        yield carry.splitlines() or [""], 0


def _open_log(path: str) -> tuple[TextIO, str]:
    """The log at `path` opened as text (undecodable bytes replaced), refused with one line when it is not a
    regular file (a FIFO would block, /dev/zero never ends: `-` reads a stream) or larger than MAX_LOG_BYTES."""
    where = f"--log {path}"
    try:
        handle = open_regular(path, MAX_LOG_BYTES, where, LOG_FIX)
    except OSError as error:
        raise BadInput(f"{where}: {error.strerror}: give a readable log file (or - for stdin)") from error
    return os.fdopen(handle, encoding="utf-8", errors="replace"), where


def _open_stream(path: str) -> tuple[TextIO, str, str]:
    """The stream of a --log (`-`: stdin), where to name it in a message, and its name in a diagnosis."""
    if path == "-":
        return sys.stdin, "--log -", "stdin"
    stream, where = _open_log(path)
    return stream, where, path


def stream_log_batches(path: str, progress: Callable[[int], None] | None = None) -> Iterator[LineBatch]:
    """The lines of a log file (`-`: stdin) in batches as they are read, or the findings of a verify report.json
    (recognised by its content: a document starting with `{` that fits MAX_REPORT_BYTES is tried as one). The file
    is opened (and refused) before the first batch is asked for; only the batch being read is held. `progress` is
    told how many characters each read took."""
    stream, where, name = _open_stream(path)

    def batches() -> Iterator[LineBatch]:
        try:
            head = stream.read(READ_CHARS)
            if head.lstrip().startswith("{"):
                head += stream.read(MAX_REPORT_BYTES + 1 - len(head))
                if len(head) <= MAX_REPORT_BYTES and (report := _as_report(head)) is not None:
                    found = report_lines(report, name)
                    yield LineBatch(log=name, first_number=1, texts=[line.text for line in found],
                                    kind_of=lambda _text: "verify", lines=found)
                    return
            number = 1
            for lines, read in _text_batches(stream, where, head):
                if progress is not None:
                    progress(read)
                if lines:
                    yield LineBatch(log=name, first_number=number, texts=lines, kind_of=classify)
                    number += len(lines)
        finally:
            if stream is not sys.stdin:
                stream.close()

    return batches()


def log_size(path: str) -> int | None:
    """A --log file's size in bytes (None for stdin or what is not a regular file): how long a read will be."""
    if path == "-":
        return None
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_size if stat.S_ISREG(status.st_mode) else None


def stream_log(path: str) -> Iterator[LogLine]:
    """The lines of a log file (`-`: stdin) one by one, as stream_log_batches reads them."""
    batches = stream_log_batches(path)

    def lines() -> Iterator[LogLine]:
        for batch in batches:
            if batch.lines is not None:
                yield from batch.lines
                continue
            for offset, text in enumerate(batch.texts):
                yield LogLine(log=batch.log, kind=batch.kind_of(text), number=batch.first_number + offset, text=text)

    return lines()


def read_log(path: str) -> list[LogLine]:
    """A log file, `-` for stdin, or a verify report.json (recognised by its content), as a list of its lines."""
    return list(stream_log(path))


# ---------------------------------------------------------------- journal commands

def check_unit_name(unit: str) -> str:
    if not _UNIT_NAME.match(unit):
        raise BadInput(f"--unit {unit!r}: not a systemd unit name (letters, digits, @ . _ : -)")
    return unit


def unit_log_argv(unit: str, lines: int = UNIT_LOG_LINES) -> list[str]:
    return ["journalctl", "--unit", check_unit_name(unit), "--no-pager", "--output", "short-iso",
            "--lines", str(lines)]


def _journal_time(stamp: str) -> datetime | None:
    stamp = stamp.replace(",", ".")
    if stamp.endswith("Z"):
        stamp = stamp[:-1] + "+00:00"
    elif re.search(r"[+-]\d{4}$", stamp):
        stamp = stamp[:-2] + ":" + stamp[-2:]
    try:
        return datetime.fromisoformat(stamp)
    except ValueError:
        return None


def log_window(unit_text: str) -> tuple[datetime, datetime] | None:
    """First and last time stamp of a journal read with --output short-iso, or None when it has none."""
    stamps = [stamp for line in unit_text.splitlines()
              if (found := _ISO_PREFIX.match(line)) and (stamp := _journal_time(found.group(1))) is not None]
    return (stamps[0], stamps[-1]) if stamps else None


def kernel_log_argv(window: tuple[datetime, datetime] | None, lines: int = KERNEL_LOG_LINES) -> list[str]:
    """journalctl -k around the unit's log (UTC, so the remote host's time zone does not matter); without a
    window, the kernel log's last lines."""
    argv = ["journalctl", "-k", "--no-pager", "--output", "short-iso"]
    if window is None:
        return argv + ["--lines", str(lines)]
    start = window[0].astimezone(UTC) - KERNEL_WINDOW_MARGIN
    end = window[1].astimezone(UTC) + KERNEL_WINDOW_MARGIN
    return argv + ["--since", start.strftime("%Y-%m-%d %H:%M:%S UTC"),
                   "--until", end.strftime("%Y-%m-%d %H:%M:%S UTC"), "--lines", str(lines)]


def collect_unit(run: Runner, unit: str, where: str = "") -> tuple[list[LogLine], list[str]]:
    """The unit's journal and the kernel log around it, through `run` (local or SSH). Returns lines and names."""
    label = f"{where}:{unit}" if where else unit
    code, unit_text, error = run(unit_log_argv(unit))
    if code != 0:
        raise BadInput(f"journalctl --unit {unit}{' on ' + where if where else ''} failed (exit {code}): "
                       f"{_first_line(error) or 'no output'}: check the unit name and that you may read the journal")
    code, kernel_text, error = run(kernel_log_argv(log_window(unit_text)))
    kernel_label = f"{where}:kernel" if where else "kernel"
    lines = lines_from_text(unit_text, label, "serve")
    if code == 0:
        lines += lines_from_text(kernel_text, kernel_label, "kernel")
        return lines, [label, kernel_label]
    # The unit's own log is the evidence that matters; an unreadable kernel log (no permission) is noted, not fatal.
    return lines, [label, f"{kernel_label} (unreadable: {_first_line(error) or f'exit {code}'})"]


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def local_runner(argv: list[str]) -> tuple[int, str, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=120, check=False)
    except FileNotFoundError as error:
        raise BadInput(f"{argv[0]}: not found on this machine: diagnose --unit needs systemd's journalctl "
                       f"(or give the log with --log)") from error
    except subprocess.TimeoutExpired as error:
        raise BadInput(f"{shlex.join(argv)}: no answer in 120 s") from error
    return done.returncode, done.stdout, done.stderr


# ---------------------------------------------------------------- SSH (paramiko)

def ssh_settings(host: str, config_path: Path | None = None) -> dict[str, Any]:
    """What ~/.ssh/config says for HOST: hostname, port, user, identity files, proxy command, host key policy."""
    paramiko = require("paramiko", "diagnose --ssh")

    path = config_path or Path.home() / ".ssh" / "config"
    looked_up: dict[str, Any] = {"hostname": host}
    if path.is_file():
        try:
            looked_up = dict(paramiko.SSHConfig.from_path(str(path)).lookup(host))
        except (OSError, paramiko.SSHException, ValueError) as error:
            raise BadInput(f"{path}: unreadable SSH config ({error}): fix it or move it aside") from error
    try:
        port = int(looked_up.get("port", 22))
    except ValueError as error:
        raise BadInput(f"{path}: Port {looked_up.get('port')!r} for {host} is not a number") from error
    return {
        "hostname": looked_up.get("hostname", host),
        "port": port,
        "username": looked_up.get("user"),
        "key_filename": looked_up.get("identityfile"),
        "proxycommand": looked_up.get("proxycommand"),
        "strict_host_key_checking": str(looked_up.get("stricthostkeychecking", "yes")).lower(),
    }


def ssh_runner(host: str, config_path: Path | None = None,
               timeout_s: float = SSH_TIMEOUT_S) -> tuple[Runner, Callable[[], None]]:
    """Connect once (honouring ~/.ssh/config and the SSH agent) and return (runner, close)."""
    paramiko = require("paramiko", "diagnose --ssh")

    settings = ssh_settings(host, config_path)
    client = paramiko.SSHClient()
    client.load_system_host_keys()
    known_hosts = Path.home() / ".ssh" / "known_hosts"
    if known_hosts.is_file():
        client.load_host_keys(str(known_hosts))
    # An unknown host key is refused unless the user's SSH config says otherwise, like ssh itself.
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy() if settings["strict_host_key_checking"] in
                                       ("no", "off", "accept-new") else paramiko.RejectPolicy())
    sock = paramiko.ProxyCommand(settings["proxycommand"]) if settings["proxycommand"] else None
    target = f"{settings['hostname']}:{settings['port']}"
    try:
        client.connect(settings["hostname"], port=settings["port"], username=settings["username"],
                       key_filename=settings["key_filename"], allow_agent=True, look_for_keys=True,
                       timeout=timeout_s, banner_timeout=timeout_s, auth_timeout=timeout_s, sock=sock)
    except paramiko.AuthenticationException as error:
        agent_keys = len(paramiko.Agent().get_keys())
        client.close()
        raise BadInput(f"ssh {host} ({target}): authentication failed ({error}; {agent_keys} key(s) in the SSH "
                       f"agent): add your key to the agent or set IdentityFile in ~/.ssh/config") from error
    except paramiko.SSHException as error:
        client.close()
        raise BadInput(f"ssh {host} ({target}): {error}: connect once with ssh to check the host key") from error
    except (TimeoutError, socket.gaierror, OSError) as error:
        client.close()
        reason = getattr(error, "strerror", None) or str(error) or error.__class__.__name__
        raise Unreachable(f"ssh {host} ({target}): unreachable ({reason}): check the name, the port and that sshd "
                       f"runs") from error

    def run(argv: list[str]) -> tuple[int, str, str]:
        try:
            _, stdout, stderr = client.exec_command(shlex.join(argv), timeout=120)
            out = stdout.read().decode(errors="replace")
            err = stderr.read().decode(errors="replace")
            return stdout.channel.recv_exit_status(), out, err
        except (paramiko.SSHException, OSError) as error:
            raise BadInput(f"ssh {host}: {shlex.join(argv)} failed: {error}") from error

    return run, client.close
