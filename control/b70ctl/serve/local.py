"""Run a vLLM server as a local process (the embedded default's demo and the real-vLLM tests).

The command comes from `render_serve`, like the systemd unit's. A server that does not become healthy in time
is stopped and the failure names its last log lines; a stopped server leaves no process behind.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from b70ctl.errors import BadInput
from b70ctl.serve.render import ServeCommand

# Ports this process has handed out: two servers started together never get the same one.
_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (net.ipv4.ip_local_port_range; 32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free port for a server to listen on, below the kernel's ephemeral range. A port the kernel picked (bind to
    0) was free only until the server bound it: meanwhile the kernel could give it to any socket it numbers itself,
    such as the ZMQ and torch.distributed sockets of another vLLM starting at the same time, and the server then
    died with EADDRINUSE. The kernel never numbers its own sockets below that range."""
    low = _ephemeral_low()
    candidates = list(range(max(1024, low - 12000), low))
    random.SystemRandom().shuffle(candidates)
    for port in candidates[:500]:
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as sock:  # below the range is full: the kernel's pick, as before
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def bound_cores(threads_bind: str) -> set[int]:
    """The cores named by VLLM_CPU_OMP_THREADS_BIND ("0|1", "0-3,6|4-5"); none for vLLM's "auto" and "nobind"."""
    if threads_bind in ("auto", "nobind"):
        return set()
    cores: set[int] = set()
    for part in re.split(r"[|,]", threads_bind):
        low, _, high = part.strip().partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


class LocalServer:
    """One vLLM OpenAI-compatible server process, started in its own process group."""

    def __init__(self, name: str, command: ServeCommand, python: str, port: int, log_path: Path,
                 extra_env: dict[str, str] | None = None):
        self.name = name
        self.command = command
        self.python = python
        self.port = port
        self.log_path = log_path
        self.extra_env = extra_env or {}
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LocalServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.command.env, **self.extra_env}
        missing = sorted(bound_cores(env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")) - os.sched_getaffinity(0))
        if missing:
            raise BadInput(f"vLLM server {self.name} binds its TP ranks to CPU cores {missing}, which this process "
                           f"may not use (allowed: {sorted(os.sched_getaffinity(0))}): lower the recipe's TP")
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command.local_argv(self.python), env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        return self

    def wait_healthy(self, timeout_s: float = 300.0, progress: Callable[[str], None] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise BadInput(f"vLLM server {self.name} exited with code {self.process.returncode} during start: "
                               f"{self.last_log_line()} (log: {self.log_path})")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise BadInput(f"vLLM server {self.name} not healthy after {timeout_s:.0f} s: {self.last_log_line()} "
                       f"(log: {self.log_path})")

    def last_log_line(self) -> str:
        try:
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no log"
        # vLLM logs harmless warnings that mention errors (ulimit, Triton); a failure is an ERROR line or an
        # exception name.
        errors = [line for line in lines if " ERROR " in line or re.search(r"\b\w+(Error|Exception)\b:", line)]
        return (errors or lines or ["empty log"])[-1].strip()[:300]

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the whole process group (API server, engine core, workers), SIGKILL what is left."""
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.process = None

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
