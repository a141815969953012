"""Helpers of the hostile-input corpus (test_hostile_inputs.py, test_hostile_arguments.py, test_hostile_output.py,
test_tune_unit.py): run b70ctl's real entry point in this process, and check what a refused or faulted command left
behind; a case and its runner, a misbehaving endpoint, and the hostile values a unit file must carry intact. Test
modules import these from here, never from each other.

Every case asserts the same four things: the exit code; exactly one `error:` line naming the problem (never a
traceback); no file changed outside the places the case says the command may write; no temporary or
half-written file anywhere under the case's directory. Faults the machine cannot produce on demand (a full disk, a
directory root may not write to: the tests run as root, which ignores permissions) are simulated in-process while
the command runs (`disk_full`, `read_only`).
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import re
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

# Names the writers use for what is not finished yet: none may outlive a command (a fetch's .part only survives a
# failed download, to resume it: no case here downloads).
HALF_WRITTEN = re.compile(r"(\.tmp$|\.part$|\.partial$|\.retired$|\.write-test$|^\.[^/]*\.[0-9a-z_]{8}\.tmp$)")


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]

    @property
    def warning_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("warning:")]


@dataclass
class Invocation:
    """What a case runs: the arguments, its environment changes, stdin, where it may write, and a fault that is in
    force while it runs."""

    args: list[str]
    env: dict[str, str | None] = field(default_factory=dict)
    stdin: str | None = None
    may_write: list[Path] = field(default_factory=list)
    fault: Callable[[pytest.MonkeyPatch], None] | None = None


def disk_full(patch: pytest.MonkeyPatch) -> None:
    """Every temporary file a writer makes lands on a full disk: it is created, and its first write reaches the
    disk as a write to /dev/full does, failing with ENOSPC."""
    make_temporary = tempfile.mkstemp

    def on_full_disk(*args: Any, **kwargs: Any) -> tuple[int, str]:
        handle, name = make_temporary(*args, **kwargs)
        full = os.open("/dev/full", os.O_WRONLY)
        os.dup2(full, handle)
        os.close(full)
        return handle, name

    patch.setattr(tempfile, "mkstemp", on_full_disk)


def copy_fills_disk(patch: pytest.MonkeyPatch) -> None:
    """A source on another filesystem (no hard link) and a disk that fills half-way through each copy."""
    def cross_device(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    def half_copy(source: Any, target: Any, *args: Any, **kwargs: Any) -> None:
        data = Path(source).read_bytes()
        Path(target).write_bytes(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))

    patch.setattr(os, "link", cross_device)
    patch.setattr(shutil, "copyfile", half_copy)


def read_only(directory: Path) -> Callable[[pytest.MonkeyPatch], None]:
    """`directory` as a read-only mount (or a 0500 directory to a user who is not root) looks to a writer: making,
    linking, renaming or opening for writing anything below it fails with EACCES."""
    def inside(path: Any) -> bool:
        try:
            return Path(os.fsdecode(path)).absolute().is_relative_to(directory)
        except (TypeError, ValueError):
            return False

    def refused(path: Any) -> OSError:
        return PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))

    def fault(patch: pytest.MonkeyPatch) -> None:
        real_open, real_os_open = builtins.open, os.open
        writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT

        def guarded(real: Callable[..., Any], *positions: int) -> Callable[..., Any]:
            """`real`, refusing when the path argument at any of `positions` is below the directory."""
            def call(*args: Any, **kwargs: Any) -> Any:
                for position in positions:
                    if position < len(args) and inside(args[position]):
                        raise refused(args[position])
                return real(*args, **kwargs)
            return call

        def opened(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if isinstance(file, (str, bytes, os.PathLike)) and set(mode) & set("wax+") and inside(file):
                raise refused(file)
            return real_open(file, mode, *args, **kwargs)

        def os_opened(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if flags & writes and inside(path):
                raise refused(path)
            return real_os_open(path, flags, *args, **kwargs)

        patch.setattr(builtins, "open", opened)
        patch.setattr(os, "open", os_opened)
        patch.setattr(os, "mkdir", guarded(os.mkdir, 0))
        patch.setattr(os, "link", guarded(os.link, 1))
        patch.setattr(os, "symlink", guarded(os.symlink, 1))
        patch.setattr(os, "replace", guarded(os.replace, 0, 1))
        patch.setattr(os, "rename", guarded(os.rename, 0, 1))
        patch.setattr(os, "unlink", guarded(os.unlink, 0))

    return fault


def snapshot(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every entry under root: kind, size and mtime (directories by name only)."""
    seen: dict[str, tuple[str, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            stat = path.lstat()
            kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file"
            size = 0 if kind == "dir" else stat.st_size
            mtime = 0 if kind == "dir" else stat.st_mtime_ns
            seen[path.relative_to(root).as_posix()] = (kind, size, mtime)
    return seen


def run_b70ctl(args: list[str], env: dict[str, str | None] | None = None, stdin: str | None = None) -> Outcome:
    """b70ctl's own `main()` (the one the console script runs), in this process: exit code, stdout, stderr."""
    from b70ctl.cli import main

    saved_env = {name: os.environ.get(name) for name in (env or {})}
    saved = sys.argv, sys.stdin, sys.stdout, sys.stderr
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["b70ctl", *args]
    sys.stdin = io.StringIO(stdin or "")
    sys.stdout, sys.stderr = out, err
    for name, value in (env or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    code: Any = 0
    try:
        main()
    except SystemExit as exit_:
        code = exit_.code
    finally:
        sys.argv, sys.stdin, sys.stdout, sys.stderr = saved
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return Outcome(code=code if isinstance(code, int) else (0 if code is None else 1), stdout=out.getvalue(),
                   stderr=err.getvalue())


def assert_one_line_error(outcome: Outcome, code: int, pattern: str) -> None:
    """Exit `code` and one error line matching `pattern`; no pattern: no error line (exit 0, or 1 for a check that
    failed and says so in its result)."""
    assert outcome.code == code, f"exit {outcome.code}, expected {code}\nstderr: {outcome.stderr}"
    assert "Traceback" not in outcome.stderr, outcome.stderr
    if not pattern:
        assert not outcome.error_lines, outcome.stderr
        return
    lines = outcome.error_lines
    assert len(lines) == 1, f"expected one error line, got: {outcome.stderr!r}"
    assert re.search(pattern, lines[0]), f"{pattern!r} not in {lines[0]!r}"


def assert_left_clean(root: Path, before: dict[str, tuple[str, int, int]], may_write: list[Path]) -> None:
    """Nothing changed outside may_write; nothing half-written anywhere under root."""
    after = snapshot(root)
    allowed = [p.resolve().relative_to(root.resolve()).as_posix() for p in may_write]

    def inside(name: str) -> bool:
        return any(name == a or name.startswith(a + "/") for a in allowed)

    changed = sorted(name for name in set(before) | set(after)
                     if before.get(name) != after.get(name) and not inside(name)
                     and not (before.get(name, ("",))[0] == "dir" and after.get(name, ("",))[0] == "dir"))
    assert not changed, f"written outside the target: {changed}"
    half = sorted(name for name in after if HALF_WRITTEN.search(name.rsplit("/", 1)[-1]))
    assert not half, f"half-written files left: {half}"


class QuietHandler(BaseHTTPRequestHandler):
    """The plumbing every loopback handler shares: HTTP/1.1 (kept-alive connections, as vLLM's uvicorn), no access
    log on stderr, and JSON answers with their Content-Length."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def send_json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class LoopbackServer:
    """A threaded HTTP server on 127.0.0.1 answering with `handler`, started by `with` and shut down after: the fake
    servers of the hostile rows differ only in their handler."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], *, quiet_errors: bool = False) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        if quiet_errors:  # a connection the handler resets on purpose is not an error to print
            self.httpd.handle_error = lambda request, address: None  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# --- shared by the hostile-input test modules ------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Path], Invocation]
    exit_code: int
    message: str  # regex the one error line must match
    warning: str | None = None  # regex one `warning:` line on stderr must match


def run_case(case: Case, tmp_path: Path) -> Outcome:
    work = tmp_path / "case"
    work.mkdir()
    invocation = case.build(work)
    before = snapshot(tmp_path)
    with pytest.MonkeyPatch.context() as patch:
        if invocation.fault is not None:
            invocation.fault(patch)
        outcome = run_b70ctl(invocation.args, invocation.env, invocation.stdin)
    assert_one_line_error(outcome, case.exit_code, case.message)
    if case.warning is not None:
        assert any(re.search(case.warning, line) for line in outcome.warning_lines), \
            f"{case.warning!r} not in the warnings: {outcome.stderr!r}"
    assert_left_clean(tmp_path, before, invocation.may_write + [tmp_path / "xdg-cache", tmp_path / "hf-home"])
    return outcome


class Misbehaving(LoopbackServer):
    """A local HTTP server answering each path with a fixed (status, content type, body); it records the
    Authorization header of every request."""

    def __init__(self, routes: dict[str, tuple[int, str, bytes]]) -> None:
        from http.server import BaseHTTPRequestHandler

        self.routes = routes
        self.authorizations: list[str | None] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                authorization = self.headers.get("Authorization")
                server.authorizations.append(authorization)
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                status, content_type, body = server.routes.get(self.path.split("?")[0],
                                                               (404, "application/json", b'{"detail":"Not Found"}'))
                body = _echoed(body, authorization or "")
                if status == 0:  # hang up without an answer
                    self.close_connection = True
                    return
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer  # noqa: N815

        super().__init__(Handler)


SECRET = "sk-hostile-4f1e9d"
JSON = "application/json"


def _echoed(body: bytes, authorization: str) -> bytes:
    """A body as a server or proxy that echoes the request's credentials sends it: {AUTH} is the Authorization
    header, {TOKEN} the bearer token alone, {PASSWORD} the basic-auth password, decoded."""
    import base64

    token = authorization.removeprefix("Bearer ") if authorization.startswith("Bearer ") else ""
    password = ""
    if authorization.startswith("Basic "):
        password = base64.b64decode(authorization.removeprefix("Basic ")).decode().partition(":")[2]
    return body.replace(b"{AUTH}", authorization.encode()).replace(b"{TOKEN}", token.encode()) \
        .replace(b"{PASSWORD}", password.encode())


def models(body: bytes, status: int = 200, content_type: str = JSON) -> dict[str, tuple[int, str, bytes]]:
    return {"/v1/models": (status, content_type, body), "/health": (200, "text/plain", b"")}


GOOD_MODELS = models(b'{"object":"list","data":[{"id":"tiny-qwen3","object":"model"}]}')


GOOD_URL = "http://127.0.0.1:9"  # nothing listens on the discard port


def render_unit(recipe_name: str, exec_argv: list[str], unit: str = "vllm-b70", user: str = "root") -> str:
    """The unit file as `b70ctl serve units` writes it (the vllm_serve role copies it as given)."""
    from b70ctl.serve.unit import unit_file_text

    return unit_file_text(recipe_name, unit, 8000, False, user, exec_argv)


HOSTILE_UNIT_VALUES = {
    "quote": "/models/it's here",
    "double-quote": '/models/"x"',
    "newline-directive": "/models/x\nExecStartPre=+/bin/sh -c 'touch /pwned'",
    "carriage-return": "/models/x\rExecStartPre=+/bin/true",
    "specifier": "/models/%h/%n",
    "dollar": "/models/$HOME/${PATH}",
    "backslash": "/models/a\\nb\\",
    "semicolon": "/models/x ; /bin/true",
}
